"""Serving under tensor parallelism: one scheduler (on rank 0) and N runners.

Rank 0's engine core talks to a TPDriver in place of its ModelRunner: each SchedulerOutput
(tensor-free, msgspec) goes to every other rank first, then rank 0 runs its own share; the
forwards meet in the model's collectives. The other ranks (serve_rank) only apply what they
receive -- they never decide anything, so every rank's KV rows, pages and requests are the
same by construction. Every rank samples from the same all-gathered logits with the same
seeded generator, so they draw the same tokens; only rank 0's go back to the scheduler.
Each side keeps a running digest of the step messages it applied and the tokens it
sampled: `TPDriver.digests()` asks every rank for theirs (the tests compare them).
Every rank also compiles grammars itself: the server's scheduler loop tells them a held
request's grammar when it arrives and hands the request over once every rank has compiled
it (`start_grammar`, `grammars_done`; entrypoints/grammar_hold.py).
"""
from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import time
from typing import Any

import msgspec

from kvstrata.protocol.disagg import PDOp
from kvstrata.protocol.scheduler_output import Event, RunnerOutput, SchedulerOutput
from kvstrata.runner.parallel.tp_comm import RankLinks
from kvstrata.runner.parallel.tp_events import EventMerger

logger = logging.getLogger(__name__)
# Exit status of a process that lost a tensor-parallel peer; frontend/process_utils.py
# (which the runner may not import) names it in the API's errors: the test checks they agree.
TP_RANK_LOST_EXIT_CODE = 71


class StepMsg(msgspec.Struct, tag="step"):
    sched: SchedulerOutput


class CallMsg(msgspec.Struct, tag="call"):
    # "digests" | "check_rows" | "enable_disagg" | "shutdown" | GRAMMAR_OPS
    op: str
    arg: Any = None


class ReplyMsg(msgspec.Struct, tag="reply"):
    rank: int
    ok: bool
    result: Any = None


class EventsMsg(msgspec.Struct, tag="events"):
    """A rank's executor events of one step (sent when the runner has executors)."""
    rank: int
    events: list[Event]


# Structured output (entrypoints/grammar_hold.py): start a grammar's compile ([field, text];
# answers at once: whether it is compiled already), which of [[field, text], ...] are
# compiled, the backend's counters. Every rank compiles while rank 0 holds the request.
GRAMMAR_OPS = ("grammar_compile", "grammar_done", "grammar_stats")

_DOWN = msgspec.msgpack.Decoder(StepMsg | CallMsg)
_UP = msgspec.msgpack.Decoder(ReplyMsg | EventsMsg)
_encode = msgspec.msgpack.encode


def reports_events(runner: Any) -> bool:
    """The runner has op executors (HiCache, PD, retraction backups): its events go to
    rank 0 after every step. The same answer on every rank (same flags, same ops)."""
    return any(getattr(runner, name, None) is not None for name in ("hicache", "disagg",
                                                                    "backup"))


class _Digests:
    def __init__(self):
        self.steps, self.tokens, self.count = hashlib.blake2b(), hashlib.blake2b(), 0

    def add(self, sched_bytes: bytes, out: RunnerOutput) -> None:
        self.steps.update(sched_bytes)
        self.tokens.update(_encode((out.rids, out.token_ids)))
        self.count += 1

    def result(self) -> dict:
        return {"steps": self.count, "schedule": self.steps.hexdigest(),
                "tokens": self.tokens.hexdigest()}


