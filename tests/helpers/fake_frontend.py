"""An API server without a scheduler: a fake tokenizer manager that answers every request
with one token and records the ipc.GenerateReq it would have sent, and the `state` that
api_server.create_app expects. For HTTP-side tests (request routing, PD bootstrap fields)
that need no model."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from kvstrata.frontend import ipc
from kvstrata.metrics import ServerMetrics


class _Tokenizer:
    eos_token_id = 0

    def __len__(self) -> int:
        return 100

    def decode(self, ids, **kwargs) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)

    def apply_chat_template(self, messages, **kwargs):
        return [3, 4, 5]


class RecordingTM:
    """Answers every request with one token and records the ipc.GenerateReq it was given."""

    def __init__(self, server_args=None):
        self.server_args = server_args  # as the real one's: request checks read flags
        self.tokenizer = _Tokenizer()
        self.reqs: list[ipc.GenerateReq] = []
        self.states: dict = {}
        self.load: dict = {}
        self._n = 0

    def new_rid(self) -> str:
        self._n += 1
        return f"r{self._n}"

    def apply_chat_template(self, messages, **kwargs) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def encode_prompt(self, text: str) -> list[int]:
        return [1 + ord(c) % 50 for c in text]

    def health_prompt_ids(self) -> list[int]:
        return self.encode_prompt("hi")

    async def control(self, op: str, timeout: float = 10.0) -> dict:
        """The scheduler's answer to a control op: its load counters, counted per call."""
        self.control_calls = getattr(self, "control_calls", 0) + 1
        if op != "get_load":
            raise RuntimeError(f"unknown op {op!r}")
        return {"num_running_reqs": 0, "num_waiting_reqs": 0, "num_retractions": 0,
                "control_calls": self.control_calls}

    async def generate(self, req: ipc.GenerateReq, log_metrics: bool = True):
        self.reqs.append(req)
        yield ipc.TextOutput(rid=req.rid, text="x", new_token_ids=[7], finished=True,
                             finish_type="length", prompt_tokens=len(req.prompt_ids),
                             completion_tokens=1)


def app_state(server_args, context_len: int = 64) -> SimpleNamespace:
    """create_app's state around a RecordingTM (state.tm) for these server args."""
    return SimpleNamespace(tm=RecordingTM(server_args), server_args=server_args, model_names=["m"],
                           context_len=context_len, engine_info={}, healthy=lambda: True,
                           metrics=ServerMetrics("m"))


def serve_app(app):
    """Run an ASGI app with uvicorn on a free loopback port in a daemon thread; returns
    (server, thread, port). Stop it with `server.should_exit = True; thread.join()`."""
    import uvicorn

    from tests.helpers.ports import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started
    return server, thread, port
