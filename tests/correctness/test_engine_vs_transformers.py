"""The whole engine (scheduler + runner through kvstrata.LLM) against transformers' greedy
generate on tiny random checkpoints: batched, alone, chunked, from the prefix cache, under
forced retraction, with page size 1 and 16. One shared comparison rule (helpers.compare)."""
from __future__ import annotations

import pytest

from helpers.compare import assert_tokens_match
from tests.conftest import GREEDY_TOKENS
from helpers.runner import forward_logits

# min_new_tokens blocks EOS exactly as the reference's min_new_tokens does.
GREEDY = {"max_new_tokens": GREEDY_TOKENS, "min_new_tokens": GREEDY_TOKENS, "temperature": 0}


def make_llm(path, **kw):
    from kvstrata import LLM

    kw.setdefault("max_total_tokens", 4096)
    return LLM(model_path=path, skip_tokenizer_init=True, **kw)


def check(outs, refs, prompts, label):
    for i, (out, prompt) in enumerate(zip(outs, prompts)):
        ref_tokens, ref_logits = refs[i]
        assert_tokens_match(out["output_ids"], ref_tokens, ref_logits, label=f"{label} prompt {i}")
        assert out["meta_info"]["prompt_tokens"] == len(prompt)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_batched_greedy_equals_transformers(arch, page_size, tiny_checkpoints, tiny_prompts,
                                            tiny_references):
    llm = make_llm(tiny_checkpoints[arch], page_size=page_size)
    try:
        outs = llm.generate(input_ids=tiny_prompts, sampling_params=GREEDY)
        check(outs, tiny_references[arch], tiny_prompts, f"{arch} P={page_size} batched")
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_alone_chunked_prefix_and_retraction(tiny_checkpoints, tiny_prompts, tiny_references):
    refs = tiny_references["llama"]
    path = tiny_checkpoints["llama"]
    llm = make_llm(path, page_size=16, chunked_prefill_size=16)
    try:
        # Alone, one at a time; the 45- and 70-token prompts take several 16-token chunks.
        for i, prompt in enumerate(tiny_prompts):
            out = llm.generate(input_ids=prompt, sampling_params=GREEDY)
            check([out], refs[i:i + 1], [prompt], "llama alone+chunked")
        # Again, batched: whole pages of every prompt now come from the radix cache.
        outs = llm.generate(input_ids=tiny_prompts, sampling_params=GREEDY)
        check(outs, refs, tiny_prompts, "llama prefix-cached")
        for out, prompt in zip(outs, tiny_prompts):
            assert out["meta_info"]["cached_tokens"] == (len(prompt) - 1) // 16 * 16
        llm.check_integrity()
    finally:
        llm.shutdown()

    # A pool far too small for the batch (8 prompts need 450 tokens at the end): requests
    # are retracted and recomputed, outputs unchanged.
    llm = make_llm(path, page_size=1, max_total_tokens=200, schedule_conservativeness=0.1)
    try:
        outs = llm.generate(input_ids=tiny_prompts, sampling_params=GREEDY)
        check(outs, refs, tiny_prompts, "llama retraction")
        assert llm.get_load()["num_retractions"] > 0
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_prompt_longer_than_context_fails_only_that_request(tiny_checkpoints):
    llm = make_llm(tiny_checkpoints["qwen2"], max_total_tokens=2048)
    try:
        outs = llm.generate(input_ids=[[5] * 600, [5, 6, 7]],
                            sampling_params={"max_new_tokens": 4, "temperature": 0})
        assert outs[0]["meta_info"]["finish_reason"]["type"] == "abort"
        assert "context length" in outs[0]["meta_info"]["finish_reason"]["message"]
        assert len(outs[1]["output_ids"]) == 4
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_logprobs_through_the_engine(tiny_checkpoints, tiny_prompts):
    import torch

    llm = make_llm(tiny_checkpoints["llama"])
    try:
        prompt = tiny_prompts[3]
        out = llm.generate(input_ids=prompt, return_logprob=True,
                           sampling_params={**GREEDY, "max_new_tokens": 4, "min_new_tokens": 0,
                                            "logprobs": 3})
        meta = out["meta_info"]
        assert [t for _, t in meta["output_token_logprobs"]] == out["output_ids"]
        for (lp, tid), top in zip(meta["output_token_logprobs"], meta["output_top_logprobs"]):
            assert len(top) == 3 and top[0][0] == tid  # greedy: the sampled token is the top one
            assert abs(top[0][1] - lp) < 1e-6 and top[0][1] >= top[1][1] >= top[2][1]
        # Prompt logprobs (echo): one per prompt token after the first, all <= 0.
        assert len(meta["input_token_logprobs"]) == len(prompt) - 1
        assert all(x <= 0 for x in meta["input_token_logprobs"])
        logits = forward_logits(llm.engine.runner, prompt)
        ref = torch.log_softmax(logits.float(), -1)[:-1].gather(
            1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(meta["input_token_logprobs"]), ref, atol=1e-4)
        llm.check_integrity()
    finally:
        llm.shutdown()


def test_mem_fraction_static_sizes_the_pool(tiny_checkpoints):
    from kvstrata import LLM

    small = LLM(model_path=tiny_checkpoints["qwen2"], skip_tokenizer_init=True,
                mem_fraction_static=0.001)
    large = LLM(model_path=tiny_checkpoints["qwen2"], skip_tokenizer_init=True,
                mem_fraction_static=0.002)
    try:
        a, b = small.get_load()["max_total_num_tokens"], large.get_load()["max_total_num_tokens"]
        assert 0 < a < b
    finally:
        small.shutdown()
        large.shutdown()
