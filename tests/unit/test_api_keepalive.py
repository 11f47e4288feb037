"""A server error must not break the client's keep-alive connection: Starlette re-raises an
unhandled exception after sending the 500, and uvicorn closed the socket when it saw it, so
the next request on that connection was reset. Two requests on one raw socket prove it."""
from __future__ import annotations

import socket
from types import SimpleNamespace

from kvstrata.entrypoints.api.api_server import create_app
from kvstrata.metrics import ServerMetrics
from tests.helpers.fake_frontend import serve_app


class _BrokenTokenizerManager:
    async def control(self, op: str, timeout: float = 10.0) -> dict:
        raise RuntimeError(f"{op} exploded")


def _request(sock: socket.socket, path: str) -> tuple[int, bytes]:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", "0"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-body"
        body += chunk
    return int(lines[0].split()[1]), body


def test_next_request_on_the_connection_after_a_500_succeeds():
    state = SimpleNamespace(tm=_BrokenTokenizerManager(),
                            server_args=SimpleNamespace(model_path="m", enable_metrics=True),
                            model_names=["m"], context_len=64, engine_info={},
                            healthy=lambda: True, metrics=ServerMetrics("m"))
    server, thread, port = serve_app(create_app(state))
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            status, body = _request(sock, "/debug/kv")
            assert status == 500 and b"check_integrity exploded" in body
            for _ in range(3):  # the same socket keeps serving
                assert _request(sock, "/health")[0] == 200
                assert _request(sock, "/debug/kv")[0] == 500
    finally:
        server.should_exit = True
        thread.join(10)
