"""Start and stop a `mooncake_master` (the Mooncake Store's metadata service) on 127.0.0.1.

Tests and benchmarks own the master they use: it listens on free loopback ports, and `stop()`
ends it by its pid. The binary ships inside the `mooncake-transfer-engine-non-cuda` wheel
(next to the `mooncake` package, and as a console script in the environment's bin/).
A real deployment runs one master for all servers and gives its address to each of them
(extra config `master_server_address`, or MOONCAKE_MASTER).
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time


def mooncake_master_binary() -> str:
    """Path of the `mooncake_master` executable; FileNotFoundError naming the wheel if none."""
    candidates = [os.path.join(os.path.dirname(sys.executable), "mooncake_master")]
    try:
        import mooncake
        candidates.insert(0, os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"))
    except ImportError:
        pass
    found = shutil.which("mooncake_master")
    candidates += [found] if found else []
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    raise FileNotFoundError("mooncake_master not found: install the "
                            "mooncake-transfer-engine-non-cuda wheel (make setup)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MooncakeMaster:
    """`with MooncakeMaster() as master: ... master.address` ("127.0.0.1:<rpc port>")."""

    def __init__(self, *, start_timeout: float = 15.0, extra_flags: tuple[str, ...] = ()):
        self.start_timeout = start_timeout
        self.extra_flags = extra_flags
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self._log = None

    def start(self) -> "MooncakeMaster":
        binary = mooncake_master_binary()
        for _attempt in range(3):  # a free port may be taken between probe and bind
            rpc_port = _free_port()
            self._log = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(
                [binary, "-rpc_address=127.0.0.1", f"-rpc_port={rpc_port}",
                 "-metrics_host=127.0.0.1", f"-metrics_port={_free_port()}",
                 "-enable_metric_reporting=false", *self.extra_flags],
                stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
            if self._wait_listening(rpc_port):
                self.address = f"127.0.0.1:{rpc_port}"
                return self
            self.stop()
        raise RuntimeError("mooncake_master did not start: " + self.log_tail())

    def _wait_listening(self, port: int) -> bool:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                return True
            except OSError:
                time.sleep(0.02)
        return False

    def log_tail(self, limit: int = 2000) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-limit:]

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
