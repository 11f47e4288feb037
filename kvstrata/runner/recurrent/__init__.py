"""The recurrent (SSM / linear-attention) layers' kernels over the state pool
(kv/state_pool.py), and the backend through which a model's recurrent layers reach them.

  backend.py      per step which rows decode, prefill or verify; per layer the conv and the
                  scan over each request's state slot; the verify commit
  conv.py         the causal conv1d over a request's conv window (chunk, one-token step)
  gated_delta.py  Gated DeltaNet: the chunked rule (prefill), the step, the per-token loop
  ssd.py          Mamba2's SSD: the chunked scan (prefill), the step, the per-token loop
  fused_step.py   the decode step in place on the pool (`_recurrent_step`, C, csrc/)
  fixed_scan.py   deterministic inference's backend: every token, prompt or decode, through
                  that C step in order; the conv's taps in one order
  pointwise.py    sigmoid / SiLU / softplus as torch runs them or position-free (`_pointwise`,
                  C, csrc/: deterministic inference)
"""
