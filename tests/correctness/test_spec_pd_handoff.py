"""PD + NEXTN in-process (two runners, the transfer done by copying every registered page
buffer): the prefill's draft-extend ships the MTP layer's KV, its first top-k, its hidden
state and its DSA seed; the decode server's first draft round starts from them.

On each simulated platform the seed is remapped to decode-local slots (cuda, hip) or passed
through as positions (npu, cpu) per the resolved gate, and the seeded draft step attends to
exactly the slots whose MTP latent equals the prefill's at the seed positions. Output never
changes: a fail-closed seed and an all -1 seed make the first draft step run the indexer.
"""
from __future__ import annotations

import pytest
import torch

from helpers.runner import make_runner
from kvstrata.kv.device_pool import page_buffers_of
from kvstrata.protocol import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput
from kvstrata.protocol.disagg import PDOp
from kvstrata.protocol.scheduler_output import RUNNER_DRAFT
from tests.conftest import DSA_INDEX_TOPK
from tests.correctness.test_dsa_pd_seed import P, _gate, _slots

STEPS = 3
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def _buffers(runner):
    return page_buffers_of(runner.kv_pool) + runner.draft.page_buffers()


def _transfer(prefill, decode, pages: int) -> None:
    """What a PD transfer does: every registered buffer's pages, source -> destination, and
    the decode runner's receiver_init op (here handed to the draft directly: these runners
    have no transfer manager)."""
    for src, dst in zip(_buffers(prefill), _buffers(decode)):
        dst[:, DST[:pages]] = src[:, SRC[:pages]]
    decode.draft.on_copies([PDOp(room=1, kind="receiver_init", page_ids=DST[:pages])])


@pytest.fixture(scope="module")
def runners(tiny_dsa_mtp_checkpoint):
    kw = dict(page_size=P, max_total_tokens=256, context_length=256, max_running_requests=4,
              speculative_algorithm="NEXTN", speculative_num_steps=STEPS)
    prefill = make_runner(tiny_dsa_mtp_checkpoint, **kw)
    decode = make_runner(tiny_dsa_mtp_checkpoint, **kw)
    prefill.pd_role = "prefill"
    return prefill, decode


SRC = [9, 3, 12, 5, 30, 7, 21, 2, 17, 11, 26, 14]
DST = [40, 33, 2, 51, 8, 19, 44, 6, 60, 27, 13, 38, 22]


def _prefill(prefill, prompt, rid: str, chunk: int = 16):
    """The prompt in chunks of `chunk` (each page sent right after its chunk, as the
    scheduler does); returns the last step's output."""
    n = len(prompt)
    new = [NewRequestData(rid, prompt, [], PARAMS)]
    for step, lo in enumerate(range(0, n, chunk)):
        hi = min(lo + chunk, n)
        out = prefill.execute(SchedulerOutput(step, True, new, [ScheduledRequest(
            rid, 1, lo, prompt[lo:hi], lo, _slots(SRC, hi)[lo:], hi == n)], []))
        new = []
    prefill.execute(SchedulerOutput(99, False, [], [], [rid]))
    return out


def _decode_first_step(decode, rid: str, prompt, first: int, seed, handoff):
    n = len(prompt)
    out = decode.execute(SchedulerOutput(0, False, [NewRequestData(
        rid, prompt, [first], PARAMS, dsa_seed=seed, spec_handoff=handoff)], [ScheduledRequest(
            rid, 2, n, [first] + [RUNNER_DRAFT] * STEPS, 0, _slots(DST, n + 1 + STEPS), True,
            num_draft=STEPS)], []))
    decode.execute(SchedulerOutput(1, False, [], [], [rid]))
    return out


