"""Prefill/decode disaggregation vs one co-located server, same load, same run (also
`kvstrata bench pd`): TTFT/TPOT p50/p99 and output tok/s through sglang-router with each
transfer backend, and each backend's transfer GB/s beside a raw loopback socket copy.

    .venv/bin/python benchmarks/bench_pd.py --model smollm2-135m --backends tcp mooncake
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvstrata.bench.pd import add_args, run  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
