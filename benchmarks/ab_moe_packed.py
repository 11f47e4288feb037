"""What packing the llama-family MoE blocks buys (runner/cpu/fixed_experts.pack_moe_layers:
router, every routed expert and the shared experts on kvstrata's packed linears, the default):
random Qwen3-MoE and Mixtral-shaped checkpoints, offline `kvstrata.LLM`, packed and unpacked
(KVSTRATA_CPU_PACKED_EXPERTS=0: the experts on torch's F.linear over the plain [E, out, in]
stacks, the path before; attention and the output head packed in both) alternated round by
round in one run, and packed with every layer in oneDNN's layout (KVSTRATA_CPU_BF16_GEMM=onednn,
a control for kvstrata's bf16 GEMM). Speed-ups over unpacked per round and their median: the
figures behind docs/benchmarks.md "MoE blocks on packed linears". The measurement (decode of
--num-prompts at once, batch 1, a --prefill-len prompt) is ab_deepseek_packed.py's.

  python benchmarks/ab_moe_packed.py --threads 1 --rounds 2 --dtypes bfloat16 float32
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from benchmarks import ab_deepseek_packed as ab  # noqa: E402

# Both: hidden 512, 8 heads of 64 (GQA 8:4), 4 layers, vocab ab.VOCAB.
COMMON = dict(vocab_size=ab.VOCAB, hidden_size=512, num_hidden_layers=4,
              num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
              bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
# experts packed (default) / on F.linear; "onednn": packed, no kvstrata bf16 GEMM
SETTINGS = {"unpacked": {"KVSTRATA_CPU_PACKED_EXPERTS": "0"},
            "packed": {"KVSTRATA_CPU_PACKED_EXPERTS": "1"},
            "onednn": {"KVSTRATA_CPU_PACKED_EXPERTS": "1", "KVSTRATA_CPU_BF16_GEMM": "onednn"}}


def build_qwen3_moe(path: str) -> str:
    """Qwen3-30B-A3B's routing (softmax top-8, norm_topk_prob) over 64 experts 256 wide."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**COMMON, head_dim=64, intermediate_size=1024,
                         moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
                         norm_topk_prob=True)
    return ab._save(Qwen3MoeForCausalLM(cfg), path)


def build_mixtral(path: str) -> str:
    """Mixtral's: 8 experts 1024 wide, top-2."""
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(**COMMON, intermediate_size=1024, num_local_experts=8,
                        num_experts_per_tok=2)
    return ab._save(MixtralForCausalLM(cfg), path)


BUILDERS = {"qwen3-moe": build_qwen3_moe, "mixtral": build_mixtral}


def main(argv=None) -> dict:
    return ab.build_and_run(ab.parse_args(argv, BUILDERS, SETTINGS, __doc__), BUILDERS,
                            SETTINGS, "ab-moe-packed-", "packed_moe_layers")


if __name__ == "__main__":
    main()