@pytest.mark.parametrize("platform", ["cuda", "hip", "npu", "cpu"])
def test_first_draft_round_reads_the_prefills_topk(platform, runners, tiny_prompts,
                                                   tiny_dsa_references):
    prefill, decode = runners
    remap = _gate(platform)
    decode.dsa_seeds.remap = remap
    prompt = tiny_prompts[6]                       # 45 tokens > index_topk: really sparse
    n = len(prompt)
    out = _prefill(prefill, prompt, "a")
    first = out.token_ids[0]
    handoff, wire = out.spec_handoffs["a"], out.dsa_seeds["a"]
    assert len(handoff.topk_index) == 1 and 0 < handoff.topk_p[0] <= 1
    assert len(wire) == DSA_INDEX_TOPK and all(0 <= p < n for p in wire)
    pages = -(-n // P)
    _transfer(prefill, decode, pages)
    assert len(_buffers(decode)) == 2             # the MTP layer's KV is a buffer too

    used = decode.draft.handoffs_used
    out = _decode_first_step(decode, "b", prompt, first, wire, handoff)
    ref = tiny_dsa_references[6][0]
    assert out.token_ids == ref[1:1 + len(out.token_ids)]  # exact: greedy = plain
    assert decode.draft.handoffs_used == used + 1
    assert out.dsa_seed_outcomes == {"used": 1}
    # The seeded draft step attended to exactly the decode slots of the prefill's top-k,
    # whose MTP latent (and indexer key) is the prefill's at the seed positions.
    attended = decode.draft.model.attn_backend.last_selected[0][0]
    local = torch.tensor(_slots(DST, n))[torch.tensor(wire)]
    assert attended.tolist() == local.tolist()
    sent = prefill.draft.pool.kv[0, 0, torch.tensor(_slots(SRC, n))[torch.tensor(wire)]]
    assert torch.equal(decode.draft.pool.kv[0, 0, attended], sent)


@pytest.mark.parametrize("seed_kind", ["out_of_range", "all_minus_one"])
def test_unusable_seeds_recompute_the_indexer(seed_kind, runners, tiny_prompts,
                                              tiny_dsa_references):
    prefill, decode = runners
    decode.dsa_seeds.remap = True
    prompt = tiny_prompts[5]                       # 31 tokens
    n = len(prompt)
    out = _prefill(prefill, prompt, "c")
    first, handoff, wire = out.token_ids[0], out.spec_handoffs["c"], out.dsa_seeds["c"]
    pages = -(-n // P)
    _transfer(prefill, decode, pages)
    seed = [n + 40] + wire[1:] if seed_kind == "out_of_range" else [-1] * len(wire)
    out = _decode_first_step(decode, "d", prompt, first, seed, handoff)
    assert out.token_ids == tiny_dsa_references[5][0][1:1 + len(out.token_ids)]
    expected = "failed_closed" if seed_kind == "out_of_range" else "recomputed"
    assert out.dsa_seed_outcomes == {expected: 1}
    # The first draft step ran the indexer: its selection is not forced to -1 padding.
    assert int((decode.draft.model.attn_backend.last_selected[0] >= 0).sum()) > 0


@pytest.fixture(scope="module")
def eagle_runners(tiny_checkpoints, tmp_path_factory):
    """A PD pair of an EAGLE head that copies its target (tests/helpers/eagle_heads.py):
    nearly every draft passes when the head's KV of the prompt is right."""
    from tests.helpers.eagle_heads import copy_head, copyable_target

    root = tmp_path_factory.mktemp("eagle_pd")
    target = copyable_target(tiny_checkpoints["llama"], str(root / "target"))
    head = copy_head(target, str(root / "head"))
    kw = dict(page_size=P, max_total_tokens=256, context_length=256, max_running_requests=4,
              speculative_algorithm="EAGLE", speculative_draft_model_path=head,
              speculative_num_steps=STEPS)
    prefill, decode = make_runner(target, **kw), make_runner(target, **kw)
    prefill.pd_role = "prefill"
    return prefill, decode


def test_eagle_head_kv_and_state_cross(eagle_runners):
    """Any EAGLE-family draft (no DSA here): the decode's first round runs no extend (no
    catch-up over the prompt: the head's KV came with the pages, the state with the
    metadata) and its drafts pass; a decode that gets the pages but not the state extends
    from zero features over the last position only. Output equals plain decoding."""
    prefill, decode = eagle_runners
    prompt = [5 + (7 * i) % 250 for i in range(37)]
    n = len(prompt)
    out = _prefill(prefill, prompt, "e")
    first, handoff = out.token_ids[0], out.spec_handoffs["e"]
    assert "e" not in out.dsa_seeds and len(handoff.hidden) == 4 * 64  # fp32 hidden
    pages = -(-n // P)
    assert len(_buffers(decode)) == 2
    _transfer(prefill, decode, pages)
    plain = [first]
    for k in range(STEPS + 1):  # the co-located continuation (plain steps on the prefill)
        write = 0 if k == 0 else n + k  # a new request lists its row's slots from 0
        step = prefill.execute(SchedulerOutput(10 + k, False, [NewRequestData(
            "p", prompt, plain[:1], PARAMS)] if k == 0 else [], [ScheduledRequest(
                "p", 1, n + k, [plain[-1]], write, _slots(SRC, n + k + 1)[write:], True)], []))
        plain.append(step.token_ids[0])
    prefill.execute(SchedulerOutput(20, False, [], [], ["p"]))

    used = decode.draft.handoffs_used
    got = _decode_first_step(decode, "f", prompt, first, None, handoff)
    assert decode.draft.handoffs_used == used + 1
    assert got.draft_catch_up_tokens == 0
    assert got.token_ids == plain[1:1 + len(got.token_ids)]
    assert len(got.token_ids) == STEPS + 1  # every draft passed
    again = _decode_first_step(decode, "g", prompt, first, None, None)  # pages, no state
    assert again.token_ids == plain[1:1 + len(again.token_ids)]
    assert decode.draft.handoffs_used == used + 1
