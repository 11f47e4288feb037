"""The bootstrap server: runs on the prefill server (at --disaggregation-bootstrap-port) and
tells decode servers where each prefill rank's transfer endpoint is (SGLang's
CommonKVBootstrapServer, reference section 3.2).

Routes:
  PUT  /route   a prefill rank registers {rank_ip, rank_port, page_size, kv_cache_dtype,
                attn_tp_size/rank, attn_cp_size/rank, attn_dp_size/rank, pp_size/rank,
                system_dp_size/rank}; the first registration fixes the parallel sizes.
  GET  /route?prefill_dp_rank&prefill_cp_rank&target_tp_rank&target_pp_rank
                all four required (400); all -1: the prefill's parallel info once every
                rank registered (503 "Prefill server not fully registered yet (N workers
                registered)." before); else that rank's {rank_ip, rank_port} or 404.
  GET  /route?engine_rank&target_dp_group[&target_pp_rank]   SGLang's earlier form, the
                same answers (engine_rank = tp rank; all -1: the info, with its
                prefill_tp_size / prefill_dp_size / prefill_pp_size names too)
  POST /register_dp_rank {bootstrap_room, dp_rank}; POST /query_dp_ranks {bootstrap_rooms}
                the room -> prefill dp rank table (entries older than
                KVSTRATA_DISAGG_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL are dropped)
  GET  /health  "OK"
kvstrata fills the tp axis (--tp-size: every prefill rank registers; cp = dp = pp = 1), and
keeps SGLang's four-rank keys so a decode server addresses ranks the same way.

FastAPI app served by uvicorn in a daemon thread; `start()` returns once it listens,
`stop()` (the manager's close()) shuts it down and joins the thread.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from kvstrata import envs

RESOLVE_RETRY_SECONDS = 0.5
LEGACY_ROUTE_PARAMS = ("engine_rank", "target_dp_group")


def _legacy_query(q) -> tuple[int, int, int, int]:
    """SGLang's earlier GET /route: `engine_rank` (the tp rank), `target_dp_group` and
    optionally `target_pp_rank`; all -1 asks for the parallel info, answered with the
    `prefill_tp_size` / `prefill_dp_size` / `prefill_pp_size` names besides ours."""
    tp, dp = int(q["engine_rank"]), int(q["target_dp_group"])
    pp = int(q.get("target_pp_rank", -1 if (tp, dp) == (-1, -1) else 0))
    return (dp, -1, tp, pp) if (tp, dp, pp) == (-1, -1, -1) else (dp, 0, tp, pp)
ROUTE_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")


class BootstrapServer:
    def __init__(self, host: str, port: int, cleanup_interval: float | None = None):
        self.host, self.port = host, port
        self.cleanup_interval = (envs.KVSTRATA_DISAGG_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL.get()
                                 if cleanup_interval is None else cleanup_interval)
        # port_table[dp_group][cp_rank][tp_rank][pp_rank] = {"rank_ip", "rank_port"}
        self.port_table: dict[int, dict[int, dict[int, dict[int, dict]]]] = {}
        self.parallel_info: dict | None = None
        self.registered_count = 0
        self.room_to_dp_rank: dict[int, tuple[int, float]] = {}  # room -> (dp rank, time)
        self._lock = threading.Lock()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.app = self._build_app()

    # ------------------------------------------------------------------ state (also for tests)
    def register(self, info: dict) -> None:
        with self._lock:
            if self.parallel_info is None:
                system_dp = int(info.get("system_dp_size", 1))
                self.parallel_info = {
                    "attn_tp_size": int(info.get("attn_tp_size", 1)),
                    "attn_cp_size": int(info.get("attn_cp_size", 1)),
                    "dp_size": (int(info.get("attn_dp_size", 1)) if system_dp == 1
                                else system_dp),
                    "pp_size": int(info.get("pp_size", 1)),
                    "page_size": info.get("page_size"),
                    "kv_cache_dtype": info.get("kv_cache_dtype"),
                    "follow_bootstrap_room":
                        info.get("load_balance_method", "follow_bootstrap_room")
                        == "follow_bootstrap_room",
                    "prefill_http_port": info.get("prefill_http_port"),
                }
            dp_group = int(info.get("attn_dp_rank", 0) if int(info.get("system_dp_size", 1))
                           == 1 else info.get("system_dp_rank", 0))
            cp, tp, pp = (int(info.get(k, 0)) for k in ("attn_cp_rank", "attn_tp_rank",
                                                         "pp_rank"))
            self.port_table.setdefault(dp_group, {}).setdefault(cp, {}).setdefault(tp, {})[pp] = {
                "rank_ip": info["rank_ip"], "rank_port": int(info["rank_port"])}
            self.registered_count += 1

    def expected_count(self) -> int:
        p = self.parallel_info
        return 0 if p is None else (p["dp_size"] * p["attn_cp_size"] * p["attn_tp_size"]
                                    * p["pp_size"])

    def cleanup_rooms(self, now: float | None = None) -> int:
        """Forget room entries older than the cleanup interval; returns how many."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [r for r, (_, t) in self.room_to_dp_rank.items()
                   if now - t > self.cleanup_interval]
            for r in old:
                del self.room_to_dp_rank[r]
        return len(old)

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cleanup_interval)
            self.cleanup_rooms()

    # ------------------------------------------------------------------ HTTP
    def _build_app(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(_app):
            task = asyncio.get_running_loop().create_task(self._cleanup_loop())
            yield
            task.cancel()

        app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None, lifespan=lifespan)

        @app.put("/route")
        async def put_route(request: Request):
            info = await request.json()
            if not isinstance(info, dict) or "rank_ip" not in info or "rank_port" not in info:
                return PlainTextResponse("rank_ip and rank_port are required", 400)
            self.register(info)
            return PlainTextResponse("OK")

        @app.get("/route")
        async def get_route(request: Request):
            q = request.query_params
            legacy = "engine_rank" in q  # SGLang's earlier form (see _legacy_query)
            names = LEGACY_ROUTE_PARAMS if legacy else ROUTE_PARAMS
            if any(k not in q for k in names):
                return PlainTextResponse(("Missing inputs for bootstrap server." if legacy else
                                          "Missing required parameters: ")
                                         + ("" if legacy else ", ".join(names)), 400)
            try:
                dp, cp, tp, pp = (_legacy_query(q) if legacy else
                                  tuple(int(q[k]) for k in ROUTE_PARAMS))
            except ValueError:
                return PlainTextResponse("parameters must be integers", 400)
            with self._lock:
                if (dp, cp, tp, pp) == (-1, -1, -1, -1):
                    if self.parallel_info is None or \
                            self.registered_count < self.expected_count():
                        return PlainTextResponse(
                            "Prefill server not fully registered yet "
                            f"({self.registered_count} workers registered).", 503)
                    info = dict(self.parallel_info)
                    if legacy:  # the names SGLang's earlier decode servers read
                        info.update(prefill_tp_size=info["attn_tp_size"],
                                    prefill_attn_tp_size=info["attn_tp_size"],
                                    prefill_dp_size=info["dp_size"],
                                    prefill_pp_size=info["pp_size"])
                    return JSONResponse(info)
                entry = self.port_table.get(dp, {}).get(cp, {}).get(tp, {}).get(pp)
            if entry is None:
                return PlainTextResponse(f"no prefill rank dp={dp} cp={cp} tp={tp} pp={pp}",
                                         404)
            return JSONResponse(entry)

        @app.post("/register_dp_rank")
        async def register_dp_rank(request: Request):
            body = await request.json()
            with self._lock:
                self.room_to_dp_rank[int(body["bootstrap_room"])] = (int(body["dp_rank"]),
                                                                     time.monotonic())
            return PlainTextResponse("OK")

        @app.post("/query_dp_ranks")
        async def query_dp_ranks(request: Request):
            rooms = (await request.json()).get("bootstrap_rooms", [])
            with self._lock:
                return JSONResponse({str(r): self.room_to_dp_rank[int(r)][0] for r in rooms
                                     if int(r) in self.room_to_dp_rank})

        @app.get("/health")
        async def health():
            return PlainTextResponse("OK")

        return app

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 10.0) -> None:
        config = uvicorn.Config(self.app, host=self.host, port=self.port, log_level="warning",
                                lifespan="on", access_log=False)
        # Bound here, so a taken port is this thread's clear error (uvicorn binding it
        # would sys.exit() inside its own thread).
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise RuntimeError(f"bootstrap server could not listen on {self.host}:"
                               f"{self.port}: {e}") from None
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="pd-bootstrap", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"bootstrap server could not listen on "
                                   f"{self.host}:{self.port}")
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._server = None


__all__ = ["BootstrapServer"]
