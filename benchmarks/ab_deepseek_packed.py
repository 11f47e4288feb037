"""What packing the unflagged DeepSeek path buys (runner/models/deepseek_packed.py): random
DeepSeek-V3 and V2-Lite-shaped checkpoints, offline `kvstrata.LLM`, packed (the default) and
unpacked (KVSTRATA_CPU_PACKED_LINEAR=0: torch's F.linear on the plain weights, the path before)
alternated round by round in one run (a noisy box hits both alike), and packed with every
layer in oneDNN's layout (KVSTRATA_CPU_BF16_GEMM=onednn: no kvstrata bf16 GEMM). Reported
as speed-ups over unpacked per round and their median -- the figures behind docs/benchmarks.md
"DeepSeek on packed linears".

Per round, model and setting, one engine:
  - decode: --num-prompts prompts of --input-len tokens, --output-len out, greedy, all at
    once (output tok/s; short prompts, so decode steps dominate), then batch 1
    (--batch1-prompts one at a time);
  - prefill: one prompt of --prefill-len tokens, max_new_tokens 1, radix cache off (seconds,
    best of 2).

  python benchmarks/ab_deepseek_packed.py                        # v3 and v2-lite, bf16
  python benchmarks/ab_deepseek_packed.py --models v3 --rounds 3 --dtypes bfloat16 float32
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from kvstrata.bench.box_load import add_quiet_arg, announce_load  # noqa: E402
from kvstrata.bench.report import write_json  # noqa: E402
from kvstrata.bench.offline import make_prompts  # noqa: E402

VOCAB = 32000
# KVSTRATA_CPU_PACKED_LINEAR, KVSTRATA_CPU_BF16_GEMM: unpacked is the path before; "onednn"
# packs every layer in oneDNN's layout only (no kvstrata bf16 GEMM), a control for the GEMM
SETTINGS = {"unpacked": ("0", "auto"), "packed": ("1", "auto"), "onednn": ("1", "onednn")}
# Shared by both shapes: hidden 512, 8 heads, MLA ranks a quarter of V3's, 4 layers.
COMMON = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408,
              num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8,
              kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
              first_k_dense_replace=1, max_position_embeddings=4096, bos_token_id=1,
              eos_token_id=2)


def build_v3(path: str) -> str:
    """DeepSeek-V3's structure: q LoRA, sigmoid router with groups, 8 experts top-2, one
    shared expert."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**COMMON, q_lora_rank=384, moe_intermediate_size=512,
                           n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
                           n_group=2, topk_group=1)
    return _save(DeepseekV3ForCausalLM(cfg), path)