class TPDriver:
    """Rank 0's runner as the engine core sees it: `execute` broadcasts, then runs rank 0's
    share; anything else is rank 0's ModelRunner (facts, stats, integrity checks)."""

    def __init__(self, runner: Any, links: RankLinks, processes: list[subprocess.Popen],
                 restore: Any = None):
        self.runner, self.links, self.processes = runner, links, processes
        self._restore = restore
        self._digests = _Digests()
        self._merger = EventMerger(links.size)
        self.lost: str | None = None
        self.exit_on_rank_loss = False  # the server's scheduler process: exit, do not wait
        self.reply_timeout_s = 300.0      # --watchdog-timeout (set by the engine factory)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["runner"], name)

    def on_rank_lost(self, reason: str) -> None:
        self.lost = reason
        shm = self.runner.tp_rank.group.shm
        if shm is not None:  # a forward waiting in shared memory stops waiting
            shm.abort_reason = reason
        if self.exit_on_rank_loss:
            os._exit(TP_RANK_LOST_EXIT_CODE)

    def _check(self) -> None:
        if self.lost is not None:
            raise RuntimeError(f"tensor parallelism: {self.lost}")

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        self._check()
        data = _encode(StepMsg(sched))
        self.links.send_all(data)
        out = self.runner.execute(sched)
        self._digests.add(data, out)
        if reports_events(self.runner):  # every rank's executors: a job ends on all of them
            per_rank = [out.events] + [m.events for m in self._replies("step")]
            out.events = self._merger.merge(per_rank)
            self._merger.release(op.room for op in sched.ops
                                 if isinstance(op, PDOp) and op.kind == "release")
        return out

    def call(self, op: str, arg: Any = None) -> list[ReplyMsg]:
        """Ask every other rank; their replies in rank order."""
        self._check()
        self.links.send_all(_encode(CallMsg(op, arg)))
        return self._replies(op)

    def _replies(self, op: str) -> list:
        """One message from every other rank (a ReplyMsg, or an EventsMsg after a step),
        in rank order."""
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + self.reply_timeout_s
        while len(replies) < self.links.size - 1:
            data = self.links.recv(1.0)  # in slices: a lost rank (heartbeat) ends the wait
            if data is not None:
                reply = _UP.decode(data)
                replies[reply.rank] = reply
                continue
            self._check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor parallelism: no reply to {op!r} from ranks "
                                   f"{sorted(set(range(1, self.links.size)) - set(replies))}")
        return [replies[r] for r in sorted(replies)]

    def enable_disagg(self, *args) -> None:
        """PD on every rank: the others first (a prefill rank > 0 registers with rank 0's
        bootstrap server, retrying while it starts), then rank 0, then their answers."""
        self._check()
        self.links.send_all(_encode(CallMsg("enable_disagg", list(args))))
        self.runner.enable_disagg(*args, tp=(0, self.links.size))
        for reply in self._replies("enable_disagg"):
            if not reply.ok:
                raise RuntimeError(f"rank {reply.rank}: {reply.result}")

    def start_grammar(self, key: tuple[str, str]) -> bool:
        """Every other rank starts compiling the grammar `key` ((field, text)) on its own
        backend's thread; True when all of them had it compiled already."""
        return all(self._results("grammar_compile", list(key)))

    def grammars_done(self, keys: list[tuple[str, str]]) -> list[bool]:
        """For each grammar key, whether every other rank's compile of it has ended."""
        per_rank = self._results("grammar_done", [list(k) for k in keys])
        return [all(done[i] for done in per_rank) for i in range(len(keys))]

    def grammar_stats(self) -> list[dict]:
        """Every rank's GrammarBackend.stats(), in rank order."""
        return [self.runner.grammar.stats()] + self._results("grammar_stats")

    def _results(self, op: str, arg: Any = None) -> list:
        """call(), each rank's result; a rank that could not answer is an error."""
        replies = self.call(op, arg)
        for reply in replies:
            if not reply.ok:
                raise RuntimeError(f"rank {reply.rank}: {reply.result}")
        return [reply.result for reply in replies]

    def digests(self) -> list[dict]:
        """Every rank's digests of the steps it applied and the tokens it sampled."""
        return [self._digests.result()] + [r.result for r in self.call("digests")]

    def check_req_to_token(self, expected: dict[int, list[int]],
                           swa_expected: dict[int, tuple[int, list[int]]] | None = None) -> None:
        """Every rank's req_to_token rows (and SWA rows) are the scheduler's
        (KVSTRATA_CHECK_INTEGRITY)."""
        self.runner.check_req_to_token(expected, swa_expected)
        swa = None if swa_expected is None else {str(k): list(v) for k, v in swa_expected.items()}
        for reply in self.call("check_rows", [{str(k): v for k, v in expected.items()}, swa]):
            if not reply.ok:
                raise AssertionError(f"rank {reply.rank}: {reply.result}")

    def shutdown(self) -> None:
        if self.lost is None:
            try:
                self.links.send_all(_encode(CallMsg("shutdown")))
            except Exception:  # a closed peer: the processes are ended below anyway
                pass
        for p in self.processes:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                logger.warning("rank process %d did not stop; killing it", p.pid)
                p.kill()
                p.wait()
        self.links.close()
        self.runner.shutdown()
        destroy_group()
        if self._restore is not None:
            self._restore()


