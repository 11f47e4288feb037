"""Tiny random llama / qwen2 / qwen3 / mistral checkpoints against transformers (float32).

Prefill logits: atol 1e-4 (observed ~1e-5; only summation order differs).
Greedy: 32 tokens for 8 prompts, equal up to vLLM's near-tie rule, under several ways of
batching the same work (all together, alone, page sizes 1/4/16, chunked + staggered).
"""
from __future__ import annotations

import pytest
import torch

from tests.conftest import GREEDY_TOKENS, TINY_ARCHS
from helpers.compare import assert_tokens_match
from helpers.driver import greedy_generate, greedy_in_mode
from helpers.runner import forward_logits, make_runner, num_live_requests
from kvstrata.runner.model_runner import ModelRunner

PREFILL_ATOL = 1e-4

_runners: dict[tuple[str, int, bool], ModelRunner] = {}


def _runner(path: str, arch: str, page_size: int, deterministic: bool = False) -> ModelRunner:
    key = (arch, page_size, deterministic)
    if key not in _runners:  # a tiny runner loads in ms, but reuse keeps the suite lean
        _runners[key] = make_runner(path, page_size=page_size, max_total_tokens=4096,
                                    context_length=512, max_running_requests=16,
                                    enable_deterministic_inference=deterministic)
    return _runners[key]


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_prefill_logits_match_transformers(arch, tiny_checkpoints, tiny_prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[arch], dtype=torch.float32).eval()
    runner = _runner(tiny_checkpoints[arch], arch, 1)
    for prompt in tiny_prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        ours = forward_logits(runner, prompt)
        torch.testing.assert_close(ours, ref, atol=PREFILL_ATOL, rtol=0)


# (page_size, batch everything together?, prefill chunk size, staggered arrivals?)
MODES = {
    "p1_batched": (1, True, None, False),
    "p16_batched": (16, True, None, False),
    "p16_alone": (16, False, None, False),
    "p4_chunked_staggered": (4, True, 6, True),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_matches_transformers(arch, mode, tiny_checkpoints, tiny_prompts,
                                     tiny_references):
    page_size, batched, chunk, staggered = MODES[mode]
    runner = _runner(tiny_checkpoints[arch], arch, page_size)
    refs = tiny_references[arch]
    outs = greedy_in_mode(runner, tiny_prompts, GREEDY_TOKENS, batched, chunk, staggered)
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outs, refs)):
        assert_tokens_match(ours, ref_tokens, ref_logits, label=f"{arch}/{mode} prompt {i}")
    assert num_live_requests(runner) == 0


@pytest.mark.parametrize("mode", ["p1_batched", "p16_batched", "p4_chunked_staggered"])
@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_deterministic_kernels_match_transformers(arch, mode, tiny_checkpoints, tiny_prompts,
                                                  tiny_references):
    """--enable-deterministic-inference (one GEMM body per row count, every query through
    the paged decode kernel) is the same model: greedy tokens equal transformers' under the
    near-tie rule, pages of 1 and 16, chunked and staggered (its bit-identity across
    batches is test_deterministic_inference.py's)."""
    page_size, batched, chunk, staggered = MODES[mode]
    runner = _runner(tiny_checkpoints[arch], arch, page_size, deterministic=True)
    assert runner.deterministic
    outs = greedy_in_mode(runner, tiny_prompts, GREEDY_TOKENS, batched, chunk, staggered)
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outs, tiny_references[arch])):
        assert_tokens_match(ours, ref_tokens, ref_logits, label=f"{arch}/{mode} prompt {i}")
    assert num_live_requests(runner) == 0


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_deterministic_prompt_logprobs_and_a_prefix_hit_match_transformers(
        arch, tiny_checkpoints, tiny_prompts):
    """The deterministic path's logits through chunks of 16 over pages of 16 (every prompt
    token's logprob) and after a prefix hit (the next token's, the prefix read from the
    pool), within PREFILL_ATOL of transformers'. (Prompt logprobs recompute the whole prompt,
    so the hit is measured on the output token.)"""
    from transformers import AutoModelForCausalLM

    from kvstrata import LLM
    prompt = tiny_prompts[-1]  # 70 tokens: five chunks
    hf = AutoModelForCausalLM.from_pretrained(tiny_checkpoints[arch], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0], dim=-1)
    want = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    with LLM(model_path=tiny_checkpoints[arch], skip_tokenizer_init=True, page_size=16,
             chunked_prefill_size=16, max_total_tokens=4096,
             enable_deterministic_inference=True) as llm:
        greedy = {"max_new_tokens": 1, "temperature": 0, "logprobs": 0}
        out = llm.generate(input_ids=prompt, sampling_params=greedy, return_logprob=True)
        got = torch.tensor([lp for lp in out["meta_info"]["input_token_logprobs"]
                            if lp is not None])
        torch.testing.assert_close(got, want[-len(got):], atol=PREFILL_ATOL, rtol=0)
        llm.flush_cache()
        llm.generate(input_ids=prompt[:40], sampling_params=greedy)  # caches 32 tokens
        out = llm.generate(input_ids=prompt, sampling_params=greedy)
        assert out["meta_info"]["cached_tokens"] >= 32
        (lp, token), = out["meta_info"]["output_token_logprobs"]
        assert abs(lp - ref[-1, token].item()) < PREFILL_ATOL