def build_v2_lite(path: str) -> str:
    """DeepSeek-V2-Lite's structure: no q LoRA (q_proj), greedy softmax top-6 of 16 experts
    (V2-Lite: of 64), two shared experts."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = DeepseekV2Config(**COMMON, q_lora_rank=None, moe_intermediate_size=256,
                           n_routed_experts=16, n_shared_experts=2, num_experts_per_tok=6,
                           topk_method="greedy")
    return _save(DeepseekV2ForCausalLM(cfg), path)


def _save(model, path: str) -> str:
    model.save_pretrained(path, safe_serialization=True)
    return path


BUILDERS = {"v3": build_v3, "v2-lite": build_v2_lite}


def parse_args(argv=None, builders: dict = BUILDERS, settings: dict = SETTINGS,
               description: str = __doc__):
    """The A/B's arguments; another model family's A/B passes its builders and arms."""
    p = argparse.ArgumentParser(description=description.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(builders), choices=list(builders))
    p.add_argument("--dtypes", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--input-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--batch1-prompts", type=int, default=2)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: this process's CPU seconds (time.process_time), steadier than "
                        "wall time on a shared box at --threads 1")
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--arms", nargs="+", default=list(settings), choices=list(settings))
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    add_quiet_arg(p)
    return p.parse_args(argv)


def measure(args, path: str, dtype: str, env: dict, packed: bool,
            info_key: str = "packed_absorbed_heads") -> dict:
    """One engine under the environment `env` (its "--quantization" entry, if any, is the
    flag: ab_hybrid_packed.py's w8a8 arm): its decode, batch-1 and prefill figures;
    `info_key` in /server_info's quantization_info exactly when the arm is `packed`."""
    from kvstrata import LLM

    env = dict(env)
    quantization = env.pop("--quantization", None)
    os.environ.update(env)
    prompts = make_prompts(args.num_prompts, args.input_len, args.input_len, VOCAB, args.seed)
    long_prompts = make_prompts(3, args.prefill_len, args.prefill_len, VOCAB, args.seed + 1)
    llm = LLM(model_path=path, skip_tokenizer_init=True, dtype=dtype, page_size=16,
              max_total_tokens=16384, disable_radix_cache=True, quantization=quantization)
    try:
        info = llm.server_info()["quantization_info"]
        assert (info_key in info) == packed, info
        greedy = {"max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0}
        llm.generate(input_ids=prompts[:2], sampling_params={**greedy, "max_new_tokens": 4})
        clock = time.process_time if args.clock == "cpu" else time.perf_counter
        served = _output_tok_s(llm, prompts, greedy, clock)
        one = statistics.fmean(_output_tok_s(llm, [p], greedy, clock)
                               for p in prompts[:args.batch1_prompts])
        # batch-1 time per output token: a request of output-len tokens less one of 1 token
        tpot = statistics.median(
            (_seconds(llm, [p], greedy, clock)
             - _seconds(llm, [p], {**greedy, "max_new_tokens": 1}, clock))
            / (args.output_len - 1) * 1e3 for p in prompts[:args.batch1_prompts])
        prefill = min(_seconds(llm, [p], {**greedy, "max_new_tokens": 1}, clock)
                      for p in long_prompts[:2])
        llm.check_integrity()
    finally:
        llm.shutdown()
        for var in env:
            os.environ.pop(var, None)
    return {"decode_tok_s": served, "batch1_tok_s": one, "batch1_tpot_ms": tpot,
            "prefill_s": prefill}


def _seconds(llm, prompts, params, clock=time.perf_counter) -> float:
    start = clock()
    llm.generate(input_ids=prompts, sampling_params=params)
    return clock() - start


def _output_tok_s(llm, prompts, params, clock=time.perf_counter) -> float:
    return len(prompts) * params["max_new_tokens"] / _seconds(llm, prompts, params, clock)


def speedups(got: dict, arm: str) -> dict:
    """arm / unpacked as a speed-up (> 1: faster than unpacked) of each figure."""
    p, u = got[arm], got["unpacked"]
    return {"decode": p["decode_tok_s"] / u["decode_tok_s"],
            "batch1": p["batch1_tok_s"] / u["batch1_tok_s"],
            "batch1_tpot": u["batch1_tpot_ms"] / p["batch1_tpot_ms"],
            "prefill": u["prefill_s"] / p["prefill_s"]}


def run_ab(args, paths: dict, settings: dict, info_key: str) -> dict:
    """Every dtype x model: the arms of `settings` (name -> environment; "unpacked" the
    baseline) alternated round by round, each arm's speed-ups over unpacked and their
    medians. Returns the result JSON (also written to --output-json)."""
    import torch

    result = {"args": vars(args), "load": announce_load(args.require_quiet), "models": {},
              "threads": torch.get_num_threads()}
    for dtype in args.dtypes:
        for name, path in paths.items():
            rounds = []
            arms = [a for a in args.arms if a != "unpacked"]
            for r in range(args.rounds):
                order = ["unpacked", *arms]
                order = order if r % 2 == 0 else order[::-1]
                got = {s: measure(args, path, dtype, settings[s], s != "unpacked", info_key)
                       for s in order}
                rounds.append({**got, "speedup": {a: speedups(got, a) for a in arms}})
                print(f"{name} {dtype} round {r + 1}: " + "; ".join(
                    f"{s} " + ", ".join(f"{k} {v:.3f}" for k, v in got[s].items())
                    for s in order), flush=True)
            median = {a: {k: statistics.median(x["speedup"][a][k] for x in rounds)
                          for k in rounds[0]["speedup"][a]} for a in arms}
            for a in arms:
                print(f"{name} {dtype} median speed-up {a} / unpacked: "
                      + ", ".join(f"{k} {v:.2f}x" for k, v in median[a].items()), flush=True)
            result["models"].setdefault(name, {})[dtype] = {"rounds": rounds,
                                                            "median_speedup": median}
    result["load_after"] = announce_load(False)
    if args.output_json:
        write_json(args.output_json, result)
    return result


def build_and_run(args, builders: dict, settings: dict, prefix: str, info_key: str) -> dict:
    """The A/B scripts' common main: threads and seed from the flags, each model's random
    checkpoint built in a temporary folder, then run_ab over them."""
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        paths = {name: builders[name](os.path.join(tmp, name)) for name in args.models}
        return run_ab(args, paths, settings, info_key)


def main(argv=None) -> dict:
    settings = {arm: {"KVSTRATA_CPU_PACKED_LINEAR": packed, "KVSTRATA_CPU_BF16_GEMM": gemm}
                for arm, (packed, gemm) in SETTINGS.items()}
    return build_and_run(parse_args(argv), BUILDERS, settings, "ab-ds-packed-",
                         "packed_absorbed_heads")


if __name__ == "__main__":
    main()
