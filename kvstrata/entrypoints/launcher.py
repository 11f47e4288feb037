"""Start the server's processes, wait until each is ready, serve, and shut down in order.

    main process   : uvicorn + FastAPI + tokenizer manager
    child 1        : scheduler (engine core + model runner)
    child 2        : detokenizer

Children are started with the "spawn" method (a fresh interpreter: no inherited ZMQ context,
torch threads or locks) and with PDEATHSIG, so a SIGKILLed launcher leaves no orphan.
Shutdown order on SIGINT/SIGTERM: uvicorn stops accepting and drains (bounded), the
scheduler gets a ShutdownReq and forwards one to the detokenizer, both are joined, and any
child that does not exit in time is terminated, then killed.

When a child exits on its own (crash, SIGKILL, --watchdog-timeout) the tokenizer manager fails
every in-flight request at once and /health turns 503; the launcher then gives the handlers
up to DEAD_DRAIN_S to send those errors, stops uvicorn the same bounded way, and
launch_server returns ENGINE_DEAD_EXIT_CODE, so that `kvstrata serve` exits non-zero and a
supervisor restarts it (SGLang likewise takes the whole server down when a child dies).
"""
from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field

from kvstrata.frontend import ipc

logger = logging.getLogger("kvstrata.launcher")

READY_TIMEOUT_S = 900  # the first load of a big model may be slow on CPU
JOIN_TIMEOUT_S = 10
GRACEFUL_HTTP_SHUTDOWN_S = 5
DEAD_DRAIN_S = 5
ENGINE_DEAD_EXIT_CODE = 1


@dataclass
class ServerState:
    server_args: object
    tm: object
    model_names: list[str]
    engine_info: dict
    metrics: object
    processes: list = field(default_factory=list)

    @property
    def context_len(self) -> int | None:
        return self.engine_info.get("max_context_len")

    def healthy(self) -> bool:
        return not self.tm.engine_dead and all(p.is_alive() for p in self.processes)


class StartupError(RuntimeError):
    pass


def _wait_ready(children: list[tuple[mp.Process, object]], timeout: float) -> dict[str, dict]:
    """Wait for one ReadyMsg per child; fail fast if a child dies or reports an error."""
    infos: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    pending = list(children)
    while pending:
        if time.monotonic() > deadline:
            raise StartupError(f"timed out after {timeout:.0f}s waiting for "
                               f"{[p.name for p, _ in pending]}")
        for proc, conn in list(pending):
            if conn.poll(0.1):
                msg = ipc.decode(conn.recv_bytes(), "ready")
                if not msg.ok:
                    raise StartupError(f"{msg.process} failed to start: {msg.error}")
                infos[msg.process] = msg.info
                pending.remove((proc, conn))
            elif not proc.is_alive():
                raise StartupError(f"{proc.name} exited with code {proc.exitcode} during "
                                   "start-up")
    return infos


def _stop_children(processes: list[mp.Process], grace_s: float) -> None:
    """Join for up to grace_s (children that got a ShutdownReq exit by themselves), then
    terminate, then kill."""
    deadline = time.monotonic() + grace_s
    for proc in processes:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            logger.warning("%s did not exit in time: terminating", proc.name)
            proc.terminate()
            proc.join(3)
        if proc.is_alive():
            proc.kill()
            proc.join(3)


