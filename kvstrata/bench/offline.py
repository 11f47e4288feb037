"""Offline throughput: kvstrata.LLM vs transformers `generate` (static batches) on the same
prompts, same dtype, same machine, in the same run. Prints output tok/s of each and the ratio.

    kvstrata bench offline --model tiny        # a random ~19M-parameter llama built on the fly
    kvstrata bench offline --model tiny-dsa    # a random DeepseekV32 (MLA + DSA + MoE)
    kvstrata bench offline --model random-qwen2.5-0.5b   # Qwen2.5-0.5B's shapes, random bf16
                                  # weights (14 heads, 2 KV heads: splits over 2 ranks)
    kvstrata bench offline --model /path/to/deepseek_v32_dir
    kvstrata bench offline --model smollm2-135m
    kvstrata bench offline --model smollm2-135m --quantization w8a8_int8   # int8 kvstrata
                                                     # (transformers stays float32)
    kvstrata bench offline --model tiny --tp-size 1,2   # tensor parallel: each size's tok/s,
                                  # its ratio to tp 1 and the share of time in collectives
"""
from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from kvstrata.bench.box_load import add_quiet_arg, announce_load
from kvstrata.bench.hf_reference import load_hf_model
from kvstrata.config.server_args import QUANTIZATIONS

TINY = "tiny"
TINY_DSA = "tiny-dsa"
RANDOM_QWEN = "random-qwen2.5-0.5b"


def build_tiny_checkpoint(path: str) -> str:
    """A random llama of about 19M parameters (the size machine-facts.md measured peers on)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=688,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=2048, tie_word_embeddings=True)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def build_tiny_dsa_checkpoint(path: str) -> str:
    """A random DeepseekV32 of about 21M parameters: MLA + DSA indexer (index_topk 64, far
    below the prompts, so attention is sparse) + MoE after 2 dense layers."""
    import torch
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

    torch.manual_seed(0)
    cfg = DeepseekV32Config(
        vocab_size=32000, hidden_size=256, intermediate_size=688, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, q_lora_rank=192,
        kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64,
        first_k_dense_replace=2, index_topk=64, index_head_dim=64, index_n_heads=16,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)
    DeepseekV32ForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


def build_random_qwen_checkpoint(path: str) -> str:
    """Qwen2.5-0.5B-Instruct's published config (494M parameters) with random bf16 weights:
    a model of a size people serve on a CPU whose heads split over 2 tensor-parallel ranks
    (SmolLM2's 9 heads / 3 KV heads do not); ~1 GB on disk, ~20 s to build."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                      num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                      max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, bos_token_id=151643, eos_token_id=151645)
    Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    return path


def model_for(name: str, tmp: str) -> tuple[str, int]:
    """(checkpoint path, vocab size) for --model: the built-in tiny ones, or a dir / name."""
    if name == TINY:
        return build_tiny_checkpoint(os.path.join(tmp, "tiny")), 32000
    if name == TINY_DSA:
        return build_tiny_dsa_checkpoint(os.path.join(tmp, "tiny-dsa")), 32000
    if name == RANDOM_QWEN:
        return build_random_qwen_checkpoint(os.path.join(tmp, RANDOM_QWEN)), 151936
    config = os.path.join(name, "config.json")
    if os.path.isfile(config):
        with open(config, encoding="utf-8") as fh:
            return name, int(json.load(fh)["vocab_size"])
    return name, 49152  # smollm2-135m / a GGUF file


def make_prompts(num: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(num)]


def run_kvstrata(model_path: str, prompts, output_len: int, stats: dict | None = None,
                 **server_args) -> float:
    """Output tok/s. `stats`: filled with the share of the timed run rank 0 spent in the
    model's collectives (tensor parallelism: all-reduce and the logits' all-gather)."""
    from kvstrata import LLM

    llm = LLM(model_path=model_path, skip_tokenizer_init=True, **server_args)
    params = {"max_new_tokens": output_len, "ignore_eos": True, "temperature": 0}
    llm.generate(input_ids=prompts[:2], sampling_params={**params, "max_new_tokens": 4})  # warm-up
    joined = getattr(llm.engine.runner, "tp_rank", None)
    group = joined.group if joined is not None else None
    comm0 = group.comm_seconds if group is not None else 0.0
    start = time.perf_counter()
    outs = llm.generate(input_ids=prompts, sampling_params=params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o["output_ids"]) for o in outs)
    if stats is not None and group is not None:
        stats["collective_share"] = (group.comm_seconds - comm0) / elapsed
    llm.check_integrity()
    llm.shutdown()
    return tokens / elapsed


