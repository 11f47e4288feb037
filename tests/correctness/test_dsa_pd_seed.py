"""The DSA seed under PD, end to end inside one process, on each simulated platform.

A prefill runner computes a prompt and reports its last-position top-k as positions; its
pages are copied into other page ids of a decode runner exactly as the transfer backends
copy them (the registered page buffers); the decode runner receives the seed through
NewRequestData, remaps it (cuda, hip) or passes the positions through (npu, cpu) per the gate
start-up resolves on that platform. Proof: for every seed position p, the latent + indexer
row at the decode-local slot equals the prefill runner's row at position p, in every layer;
and the seed never changes the target's own output."""
from __future__ import annotations

import pytest
import torch

from helpers.runner import make_runner
from kvstrata.config.resolve import resolve
from kvstrata.config.resolve_types import ModelInfo
from kvstrata.config.server_args import ServerArgs
from kvstrata.kv.device_pool import page_buffers_of
from kvstrata.platform import simulated
from kvstrata.protocol import NewRequestData, SamplingParams, ScheduledRequest, SchedulerOutput
from kvstrata.protocol.disagg import (PDMetadata, dsa_seed_extras, dsa_seed_from_extras)
from tests.conftest import DSA_INDEX_TOPK

P = 4
PARAMS = SamplingParams(temperature=0.0, max_new_tokens=4, ignore_eos=True)


def _gate(platform: str) -> bool:
    args, _ = resolve(ServerArgs(disaggregation_mode="decode"), simulated(platform),
                      ModelInfo(kv_pool_kind="mla", uses_dsa=True), env={})
    return bool(args.dsa_remap_pd_seed_to_local_slots)


def _slots(pages: list[int], n: int) -> list[int]:
    return [pages[q // P] * P + q % P for q in range(n)]


@pytest.fixture(scope="module")
def runners(tiny_dsa_checkpoint):
    kw = dict(page_size=P, max_total_tokens=256, context_length=256, max_running_requests=4)
    prefill, decode = make_runner(tiny_dsa_checkpoint, **kw), make_runner(tiny_dsa_checkpoint, **kw)
    prefill.pd_role = "prefill"
    return prefill, decode


@pytest.mark.parametrize("platform", ["cuda", "hip", "npu", "cpu"])
def test_seed_points_at_the_transferred_latents(platform, runners, tiny_prompts):
    prefill, decode = runners
    remap = _gate(platform)
    assert remap is (platform in ("cuda", "hip"))
    decode.dsa_seeds.remap = remap  # what build_runner passes from the resolved gate
    prompt = tiny_prompts[6]                     # 45 tokens > index_topk
    n = len(prompt)
    src_pages, dst_pages = [9, 3, 12, 5, 30, 7, 21, 2, 17, 11, 26, 14], \
        [40, 33, 2, 51, 8, 19, 44, 6, 60, 27, 13, 38, 22]
    out = prefill.execute(SchedulerOutput(0, True, [NewRequestData("a", prompt, [], PARAMS)], [
        ScheduledRequest("a", 1, 0, prompt, 0, _slots(src_pages, n), True)], []))
    first = out.token_ids[0]
    wire = out.dsa_seeds["a"]
    assert len(wire) == DSA_INDEX_TOPK and all(0 <= p < n for p in wire)
    # Co-located continuation: the token the decode side must produce too.
    colocated = prefill.execute(SchedulerOutput(1, False, [], [ScheduledRequest(
        "a", 1, n, [first], n, _slots(src_pages, n + 1)[n:], True)], [])).token_ids[0]
    prefill.execute(SchedulerOutput(2, False, [], [], ["a"]))

    # The transfer: page bytes of every registered buffer, source pages -> destination pages.
    pages_sent = -(-n // P)
    for src, dst in zip(page_buffers_of(prefill.kv_pool), page_buffers_of(decode.kv_pool)):
        dst[:, dst_pages[:pages_sent]] = src[:, src_pages[:pages_sent]]
    md = PDMetadata(room=1, first_token_id=first, extras=dsa_seed_extras(wire, DSA_INDEX_TOPK))
    seed = dsa_seed_from_extras(md.extras)

    out = decode.execute(SchedulerOutput(0, False, [NewRequestData(
        "b", prompt, [first], PARAMS, dsa_seed=seed)], [ScheduledRequest(
            "b", 2, n, [first], 0, _slots(dst_pages, n + 1), True)], []))
    assert out.token_ids == [colocated]           # the seed never touches target attention
    kept = decode.dsa_seeds.seeds["b"]
    table_row = decode.req_to_token.table[2]
    local = table_row[torch.tensor(wire)]
    assert kept.tolist() == (local.tolist() if remap else wire)
    sent, received = prefill.dsa_seeds.records[-1], decode.dsa_seeds.records[-1]
    assert (sent["side"], received["side"], received["remapped"]) == ("prefill", "decode", remap)
    assert received["positions"] == sent["positions"] == wire
    assert received["latent"] == sent["latent"]   # every layer, latent and indexer key
    decode.execute(SchedulerOutput(1, False, [], [], ["b"]))
    assert "b" not in decode.dsa_seeds.seeds


def test_seed_metadata_round_trip():
    import msgspec

    with_seed = PDMetadata(room=3, first_token_id=5, extras=dsa_seed_extras([4, 5, 6, -1], 4))
    without = PDMetadata(room=4, first_token_id=5, extras=dsa_seed_extras(None, 3))
    assert without.extras == {"dsa_topk_positions": [-1, -1, -1]}
    for md in (with_seed, without):
        back = msgspec.msgpack.decode(msgspec.msgpack.encode(md), type=PDMetadata)
        assert back == md
    assert dsa_seed_from_extras(with_seed.extras) == [4, 5, 6, -1]
    assert dsa_seed_from_extras(without.extras) is None
    assert dsa_seed_from_extras({}) is None
    with pytest.raises(ValueError, match="index_topk=4"):
        dsa_seed_extras([1, 2], 4)
