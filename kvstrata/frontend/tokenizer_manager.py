"""The api server's side of the engine: tokenises, sends requests to the scheduler, and
routes the detokenizer's text outputs back to the waiting HTTP handlers.

Every request gets an asyncio.Queue of TextOutputs. One background task reads the inbound
socket and fills the queues, and keeps the latest load the scheduler published (LoadReport),
so /get_load and /metrics never wait behind a long engine step.

Failure: the event loop watches each child process's sentinel, so the moment the scheduler or
the detokenizer exits (crash, SIGKILL, --watchdog-timeout) every waiting request is failed
with a 500 naming the cause, /health turns 503, and `wait_dead()` returns so the launcher can
exit non-zero. A backstop task covers a scheduler stuck where its own watchdog cannot run:
requests in flight and nothing heard from the engine for 2 x --watchdog-timeout + 10 s
(counted from the later of the last message and the first request to wait: an idle engine
says nothing, and its silence before a request is no hang).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from kvstrata.frontend import ipc
from kvstrata.frontend.process_utils import describe_exit
from kvstrata.frontend.tokenizer_loader import NoTokenizer, TokenizerSkipped, skipped_message
from kvstrata.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The scheduler process is gone: every request fails with 500."""


class DuplicateRequestError(ValueError):
    """A request id equal to one still running: the client's mistake (a 400)."""


@dataclass
class _ReqState:
    queue: asyncio.Queue
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    finished: bool = False


