"""The scheduler core (no torch): continuous batching, chunked prefill, retraction, the
progress guarantee. Sides (engine/sides/) plug into it through its facade.

  core.py             Scheduler: queues, one step's prefill or decode batch, results, and
                      the one end of every request (finish)
  facade.py           SchedulerFacade: the typed interface sides get (all they may touch)
  config.py           SchedulerConfig (the KV plan + scheduling policy)
  prefill_adder.py    which waiting requests join a prefill batch (token budgets)
  prefill_step.py     PrefillStep: the prefill step (admission, prefix match, pages, rows)
  new_token_ratio.py  how much of max_new_tokens admission reserves (SGLang's estimator)
  out_of_memory.py    retraction for decode and the abort of a request that can never fit
  stop_checker.py     whether a request is finished after a token
  verify_step.py      speculation's scheduler half: drafts before a decode step, settle after
  introspect.py       the whole-state integrity check and the state dump
"""
