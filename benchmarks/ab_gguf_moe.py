"""An MoE GGUF file kept packed (--quantization gguf) against the same file dequantized at
load to bf16 (--load-format gguf_dequantize --dtype bfloat16): decode speed and weight
memory, measured in one process in CPU time (a shared box's wall clock moves with every
other job; OMP_NUM_THREADS=1 is set here before torch loads).

The model: a random Mixtral-shaped file (8 experts top-2, q/k rows permuted as llama.cpp's
converter writes them) of --layers layers, hidden --hidden, experts --expert-width wide,
written by tests/helpers/family_gguf.py with a Q4_K_M file's mix (attention and expert
gate / up Q4_K, attn_v and ffn_down Q6_K, the router F32; K-quants as random blocks: speed
depends on shapes and types, not values). Two engines stay loaded side by side; round after
round, in alternating order, each runs benchmarks/ab_deterministic_offline.py's measure:
--num-prompts prompts at once (output tokens per CPU second) and batch-1 TPOT (CPU time of
--output-len tokens minus 1 token). Reported as packed / bf16 ratios per round and their
median (throughput > 1 and TPOT < 1: packed is faster).

  python benchmarks/ab_gguf_moe.py --rounds 3 --output-json moe.json
  python benchmarks/ab_gguf_moe.py --rounds 3 --int8-activations   # llama.cpp's scheme
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # helpers.family_gguf writes the file

from benchmarks.ab_deterministic_offline import (add_round_args, engines_beside,  # noqa: E402
                                                 run_and_report, start_beside)

# A Q4_K_M file's types (llama-quantize: attn_v and ffn_down one step up, Q6_K)
Q4_K_M = {"q_proj": "Q4_K", "k_proj": "Q4_K", "v_proj": "Q6_K", "o_proj": "Q4_K",
          "experts.gate": "Q4_K", "experts.up": "Q4_K", "experts.down": "Q6_K",
          "embed_tokens": "Q4_K", "lm_head": "Q6_K", "gate": "F32"}
# the baseline first: ratios are packed / bf16
RUNS = {"bf16": dict(load_format="gguf_dequantize", dtype="bfloat16"),
        "packed": dict(quantization="gguf")}  # --dtype auto: float32 activations


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--expert-width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--int8-activations", action="store_true",
                   help="the packed layers on 8-bit activation blocks "
                        "(KVSTRATA_GGUF_INT8_ACTIVATIONS=1; the bf16 model has no GGUF layer)")
    add_round_args(p, num_prompts=16, concurrency=16, input_len=64, output_len=32,
                   batch1_prompts=2)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from helpers.family_gguf import VOCAB, write_family_gguf
    from kvstrata.runner.quant.gguf_linear import weight_bytes

    result, tmp = start_beside(args, "ab_gguf_moe_")
    path = os.path.join(tmp, "mixtral.gguf")
    write_family_gguf("mixtral", path, types=Q4_K_M, hidden=args.hidden,
                      expert_width=args.expert_width, layers=args.layers)
    result["file_bytes"] = os.path.getsize(path)
    if args.int8_activations:  # read as the packed model loads
        os.environ["KVSTRATA_GGUF_INT8_ACTIVATIONS"] = "1"
    llms = engines_beside(path, args, RUNS)
    result["weight_bytes"] = {name: weight_bytes(llm.engine.runner.model)
                              for name, llm in llms.items()}
    print(f"file {result['file_bytes'] / 2**20:.1f} MiB; weights " + ", ".join(
        f"{name} {b / 2**20:.1f} MiB" for name, b in result["weight_bytes"].items()), flush=True)
    return run_and_report(args, llms, range(4, VOCAB), result)

if __name__ == "__main__":
    main()
