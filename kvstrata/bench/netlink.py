"""A link where bytes cost time, for `kvstrata bench pd --link-rate RATE`.

On one machine the KV pages a PD decode server receives cross loopback, where a few tens of
MB cost a few ms; the decode radix cache's saving (fewer bytes from the second turn on) then
cannot show in TTFT. Here the prefill and the decode server live in two network namespaces
joined by a veth pair whose sending ends carry a `tbf` qdisc at RATE, so every byte between
them is paced like on a datacenter link. Both transfer backends (tcp: zmq PUSH to the decode's
data port; mooncake: the prefill writes into the decode's memory over Mooncake's TCP
transport) send from the prefill to the decode server's address, so both cross it alike.

Topology (a free 10.A.B.0/28 is picked per link; names carry the creating PID and a random
token, so a crashed run never collides with the next one and its leftovers are swept):

    root namespace: bench client, sglang-router
      |-- veth kv<tok>rp ----- .1 / .2 ---- namespace P: prefill server, bound to .9
      |-- veth kv<tok>rd ----- .5 / .6 ---- namespace D: decode server, bound to .10
    P .9 ====== veth kv<tok>pd / kv<tok>dp, tbf RATE on both sending ends ====== D .10

Why three veth pairs: the servers must bind the address the other side dials (the prefill
publishes its bootstrap server and data endpoint at its --host, the router tells the decode
that host), so they bind the P-D link's addresses .9 and .10. The router and the client stay
in the root namespace and reach .9 / .10 through their own unshaped links (a /32 route each;
P and D accept traffic for any of their own addresses, and answer over the connected root
link, so no forwarding is needed anywhere). Only the servers' mutual traffic (KV pages,
control messages, bootstrap look-ups) crosses the shaped link; requests and answers do not.

Latency is not modelled: this kernel has no netem, and a paced sender inside the backends
would be the backends' code, not the benchmark's.

Needs root, `ip` and `tc` (iproute2), and the kernel's veth and tbf; otherwise `up()` raises
LinkUnavailable with the reason. This file imports only the standard library: it is also run
as a script (`python netlink.py recv|send ...`) inside the namespaces to measure the rate.
"""
from __future__ import annotations

import json
import os
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from typing import Self

PREFIX = "kvstrata"  # namespace names: kvstrata-<pid>-<token>-{p,d}
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-([0-9a-f]{{6}})-[pd]$")
_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}


class LinkUnavailable(RuntimeError):
    """Namespaces, veth or tbf cannot be made here (not root, no iproute2, kernel lacks it)."""


def parse_rate(text: str) -> float:
    """tc's rate spelling ("10gbit", "200mbit", "1.5gbit") -> bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?bit)\s*", text.lower())
    if not m:
        raise ValueError(f"link rate {text!r}: expected e.g. 200mbit, 10gbit, 25gbit")
    return float(m.group(1)) * _UNITS[m.group(2)]


def tbf_params(rate_bps: float) -> tuple[int, int]:
    """(burst, limit) in bytes for tbf at `rate_bps`.
    burst: at least 256 KiB, so that a 64 KiB GSO super-packet of the veth always fits (tbf
    splits bigger skbs segment by segment, which costs CPU at 10+ Gb/s) and the token bucket
    is not refilled every few microseconds; at most 1 ms of the rate beyond that, so a
    transfer's start is not sent at veth speed for long. limit: 10 ms of queue at the rate
    plus the burst (a drop-tail queue too short for TCP's window makes TCP back off below
    the rate; a much longer one only adds queueing delay for the small control messages)."""
    rate_bytes = rate_bps / 8
    burst = max(256 << 10, int(rate_bytes * 1e-3))
    return burst, burst + int(rate_bytes * 10e-3)


def _run(cmd: list[str], check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
    if check and r.returncode != 0:
        raise LinkUnavailable(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()}")
    return r


def why_unavailable() -> str | None:
    """The cheap reasons a link cannot be made (None: worth trying; up() is the real test)."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (run as root, or drop --link-rate)"
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return f"{' and '.join(missing)} not found (install iproute2)"
    return None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def namespaces() -> list[str]:
    r = _run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]