def run_transformers(model_path: str, prompts, output_len: int, batch_size: int) -> float:
    import torch

    model = load_hf_model(model_path)
    pad = 0
    tokens = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                                 max_new_tokens=output_len, min_new_tokens=output_len)
        tokens += (out.shape[1] - width) * len(batch)
    return tokens / (time.perf_counter() - start)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default=TINY,
                    help=f"'{TINY}', '{TINY_DSA}', '{RANDOM_QWEN}', 'smollm2-135m', a dir or "
                         f"a .gguf")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--min-input-len", type=int, default=64)
    ap.add_argument("--max-input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--max-running-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--quantization", default=None, choices=QUANTIZATIONS,
                    help="kvstrata's --quantization (the transformers reference stays float)")
    ap.add_argument("--tp-size", default="1",
                    help="tensor parallel sizes to run, e.g. 1,2 (ratios against the first)")
    ap.add_argument("--output-json", default="benchmarks/results/offline.json")
    add_quiet_arg(ap)


def run(args: argparse.Namespace) -> dict:
    load = announce_load(args.require_quiet)
    with tempfile.TemporaryDirectory() as tmp:
        model, vocab = model_for(args.model, tmp)
        prompts = make_prompts(args.num_prompts, args.min_input_len, args.max_input_len, vocab,
                               args.seed)
        total = args.max_input_len + args.output_len
        sizes = [int(x) for x in str(args.tp_size).split(",")]
        per_tp: dict[int, dict] = {}
        for tp in sizes:
            stats: dict = {}
            tok_s = run_kvstrata(model, prompts, args.output_len, stats,
                                 page_size=args.page_size, tp_size=tp,
                                 max_running_requests=args.max_running_requests,
                                 max_total_tokens=total * args.max_running_requests,
                                 quantization=args.quantization)
            per_tp[tp] = {"tok_s": tok_s, "ratio_vs_first": tok_s / per_tp.get(
                sizes[0], {"tok_s": tok_s})["tok_s"], **stats}
            print(f"kvstrata tp {tp}: {tok_s:8.1f} output tok/s"
                  + (f" (--quantization {args.quantization})" if args.quantization else "")
                  + (f", {per_tp[tp]['ratio_vs_first']:.2f}x tp {sizes[0]}, "
                     f"{stats['collective_share']:.0%} of the run in collectives"
                     if "collective_share" in stats else ""))
        ours = per_tp[sizes[0]]["tok_s"]
        result = {"model": args.model, "num_prompts": args.num_prompts,
                  "quantization": args.quantization, "box_load": load,
                  "input_len": [args.min_input_len, args.max_input_len],
                  "output_len": args.output_len, "kvstrata_tok_s": ours,
                  "tp": {str(k): v for k, v in per_tp.items()}}
        if not args.skip_transformers:
            ref = run_transformers(model, prompts, args.output_len, args.hf_batch_size)
            print(f"transformers: {ref:8.1f} output tok/s (static batches of {args.hf_batch_size})")
            print(f"ratio:        {ours / ref:8.2f}x")
            result.update(transformers_tok_s=ref, ratio=ours / ref)
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump(result, f, indent=2)
    return result




def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="kvstrata bench offline", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(ap)
    return run(ap.parse_args(argv))


if __name__ == "__main__":
    main()
