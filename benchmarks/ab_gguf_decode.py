"""Batch-1 (or batch-B) decode of a GGUF file kept packed against the same file dequantized at
load, in one process, interleaved: ms per decoded token of each variant, and the ratios to the
bf16 model timed in the same round (the box is shared: ratios within a round, medians over
rounds).

Variants (each one engine, loaded once; KVSTRATA_GGUF_INT8_ACTIVATIONS is read at load):
  packed       --quantization gguf, float activations (gguf_matmul.matmul)
  packed_q8    --quantization gguf, KVSTRATA_GGUF_INT8_ACTIVATIONS=1 (gguf_matmul.matmul_q8)
  bf16         --load-format gguf_dequantize --dtype bfloat16
  *_noplan     the same engine with KVSTRATA_CPU_DECODE_PLAN=0 (the per-op layer loop)
A token's time: (time of --tokens new tokens - time of 8) / (--tokens - 8), prompts of 32
tokens, greedy, EOS ignored.

  python benchmarks/ab_gguf_decode.py --threads 1 --rounds 3
  python benchmarks/ab_gguf_decode.py --model /tmp/kvstrata-gguf/SmolLM2-135M-Instruct.Q8_0.gguf
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402

ENGINES = {"packed": ({"quantization": "gguf"}, "0"),
           "packed_q8": ({"quantization": "gguf"}, "1"),
           "bf16": ({"load_format": "gguf_dequantize", "dtype": "bfloat16"}, "0")}


def make_engine(model: str, kwargs: dict, int8: str):
    from kvstrata import LLM

    os.environ["KVSTRATA_GGUF_INT8_ACTIVATIONS"] = int8
    return LLM(model_path=model, skip_tokenizer_init=True, max_total_tokens=8192,
               disable_radix_cache=True, **kwargs)


def per_token_ms(llm, batch: int, tokens: int, plan: bool) -> float:
    os.environ["KVSTRATA_CPU_DECODE_PLAN"] = "1" if plan else "0"
    prompts = [[(37 * i + 11 * j) % 40000 + 100 for j in range(32)] for i in range(batch)]

    def timed(n: int) -> float:
        params = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
        t = time.perf_counter()
        llm.generate(input_ids=prompts, sampling_params=params)
        return time.perf_counter() - t
    timed(8)  # warm-up: the plan for this batch size
    return (timed(tokens) - timed(8)) / (tokens - 8) * 1e3


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--variants", nargs="+", default=["packed", "packed_q8", "bf16",
                                                     "packed_noplan", "packed_q8_noplan"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--tokens", type=int, default=72)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    add_quiet_arg(p)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    announce_load(args.require_quiet)
    engines = {}
    for v in args.variants:
        name = v.removesuffix("_noplan")
        if name not in engines:
            engines[name] = make_engine(args.model, *ENGINES[name])
    times: dict[str, list[float]] = {v: [] for v in args.variants}
    for r in range(args.rounds):
        for v in args.variants:
            times[v].append(per_token_ms(engines[v.removesuffix("_noplan")], args.batch,
                                         args.tokens, not v.endswith("_noplan")))
        print(f"round {r + 1}: " + "  ".join(f"{v} {t[-1]:.2f}" for v, t in times.items())
              + f" ms/token (load {os.getloadavg()[0]:.1f})", flush=True)
    report = {"batch": args.batch, "threads": torch.get_num_threads(), "ms_per_token": times}
    base = "bf16" if "bf16" in times else args.variants[0]
    for v in args.variants:
        ratio = statistics.median(b / t for b, t in zip(times[base], times[v]))
        report[f"{v}_speed_vs_{base}"] = ratio
        print(f"{v:18s} median {statistics.median(times[v]):7.2f} ms/token, "
              f"speed {ratio:.2f}x {base}'s (within rounds)")
    for llm in engines.values():
        llm.shutdown()
    return report


if __name__ == "__main__":
    main()