def sweep_stale() -> list[str]:
    """Remove the namespaces (and their root-side veths) of runs whose process is gone: a run
    killed before its finally block leaves them behind. Returns the names removed."""
    removed = []
    for name in namespaces():
        m = _NS_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            for dev in (f"kv{m.group(2)}rp", f"kv{m.group(2)}rd"):
                _run(["ip", "link", "del", dev], check=False)
            _run(["ip", "netns", "del", name], check=False)
            removed.append(name)
    return removed


def _free_subnet() -> str:
    """'10.A.B' of a /28 no route of the root namespace covers but the default one."""
    for _ in range(64):
        base = f"10.{random.randint(64, 254)}.{random.randint(0, 255)}"
        routes = _run(["ip", "-4", "route", "show", "to", "match", f"{base}.1"]).stdout
        if all(line.startswith("default") for line in routes.splitlines() if line.strip()):
            return base
    raise LinkUnavailable("no free 10.x.y.0/28 for the link's addresses")


class NetLink:
    """`with NetLink() as link:` two namespaces and their veths; `link.shape("10gbit")`;
    servers started under `link.exec_prefix("p"|"d")` bind `link.addr("p"|"d")`;
    `link.measure()` is the achieved P->D rate. Everything is removed on exit (also after a
    failed set-up)."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(3)
        self.ns = {s: f"{PREFIX}-{os.getpid()}-{self.token}-{s}" for s in "pd"}
        self.rate: str | None = None
        self.base = ""
        self._created: list[str] = []  # namespaces made so far (down() removes them)

    # ---- set-up and removal
    def __enter__(self) -> Self:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        reason = why_unavailable()
        if reason:
            raise LinkUnavailable(reason)
        sweep_stale()
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _build(self) -> None:
        t, b = self.token, _free_subnet()
        self.base = b
        for s in "pd":
            _run(["ip", "netns", "add", self.ns[s]])
            self._created.append(self.ns[s])
            # A new namespace's loopback is down, and a server's own 127.0.0.1 sockets
            # (e.g. its processes' local ports) need it.
            _run(["ip", "-n", self.ns[s], "link", "set", "lo", "up"])
        # (root end, namespace end, side, root address, namespace address)
        for root_dev, ns_dev, s, ra, na in ((f"kv{t}rp", f"kv{t}pr", "p", 1, 2),
                                            (f"kv{t}rd", f"kv{t}dr", "d", 5, 6)):
            _run(["ip", "link", "add", root_dev, "type", "veth", "peer", "name", ns_dev,
                  "netns", self.ns[s]])
            _run(["ip", "addr", "add", f"{b}.{ra}/30", "dev", root_dev])
            _run(["ip", "link", "set", root_dev, "up"])
            _run(["ip", "-n", self.ns[s], "addr", "add", f"{b}.{na}/30", "dev", ns_dev])
            _run(["ip", "-n", self.ns[s], "link", "set", ns_dev, "up"])
        _run(["ip", "link", "add", f"kv{t}pd", "netns", self.ns["p"], "type", "veth", "peer",
              "name", f"kv{t}dp", "netns", self.ns["d"]])
        for s, dev, host in (("p", f"kv{t}pd", 9), ("d", f"kv{t}dp", 10)):
            _run(["ip", "-n", self.ns[s], "addr", "add", f"{b}.{host}/30", "dev", dev])
            _run(["ip", "-n", self.ns[s], "link", "set", dev, "up"])
        # The root namespace reaches each server's link address through that server's root
        # link (not through the shaped one: root has no route into the P-D /30 otherwise).
        _run(["ip", "route", "add", f"{b}.9/32", "via", f"{b}.2", "dev", f"kv{t}rp"])
        _run(["ip", "route", "add", f"{b}.10/32", "via", f"{b}.6", "dev", f"kv{t}rd"])

    def down(self) -> None:
        """Remove both namespaces and the root-side veths. Deleting a veth end deletes its
        peer at once; deleting a namespace's name does not free the namespace while a process
        still runs in it, so callers stop their servers first (the veths go regardless)."""
        for dev in (f"kv{self.token}rp", f"kv{self.token}rd"):
            _run(["ip", "link", "del", dev], check=False)  # with it: its /32 route
        if self.ns["p"] in self._created:
            _run(["ip", "-n", self.ns["p"], "link", "del", f"kv{self.token}pd"], check=False)
        for name in self._created:
            _run(["ip", "netns", "del", name], check=False)
        self._created = []

    # ---- shaping
    def shape(self, rate: str | None) -> None:
        """tbf at `rate` on both sending ends of the P-D veth (None: remove it)."""
        for s, dev in (("p", f"kv{self.token}pd"), ("d", f"kv{self.token}dp")):
            if rate is None:
                _run(["tc", "-n", self.ns[s], "qdisc", "del", "dev", dev, "root"], check=False)
                continue
            burst, limit = tbf_params(parse_rate(rate))
            r = _run(["tc", "-n", self.ns[s], "qdisc", "replace", "dev", dev, "root", "tbf",
                      "rate", rate, "burst", str(burst), "limit", str(limit)], check=False)
            if r.returncode != 0:
                raise LinkUnavailable(f"tc tbf at {rate} failed (is sch_tbf in this kernel?): "
                                      f"{(r.stderr or r.stdout).strip()}")
        self.rate = rate

    # ---- what the servers use
    def addr(self, side: str) -> str:
        """The address a server in namespace `side` ("p" or "d") binds and is dialled at."""
        return f"{self.base}.{9 if side == 'p' else 10}"

    def exec_prefix(self, side: str) -> list[str]:
        return ["ip", "netns", "exec", self.ns[side]]

    def measure(self, seconds: float = 1.0) -> dict:
        """The achieved rate from P to D: a TCP socket blast over the link."""
        return blast(self.exec_prefix("p"), self.exec_prefix("d"), self.addr("d"), seconds)

    def describe(self) -> dict:
        return {"namespaces": dict(self.ns), "prefill_addr": self.addr("p"),
                "decode_addr": self.addr("d"), "rate": self.rate,
                "tbf": dict(zip(("burst", "limit"), tbf_params(parse_rate(self.rate))))
                if self.rate else None}


# ---- rate measurement: one TCP stream, receiver in one namespace, sender in the other
def blast(send_prefix: list[str], recv_prefix: list[str], host: str, seconds: float = 1.0,
          timeout: float = 60.0) -> dict:
    """{gbps, bytes, seconds}: what one TCP stream moves from the sender's namespace to
    `host` in the receiver's, sending for `seconds` (the receiver times first byte to EOF,
    so bytes still queued in tbf when the sender stops are counted when they arrive)."""
    me = os.path.abspath(__file__)
    recv = subprocess.Popen([*recv_prefix, sys.executable, me, "recv", host],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = recv.stdout.readline().strip()
        if not port.isdigit():
            raise LinkUnavailable(f"rate probe receiver did not start: {recv.stderr.read()}")
        send = subprocess.run([*send_prefix, sys.executable, me, "send", host, port,
                               str(seconds)], capture_output=True, text=True, timeout=timeout,
                              check=False)
        if send.returncode != 0:
            raise LinkUnavailable(f"rate probe sender failed: {send.stderr.strip()}")
        out, err = recv.communicate(timeout=timeout)
        if recv.returncode != 0:
            raise LinkUnavailable(f"rate probe receiver failed: {err.strip()}")
        r = json.loads(out)
        return {"gbps": r["bytes"] * 8 / max(r["seconds"], 1e-9) / 1e9, **r}
    finally:
        if recv.poll() is None:
            recv.kill()
            recv.wait(10)


def _recv(host: str) -> None:
    with socket.socket() as s:
        s.bind((host, 0))
        s.listen(1)
        s.settimeout(30)
        print(s.getsockname()[1], flush=True)
        conn, _ = s.accept()
        with conn:
            conn.settimeout(30)
            buf, n, t0 = bytearray(1 << 20), 0, None
            while (k := conn.recv_into(buf)) > 0:
                t0 = t0 if t0 is not None else time.perf_counter()
                n += k
            dt = time.perf_counter() - t0 if t0 is not None else 0.0
    print(json.dumps({"bytes": n, "seconds": dt}))


def _send(host: str, port: int, seconds: float) -> None:
    data = memoryview(bytes(1 << 20))
    with socket.create_connection((host, port), timeout=30) as c:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            c.sendall(data)


if __name__ == "__main__":
    if sys.argv[1] == "recv":
        _recv(sys.argv[2])
    else:
        _send(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
