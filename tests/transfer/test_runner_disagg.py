"""ModelRunner with PD on: a prefill runner computes a prompt's KV, ships it through
PDOps / PDEvents (tcp) into other pages of a decode runner, and the decode runner's next
token from the shipped KV equals the prefill runner's own next token."""
from __future__ import annotations

import torch

from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv.device_pool import page_buffers_of
from kvstrata.protocol.disagg import KVPoll, PDMetadata, PDOp
from kvstrata.protocol.sampling_params import SamplingParams
from kvstrata.protocol.scheduler_output import (NewRequestData, ScheduledRequest,
                                                SchedulerOutput)
from kvstrata.runner.model_runner import ModelRunner

from .conftest import free_port

PAGE = 4
ROOM = 77


def runner(path: str, role: str, port: int) -> ModelRunner:
    r = ModelRunner(path, dtype="float32", device="cpu")
    d = r.model.dims
    r.allocate_kv(KVPlan.mha(num_layers=d.num_layers, num_kv_heads=d.num_kv_heads,
                             head_dim=d.head_dim, dtype="float32", page_size=PAGE,
                             num_pages=24, num_rows=4, context_len=64))
    r.enable_disagg(role, "tcp", "127.0.0.1", port, num_metadata_slots=4)
    return r


def slots(pages: list[int], n: int) -> list[int]:
    return [pages[p // PAGE] * PAGE + p % PAGE for p in range(n)]


def step(r: ModelRunner, n: int, ops=(), new=(), scheduled=()):
    return r.execute(SchedulerOutput(n, bool(scheduled), list(new), list(scheduled), [],
                                     ops=list(ops)))


def run_until(r: ModelRunner, state: KVPoll, ops=()) -> list:
    seen = []
    for n in range(400):  # idle steps wait up to IDLE_WAIT_SECONDS each
        seen += step(r, n, ops if n == 0 else ()).events
        if seen and seen[-1].state == state:
            return seen
    raise AssertionError(f"never reached {state!r}: {seen}")


def test_prefill_to_decode_through_the_runners(tiny_checkpoints):
    path, port = tiny_checkpoints["llama"], free_port()
    prefill, decode = runner(path, "prefill", port), runner(path, "decode", port)
    try:
        prompt = [5, 9, 14, 3, 27, 8, 11, 40, 2, 19]  # 10 tokens: 3 pages of 4
        src_pages, dst_pages = [2, 3, 4], [7, 11, 5]
        greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
        new = NewRequestData("a", prompt, [], greedy)
        out = step(prefill, 1, [PDOp(ROOM, "sender_create", "127.0.0.1", port)], [new],
                   [ScheduledRequest("a", 1, 0, prompt, 0, slots(src_pages, 10), True)])
        first = out.token_ids[0]
        assert [e.state for e in out.events] == [KVPoll.BOOTSTRAPPING]
        run_until(decode, KVPoll.WAITING_FOR_INPUT,
                  [PDOp(ROOM, "receiver_create", "127.0.0.1", port)])
        assert [e.state for e in run_until(decode, KVPoll.TRANSFERRING, [
            PDOp(ROOM, "receiver_init", page_ids=dst_pages, metadata_index=2)])] == [
            KVPoll.TRANSFERRING]
        run_until(prefill, KVPoll.WAITING_FOR_INPUT)
        meta = PDMetadata(ROOM, first_token_id=first)
        events = run_until(prefill, KVPoll.SUCCESS, [
            PDOp(ROOM, "sender_init", num_pages=3, metadata_index=0),
            PDOp(ROOM, "send", page_ids=src_pages[:2]),
            PDOp(ROOM, "send", page_ids=src_pages[2:], last=True, metadata=meta)])
        assert events[-1].state == KVPoll.SUCCESS
        got = run_until(decode, KVPoll.SUCCESS)[-1]
        assert got.metadata == meta
        assert torch.equal(page_buffers_of(decode.kv_pool)[0][:, dst_pages],
                           page_buffers_of(prefill.kv_pool)[0][:, src_pages])
        # the next token: decode from the shipped KV == prefill from its own
        nxt = []
        for r, pages in ((prefill, src_pages), (decode, dst_pages)):
            new = [] if r is prefill else [NewRequestData("a", prompt, [first], greedy)]
            out = step(r, 99, [PDOp(ROOM, "release")], new,
                       [ScheduledRequest("a", 1, 10, [first], 0, slots(pages, 11), True)])
            nxt.append(out.token_ids[0])
        assert nxt[0] == nxt[1]
        assert not prefill.disagg.has_live and not decode.disagg.has_live
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert prefill.disagg is None
