"""What --enable-deterministic-inference costs on the tiny random MLA models, offline: DeepSeek-V3
(dense latent attention) and V3.2 (MLA + the DSA indexer), ~21M parameters each
(kvstrata/bench/offline.py's tiny-dsa shapes; the V3 one without the indexer), with the flag on
and off alternated round after round in one run (a noisy box hits both alike). Reported as
ratios on / off of output tok/s (< 1: it costs) per round and their median -- the figures
behind docs/benchmarks.md "Deterministic inference on MLA / DSA".

Per round and setting: `kvstrata.LLM.generate` of --num-prompts prompts (--input-len tokens
each, --output-len out, greedy, ignore_eos) all at once, then batch 1 (--batch1-prompts one
at a time, max_running_requests 1).

  python benchmarks/ab_deterministic_mla.py                      # both models, bf16 + fp32
  python benchmarks/ab_deterministic_mla.py --models tiny-mla --dtypes bfloat16 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402
from kvstrata.bench.offline import (build_tiny_dsa_checkpoint, make_prompts,  # noqa: E402
                                    run_kvstrata)

VOCAB = 32000
SETTINGS = {"off": dict(enable_deterministic_inference=False,
                        disable_deterministic_inference=True),
            "on": dict(enable_deterministic_inference=True)}


def build_tiny_mla_checkpoint(path: str) -> str:
    """tiny-dsa's shapes as DeepSeek-V3 (no indexer: dense MLA attention)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, q_lora_rank=192,
        kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        first_k_dense_replace=2, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    DeepseekV3ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


BUILDERS = {"tiny-mla": build_tiny_mla_checkpoint, "tiny-dsa": build_tiny_dsa_checkpoint}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                   choices=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--batch1-prompts", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    add_quiet_arg(p)
    return p.parse_args(argv)


def measure(args, path: str, prompts, dtype: str, setting: str) -> dict:
    common = dict(dtype=dtype, page_size=16, max_total_tokens=65536, **SETTINGS[setting])
    served = run_kvstrata(path, prompts, args.output_len, max_running_requests=64, **common)
    one = run_kvstrata(path, prompts[:args.batch1_prompts], args.output_len,
                       max_running_requests=1, **common)
    return {"output_tok_s": served, "batch1_tok_s": one}


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = {"args": vars(args), "load": announce_load(args.require_quiet), "models": {}}
    prompts = make_prompts(args.num_prompts, args.input_len, args.input_len, VOCAB, args.seed)
    with tempfile.TemporaryDirectory(prefix="ab-det-mla-") as tmp:
        for name in args.models:
            path = BUILDERS[name](os.path.join(tmp, name))
            for dtype in args.dtypes:
                rounds = []
                for r in range(args.rounds):
                    order = ("off", "on") if r % 2 == 0 else ("on", "off")
                    got = {s: measure(args, path, prompts, dtype, s) for s in order}
                    ratio = {k: got["on"][k] / got["off"][k] for k in got["on"]}
                    rounds.append({**got, "on_over_off": ratio})
                    print(f"{name} {dtype} round {r + 1}: " + ", ".join(
                        f"{k} off {got['off'][k]:.1f} on {got['on'][k]:.1f} "
                        f"({ratio[k]:.3f}x)" for k in ratio), flush=True)
                median = {k: statistics.median(x["on_over_off"][k] for x in rounds)
                          for k in rounds[0]["on_over_off"]}
                print(f"{name} {dtype} median on/off: "
                      + ", ".join(f"{k} {v:.3f}x" for k, v in median.items()), flush=True)
                result["models"].setdefault(name, {})[dtype] = {"rounds": rounds,
                                                                "median_on_over_off": median}
    if args.output_json:
        write_json(args.output_json, result)
    return result


if __name__ == "__main__":
    main()
