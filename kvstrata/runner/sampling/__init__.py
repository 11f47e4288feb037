"""From logits to tokens.

  sampler.py     one step's logits -> next tokens (+ logprobs): penalties, bias, temperature,
                 top-k/p/min-p, seeded draws, the grammar mask last
  logit_rows.py  row helpers: greedy argmax, finite logprobs, top-n lists
  grammar.py     structured output: one llguidance matcher per constrained request
  prompt_logprobs.py  RequestSampling (a live request's state in the runner) and the prompt
                 logprobs accumulated across its prefill chunks
"""
