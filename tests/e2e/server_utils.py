"""Start a real `kvstrata serve` process on a free loopback port, and tear it down checking
that its whole process tree is gone."""
from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time

import httpx

from tests.helpers.ports import free_port  # noqa: F401 (the e2e tests import it from here)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def engine_factory_env() -> dict:
    """Use the real engine factory when it exists, else the interim one in this folder."""
    if importlib.util.find_spec("kvstrata.entrypoints.engine_factory") is not None:
        return {}
    return {"KVSTRATA_ENGINE_FACTORY": "tests.e2e.interim_engine_factory:build_engine"}


def child_pids(pid: int) -> list[int]:
    """All descendants of `pid` (from /proc, so no psutil needed)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for child in parents.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def rank_pids(root: int | None = None) -> list[int]:
    """The tensor-parallel rank processes under `root` (default: this process), zombies
    included (/proc lists them)."""
    out = []
    for pid in child_pids(root or os.getpid()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"kvstrata.entrypoints.tp_worker" in f.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Unless a test sizes the KV pool itself, its server gets this many tokens: a default-sized
# CPU pool is several GB (~3 s of CPU per start to zero it, and memory the parallel test
# worker's servers then lack). Tests of the default sizing pass --mem-fraction-static or
# --max-total-tokens themselves.
TEST_KV_TOKENS = "32768"
KV_SIZE_FLAGS = ("--max-total-tokens", "--mem-fraction-static")


def with_test_kv_size(args) -> list[str]:
    args = list(args)
    if not any(a.split("=")[0] in KV_SIZE_FLAGS for a in args):
        args += ["--max-total-tokens", TEST_KV_TOKENS]
    return args


class ServerProcess:
    def __init__(self, model_path: str, *extra_args: str, env: dict | None = None,
                 timeout: float = 180, wait: bool = True, port: int | None = None):
        """Starts the server; waits until /health answers 200 unless `wait` is False (then
        call wait_healthy(): several servers start faster side by side). `port`: a restart
        where its predecessor listened (a router still points there)."""
        self.port = port or free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = f"/tmp/kvstrata-e2e-{self.port}.log"
        cmd = [sys.executable, "-m", "kvstrata.entrypoints.cli", "serve", "--model-path",
               model_path, "--host", "127.0.0.1", "--port", str(self.port),
               *with_test_kv_size(extra_args)]
        pythonpath = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
        # One intra-op thread unless the caller chose (as tests/conftest.py does in-process):
        # the parallel test workers already keep both cores busy, and OpenMP workers spinning
        # against them cost CPU time for ops of a few microseconds.
        full_env = {**os.environ, "PYTHONPATH": pythonpath, **engine_factory_env(),
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=self.log,
                                     stderr=subprocess.STDOUT)
        self.children: list[int] = []
        if wait:
            self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 180) -> None:
        self._wait_healthy(timeout)
        self.children = child_pids(self.proc.pid)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n"
                                   + self.read_log())
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy:\n" + self.read_log())

    def read_log(self) -> str:
        with open(self.log_path) as f:
            return f.read()[-6000:]

    def send(self, sig: int = signal.SIGTERM) -> None:
        """Send `sig` without waiting (stop_all: several servers shut down side by side)."""
        self.children = self.children or child_pids(self.proc.pid)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.signalled = True

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int | None:
        if not getattr(self, "signalled", False) or sig != signal.SIGTERM:
            self.send(sig)
        if self.proc.returncode is None:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        # Children exit right after the launcher; give them a moment.
        deadline = time.monotonic() + 10
        while any(pid_alive(p) for p in self.children) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.log.close()
        return self.proc.returncode


def stop_all(servers) -> None:
    """Stop several servers at once: signal them all, then wait for each."""
    servers = [s for s in servers if s is not None]
    for srv in servers:
        srv.send()
    for srv in servers:
        srv.stop()


def ask_capital_of_france(srv: ServerProcess, max_tokens: int = 24,
                          model: str = "smollm2-135m") -> str:
    """SmolLM2's smoke question through the official client, greedy: the answer's text
    (float32 and bf16 alike answer "The capital of France is Paris.")."""
    import openai

    client = openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)
    r = client.chat.completions.create(
        model=model, temperature=0, max_tokens=max_tokens,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    return r.choices[0].message.content