def test_prompt_logprobs_across_chunks(tiny_checkpoints, tiny_prompts):
    from kvstrata.protocol import (NewRequestData, SamplingParams, ScheduledRequest,
                                   SchedulerOutput)

    runner = _runner(tiny_checkpoints["llama"], "llama", 4)
    prompt = tiny_prompts[-1]
    ref = torch.log_softmax(forward_logits(runner, prompt), dim=-1)
    expected = ref[:-1].gather(1, torch.tensor(prompt[1:])[:, None])[:, 0]
    params = SamplingParams(temperature=0.0, max_new_tokens=1)
    new = [NewRequestData("echo", prompt, [], params, return_prompt_logprobs=True)]
    got, pos, step = None, 0, 0
    pages = iter(range(1, runner.plan.num_pages + 1))
    while pos < len(prompt):
        n = min(20, len(prompt) - pos)
        slots = []
        for p in range(pos, pos + n):
            if p % 4 == 0:
                page = next(pages)
            slots.append(page * 4 + p % 4)
        last = pos + n == len(prompt)
        out = runner.execute(SchedulerOutput(step, True, new, [ScheduledRequest(
            "echo", 1, pos, prompt[pos:pos + n], pos, slots, last)], []))
        new = []
        assert ("echo" in out.prompt_logprobs) == last
        if last:
            got = out.prompt_logprobs["echo"]
            assert out.token_ids == [int(ref[-1].argmax())]
        pos, step = pos + n, step + 1
    runner.execute(SchedulerOutput(step, False, [], [], ["echo"]))
    torch.testing.assert_close(torch.tensor(got), expected, atol=1e-4, rtol=0)


def test_sampled_logprobs_and_top_logprobs(tiny_checkpoints, tiny_prompts):
    from kvstrata.protocol import SamplingParams

    runner = _runner(tiny_checkpoints["qwen2"], "qwen2", 1)
    prompt = tiny_prompts[4]
    ref = torch.log_softmax(forward_logits(runner, prompt)[-1], dim=-1)
    params = SamplingParams(temperature=0.0, max_new_tokens=1, logprobs=3)
    from kvstrata.protocol import NewRequestData, ScheduledRequest, SchedulerOutput

    slots = list(range(1, len(prompt) + 1))
    out = runner.execute(SchedulerOutput(0, True, [NewRequestData("lp", prompt, [], params)],
                                         [ScheduledRequest("lp", 1, 0, prompt, 0, slots, True)],
                                         []))
    runner.execute(SchedulerOutput(1, False, [], [], ["lp"]))
    top = torch.topk(ref, 3)
    assert out.token_ids == [int(top.indices[0])]
    assert abs(out.logprobs[0] - float(top.values[0])) < 1e-4
    assert [t.token_id for t in out.top_logprobs[0]] == top.indices.tolist()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_float32(dtype, tiny_checkpoints, tiny_prompts):
    """Half precision cannot match float32 token for token; check it is close and runs
    the paged decode path."""
    path = tiny_checkpoints["qwen3"]
    runner = make_runner(path, dtype=dtype, page_size=16, max_total_tokens=1024,
                         context_length=512, max_running_requests=4)
    assert runner.kv_pool.kv.dtype == getattr(torch, dtype)
    ref = forward_logits(_runner(path, "qwen3", 16), tiny_prompts[6])
    ours = forward_logits(runner, tiny_prompts[6])
    assert (ours - ref).abs().max() < 0.15 * ref.abs().max()
    outs = greedy_generate(runner, tiny_prompts[:3], 4)
    assert all(len(o) == 4 for o in outs)


def test_context_overflow_is_rejected(tiny_checkpoints):
    from kvstrata.protocol import (NewRequestData, SamplingParams, ScheduledRequest,
                                   SchedulerOutput)

    runner = _runner(tiny_checkpoints["llama"], "llama", 1)
    with pytest.raises(ValueError, match="context length 512"):
        runner.execute(SchedulerOutput(0, True, [NewRequestData("x", [5], [], SamplingParams())],
                                       [ScheduledRequest("x", 1, 512, [5], 512, [3], True)], []))
    runner.execute(SchedulerOutput(1, False, [], [], ["x"]))


def test_a_new_requests_first_entry_must_list_its_row_from_position_0(tiny_checkpoints):
    """A row held before keeps that request's slots: a new request's first entry that starts
    recording past 0 would attend to them (a hand-built test entry did, unseen)."""
    from kvstrata.protocol import (NewRequestData, SamplingParams, ScheduledRequest,
                                   SchedulerOutput)

    runner = _runner(tiny_checkpoints["llama"], "llama", 1)
    with pytest.raises(ValueError, match="records its row from position 2, not 0"):
        runner.execute(SchedulerOutput(0, True, [NewRequestData("y", [5, 6, 7], [],
                                                                SamplingParams())],
                                       [ScheduledRequest("y", 1, 2, [7], 2, [9], True)], []))
    runner.execute(SchedulerOutput(1, False, [], [], ["y"]))


def test_sliding_window_no_longer_caps_context(tiny_checkpoints, tmp_path):
    """A Mistral window is applied by the attention backend (runner/attention/window.py;
    greedy against transformers: test_sliding_window_models.py), so the context is the
    model's, not the window."""
    import json
    import shutil

    src = tiny_checkpoints["mistral"]
    dst = tmp_path / "mistral_sw"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["sliding_window"] = 128
    (dst / "config.json").write_text(json.dumps(cfg))
    runner = make_runner(str(dst), max_total_tokens=256)
    assert runner.max_context_len == cfg["max_position_embeddings"]
    assert runner.model.attn_backend.layer_windows == (128,) * cfg["num_hidden_layers"]