class TokenizerManager:
    def __init__(self, server_args, tokenizer, paths: ipc.IpcPaths, engine_info: dict,
                 metrics: ServerMetrics, children: Mapping[str, object] | None = None):
        """`children`: name -> multiprocessing.Process of the scheduler and detokenizer."""
        self.server_args = server_args
        self.tokenizer = tokenizer
        self.paths = paths
        self.engine_info = engine_info
        self.metrics = metrics
        self.children = dict(children or {})
        self.states: dict[str, _ReqState] = {}
        self.pending_calls: dict[int, asyncio.Future] = {}
        self.call_ids = itertools.count(1)
        self.engine_dead = False
        self.dead_reason: str | None = None
        self._dead = asyncio.Event()
        # The scheduler's latest get_load(); engine_info carries the one taken at start.
        self.load: dict = dict(engine_info.get("load", {}))
        self.last_heard = time.monotonic()
        self.waiting_since = 0.0  # when the in-flight requests went from none to some
        self._tasks: list[asyncio.Task] = []
        self.ctx: zmq.asyncio.Context | None = None

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self.ctx = zmq.asyncio.Context()
        self.send_sock = self.ctx.socket(zmq.PUSH)
        self.send_sock.connect(self.paths.scheduler_in)
        self.recv_sock = self.ctx.socket(zmq.PULL)
        self.recv_sock.bind(self.paths.api_in)
        self._tasks = [asyncio.create_task(self._recv_loop()),
                       asyncio.create_task(self._hang_backstop())]
        loop = asyncio.get_running_loop()
        for name, proc in self.children.items():
            loop.add_reader(proc.sentinel, self._on_child_exit, name, proc)

    async def stop(self) -> None:
        loop = asyncio.get_running_loop()
        for proc in self.children.values():
            loop.remove_reader(proc.sentinel)
        for task in self._tasks:
            task.cancel()
        if self.ctx is not None:
            self.send_sock.close(linger=0)
            self.recv_sock.close(linger=0)
            self.ctx.term()
            self.ctx = None

    async def _recv_loop(self) -> None:
        while True:
            msg = ipc.decode(await self.recv_sock.recv(), "api")
            self.last_heard = time.monotonic()
            if isinstance(msg, ipc.LoadReport):
                self.load = msg.load
            elif isinstance(msg, ipc.TextOutputs):
                for out in msg.outputs:
                    state = self.states.get(out.rid)
                    if state is not None:
                        state.queue.put_nowait(out)
            elif isinstance(msg, ipc.ControlReply):
                fut = self.pending_calls.pop(msg.call_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, ipc.EngineFailure) and not self.engine_dead:
                self._fail_everything(f"the scheduler process failed: {msg.reason}")

    def _on_child_exit(self, name: str, proc) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        # Reap it so its exit code is known: the sentinel closes a moment before the
        # process can be waited for, so join(0) may still see it running.
        proc.join(1.0)
        if not self.engine_dead:
            self._fail_everything(f"the {name} process {describe_exit(proc.exitcode)}")

    async def _hang_backstop(self) -> None:
        limit = 2 * float(getattr(self.server_args, "watchdog_timeout", 300.0)) + 10.0
        while not self.engine_dead:
            await asyncio.sleep(1.0)
            silent = time.monotonic() - max(self.last_heard, self.waiting_since)
            if self.states and silent > limit:
                proc = self.children.get("scheduler")
                logger.error("no output from the engine for %.0f s with %d requests in "
                             "flight (the scheduler's own watchdog did not fire): killing it",
                             silent, len(self.states))
                self._fail_everything(f"the engine made no progress for {silent:.0f} s")
                if proc is not None and proc.is_alive():
                    proc.kill()

    async def wait_dead(self) -> str:
        """Return the reason once the engine is gone (a child process exited)."""
        await self._dead.wait()
        return self.dead_reason or "the engine stopped"

    async def drain(self, timeout: float) -> None:
        """Wait until every in-flight request has taken its final output (bounded)."""
        deadline = time.monotonic() + timeout
        while self.states and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def _fail_everything(self, why: str) -> None:
        logger.error("%s: failing %d in-flight requests", why, len(self.states))
        self.engine_dead = True
        self.dead_reason = why
        self._dead.set()
        self.metrics.on_abort("engine_dead", len(self.states))
        for rid, state in self.states.items():
            state.queue.put_nowait(ipc.TextOutput(
                rid=rid, text="", new_token_ids=[], finished=True, finish_type="abort",
                error_message=why, error_status=500))
        for fut in self.pending_calls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(why))
        self.pending_calls.clear()

    # ---- requests ------------------------------------------------------------------------
    def encode_prompt(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    @property
    def has_tokenizer(self) -> bool:
        """False under --skip-tokenizer-init (token ids in and out, no text)."""
        return not isinstance(self.tokenizer, NoTokenizer)

    def health_prompt_ids(self) -> list[int]:
        """/health_generate's one-token prompt ("hi"; token 0 under --skip-tokenizer-init)."""
        return self.encode_prompt("hi") if self.has_tokenizer else [0]

    def apply_chat_template(self, messages: list[dict], **template_kwargs) -> list[int]:
        # Render to text, then encode without special tokens: the template already writes
        # any BOS/role markers it wants, and encode() must not add a second BOS.
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=True,
                                                  **template_kwargs)
        return self.encode_prompt(text)

    def _wait_for(self, rid: str) -> "_ReqState":
        """A request's state; the first one in flight starts the backstop's clock."""
        if not self.states:
            self.waiting_since = time.monotonic()
        state = self.states[rid] = _ReqState(asyncio.Queue())
        return state

    def new_rid(self) -> str:
        return uuid.uuid4().hex

    async def generate(self, req: ipc.GenerateReq,
                       log_metrics: bool = True) -> AsyncIterator[ipc.TextOutput]:
        """Yield the TextOutputs of one request until it finishes. If the consumer stops
        early (client disconnect, cancellation) the request is aborted in the engine.
        log_metrics=False (SGLang's flag) keeps the request out of /metrics."""
        if self.engine_dead:
            raise EngineDeadError(f"the server is shutting down: {self.dead_reason}")
        for name, what in (("stop", "a stop string"), ("stop_regex", "a stop regex")):
            if getattr(req.sampling_params, name, None) and not self.has_tokenizer:
                raise TokenizerSkipped(skipped_message(what), name)
        if req.rid in self.states:
            raise DuplicateRequestError(f"duplicate request id {req.rid!r}: a request with "
                                        "this id is still running")
        state = self._wait_for(req.rid)
        try:
            await self.send_sock.send(ipc.encode(req))
            while True:
                out: ipc.TextOutput = await state.queue.get()
                if state.first_token_at is None and out.new_token_ids:
                    state.first_token_at = time.perf_counter()
                if out.finished:
                    state.finished = True
                    if log_metrics:
                        self._record(state, out)
                yield out
                if out.finished:
                    return
        finally:
            self.states.pop(req.rid, None)
            if not state.finished and not self.engine_dead:
                # Consumer went away mid-request (a client disconnect): free its KV now.
                if log_metrics:
                    self.metrics.on_abort("client_disconnect")
                self.abort(req.rid)

    def _record(self, state: _ReqState, out: ipc.TextOutput) -> None:
        now = time.perf_counter()
        ttft = state.first_token_at - state.created if state.first_token_at else None
        self.metrics.on_finish(
            prompt_tokens=out.prompt_tokens, completion_tokens=out.completion_tokens,
            cached_tokens=out.cached_tokens, finish_type=out.finish_type or "unknown",
            ttft=ttft, e2e=now - state.created)

    def abort(self, rid: str) -> None:
        # Called from finally blocks (possibly during cancellation), so do not await: a
        # PUSH socket with a connected peer queues the message without blocking.
        try:
            self.send_sock.send(ipc.encode(ipc.AbortReq(rid)), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            logger.warning("could not send abort for %s", rid)

    def abort_all(self) -> int:
        rids = list(self.states)
        for rid in rids:
            self.abort(rid)
        return len(rids)

    async def control(self, op: str, timeout: float = 10.0) -> dict:
        if self.engine_dead:
            raise EngineDeadError(f"the server is shutting down: {self.dead_reason}")
        call_id = next(self.call_ids)
        fut = asyncio.get_running_loop().create_future()
        self.pending_calls[call_id] = fut
        await self.send_sock.send(ipc.encode(ipc.ControlReq(call_id, op)))
        try:
            reply: ipc.ControlReply = await asyncio.wait_for(fut, timeout)
        finally:
            self.pending_calls.pop(call_id, None)
        if not reply.ok:
            raise RuntimeError(reply.error or f"{op} failed")
        return reply.result
