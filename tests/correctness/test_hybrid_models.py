"""Tiny random hybrid recurrent models (tests/helpers/hybrid_ckpt.py: Qwen3.5, Qwen3-Next with
its MoE, Nemotron-H, Mamba2, Granite-4.0-H with rope and its multipliers) against transformers, float32, through the ModelRunner driven by
hand-built ScheduledRequests (the engine's state-slot scheduling is not needed for these):

- prefill logits within PREFILL_ATOL of transformers' (observed <= 9e-5: the Gated DeltaNet
  checkpoints' large weights amplify float32 rounding; transformers' own float32 is as far
  from its float64);
- greedy tokens equal transformers' generate with page sizes 1 and 16, prompts run whole or in
  chunks that do and do not divide them (a chunk's recurrent layers start from the state the
  previous one left in the request's slot), batched with staggered arrivals, a slot reused
  from an earlier request (state_reset);
- a prefix hit: a snapshot taken at the end of a prefix (state_snapshot_to), copied into a new
  request's slot (state_copy_from) with the prefix's KV pages, gives the uninterrupted run's
  tokens and transformers' logprobs, and leaves the snapshot unchanged;
- speculative verify entries (drafts partly right, all wrong): the state after the accepted
  tokens only, so decoding continues exactly.
"""
from __future__ import annotations

import pytest
import torch

from helpers.driver import greedy_in_mode
from helpers.gemma_ckpt import hf_greedy
from helpers.hybrid_ckpt import (ARCH_NAMES, HYBRIDS, VOCAB, hf_hybrid, hf_logits,
                                 hybrid_checkpoints, hybrid_runner)
from helpers.runner import forward_logits
from kvstrata.protocol import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput

PREFILL_ATOL = 2e-4
NEW_TOKENS = 10
PROMPT_LENS = (1, 29, 70)  # one token, one below the 64-token chunk, one across it
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True)
GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True,
                                 logprobs=0)

