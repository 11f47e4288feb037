"""The scheduler subprocess: a loop around the engine core.

Each iteration drains the inbound socket (requests, aborts, control calls) without blocking
while there is work, then runs one engine step and ships its outputs to the detokenizer.
When the engine is idle it blocks on the socket, so an idle server burns no CPU.
"""
from __future__ import annotations

import importlib
import logging
import os
import time
import traceback

import zmq

from kvstrata import envs
from kvstrata.entrypoints.engine_factory import start_up_info
from kvstrata.entrypoints.grammar_hold import GrammarHold
from kvstrata.entrypoints.scheduler_watchdog import (StepWatchdog, engine_state_dump,
                                                      slow_step_from_env)
from kvstrata.frontend import ipc

logger = logging.getLogger(__name__)

# envs.KVSTRATA_ENGINE_FACTORY ("module:function") swaps the engine: tests inject fakes and faults.

# How often a busy scheduler publishes its load to the API process (see report_load).
LOAD_REPORT_INTERVAL_S = 0.1


def load_engine_factory():
    spec = envs.KVSTRATA_ENGINE_FACTORY.get()
    module_name, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module_name), attr or "build_engine")


def engine_info(engine, tokenizer) -> dict:
    """What the api server needs to validate requests before they reach the engine."""
    info: dict = {"pid": os.getpid()}
    for name in ("max_context_len", "context_len", "max_model_len"):
        value = getattr(engine, name, None)
        if isinstance(value, int):
            info["max_context_len"] = value
            break
    try:
        load = dict(engine.get_load())
        info.update(load)
        info["load"] = load  # the API process's /get_load until the first LoadReport
    except Exception:  # info is best effort; the engine may not support it before serving
        pass
    # Resolved args, resolutions and KV plan: start-up ran once, here, with the model's facts.
    info.update(start_up_info(engine))
    return info


class SchedulerLoop:
    def __init__(self, engine, tokenizer, recv_sock, send_sock,
                 watchdog: StepWatchdog | None = None):
        self.engine = engine
        self.tokenizer = tokenizer
        self.recv_sock = recv_sock
        self.send_sock = send_sock
        self.watchdog = watchdog
        self.slow_step = slow_step_from_env()
        self.last_load_report = 0.0
        self.load_failed = False
        # A request added or aborted since the last step must see one more step, even if the
        # engine reports no unfinished work: that step carries its error / abort output.
        self.step_pending = False
        self.running = True
        # requests waiting for their grammar to compile before they join the engine
        self.grammars = GrammarHold.of(engine)

    def handle(self, msg) -> None:
        engine = self.engine
        if isinstance(msg, ipc.GenerateReq):
            sp = msg.sampling_params
            # The detokenizer holds back and cuts the stop strings it is given: none, with
            # no_stop_trim, so that the output keeps them.
            stop = [] if sp.no_stop_trim else list(sp.stop)
            self.send_sock.send(ipc.encode(ipc.RegisterDetok(
                rid=msg.rid, stop=stop, skip_special_tokens=sp.skip_special_tokens,
                trim_stop_token=not sp.no_stop_trim)))
            if not self.grammars.hold(msg):
                engine.add_request(msg)  # the engine's own EngineRequest, as the api built it
                self.step_pending = True
        elif isinstance(msg, ipc.AbortReq):
            held = self.grammars.release(msg.rid)
            if held is not None:  # the engine ends it (and reports it) as any other abort
                engine.add_request(held)
            engine.abort_request(msg.rid)
            self.step_pending = True
        elif isinstance(msg, ipc.ControlReq):
            reply = self.control(msg)
            # Before the reply, so that the API process has it when the call returns
            # (/get_load right after /flush_cache shows the flushed cache).
            self.report_load(force=True)
            self.send_sock.send(ipc.encode(reply))
        elif isinstance(msg, ipc.ShutdownReq):
            self.running = False

    def control(self, msg: ipc.ControlReq) -> ipc.ControlReply:
        try:
            if msg.op == "get_load":
                result = dict(self.engine.get_load())
            elif msg.op == "flush_cache":
                result = {"flushed": bool(self.engine.flush_cache())}
            elif msg.op == "check_integrity":
                try:
                    self.engine.check_integrity()
                    result = {"ok": True}
                except AssertionError as e:
                    result = {"ok": False, "error": str(e)}
                result.update(self.engine.get_load())
            elif msg.op == "dsa_seeds":
                keeper = getattr(self.engine.runner, "dsa_seeds", None)
                result = {"records": list(keeper.records) if keeper is not None else None}
            elif msg.op == "grammar_stats":
                result = {"ranks": self.grammars.stats()}
            elif msg.op == "engine_info":
                result = engine_info(self.engine, self.tokenizer)
            else:
                return ipc.ControlReply(msg.call_id, False, error=f"unknown op {msg.op!r}")
            return ipc.ControlReply(msg.call_id, True, result=result)
        except Exception as e:
            logger.exception("control op %s failed", msg.op)
            return ipc.ControlReply(msg.call_id, False, error=repr(e))

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_sock, zmq.POLLIN)
        while self.running:
            busy = self.step_pending or self.engine.has_unfinished_requests()
            # Block (in 1 s slices, to notice shutdown) only when there is nothing to run;
            # look at the grammars being compiled every 5 ms.
            if busy or poller.poll(5 if self.grammars.held else 1000):
                while True:
                    try:
                        data = self.recv_sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.handle(ipc.decode(data, "scheduler"))
            if not self.running:
                break
            for req in self.grammars.ready():
                self.engine.add_request(req)
                self.step_pending = True
            if self.step_pending or self.engine.has_unfinished_requests():
                self.step_pending = False
                self.publish(self.timed_step())

    def publish(self, outputs: list) -> None:
        """A step's outputs, the load first: a client that got its last token and then asks
        /get_load or /metrics sees the load after that step -- so a step that finished a
        request reports even inside the busy interval (background HiCache writes, or other
        requests, keep the engine busy after it)."""
        self.report_load(force=any(out.finished for out in outputs))
        if outputs:
            self.send_sock.send(ipc.encode(ipc.EngineOutputs(outputs)))

    def timed_step(self) -> list:
        if self.watchdog is None:
            return self.engine.step()
        with self.watchdog.step() as n:
            if self.slow_step is not None and self.slow_step[0] == n:
                logger.warning("KVSTRATA_DEBUG_SLOW_STEP: step %d sleeps %g s", n,
                               self.slow_step[1])
                time.sleep(self.slow_step[1])
            return self.engine.step()

    def report_load(self, force: bool = False) -> None:
        """Publish get_load() after a step (at most every LOAD_REPORT_INTERVAL_S, and always
        when the engine goes idle) so the API process answers /get_load and /metrics from
        its copy instead of waiting behind a long step."""
        now = time.monotonic()
        idle = not self.engine.has_unfinished_requests()
        if force or idle or now - self.last_load_report >= LOAD_REPORT_INTERVAL_S:
            self.last_load_report = now
            try:
                load = dict(self.engine.get_load())
            except Exception:  # statistics must never stop serving; say so once
                if not self.load_failed:
                    logger.exception("get_load() failed; /get_load keeps its last value")
                self.load_failed = True
                return
            self.send_sock.send(ipc.encode(ipc.LoadReport(load)))


