"""Tensor parallelism (--tp-size) over torch.distributed, one machine or several (--nnodes).

  tensor_parallel.py  the llama-family decoder's model-parallel layers
  tp_deepseek.py      DeepSeek V2 / V3 / V3.2's share per rank (MLA heads, experts)
  tp_gpt_oss.py       gpt-oss's share per rank (heads and sinks, each expert's width)
  tp_moe.py           Qwen3-MoE / Qwen2-MoE / Mixtral / GLM-4.5's share per rank (heads,
                      experts by index, shared experts' width)
  tp_hybrid.py        the recurrent hybrids' share per rank (Gated DeltaNet and Mamba2
                      heads with their conv channels and state, n_groups split or
                      replicated, attention heads, MLP / expert widths)
  tp_hybrid_split.py  which share of each of those a rank holds, each tensor cut to it
  tp_load.py          one rank's share of a checkpoint
  tp_comm.py          how ranks find and watch each other (group, heartbeat)
  tp_runner.py        one scheduler (rank 0), N runners: the serving path
  tp_events.py        the events the scheduler sees from N ranks' executors
  shm_allreduce.py    the shared-memory all-reduce / all-gather on one machine (csrc/)
"""
