"""A MoE checkpoint served with --quantization w8a8_int8 against the same checkpoint in bf16:
decode speed and weight memory, measured in one process in CPU time (a shared box's wall
clock moves with every other job; OMP_NUM_THREADS=1 is set here before torch loads).

The model: a random Qwen3-MoE checkpoint (transformers' Qwen3MoeConfig, saved in bf16) of
--layers layers, hidden --hidden, --experts experts top --top-k, experts --expert-width wide
(Qwen3-30B-A3B's routing, 128 -> 64 experts, widths scaled down). Two engines stay loaded
side by side, both --dtype bfloat16 (w8a8: kvstrata's int8 GEMM with bf16 rows where the CPU
has AVX512-VNNI; the router stays bf16). Round after round, in alternating order, each runs
benchmarks/ab_deterministic_offline.py's measure: --num-prompts prompts at once (output
tokens per CPU second) and batch-1 TPOT (CPU time of --output-len tokens minus 1 token).
Reported as w8a8 / bf16 ratios per round and their median (throughput > 1 and TPOT < 1:
w8a8 is faster).

  python benchmarks/ab_w8a8_moe.py --rounds 3 --output-json w8a8_moe.json
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, ROOT)

from benchmarks.ab_deterministic_offline import (add_round_args, engines_beside,  # noqa: E402
                                                 run_and_report, start_beside)

VOCAB = 2048
# the baseline first: ratios are w8a8 / bf16
RUNS = {"bf16": dict(dtype="bfloat16"),
        "w8a8": dict(dtype="bfloat16", quantization="w8a8_int8")}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--expert-width", type=int, default=192)
    p.add_argument("--layers", type=int, default=4)
    add_round_args(p, num_prompts=16, concurrency=16, input_len=64, output_len=32,
                   batch1_prompts=2)
    return p.parse_args(argv)


def write_checkpoint(args, path: str) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(args.seed)
    config = tf.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=args.hidden // 8,
        intermediate_size=4 * args.hidden, moe_intermediate_size=args.expert_width,
        num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        max_position_embeddings=4096, initializer_range=0.05, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=None, pad_token_id=0)
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from kvstrata.runner.quant.w8a8 import weight_bytes

    result, tmp = start_beside(args, "ab_w8a8_moe_")
    path = os.path.join(tmp, "qwen3_moe")
    write_checkpoint(args, path)
    llms = engines_beside(path, args, RUNS)
    result["weight_bytes"] = {name: weight_bytes(llm.engine.runner.model)
                              for name, llm in llms.items()}
    result["kernel"] = llms["w8a8"].server_info().get("quantization_info", {}).get("kernel")
    print(f"int8 kernel: {result['kernel']}; weights " + ", ".join(
        f"{name} {b / 2**20:.1f} MiB" for name, b in result["weight_bytes"].items()), flush=True)
    return run_and_report(args, llms, range(4, VOCAB), result)


if __name__ == "__main__":
    main()
