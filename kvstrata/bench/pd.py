"""`kvstrata bench pd`: the same load through (a) one co-located server and (b) sglang-router
in PD mode + a prefill and a decode server, per transfer backend; TTFT/TPOT p50/p99 and
output tok/s of each, as ratios against (a) measured in the same run. The KV transfer rate
of each backend is measured at the transfer layer (a prefill and a decode manager moving
pages of the model's geometry) beside a raw loopback socket copy of the same bytes, in the
same run (kvstrata/bench/transfer_rate.py). benchmarks/bench_pd.py wraps this.

All processes are started here on 127.0.0.1 ports picked here, and stopped by PID at the end.
With --link-rate RATE [RATE ...] the prefill and the decode server run instead in two network
namespaces joined by a veth pair shaped at RATE (kvstrata/bench/netlink.py), per rate: the
KV pages cross a link where bytes cost time; the router and the client stay here.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from kvstrata.bench.box_load import add_quiet_arg, announce_load
from kvstrata.bench.ports import free_port
from kvstrata.bench.serve_client import run_benchmark, summarize


class Proc:
    """A child process with its log file, in its own process group; stopped by PID (SIGINT,
    then SIGKILL of its group). `prefix`: e.g. `ip netns exec NS` (which execs the command,
    so the PID is the server's own)."""

    def __init__(self, name: str, cmd: list[str], log_dir: str, env: dict | None = None,
                 prefix: list[str] | None = None):
        self.name = name
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*(prefix or []), *cmd], stdout=self.log,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **env} if env else None)

    def wait_http(self, url: str, timeout: float = 300, ok=lambda r: r.status_code == 200) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}; log: "
                                   f"{self.log_path}\n" + open(self.log_path).read()[-2000:])
            try:
                if ok(httpx.get(url, timeout=5)):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready after {timeout} s; log: {self.log_path}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(10)
        self.log.close()


def serve_cmd(args, port: int, *extra: str, host: str = "127.0.0.1") -> list[str]:
    return [sys.executable, "-m", "kvstrata.entrypoints.cli", "serve", "--model-path",
            args.model, "--served-model-name", "bench", "--host", host, "--port",
            str(port), "--max-total-tokens", str(args.max_total_tokens),
            "--page-size", str(args.page_size), *extra]


def load_args(args, base_url: str) -> argparse.Namespace:
    return argparse.Namespace(
        base_url=base_url, model="bench", api_key=None, endpoint="completions",
        dataset="random", num_prompts=args.num_prompts, num_turns=1,
        concurrency=args.concurrency, request_rate=float("inf"), input_len=args.input_len,
        output_len=args.output_len, temperature=0.0, ignore_eos=True, usage=True,
        extra_body=None, timeout=600.0, seed=args.seed)


def run_load(args, base_url: str) -> dict:
    ns = load_args(args, base_url)
    # Warm-up request so that the first measured request does not pay for lazy init.
    httpx.post(base_url + "/v1/completions", json={"model": "bench", "prompt": "warm up",
                                                   "max_tokens": 2}, timeout=300)
    results, duration = asyncio.run(run_benchmark(ns))
    s = summarize(results, duration, ns)
    s.pop("per_request", None)
    s.pop("itl_all_ms", None)
    return s


def colocated(args, log_dir: str) -> dict:
    port = free_port()
    srv = Proc("colocated", serve_cmd(args, port), log_dir)
    try:
        srv.wait_http(f"http://127.0.0.1:{port}/health")
        return run_load(args, f"http://127.0.0.1:{port}")
    finally:
        srv.stop()


