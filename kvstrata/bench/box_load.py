"""Is the box quiet enough for a benchmark? Every bench run calls `announce_load()` first.

Figures taken while other jobs run are not comparable (a busy neighbour made 2-thread GEMMs
up to 10x slower on the development machines), so a run prints the load
average it started under, warns loudly when the box is busy, refuses with
`--require-quiet`, and records both in its JSON. Busy = the 1-minute load average is
above `KVSTRATA_BENCH_MAX_LOAD` (default 0.5) per CPU. The benchmark's own processes have
not started yet when it is called, so the load seen is other people's.
"""
from __future__ import annotations

import argparse
import os
import sys

from kvstrata import envs


class BusyBoxError(RuntimeError):
    pass


def box_load(loadavg: tuple[float, float, float] | None = None,
             cpus: int | None = None) -> dict:
    load = tuple(os.getloadavg()) if loadavg is None else tuple(loadavg)
    cpus = cpus or os.cpu_count() or 1
    limit = envs.KVSTRATA_BENCH_MAX_LOAD.get() * cpus
    return {"loadavg": list(load), "cpus": cpus, "busy_limit": limit, "busy": load[0] > limit}


def announce_load(require_quiet: bool = False, *, loadavg=None, cpus=None,
                  stream=None) -> dict:
    """Print the load; a busy box gets a loud warning, or BusyBoxError with require_quiet.
    Returns the dict to store in the run's JSON."""
    stream = stream or sys.stderr
    info = box_load(loadavg, cpus)
    la = info["loadavg"]
    print(f"load average {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} on {info['cpus']} CPUs",
          file=stream)
    if info["busy"]:
        message = (f"BUSY BOX: load average {la[0]:.2f} > {info['busy_limit']:.2f} "
                   f"(KVSTRATA_BENCH_MAX_LOAD={envs.KVSTRATA_BENCH_MAX_LOAD.get()} per CPU); "
                   "other jobs are running, so these figures are NOT comparable with others")
        if require_quiet:
            raise BusyBoxError(message + " (--require-quiet: refusing to run)")
        bar = "!" * min(len(message), 100)
        print(f"{bar}\n{message}\n{bar}", file=stream)
    return info


def add_quiet_arg(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--require-quiet", action="store_true",
                    help="refuse to run when the box is busy (see KVSTRATA_BENCH_MAX_LOAD)")


def main(argv: list[str] | None = None) -> int:
    """`python -m kvstrata.bench.box_load [--require-quiet]`, for shell benchmarks."""
    ap = argparse.ArgumentParser(prog="python -m kvstrata.bench.box_load")
    add_quiet_arg(ap)
    args = ap.parse_args(argv)
    try:
        announce_load(args.require_quiet)
    except BusyBoxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
