"""What --enable-deterministic-inference costs: the same served load on a server with it and on
one without, alternated round after round in one run (a noisy box hits both alike), per dtype.
Reported as ratios (on / off: throughput < 1 and TPOT > 1 mean it costs) per round and their
median -- the figures behind rule deterministic.* (docs/configuration.md) and the table in
docs/benchmarks.md.

Per round and setting: `kvstrata bench serve`'s load (64 prompts, 32 concurrent, 128 words in,
64 tokens out, greedy, ignore_eos) for output tok/s and TPOT, then batch 1 (8 prompts, one at a
time) for its TPOT.

  python benchmarks/ab_deterministic.py                       # bf16 and fp32, 2 rounds
  python benchmarks/ab_deterministic.py --dtypes bfloat16 --rounds 3 --output-json det.json
  python benchmarks/ab_deterministic.py --quantization gguf --dtypes auto   # kept packed
  python benchmarks/ab_deterministic.py --dtypes bfloat16 --settings off on on-per-token

Settings: off, on, and on-per-token (the flag with KVSTRATA_CPU_DETERMINISTIC_BLOCKS=0: every
query in the paged decode kernel's order, the order the flag ran before the prefill kernel's
order: what that change bought, measured in the same run).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.pd import Proc, run_load, serve_cmd  # noqa: E402
from kvstrata.bench.ports import free_port  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402

# setting -> (server flags, environment)
SETTINGS = {"off": (("--disable-deterministic-inference",), {}),
            "on": (("--enable-deterministic-inference",), {}),
            "on-per-token": (("--enable-deterministic-inference",),
                             {"KVSTRATA_CPU_DETERMINISTIC_BLOCKS": "0"})}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                   choices=["auto", "bfloat16", "float32"])
    p.add_argument("--quantization", default=None,
                   help="passed to both servers (gguf: the GGUF file's weights kept packed)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--settings", nargs="+", default=["off", "on"], choices=list(SETTINGS),
                   help="servers per round (off first, then alternated); ratios over off")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch1-prompts", type=int, default=8)
    p.add_argument("--max-total-tokens", type=int, default=65536)
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    add_quiet_arg(p)
    return p.parse_args(argv)


def measure(args, dtype: str, setting: str, log_dir: str) -> dict:
    """One server with this dtype and setting: the served load, then batch 1."""
    port = free_port()
    quant = ("--quantization", args.quantization) if args.quantization else ()
    flags, env = SETTINGS[setting]
    srv = Proc(f"{dtype}-{setting}", serve_cmd(args, port, "--dtype", dtype, *quant, *flags),
               log_dir, env=env)
    try:
        srv.wait_http(f"http://127.0.0.1:{port}/health")
        url = f"http://127.0.0.1:{port}"
        served = run_load(args, url)
        one = run_load(argparse.Namespace(**{**vars(args), "num_prompts": args.batch1_prompts,
                                             "concurrency": 1}), url)
        return {"output_tok_s": served["output_throughput"], "tpot_ms": served["tpot_ms"]["p50"],
                "batch1_tpot_ms": one["tpot_ms"]["p50"]}
    finally:
        srv.stop()


def main(argv=None) -> dict:
    args = parse_args(argv)
    if "off" not in args.settings or len(args.settings) < 2:
        raise SystemExit("--settings needs off and at least one other (ratios are over off)")
    result = {"args": vars(args), "load": announce_load(args.require_quiet), "dtypes": {}}
    with tempfile.TemporaryDirectory(prefix="ab-det-") as log_dir:
        for dtype in args.dtypes:
            rounds = []
            others = [s for s in args.settings if s != "off"]
            for r in range(args.rounds):
                order = args.settings if r % 2 == 0 else args.settings[::-1]
                got = {s: measure(args, dtype, s, log_dir) for s in order}
                entry = dict(got)
                for s in others:
                    ratio = {k: got[s][k] / got["off"][k] for k in got[s]}
                    entry[f"{s}_over_off"] = ratio
                    print(f"{dtype} round {r + 1} {s}: " + ", ".join(
                        f"{k} {got['off'][k]:.2f} -> {got[s][k]:.2f} ({ratio[k]:.3f}x)"
                        for k in ratio), flush=True)
                rounds.append(entry)
            out = {"rounds": rounds}
            for s in others:
                median = {k: statistics.median(x[f"{s}_over_off"][k] for x in rounds)
                          for k in rounds[0][f"{s}_over_off"]}
                out[f"median_{s}_over_off"] = median
                print(f"{dtype} median {s}/off: " + ", ".join(f"{k} {v:.3f}x"
                                                              for k, v in median.items()))
            result["dtypes"][dtype] = out
    if args.output_json:
        write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