# How long the scheduler waits for the launcher's tokenizer copy before loading its own (the
# launcher sends it once both children are ready).
TOKENIZER_SPEC_WAIT_S = 600.0


def decode_only_from(conn):
    """The launcher's tokenizer copy as a DecodeOnlyTokenizer, or None (not exact to copy,
    never sent): the caller then loads the tokenizer itself."""
    from kvstrata.frontend.tokenizer_loader import DecodeOnlyTokenizer

    try:
        if not conn.poll(TOKENIZER_SPEC_WAIT_S):
            return None
        spec = conn.recv()
    except (EOFError, OSError):
        return None
    return DecodeOnlyTokenizer(spec) if spec is not None else None


def run_scheduler_process(server_args, paths: ipc.IpcPaths, ready_conn,
                          tokenizer_spec_conn=None) -> None:
    """Entry point of the scheduler subprocess. `tokenizer_spec_conn`: where the launcher
    sends its tokenizer's decoder (tokenizer_loader.decoder_spec, or None when decoding
    with a copy would not be exact): the scheduler then decodes with that copy instead of
    importing transformers to load the tokenizer again (~1.3 s of CPU a start)."""
    from kvstrata.frontend.process_utils import die_with_parent, exit_now, setup_child_logging

    die_with_parent()
    setup_child_logging(server_args, "scheduler")
    try:
        # The tokenizer (stop strings only) loads after the ready message, off the start
        # (or at its first use: KVSTRATA_SCHEDULER_EAGER_TOKENIZER=0).
        engine, tokenizer = load_engine_factory()(server_args, defer_tokenizer=True)
        if tokenizer_spec_conn is not None and hasattr(tokenizer, "prefer"):
            tokenizer.prefer(lambda: decode_only_from(tokenizer_spec_conn))
        if hasattr(getattr(engine, "runner", None), "exit_on_rank_loss"):
            engine.runner.exit_on_rank_loss = True  # TP: a lost rank ends the server now
        ctx = zmq.Context()
        recv = ctx.socket(zmq.PULL)
        recv.bind(paths.scheduler_in)
        send = ctx.socket(zmq.PUSH)
        send.connect(paths.detokenizer_in)
        info = engine_info(engine, tokenizer)
        watchdog = StepWatchdog(getattr(server_args, "watchdog_timeout", 300.0),
                                lambda: engine_state_dump(engine))
        loop = SchedulerLoop(engine, tokenizer, recv, send, watchdog)
    except Exception as e:
        logger.exception("scheduler failed to start")
        # A bad flag (ValueError / NotImplementedError naming it) is the user's to fix: the
        # message alone; anything else is ours, with the traceback.
        error = (str(e) if isinstance(e, (ValueError, NotImplementedError))
                 else f"{e!r}\n{traceback.format_exc()}")
        ready_conn.send_bytes(ipc.encode(ipc.ReadyMsg("scheduler", False, error)))
        return
    ready_conn.send_bytes(ipc.encode(ipc.ReadyMsg("scheduler", True, info=info)))
    start_loading = getattr(tokenizer, "start_loading", None)
    if start_loading is not None and envs.KVSTRATA_SCHEDULER_EAGER_TOKENIZER.get():
        start_loading()
    watchdog.start()
    failed = False
    try:
        loop.run()
    except Exception as e:
        # The cause goes to the api server first (through the detokenizer, which keeps
        # running): it fails the requests in flight naming it, then stops the server.
        failed = True
        logger.exception("the engine loop failed: the server stops")
        send.send(ipc.encode(ipc.EngineFailure(f"{type(e).__name__}: {e}")))
    finally:
        watchdog.stop()
        engine.shutdown()
        if not failed:  # tell the detokenizer to exit after forwarding everything we sent
            send.send(ipc.encode(ipc.ShutdownReq()))
        recv.close(linger=0)
        send.close(linger=1000)
        ctx.term()
    # Everything above is closed; skip the interpreter's slow teardown.
    exit_now(1 if failed else 0)