def disaggregated(args, backend: str, log_dir: str, decode_extra: tuple[str, ...] = (),
                  tag: str = "", work=None, both_extra: tuple[str, ...] = (),
                  decode_env: dict | None = None) -> dict:
    """Router + prefill + decode on `backend`; `decode_extra`: more decode-server flags,
    `both_extra`: flags of both servers, `decode_env`: the decode server's extra environment.
    The summary carries the decode server's retraction counters after the run. `work`:
    instead of the load, work(router_url, decode_url) -> summary (bench/pd_multiturn.py).
    With `args._link` (a netlink.NetLink, --link-rate) each server runs in its namespace,
    bound to its end of the shaped link: the prefill publishes its bootstrap server and data
    endpoint there and the router names it as bootstrap_host, so the decode dials it over
    the link; the router (here) reaches both over their own unshaped links."""
    p_port, d_port, boot = free_port(), free_port(), free_port()
    link = getattr(args, "_link", None)
    p_host, d_host = (link.addr("p"), link.addr("d")) if link else ("127.0.0.1", "127.0.0.1")
    procs: list[Proc] = []
    try:
        name = backend + tag
        procs.append(Proc(f"prefill-{name}", serve_cmd(
            args, p_port, "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend",
            backend, "--disaggregation-bootstrap-port", str(boot), *both_extra, host=p_host),
            log_dir, prefix=link.exec_prefix("p") if link else None))
        procs.append(Proc(f"decode-{name}", serve_cmd(
            args, d_port, "--disaggregation-mode", "decode", "--disaggregation-transfer-backend",
            backend, *both_extra, *decode_extra, host=d_host), log_dir, decode_env,
            prefix=link.exec_prefix("d") if link else None))
        for proc, url in zip(procs, (f"http://{p_host}:{p_port}", f"http://{d_host}:{d_port}")):
            proc.wait_http(f"{url}/health")
        # The router's ports are taken only now: a port from free_port() is free until some
        # other process binds it, and the servers' start took seconds.
        r_port = free_port()
        procs.append(Proc(f"router-{name}", [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", f"http://{p_host}:{p_port}", str(boot),
            "--decode", f"http://{d_host}:{d_port}", "--host", "127.0.0.1",
            "--port", str(r_port), "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(free_port()), "--log-level", "warn"], log_dir))
        procs[-1].wait_http(f"http://127.0.0.1:{r_port}/health")
        if work is not None:
            return work(f"http://127.0.0.1:{r_port}", f"http://{d_host}:{d_port}")
        summary = run_load(args, f"http://127.0.0.1:{r_port}")
        load = httpx.get(f"http://{d_host}:{d_port}/get_load", timeout=30).json()
        load = load[0] if isinstance(load, list) else load
        summary["decode_load"] = {k: v for k, v in load.items()
                                  if k.startswith(("decode_", "spec_", "disagg_metadata"))
                                  or k in ("num_retractions", "avg_spec_accept_length")}
        return summary
    finally:
        for proc in reversed(procs):
            proc.stop()


def transfer_rates(args, backend: str) -> list[dict]:
    """GB/s of the backend vs a raw loopback socket, for pages of 16 tokens and more, in
    SmolLM2-135M's KV geometry: 30 layers x K,V = 60 sections of 3 KV heads x 64 dims x
    fp32 = 768 B per token each."""
    from kvstrata.bench.transfer_rate import measure_transfer_rate  # noqa: PLC0415 - torch

    rows = []
    for tokens in args.transfer_page_tokens:
        rate = measure_transfer_rate(backend, num_pages=args.transfer_pages, sections=60,
                                     page_bytes=tokens * 3 * 64 * 4)
        rows.append({"page_tokens": tokens, **rate})
    return rows


def ratios(pd: dict, base: dict) -> dict:
    def r(key: str, stat: str) -> float | None:
        a, b = pd[key][stat], base[key][stat]
        return None if a is None or not b else a / b
    return {"ttft_p50": r("ttft_ms", "p50"), "ttft_p99": r("ttft_ms", "p99"),
            "tpot_p50": r("tpot_ms", "p50"), "tpot_p99": r("tpot_ms", "p99"),
            "output_tok_s": pd["output_throughput"] / max(base["output_throughput"], 1e-9)}


def _link_rate(text: str) -> str:
    from kvstrata.bench.netlink import parse_rate  # noqa: PLC0415 - stdlib only

    try:
        parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2-135m", help="a dir, a .gguf or a short name")
    ap.add_argument("--backends", nargs="+", default=["tcp", "mooncake"],
                    choices=["tcp", "mooncake"])
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1,
                    help="requests in flight (default 1: low load)")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-total-tokens", type=int, default=32768)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--transfer-page-tokens", type=int, nargs="+", default=[16, 64],
                    help="page sizes (tokens) of the transfer-layer rate measurement")
    ap.add_argument("--transfer-pages", type=int, default=128)
    ap.add_argument("--dataset", choices=["random", "multiturn"], default="random",
                    help="multiturn: chats of --num-turns turns, PD with and without the "
                         "decode radix cache (KV bytes and TTFT per turn)")
    ap.add_argument("--num-turns", type=int, default=3, help="multiturn: turns per chat")
    ap.add_argument("--followup-len", type=int, default=None,
                    help="multiturn: words of each message after the first (default "
                         "--input-len / 4); the decode radix cache's saving per turn is the "
                         "conversation over what is new, so it grows with this ratio")
    ap.add_argument("--speculative-algorithm", choices=["NEXTN"], default=None,
                    help="NEXTN: both servers draft with the model's MTP layer; the decode "
                         "server with the prefill's DSA seed and with it ignored "
                         "(KVSTRATA_PD_DSA_SEED=0), same run (--model tiny-dsa-mtp builds "
                         "the tiny DSA model with an MTP layer)")
    ap.add_argument("--link-rate", nargs="+", default=None, metavar="RATE", type=_link_rate,
                    help="run the PD servers in two network namespaces joined by a veth pair "
                         "shaped by tbf at RATE (tc spelling: 10gbit, 25gbit, 200mbit), once "
                         "per rate, so KV bytes cost network time; the achieved rate is "
                         "measured and reported beside it. Needs root, iproute2 and the "
                         "kernel's veth and tbf: without them the run stops with an error "
                         "(exit 2) instead of measuring loopback. No latency is added")
    ap.add_argument("--output-json", default="benchmarks/results/pd.json")
    add_quiet_arg(ap)


def run(args: argparse.Namespace) -> dict:
    box = announce_load(args.require_quiet)
    log_dir = tempfile.mkdtemp(prefix="kvstrata-bench-pd-")
    print(f"logs: {log_dir}")
    config = {k: v for k, v in vars(args).items() if not k.startswith("_") and not callable(v)}
    result: dict = {"box_load": box, "config": config}
    if getattr(args, "link_rate", None):
        result["links"] = run_links(args, log_dir)
        return _write(args, result)
    result.update(run_setups(args, log_dir))
    return _write(args, result)


def run_links(args, log_dir: str) -> dict:
    """Per --link-rate: a fresh pair of namespaces, the unshaped and the shaped P->D rate
    measured, then the chosen workload with the servers on either side of the link. The
    namespaces are removed after each rate, also on errors (the servers are stopped first,
    by disaggregated()'s own finally)."""
    from kvstrata.bench.netlink import LinkUnavailable, NetLink, parse_rate  # noqa: PLC0415

    out = {}
    for rate in args.link_rate:
        link = NetLink()
        try:
            try:
                link.up()
                unshaped = link.measure()
                link.shape(rate)
                shaped = link.measure()
            except LinkUnavailable as e:
                print(f"error: --link-rate needs network namespaces, veth and tbf: {e}",
                      file=sys.stderr)
                raise SystemExit(2) from None
            info = {**link.describe(), "requested_gbps": parse_rate(rate) / 1e9,
                    "measured_gbps": shaped["gbps"], "unshaped_veth_gbps": unshaped["gbps"]}
            print(f"\nlink {rate}: measured {shaped['gbps']:.2f} Gb/s P->D (requested "
                  f"{info['requested_gbps']:.2f}; the same veth unshaped: "
                  f"{unshaped['gbps']:.2f} Gb/s); prefill {link.addr('p')} in "
                  f"{link.ns['p']}, decode {link.addr('d')} in {link.ns['d']}")
            args._link = link
            out[rate] = {"link": info, **run_setups(args, log_dir)}
        finally:
            args._link = None
            link.down()
    return out


def run_setups(args, log_dir: str) -> dict:
    """The workload --dataset / --speculative-algorithm chose -> its results."""
    if args.speculative_algorithm == "NEXTN":
        from kvstrata.bench.pd_nextn import run_nextn  # noqa: PLC0415
        return run_nextn(args, log_dir, disaggregated)
    if args.dataset == "multiturn":
        from kvstrata.bench.pd_multiturn import run_multiturn  # noqa: PLC0415
        return run_multiturn(args, log_dir, disaggregated)
    result = {"colocated": colocated(args, log_dir)}
    for backend in args.backends:
        pd = disaggregated(args, backend, log_dir)
        pd["vs_colocated"] = ratios(pd, result["colocated"])
        pd["transfer"] = transfer_rates(args, backend)
        result[backend] = pd
    print_report(result, args.backends)
    return result


def _write(args, result: dict) -> dict:
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=1)
    return result