def destroy_group() -> None:
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_initialized():
        dist.destroy_process_group()


def serve_rank(runner: Any, links: RankLinks) -> None:
    """A rank other than 0: apply rank 0's messages until it says shutdown. A lost rank 0
    (its heartbeat) ends this process from the heartbeat thread; an error here ends it
    with the traceback (rank 0's collective then fails, and its server exits)."""
    digests = _Digests()
    while True:
        data = links.recv()
        msg = _DOWN.decode(data)
        if isinstance(msg, StepMsg):
            out = runner.execute(msg.sched)
            digests.add(data, out)
            if reports_events(runner):
                links.reply(_encode(EventsMsg(links.rank, out.events)))
            continue
        if msg.op == "shutdown":
            return
        if msg.op == "digests":
            reply = ReplyMsg(links.rank, True, digests.result())
        elif msg.op == "enable_disagg":
            try:
                runner.enable_disagg(*msg.arg, tp=(links.rank, links.size))
                reply = ReplyMsg(links.rank, True)
            except Exception as e:  # e.g. a bootstrap server that never came up
                reply = ReplyMsg(links.rank, False, repr(e))
        elif msg.op in GRAMMAR_OPS:
            reply = _grammar_reply(runner.grammar, msg, links.rank)
        elif msg.op == "check_rows":
            try:
                rows, swa = msg.arg
                runner.check_req_to_token({int(k): v for k, v in rows.items()}, None if swa is None
                                          else {int(k): tuple(v) for k, v in swa.items()})
                reply = ReplyMsg(links.rank, True)
            except AssertionError as e:
                reply = ReplyMsg(links.rank, False, str(e))
        else:
            reply = ReplyMsg(links.rank, False, f"unknown op {msg.op!r}")
        links.reply(_encode(reply))


def _grammar_reply(backend: Any, msg: CallMsg, rank: int) -> ReplyMsg:
    """A rank > 0's answer to GRAMMAR_OPS, without waiting for any compile."""
    if backend is None:  # never expected: every rank has rank 0's flags
        return ReplyMsg(rank, False, "no grammar backend (--grammar-backend none?)")
    if msg.op == "grammar_compile":
        return ReplyMsg(rank, True, backend.compiled_key(*msg.arg).done())
    if msg.op == "grammar_done":
        return ReplyMsg(rank, True, [backend.compile_done(*key) for key in msg.arg])
    return ReplyMsg(rank, True, backend.stats())


def exit_rank_lost(reason: str) -> None:
    """A rank > 0's heartbeat lost rank 0: nothing is left to serve."""
    logger.error("tensor parallelism: %s; exiting", reason)
    os._exit(TP_RANK_LOST_EXIT_CODE)


__all__ = ["TPDriver", "serve_rank", "TP_RANK_LOST_EXIT_CODE", "exit_rank_lost",
           "destroy_group"]
