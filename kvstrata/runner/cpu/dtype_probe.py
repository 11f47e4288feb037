"""--dtype auto on a CPU that the dtype table has no row for: time the model's linear layers
in bf16 and fp32 on this machine before resolving, once per machine (cached).

Why: the table (config/rules/platform_defaults.py) holds only CPUs and thread counts whose
serving was measured -- AVX-512 BF16, AMX, AVX2 at 1-2 threads. Elsewhere (AVX-512 without
bf16 instructions, such as Skylake to Ice Lake servers; AVX2 with more threads) it keeps fp32
because nothing was measured, which can leave a faster dtype unused. Linear layers are 70-85%
of a SmolLM2 decode step and most of a prefill on a CPU, so their speed in each dtype, on the
model's own layer shapes and through the kernels the model will run (packed_linear.py's
PackedLinear, f32_gemv's copies where the model gets them), is the measurement the table rows
were built to stand for. bf16 is taken only if it is no slower at any row count measured (a
decode step at batch 1, a decode batch, a prefill slice: "auto never picks a dtype slower than
fp32") and MIN_RATIO faster over them (geometric mean): at a row count where both dtypes run
the same fp32 FMAs (32 rows on AVX2: 1.04-1.09x over five runs) a threshold on each alone
flipped between runs. The rounds alternate which dtype goes first; each ratio is a median.

The verdict is cached in $XDG_CACHE_HOME/kvstrata/cpu_dtype_probe.json (else
~/.cache/kvstrata), keyed by the CPU, its flags, the thread count, torch, the kernel builds,
the kernel choices (KNOBS) and the shapes: a restart does not measure again, and a box whose
speed moves between minutes keeps one answer. Delete the file to measure anew;
KVSTRATA_CPU_DTYPE_PROBE=off keeps the table's answer.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

import torch

from kvstrata import envs
from kvstrata.config.hf_config import ModelDims
from kvstrata.config.model_source import load_hf_config, resolve_model_path
from kvstrata.config.resolve_types import ModelInfo
from kvstrata.config.rules.platform_defaults import wants_probe
from kvstrata.kv.host_pool import total_ram_bytes
from kvstrata.platform import Platform, read_cpu_flags, read_cpu_model
from kvstrata.runner.cpu import _bf16_ops, _cpu_ops, f32_gemv
from kvstrata.runner.cpu.isa import isa_cap
from kvstrata.runner.cpu.packed_linear import PackedLinear

logger = logging.getLogger(__name__)

VERSION = 1  # of the measurement: a new one measures again
ROWS = (1, 32, 256)  # a decode step at batch 1, a decode batch, a slice of a prefill chunk
ROUNDS = 5
MIN_RATIO = 1.05  # bf16 must beat fp32 by this over the row counts (a noisy box's margin)
MIN_EACH = 1.0  # and be no slower at any one
STREAM_BYTES = 64 << 20  # fp32 weights per pass: more than a last-level cache, as a model
MAX_COPIES = 16
MAX_WEIGHT = 1 << 22  # elements of one probe weight: a wider layer keeps its k, fewer columns
KNOBS = ("KVSTRATA_CPU_BF16_GEMM", "KVSTRATA_CPU_F32_GEMV", "KVSTRATA_CPU_PACKED_LINEAR",
         "KVSTRATA_CPU_FUSED_OPS")


def layer_shapes(d: ModelDims) -> list[tuple[int, int]]:
    """(out, in) of a decoder layer's four linears (qkv, o, gate|up, down), each cut to at
    most MAX_WEIGHT elements by columns (multiples of 64, so every kernel still takes it)."""
    q, kv = d.num_heads * d.head_dim, d.num_kv_heads * d.head_dim
    shapes = [(q + 2 * kv, d.hidden_size), (d.hidden_size, q),
              (2 * d.intermediate_size, d.hidden_size), (d.hidden_size, d.intermediate_size)]
    return [(n if n * k <= MAX_WEIGHT else max(64, MAX_WEIGHT // k // 64 * 64), k)
            for n, k in shapes]


def _layers(shapes: list[tuple[int, int]], dtype: torch.dtype, copies: int,
            gemv: bool) -> list[PackedLinear]:
    gen = torch.Generator().manual_seed(0)
    return [PackedLinear((torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype), None,
                         gemv=gemv and dtype == torch.float32)
            for _ in range(copies) for n, k in shapes]


def _pass(layers: list[PackedLinear], inputs: dict[int, torch.Tensor]) -> float:
    start = time.perf_counter()
    for layer in layers:
        layer(inputs[layer.in_features])
    return time.perf_counter() - start


def measure(shapes: list[tuple[int, int]], rows: tuple[int, ...] = ROWS,
            rounds: int = ROUNDS, gemv: bool = False) -> dict[int, float]:
    """{rows: median over rounds of fp32 time / bf16 time} for a pass through every shape's
    layer (in enough copies to stream STREAM_BYTES of fp32 weights, as a model streams its
    layers). gemv: whether fp32 layers get f32_gemv's copies (gemv_copies: as the model)."""
    per_copy = sum(n * k * 4 for n, k in shapes)
    copies = max(1, min(MAX_COPIES, -(-STREAM_BYTES // per_copy)))
    layers = {dt: _layers(shapes, dt, copies, gemv) for dt in (torch.float32, torch.bfloat16)}
    gen = torch.Generator().manual_seed(1)
    ks = sorted({k for _, k in shapes})
    inputs = {(dt, m): {k: torch.randn(m, k, generator=gen).to(dt) for k in ks}
              for dt in layers for m in rows}
    with torch.inference_mode():
        for dt, dt_layers in layers.items():  # warm-up: first-touch pages, thread pools
            for m in rows:
                _pass(dt_layers, inputs[dt, m])
        ratios: dict[int, list[float]] = {m: [] for m in rows}
        for r in range(rounds):
            order = list(layers) if r % 2 == 0 else list(layers)[::-1]
            for m in rows:
                took = {dt: _pass(layers[dt], inputs[dt, m]) for dt in order}
                ratios[m].append(took[torch.float32] / took[torch.bfloat16])
    return {m: statistics.median(v) for m, v in ratios.items()}


def verdict(ratios: dict[int, float]) -> tuple[str, str]:
    """(dtype, reason) from measure()'s ratios."""
    shown = ", ".join(f"{v:.2f}x at {m} row{'s' if m > 1 else ''}"
                      for m, v in sorted(ratios.items()))
    said = (f"measured on this CPU at start-up, the model's layer shapes: bf16 linears ran "
            f"{shown} of fp32's speed (medians of {ROUNDS} interleaved rounds)")
    mean = statistics.geometric_mean(ratios.values())
    if min(ratios.values()) >= MIN_EACH and mean >= MIN_RATIO:
        return "bfloat16", f"{said}: bf16 is no slower at any and {mean:.2f}x over them"
    if min(ratios.values()) < MIN_EACH:
        return "float32", f"{said}: bf16 is slower at some row count"
    return "float32", f"{said}: bf16 is only {mean:.2f}x over them (under {MIN_RATIO}x)"


def cache_path() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kvstrata", "cpu_dtype_probe.json")


def _builds() -> str:
    """The kernel extensions as built (a rebuilt kernel measures again)."""
    stats = [os.stat(m.__file__) for m in (_bf16_ops, _cpu_ops)]
    return ",".join(f"{s.st_size}:{s.st_mtime_ns}" for s in stats)


def cache_key(shapes: list[tuple[int, int]], gemv: bool, threads: int, env: dict) -> str:
    parts = [VERSION, read_cpu_model(), sorted(read_cpu_flags()), threads, torch.__version__,
             _builds(), isa_cap(), [str(env.get(k, "")) for k in KNOBS], shapes, gemv]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:24]


def _read(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write(path: str, key: str, record: dict) -> None:
    data = _read(path)
    data[key] = record
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=1)
    os.replace(tmp, path)  # readers never see half a file


def gemv_copies(shapes: list[tuple[int, int]], num_layers: int) -> bool:
    """Whether the model's fp32 layers get f32_gemv's copies (its RAM rule over all layers)."""
    one_layer = [torch.empty(n, k) for n, k in shapes]  # not touched: no pages
    return f32_gemv.worth_copies(one_layer, total_ram_bytes() // max(1, num_layers))


def model_dims(model_path: str) -> ModelDims | None:
    """A model's dims, or None where its config is not a llama-family decoder's (resolution
    and loading then report whatever is wrong with it)."""
    try:
        return ModelDims.from_config(load_hf_config(resolve_model_path(model_path)))
    except Exception:  # any failure here is the loader's to report when it loads the model
        return None


def measured_platform(args: Any, platform: Platform, model_info: ModelInfo | None,
                      env: dict | None = None, path: str | None = None,
                      measure_fn: Callable[..., dict[int, float]] | None = None,
                      cached_only: bool = False) -> Platform:
    """`platform` with cpu_dtype_measured set where --dtype auto wants a measurement
    (config/rules/platform_defaults.py wants_probe), from the cache or measured now
    (cached_only: `kvstrata config --explain`, which shows a verdict but never measures)."""
    env = dict(envs.snapshot() if env is None else env)
    if platform.simulated or not wants_probe(args, platform, model_info, env):
        return platform
    dims = model_dims(args.model_path)
    if dims is None:
        return platform
    shapes = layer_shapes(dims)
    gemv = gemv_copies(shapes, dims.num_layers)
    path = path or cache_path()
    key = cache_key(shapes, gemv, platform.cpu_threads, env)
    record = _read(path).get(key)
    cached = isinstance(record, dict) and isinstance(record.get("ratios"), dict)
    if cached:
        ratios = {int(m): float(v) for m, v in record["ratios"].items()}
    elif cached_only:
        return platform
    else:
        logger.info("--dtype auto: timing the model's linears in bf16 and fp32 on this CPU "
                    "(once; the verdict is cached in %s)", path)
        ratios = (measure_fn or measure)(shapes, gemv=gemv)
        try:
            _write(path, key, {"ratios": ratios, "cpu": read_cpu_model(),
                               "threads": platform.cpu_threads, "shapes": shapes,
                               "measured_at": datetime.now(timezone.utc).isoformat()})
        except OSError as exc:  # a read-only home measures again next time, nothing worse
            logger.warning("could not cache the dtype measurement in %s: %s", path, exc)
    dtype, why = verdict(ratios)
    why += f" ({'as cached' if cached else 'cached'} in {path})"
    return dataclasses.replace(platform, cpu_dtype_measured=(dtype, why))


def main(argv: list[str] | None = None) -> int:
    """`python -m kvstrata.runner.cpu.dtype_probe --model M [--threads N]`: measure now (no cache
    read or written) and print the ratios, the verdict and what the table says here."""
    import argparse

    from kvstrata.config import ServerArgs, resolve
    from kvstrata.platform import detect_platform

    p = argparse.ArgumentParser(description="Time a model's linears in bf16 and fp32 here.")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ns = p.parse_args(argv)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    dims = model_dims(ns.model)
    if dims is None:
        raise SystemExit(f"{ns.model}: not a llama-family decoder's config")
    shapes = layer_shapes(dims)
    start = time.perf_counter()
    ratios = measure(shapes, gemv=gemv_copies(shapes, dims.num_layers))
    took = time.perf_counter() - start
    env = {**envs.snapshot(), "KVSTRATA_CPU_AUTO_DTYPE": "", "KVSTRATA_CPU_DTYPE_PROBE": "off"}
    table = resolve(ServerArgs(model_path=ns.model, device="cpu"), detect_platform(),
                    env=env)[1]
    print(json.dumps({"threads": torch.get_num_threads(), "seconds": round(took, 2),
                      "ratios": {m: round(v, 3) for m, v in ratios.items()},
                      "probe": verdict(ratios),
                      "table": next(r.to_json() for r in table if r.field == "dtype")},
                     indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