_runners: dict = {}


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    return hybrid_checkpoints(str(tmp_path_factory.mktemp("tiny_hybrids")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.fixture(scope="module")
def references(paths, prompts) -> dict:
    """Per architecture: (transformers' greedy tokens per prompt, its prefill logits of the
    longest prompt, its log-softmax at each greedy step of the longest prompt)."""
    out = {}
    for arch, path in paths.items():
        hf = hf_hybrid(path)
        greedy = hf_greedy(hf, prompts, NEW_TOKENS)
        out[arch] = ([toks for toks, _ in greedy], hf_logits(hf, prompts[-1]),
                     [step.float().log_softmax(-1) for step in greedy[-1][1]])
    return out


def _runner(path: str, page_size: int = 1):
    key = (path, page_size)
    if key not in _runners:
        _runners[key] = hybrid_runner(path, page_size=page_size, num_pages=4096 // page_size)
    return _runners[key]


@pytest.mark.parametrize("arch", HYBRIDS)
def test_model_reports_its_state_and_attention_layers(arch, paths):
    runner = _runner(paths[arch])
    model, facts = runner.model, runner.kv_facts()
    assert type(model).__name__ == ARCH_NAMES[arch]
    conv, ssm = facts.state_components
    layers = {"qwen3_5": (3, 1), "qwen3_next": (3, 1), "nemotron_h": (2, 1),
              "mamba2": (2, 0), "granite": (3, 1)}[arch]
    assert (conv.num_layers, model.num_attention_layers) == layers
    assert (conv.name, ssm.name, ssm.dtype) == ("conv", "ssm", "float32")
    shapes = {"qwen3_5": ((80, 3), (4, 8, 12)), "qwen3_next": ((80, 3), (4, 8, 12)),
              "nemotron_h": ((96, 3), (4, 8, 16)), "mamba2": ((192, 3), (8, 16, 16)),
              "granite": ((192, 3), (4, 32, 16))}[arch]
    assert (conv.slot_shape, ssm.slot_shape) == shapes
    # K/V only for the attention layers (none at all for Mamba2)
    assert [c.num_layers for c in facts.components] == [layers[1]] * (2 if layers[1] else 0)
    assert facts.pool_kind == ("none" if arch == "mamba2" else "mha")


@pytest.mark.parametrize("arch", HYBRIDS)
def test_prefill_logits_match_transformers(arch, paths, prompts, references):
    ours = forward_logits(_runner(paths[arch]), prompts[-1])
    assert (ours - references[arch][1]).abs().max().item() < PREFILL_ATOL


@pytest.mark.parametrize("arch", HYBRIDS)
@pytest.mark.parametrize("page_size,chunk", [(1, None), (1, 5), (16, 7)])
def test_greedy_matches_transformers(arch, page_size, chunk, paths, prompts, references):
    """chunk 5 divides the 70-token prompt but not the 29-token one; 7 neither."""
    runner = _runner(paths[arch], page_size)
    got = greedy_in_mode(runner, prompts, NEW_TOKENS, batched=True, chunk=chunk,
                         staggered=chunk is not None)
    assert got == references[arch][0]
    assert not runner._reqs


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_a_reused_slot_is_reset(arch, paths, prompts, references, monkeypatch):
    """Garbage in every state slot: a request that starts with state_reset ignores it. The
    decode rows here take the torch step (gathered slots) instead of the C kernel."""
    monkeypatch.setenv("KVSTRATA_CPU_RECURRENT_STEP", "0")
    runner = _runner(paths[arch])
    for t in runner.state_pool.tensors.values():
        t.normal_()
    assert greedy_in_mode(runner, prompts, NEW_TOKENS, batched=False) == references[arch][0]


def test_state_fields_are_applied_and_checked(paths):
    """state_reset zeroes the slot, state_copy_from copies the snapshot into it, before the
    forward; what a scheduler must never send is refused by name."""
    from kvstrata.runner import state_ops
    from kvstrata.runner.forward_batch import ForwardBatch

    pool = _runner(paths["nemotron_h"]).state_pool
    for t in pool.tensors.values():
        t.normal_()
    snapshot = pool.cpu_copy([6])
    reqs = [ScheduledRequest("a", 1, 0, [5, 6], 0, [1, 2], True, state_slot=3,
                             state_reset=True),
            ScheduledRequest("b", 2, 4, [7], 0, [3, 4, 5, 6, 7], True, state_slot=8,
                             state_copy_from=6)]
    fb = ForwardBatch.build([r.token_ids for r in reqs], [1, 2], [0, 4], torch.device("cpu"))
    state_ops.before_forward(pool, reqs, fb)
    assert not any(t[:, 3].any() for t in pool.tensors.values())
    assert all(torch.equal(t[:, 8], snapshot[n][:, 0]) for n, t in pool.tensors.items())
    assert fb.recurrent.decode == [1] and fb.recurrent.has_state == [False, True]
    bad = [dict(state_slot=0), dict(state_slot=3, state_reset=True, state_copy_from=6),
           dict(state_slot=3, draft_parents=[0]), dict(state_slot=pool.num_slots)]
    for fields in bad:
        with pytest.raises(ValueError):
            state_ops.before_forward(pool, [ScheduledRequest("c", 1, 0, [5], 0, [1], True,
                                                             **fields)], fb)
    with pytest.raises(ValueError, match="shared"):
        state_ops.before_forward(pool, [reqs[0], ScheduledRequest(
            "d", 3, 0, [1], 0, [9], True, state_slot=3)], fb)


def _sched(rid, start, tokens, slots, **state) -> ScheduledRequest:
    return ScheduledRequest(rid, state.pop("row"), start, tokens, start,
                            slots[start:start + len(tokens)], True, **state)


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2"])
def test_copy_on_write_from_a_snapshot(arch, paths, prompts, references):
    """Request a runs the prefix (snapshot into slot 9 after it), then the rest; request b
    shares the prefix: its row records the prefix's KV slots from position 0 (as the
    scheduler's prefix hit does: slot_write_start 0) and the snapshot is copied into its own
    slot 4. Each of b's tokens must have transformers' logprob too, not only its argmax: a
    row missing the prefix (stale slots from an earlier test's request in row 2) moved the
    logits by ~0.2 while the tokens still matched."""
    runner = _runner(paths[arch])
    prompt, cut = prompts[-1], 40
    slots = list(range(1, 200))
    a_new = NewRequestData("a", prompt, [], GREEDY)
    runner.execute(SchedulerOutput(0, False, [a_new], [_sched(
        "a", 0, prompt[:cut], slots, row=1, state_slot=2, state_reset=True,
        state_snapshot_to=9)], []))
    snapshot = {n: t[:, 9].clone() for n, t in runner.state_pool.tensors.items()}
    first = runner.execute(SchedulerOutput(1, False, [], [_sched(
        "a", cut, prompt[cut:], slots, row=1, state_slot=2)], [])).token_ids[0]
    b_new = NewRequestData("b", prompt, [], GREEDY_LOGPROBS)
    b_slots = slots[:cut] + list(range(300, 400))  # the prefix's KV, then its own
    b_entry = ScheduledRequest("b", 2, cut, prompt[cut:], 0, b_slots[:len(prompt)], True,
                               state_slot=4, state_copy_from=9)
    b_out = runner.execute(SchedulerOutput(2, False, [b_new], [b_entry], ["a"]))
    got, logprobs = list(b_out.token_ids), list(b_out.logprobs)
    for i in range(NEW_TOKENS - 1):
        out = runner.execute(SchedulerOutput(100 + i, False, [], [_sched(
            "b", len(prompt) + i, [got[-1]], b_slots, row=2, state_slot=4)], []))
        got += out.token_ids
        logprobs += out.logprobs
    assert [first] == got[:1] and got == references[arch][0][-1]
    hf_logprobs = [step[tok].item() for step, tok in zip(references[arch][2], got)]
    assert max(abs(a - b) for a, b in zip(logprobs, hf_logprobs)) < 2 * PREFILL_ATOL
    for name, t in runner.state_pool.tensors.items():
        assert torch.equal(t[:, 9], snapshot[name]), "copy-on-write changed the snapshot"
    runner.execute(SchedulerOutput(200, False, [], [], ["b"]))


@pytest.mark.parametrize("arch", ["qwen3_5", "granite"])
def test_speculative_verify_commits_the_accepted_step(arch, paths, prompts, references):
    runner = _runner(paths[arch])
    prompt, ref = prompts[1], references[arch][0][1]
    slots = list(range(1, 200))
    got = list(runner.execute(SchedulerOutput(0, False, [NewRequestData("v", prompt, [], GREEDY)],
                                              [_sched("v", 0, prompt, slots, row=3,
                                                      state_slot=5, state_reset=True)],
                                              [])).token_ids)
    pos, step = len(prompt), 1
    while len(got) < NEW_TOKENS:
        k = len(got)
        wrong = (ref[min(k + 2, len(ref) - 1)] + 1) % VOCAB
        drafts = ([(ref[k] + 1) % VOCAB, 9] if step % 3 == 0  # all rejected
                  else ref[k:k + 2] + [wrong, 7])                # two accepted, then wrong
        res = runner.execute(SchedulerOutput(step, False, [], [_sched(
            "v", pos, [got[-1]] + drafts, slots, row=3, state_slot=5,
            num_draft=len(drafts))], []))
        got += res.token_ids
        pos += len(res.token_ids)
        step += 1
    assert got[:NEW_TOKENS] == ref
    runner.execute(SchedulerOutput(step, False, [], [], ["v"]))


@pytest.mark.parametrize("arch", ["qwen3_5", "nemotron_h"])
def test_a_snapshot_inside_a_prefill_chunk(arch, paths, prompts):
    """state_snapshot_at inside a prefill: the forward splits its scan there and the
    snapshot slot gets the state after those tokens -- what a prefill of just them leaves
    (float32 rounding apart); the request's own slot still ends after the whole chunk."""
    runner = _runner(paths[arch])
    prompt, cut = prompts[-1], 48
    slots = list(range(1, 200))
    runner.execute(SchedulerOutput(0, False, [NewRequestData("s", prompt, [], GREEDY)], [_sched(
        "s", 0, prompt, slots, row=1, state_slot=2, state_reset=True, state_snapshot_to=9,
        state_snapshot_at=cut)], []))
    runner.execute(SchedulerOutput(1, False, [NewRequestData("h", prompt[:cut], [], GREEDY)],
                                   [_sched("h", 0, prompt[:cut], list(range(300, 400)), row=2,
                                           state_slot=3, state_reset=True)], ["s"]))
    runner.execute(SchedulerOutput(2, False, [NewRequestData("w", prompt, [], GREEDY)],
                                   [_sched("w", 0, prompt, list(range(400, 500)), row=3,
                                           state_slot=4, state_reset=True)], ["h"]))
    for t in runner.state_pool.tensors.values():
        tol = 1e-5 * max(t[:, 3].abs().max().item(), t[:, 4].abs().max().item(), 1.0)
        assert (t[:, 9] - t[:, 3]).abs().max().item() <= tol
        # the working slot: as without the snapshot (the split scan rounds differently)
        assert (t[:, 2] - t[:, 4]).abs().max().item() <= tol
    runner.execute(SchedulerOutput(3, False, [], [], ["w"]))