def _graceful_server_class():
    import signal

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after its graceful exit, which turns a clean
        shutdown into a KeyboardInterrupt traceback (and a cancelled lifespan). The launcher
        stops the children itself afterwards, so only record that we should exit."""

        def handle_exit(self, sig, frame) -> None:
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True  # a second Ctrl-C: stop waiting for connections
            else:
                self.should_exit = True

    return GracefulServer


def _send_quietly(conn, value) -> None:
    try:
        conn.send(value)
    except OSError:  # the scheduler is gone; the launcher sees that on its own
        pass


def launch_server(server_args) -> int:
    """Run the server until SIGINT/SIGTERM (returns 0) or until a child process dies
    (returns ENGINE_DEAD_EXIT_CODE). Blocking."""
    from kvstrata.entrypoints.scheduler_process import run_scheduler_process
    from kvstrata.frontend.detokenizer import run_detokenizer_process

    ipc_dir = tempfile.mkdtemp(prefix="kvstrata-ipc-")
    paths = ipc.IpcPaths.in_dir(ipc_dir)
    ctx = mp.get_context("spawn")
    children = []
    # Only a scheduler that received ShutdownReq stops itself and then the detokenizer;
    # after a failed start or a scheduler crash there is nothing to wait for.
    shutdown_sent = False
    exit_code = 0
    try:
        def start(name: str, target, *extra) -> None:
            recv_conn, send_conn = ctx.Pipe(duplex=False)
            proc = ctx.Process(target=target, args=(server_args, paths, send_conn, *extra),
                               name=f"kvstrata-{name}", daemon=True)
            children.append((proc, recv_conn))
            proc.start()
            send_conn.close()

        # The scheduler (the longest start: torch, the model) first; this process loads its
        # tokenizer meanwhile and hands the detokenizer a copy of its decoder (when decoding
        # with it is exact), which spares that process importing transformers.
        from kvstrata.frontend.tokenizer_loader import decoder_spec, load_tokenizer_for

        # The scheduler needs its tokenizer for stop strings and grammars only: it gets the
        # same copy through this pipe (sent once it is ready, by a thread: the copy may be
        # larger than the pipe's buffer and the scheduler reads it when it first needs it).
        spec_recv, spec_send = ctx.Pipe(duplex=False)
        start("scheduler", run_scheduler_process, spec_recv)
        tokenizer = load_tokenizer_for(server_args)
        spec = decoder_spec(tokenizer)
        start("detokenizer", run_detokenizer_process, spec)
        import uvicorn

        from kvstrata.entrypoints.api.api_server import create_app
        from kvstrata.frontend.tokenizer_manager import TokenizerManager
        from kvstrata.engine.sides.registry import side_counters
        from kvstrata.metrics import ServerMetrics

        infos = _wait_ready(children, READY_TIMEOUT_S)
        threading.Thread(target=_send_quietly, args=(spec_send, spec), daemon=True,
                         name="tokenizer-spec").start()
        processes = [p for p, _ in children]
        scheduler_proc, detokenizer_proc = processes

        served = getattr(server_args, "served_model_name", None) or server_args.model_path
        model_names = [served] + ([server_args.model_path]
                                  if server_args.model_path != served else [])
        metrics = ServerMetrics(served, side_counters=side_counters())
        tm = TokenizerManager(server_args, tokenizer, paths, infos["scheduler"], metrics,
                              children={"scheduler": scheduler_proc,
                                        "detokenizer": detokenizer_proc})
        state = ServerState(server_args, tm, model_names, infos["scheduler"], metrics,
                            processes)
        config = uvicorn.Config(
            create_app(state), host=server_args.host, port=server_args.port,
            log_level=str(server_args.log_level).lower(), access_log=False,
            timeout_graceful_shutdown=GRACEFUL_HTTP_SHUTDOWN_S, timeout_keep_alive=30)
        server = _graceful_server_class()(config)

        async def exit_when_engine_dies() -> None:
            nonlocal exit_code
            reason = await tm.wait_dead()
            await tm.drain(DEAD_DRAIN_S)  # let handlers send the errors they were given
            logger.error("%s: stopping the server (exit code %d)", reason,
                         ENGINE_DEAD_EXIT_CODE)
            exit_code = ENGINE_DEAD_EXIT_CODE
            server.should_exit = True

        async def serve() -> None:
            nonlocal shutdown_sent
            await tm.start()
            watcher = asyncio.create_task(exit_when_engine_dies())
            try:
                await server.serve()  # returns after SIGINT/SIGTERM and a bounded drain
            finally:
                watcher.cancel()
                if scheduler_proc.is_alive():
                    await tm.send_sock.send(ipc.encode(ipc.ShutdownReq()))
                    shutdown_sent = True
                await tm.stop()

        logger.info("serving %s on http://%s:%d", served, server_args.host, server_args.port)
        asyncio.run(serve())
    finally:
        _stop_children([c[0] for c in children if c[0].pid is not None],  # started ones
                       JOIN_TIMEOUT_S if shutdown_sent else 0.0)
        shutil.rmtree(ipc_dir, ignore_errors=True)
        logger.info("server stopped")
    return exit_code