def print_report(result: dict, backends: list[str]) -> None:
    rows = [("colocated", result["colocated"])] + [(b, result[b]) for b in backends]
    print(f"\n{'setup':10s} {'TTFT p50':>9s} {'p99':>8s} {'TPOT p50':>9s} {'p99':>8s} "
          f"{'tok/s':>7s} {'TTFT p50 x':>10s}")
    for name, s in rows:
        ratio = s.get("vs_colocated", {}).get("ttft_p50")
        print(f"{name:10s} {s['ttft_ms']['p50'] or 0:9.1f} {s['ttft_ms']['p99'] or 0:8.1f} "
              f"{s['tpot_ms']['p50'] or 0:9.1f} {s['tpot_ms']['p99'] or 0:8.1f} "
              f"{s['output_throughput']:7.1f} {'' if ratio is None else f'{ratio:10.2f}'}")
    print(f"\n{'transfer':10s} {'page tok':>8s} {'GB/s':>7s} {'socket':>7s} {'ratio':>6s}")
    for name in backends:
        for t in result[name]["transfer"]:
            print(f"{name:10s} {t['page_tokens']:8d} {t['gbps']:7.2f} "
                  f"{t['loopback_socket_gbps']:7.2f} {t['ratio_to_loopback']:6.2f}")
