"""Greedy-output comparison with vLLM's tie rule.

Two greedy runs with different (but both correct) kernels may pick different tokens where
the top two logits are practically equal. So sequences must be equal, or first differ at a
step where the reference itself was at a near-tie: our token's reference logit within
`tie_tol` of the reference's top logit. After that first (tolerated) divergence the two
continuations are unrelated and are not compared.
"""
from __future__ import annotations

import torch

TIE_TOL = 2e-3


def assert_tokens_match(ours: list[int], ref_tokens: list[int],
                        ref_logits_per_step: list[torch.Tensor], tie_tol: float = TIE_TOL,
                        label: str = "") -> None:
    assert len(ref_logits_per_step) >= len(ref_tokens)
    for i, (a, b) in enumerate(zip(ours, ref_tokens)):
        if a == b:
            continue
        step = ref_logits_per_step[i].float()
        gap = float(step.max() - step[a])
        assert gap <= tie_tol, (
            f"{label}: first difference at step {i}: ours {a} vs reference {b}; the reference "
            f"logit of our token is {gap:.3g} below its top (tolerated <= {tie_tol})\n"
            f"ours={ours}\nref ={ref_tokens}")
        return
    assert len(ours) == len(ref_tokens), (
        f"{label}: lengths differ ({len(ours)} vs {len(ref_tokens)})")


def assert_match_transformers(path: str, prompts: list[list[int]], outputs: list[list[int]],
                              label: str = "") -> None:
    """Each `outputs[i]` equals transformers' greedy continuation of `prompts[i]` (float32,
    as many tokens as the output has), up to the near-tie rule."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, ours in zip(prompts, outputs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([prompt]), do_sample=False,
                                 max_new_tokens=len(ours), min_new_tokens=len(ours),
                                 output_logits=True, return_dict_in_generate=True,
                                 pad_token_id=0)
        assert_tokens_match(ours, ref.sequences[0, len(prompt):].tolist(),
                            [s[0] for s in ref.logits], label=label)


def assert_served_twice_match(llm, prompts: list[list[int]], refs: list, sampling_params: dict,
                              label: str) -> None:
    """An LLM serves `prompts` twice (the second time from its radix cache) with the
    references' (tokens, per-step logits) each time; some prompt tokens come from the cache
    the second time, and the engine's pools are whole afterwards."""
    for life in range(2):
        outs = llm.generate(input_ids=prompts, sampling_params=sampling_params)
        for i, (out, (ref_tokens, ref_logits)) in enumerate(zip(outs, refs)):
            assert_tokens_match(out["output_ids"], ref_tokens, ref_logits,
                                label=f"{label} {life} prompt {i}")
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) > 0
    llm.engine.check_integrity()
