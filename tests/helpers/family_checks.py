"""The checks every model family's correctness file runs against transformers (float32):
prefill logits close, greedy tokens equal in a batching mode (helpers/driver.py), and a
radix hit with chunked prefill through the engine. The family files keep their checkpoints,
runners and what is particular to each family."""
from __future__ import annotations

import torch

from helpers.compare import assert_tokens_match
from helpers.driver import greedy_in_mode
from helpers.gemma_ckpt import hf_greedy
from helpers.runner import forward_logits, make_runner, num_live_requests

# (page_size, batch everything together?, prefill chunk size, staggered arrivals?)
MODES = {"p1_batched": (1, True, None, False), "p16_chunk6_staggered": (16, True, 6, True)}


_runners: dict = {}


def random_prompts(seed: int, lengths: tuple[int, ...], vocab: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def cached_runner(path: str, page_size: int = 1):
    """One float32 runner per (checkpoint, page size) for the whole session."""
    key = (path, page_size)
    if key not in _runners:
        _runners[key] = make_runner(path, page_size=page_size, max_total_tokens=2048,
                                    context_length=128, max_running_requests=8,
                                    dtype="float32")
    return _runners[key]


def assert_prefill_logits_match(runner, hf, prompts: list[list[int]], atol: float) -> None:
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(forward_logits(runner, prompt), ref, atol=atol, rtol=0)


def assert_greedy_in_mode_matches(runner, mode: str, prompts: list[list[int]],
                                  references: list, new_tokens: int, label: str) -> None:
    """`references`: hf_greedy's (tokens, per-step logits) per prompt. The runner ends with
    no live request."""
    _, batched, chunk, staggered = MODES[mode]
    outs = greedy_in_mode(runner, prompts, new_tokens, batched, chunk, staggered)
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outs, references)):
        assert_tokens_match(ours, ref_tokens, ref_logits, label=f"{label} {mode} prompt {i}")
    assert num_live_requests(runner) == 0


def assert_prefix_hit_matches(path: str, hf, prompt: list[int], atol: float) -> None:
    """Chunks of 16 on pages of 16, then a request whose first 32 tokens come from the radix
    cache; tokens and the first logprob equal transformers' and the pools drain whole."""
    from kvstrata import LLM

    (ref_tokens, ref_logits), = hf_greedy(hf, [prompt], 8)
    # logprobs 0: each output token's logprob (return_logprob would recompute the prompt)
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    with LLM(model_path=path, skip_tokenizer_init=True, page_size=16,
             chunked_prefill_size=16, max_total_tokens=2048, dtype="float32") as llm:
        llm.generate(input_ids=prompt[:34], sampling_params=greedy)  # caches 32 tokens
        out = llm.generate(input_ids=prompt, sampling_params=greedy)
        llm.engine.check_integrity()
    assert out["meta_info"]["cached_tokens"] >= 32
    assert_tokens_match(out["output_ids"], ref_tokens, ref_logits, label="prefix hit")
    lp, token = out["meta_info"]["output_token_logprobs"][0][:2]
    assert abs(lp - torch.log_softmax(ref_logits[0], -1)[token].item()) < atol


def assert_ngram_equals_plain(path: str) -> None:
    """NGRAM speculation (pages of 16) gives the tokens and logprobs of plain greedy
    decoding, some drafts are accepted, and the pools drain whole."""
    from tests.correctness.test_speculative import (assert_same, drained, greedy, make_llm,
                                                    repeating_prompts)

    prompts, params = repeating_prompts()[:4], greedy(16)
    plain = make_llm(path, False, max_total_tokens=2048)
    try:
        ref = plain.generate(input_ids=prompts, sampling_params=params)
    finally:
        plain.shutdown()
    llm = make_llm(path, True, max_total_tokens=2048, page_size=16)
    try:
        outs = llm.generate(input_ids=prompts, sampling_params=params)
        assert_same(ref, outs)
        assert sum(o["meta_info"]["spec_accept_token_num"] for o in outs) > 0
        drained(llm)
    finally:
        llm.shutdown()


def assert_packed_as_close_as_unpacked(packed, unpacked, hf, prompts: list[list[int]],
                                       label: str, ratio: float = 1.25) -> None:
    """Per token, the largest logit error of a bf16 runner against transformers' float32:
    `packed` (kvstrata's packed linears) no worse than `unpacked` (F.linear), in the median
    over tokens -- a bf16 model's worst tokens are those whose expert choice bf16 flipped,
    3-5 logits off either way, not the GEMM's to answer for."""
    errors: dict[bool, list[torch.Tensor]] = {True: [], False: []}
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        for is_packed, runner in ((True, packed), (False, unpacked)):
            logits = forward_logits(runner, prompt)
            assert logits.dtype == torch.float32 and logits.shape == ref.shape
            errors[is_packed].append((logits - ref).abs().amax(dim=-1))
    got, base = (torch.cat(errors[k]).median().item() for k in (True, False))
    print(f"{label}: median token error bf16 vs float32 transformers: packed {got:.4f}, "
          f"unpacked {base:.4f}")
    assert got <= base * ratio + 0.01


def bf16_runners_by_switch(paths: dict[str, str], switch: str) -> dict:
    """(arch, on) -> a small bf16 runner of paths[arch] built with the KVSTRATA_* ablation
    switch `switch` at 1 (on) or 0: a packed path and its control, side by side."""
    import pytest

    built = {}
    for arch, path in paths.items():
        for on in (True, False):
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv(switch, "1" if on else "0")
                built[arch, on] = make_runner(path, dtype="bfloat16", max_total_tokens=512,
                                              context_length=128, max_running_requests=4)
    return built
