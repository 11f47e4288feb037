"""Scheduler sides (no torch): features that hold requests or pages beside the plain loop,
called by the scheduler at fixed points (base.py) and reaching it only through its facade.

  base.py            SchedulerSide: the hooks and their contract
  registry.py        which sides a scheduler gets from its config (the one place that knows)
  priority.py        priority scheduling, preemption and the bounded waiting queue
  speculative.py     speculative decoding's drafting side (NGRAM source: ngram_cache.py)
  spec_gate.py       which requests draft in a decode step
  ngram_cache.py     the NGRAM draft source
  disagg_common.py   PD rooms, metadata slots, transfer endings (both roles)
  disagg_prefill.py  PD prefill server;  disagg_decode.py  PD decode server
  disagg_retract.py  decode retraction with a KV backup (inside the decode side)
"""
