"""bf16 on the CPU (what --dtype auto picks on a machine with bf16 instructions): quality
guards against the same SmolLM2 weights in float32 (issue: CPU speed per ISA, item 4).

- Perplexity of the first 1100 tokens of docs/architecture.md (the engine's prompt logprobs)
  within 1% of float32's.
- Greedy answers to the smoke prompts (32 tokens, chat template) equal float32's, except where
  float32 itself is at a near-tie: at the first differing token, bf16's choice must be
  float32's runner-up within NEAR_TIE nats of its top.
- The fact behind the first smoke prompt survives: after "The capital of France is" both
  dtypes continue with Paris. (The free answer is not that check: float32's first token there
  is a 0.082-nat tie between two openings, which kernels of equal accuracy -- perplexity
  within 0.3% -- break either way.)

Runs on every machine: without bf16 instructions the bf16 GEMMs run kvstrata's AVX2 body
(runner/csrc/bf16_gemm_avx2.h; torch's emulation where there is no AVX2), the same arithmetic
up to summation order, so the guard holds wherever a user may force --dtype bfloat16.
"""
from __future__ import annotations

import math
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PPL_TOKENS = 1100
PPL_MAX_RATIO = 1.01
NEAR_TIE = 0.5  # nats between float32's top two tokens
FACT_PREFIX = "The capital of France is"
SMOKE = ["What is the capital of France?", "Name three primary colors.",
         "Write a haiku about the sea.", "What is 12 times 7?",
         "Explain in one sentence what a CPU does."]


def _measure(gguf_path: str, dtype: str) -> dict:
    from kvstrata import LLM

    with open(os.path.join(ROOT, "docs", "architecture.md"), encoding="utf-8") as fh:
        text = fh.read()
    with LLM(model_path=gguf_path, dtype=dtype, context_length=2048, max_total_tokens=8192,
             page_size=16) as llm:
        assert llm.server_info()["dtype"] == dtype
        passage = llm.tokenizer(text)["input_ids"][:PPL_TOKENS]
        out = llm.generate(input_ids=passage, return_logprob=True,
                           sampling_params={"max_new_tokens": 1, "temperature": 0})
        lps = out["meta_info"]["input_token_logprobs"]
        prompts = []
        for q in SMOKE:
            ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                    add_generation_prompt=True, tokenize=True)
            prompts.append(ids if isinstance(ids, list) else ids["input_ids"])
        answers = llm.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": 32, "temperature": 0, "logprobs": 2})
        fact = llm.generate(input_ids=prompts[0] + llm.tokenizer(FACT_PREFIX)["input_ids"],
                            sampling_params={"max_new_tokens": 3, "temperature": 0})
    return {"ppl": math.exp(-sum(lps) / len(lps)), "n": len(lps), "answers": answers,
            "fact": fact["text"]}


@pytest.mark.slow
def test_bf16_smollm2_perplexity_and_smoke_answers(smollm2_gguf_path):
    fp32 = _measure(smollm2_gguf_path, "float32")
    bf16 = _measure(smollm2_gguf_path, "bfloat16")
    assert fp32["n"] == bf16["n"] >= 1024
    ratio = bf16["ppl"] / fp32["ppl"]
    print(f"perplexity fp32 {fp32['ppl']:.3f} bf16 {bf16['ppl']:.3f} ratio {ratio:.4f}")
    assert ratio < PPL_MAX_RATIO
    identical = 0
    for q, ref, got in zip(SMOKE, fp32["answers"], bf16["answers"]):
        if got["output_ids"] == ref["output_ids"]:
            identical += 1
            continue
        i = next(i for i, (a, b) in enumerate(zip(got["output_ids"], ref["output_ids"]))
                 if a != b)
        top = dict(ref["meta_info"]["output_top_logprobs"][i])
        gap = max(top.values()) - top.get(got["output_ids"][i], -math.inf)
        print(f"{q!r}: differs at token {i}, float32's gap {gap:.3f}")
        assert gap < NEAR_TIE, (q, ref["text"], got["text"])
    assert "Paris" in fp32["fact"] and "Paris" in bf16["fact"], (fp32["fact"], bf16["fact"])
    # Three of the five float32 answers hold a near-tie within 32 tokens (gaps of 0.007-0.135
    # nats measured); every difference above was checked to sit at one.
    assert identical >= len(SMOKE) - 3
