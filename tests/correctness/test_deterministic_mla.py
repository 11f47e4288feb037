"""--enable-deterministic-inference on DeepSeek's MLA models (V3, V2, V2-Lite: dense latent
attention) and V3.2 (MLA + the DSA indexer): runner/attention/mla_fixed.py and
runner/models/deepseek_fixed.py.

- float32 with the flag: greedy tokens still equal transformers' (near-tie rule), batched,
  chunked on pages of 4 with staggered arrivals, then again from the radix cache;
- bfloat16: every request of a mixed workload (shared prefix, chunked, arrivals at other
  steps, greedy and seeded) equals its cold run alone, bit for bit, on V2 and V2-Lite (V3 and
  V3.2 run in test_deterministic_inference.py's hypothesis property test);
- (no engine-level control here: at these tiny widths the unflagged V3 / V3.2 engines
  answered a warm request like a cold one too -- their GEMMs' K is too small for oneDNN to
  change body by row count and no indexer score tied; test_batch_invariance.py's control
  shows what moves without the flag: torch.topk's order of tied scores, by the row width);
- refused by name: a NEXTN draft.
Tiny random checkpoints (helpers/moe_ckpt.py, kvstrata/bench/tiny_dsa.py); one engine per
checkpoint and dtype for the file.
"""
from __future__ import annotations

import pytest

from helpers.compare import assert_tokens_match
from helpers.gemma_ckpt import hf_greedy
from helpers.moe_ckpt import build_moe_checkpoint, hf_moe
from tests.correctness.test_deterministic_inference import (cold_runs, drive, make_llm,
                                                            params, prompts_with_prefix)

NEW_TOKENS = 12
PROMPT_LENS = (1, 9, 17, 40)


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tiny_dsa_checkpoint) -> dict[str, str]:
    root = tmp_path_factory.mktemp("det_mla")
    built = {a: build_moe_checkpoint(a, str(root / a))
             for a in ("deepseek_v3", "deepseek_v2", "deepseek_v2_lite")}
    return {**built, "deepseek_v32": tiny_dsa_checkpoint}


def _fp32_llm(path: str):
    from kvstrata import LLM

    return LLM(model_path=path, skip_tokenizer_init=True, dtype="float32",
               enable_deterministic_inference=True, page_size=4, chunked_prefill_size=8,
               max_total_tokens=2048)


def _greedy(llm, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    sp = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    outs = llm.generate(input_ids=prompts, sampling_params=[sp] * len(prompts))
    llm.engine.check_integrity()
    return [o["output_ids"] for o in outs]


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_float32_greedy_still_equals_transformers(arch, paths, tiny_prompts,
                                                  tiny_dsa_references):
    """With the flag at float32 (the fixed fp32 GEMM, the decode kernel for every query, the
    ordered indexer): greedy tokens equal transformers', the first pass (chunks of 8 on pages
    of 4) and the second (radix hits)."""
    path = paths[arch]
    if arch == "deepseek_v32":
        prompts, refs, new_tokens = tiny_prompts, tiny_dsa_references, len(
            tiny_dsa_references[0][0])
    else:
        prompts = [p[:n] for p, n in zip(tiny_prompts[-4:], PROMPT_LENS)]
        refs, new_tokens = hf_greedy(hf_moe(path), prompts, NEW_TOKENS), NEW_TOKENS
    llm = _fp32_llm(path)
    try:
        info = llm.server_info()["quantization_info"]
        assert info["pinned_absorbed_heads"] > 0 and info["pinned_moe_layers"] > 0
        for label in ("cold", "radix hit"):
            for i, (ours, (ref_tokens, ref_logits)) in enumerate(
                    zip(_greedy(llm, prompts, new_tokens), refs)):
                assert_tokens_match(ours, ref_tokens, ref_logits, label=f"{arch} {label} {i}")
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["deepseek_v2", "deepseek_v2_lite"])
def test_bf16_requests_equal_their_cold_runs(arch, paths):
    """V2 (softmax router, group-limited) and V2-Lite (q_proj without a q LoRA, greedy
    router): prompts sharing 19 tokens, chunked by 8 on pages of 4, arriving at other steps
    (the later ones hit the radix cache beside the others' decodes), greedy and seeded: each
    equals its cold run alone on the same engine, bit for bit."""
    llm = make_llm(paths[arch], page_size=4, chunked_prefill_size=8, max_total_tokens=2048)
    try:
        prompts = prompts_with_prefix(21, 19, [3, 12, 1, 7])
        work = [(i, p, params(8, None if i % 2 else 90 + i)) for i, p in enumerate(prompts)]
        cold = cold_runs(llm, work)
        assert drive(llm, work) == cold
    finally:
        llm.shutdown()


def test_a_nextn_draft_is_refused_by_name(tiny_dsa_mtp_checkpoint):
    with pytest.raises(NotImplementedError, match="deterministic-inference with NEXTN"):
        make_llm(tiny_dsa_mtp_checkpoint, speculative_algorithm="NEXTN",
                 speculative_draft_model_path=tiny_dsa_mtp_checkpoint,
                 max_total_tokens=1024)
