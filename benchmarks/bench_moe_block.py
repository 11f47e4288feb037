"""One MoE block at Qwen3-30B-A3B's routing (128 experts, top-8, norm_topk_prob) with smaller
widths, over decode batches: kvstrata's block (runner/models/moe_decoder.py: tokens grouped
by expert, one gate|up and one down matmul per chosen expert) against, on the same weights
and inputs, in the same run:
  per-expert loop   every expert in turn finds its tokens with a mask (torch.where) and
                    adds its output back with index_add_ (the textbook loop)
  per-pair loop     one expert call per (token, chosen expert) pair
  transformers      Qwen3MoeSparseMoeBlock with each experts implementation it offers on
                    this torch (eager: its per-expert loop; batched_mm; grouped_mm)

  python benchmarks/bench_moe_block.py --hidden 512 --moe-inter 192 --batches 1 32 \
      --threads 1
"""
from __future__ import annotations

import argparse
import os
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks.bench_recurrent_kernels import _best  # noqa: E402  (best of n, seconds)
from kvstrata.runner.models.moe_decoder import STYLES, SparseMoeBlock  # noqa: E402

EXPERTS, TOP_K = 128, 8  # Qwen3-30B-A3B's


def per_expert_loop(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    ids, weights = block.route(x)
    out = torch.zeros_like(x)
    for e in range(block.num_experts):
        rows, slot = torch.where(ids == e)
        if rows.numel():
            y = block.expert(e, x[rows]) * weights[rows, slot, None]
            out.index_add_(0, rows, y)
    return out


def per_pair_loop(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    ids, weights = block.route(x)
    out = torch.zeros_like(x)
    for t, (row, w) in enumerate(zip(ids.tolist(), weights)):
        for j, e in enumerate(row):
            out[t] += block.expert(e, x[t:t + 1])[0] * w[j]
    return out


def transformers_block(block: SparseMoeBlock, hidden: int, implementation: str):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    config = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=block.inter,
                            num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                            norm_topk_prob=True)
    config._experts_implementation = implementation
    hf = Qwen3MoeSparseMoeBlock(config).eval()
    with torch.no_grad():
        hf.gate.weight.copy_(block.router)
        hf.experts.gate_up_proj.copy_(block.gate_up)
        hf.experts.down_proj.copy_(block.down)
    return lambda x: hf(x[None])[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--moe-inter", type=int, default=192)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    config = SimpleNamespace(model_type="qwen3_moe", num_experts=EXPERTS,
                             num_experts_per_tok=TOP_K, moe_intermediate_size=args.moe_inter,
                             norm_topk_prob=True)
    block = SparseMoeBlock(config, STYLES["qwen3_moe"], args.hidden, torch.float32,
                           torch.device("cpu"))
    with torch.no_grad():
        block.router.normal_(0, 0.05)
        block.gate_up.normal_(0, 0.05)
        block.down.normal_(0, 0.05)
    impls = {"per-expert loop": lambda x: per_expert_loop(block, x),
             "per-pair loop": lambda x: per_pair_loop(block, x)}
    for name in ("eager", "batched_mm", "grouped_mm"):
        try:
            impls[f"transformers {name}"] = transformers_block(block, args.hidden, name)
        except (ValueError, KeyError, ImportError) as exc:
            print(f"transformers {name}: not available here ({exc})")
    print(f"MoE block: {EXPERTS} experts, top-{TOP_K}, hidden {args.hidden}, expert width "
          f"{args.moe_inter}, float32, {torch.get_num_threads()} threads, best of {args.reps}")
    for batch in args.batches:
        x = torch.randn(batch, args.hidden) * 0.5
        with torch.inference_mode():
            ref = block(x)
            ours = _best(lambda: block(x), args.reps)
            hit = int(block.route(x)[0].unique().numel())
            row = [f"batch {batch:>3} ({hit} experts hit): kvstrata {ours * 1e3:.3f} ms"]
            for name, fn in impls.items():
                try:
                    got = fn(x)
                except RuntimeError as exc:  # an implementation this CPU build lacks
                    row.append(f"{name} failed ({str(exc).splitlines()[0][:60]})")
                    continue
                torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
                t = _best(lambda: fn(x), args.reps)
                row.append(f"{name} {t * 1e3:.3f} ms ({t / ours:.2f}x)")
        print("\n  ".join(row))


if __name__ == "__main__":
    main()
