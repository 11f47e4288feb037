"""What packing the recurrent hybrids' linears buys (runner/models/hybrid_packed.py), and
their --quantization w8a8_int8 (runner/quant/hybrid_w8a8.py): random Qwen3.5- and
Nemotron-H-shaped checkpoints (hidden 512), offline `kvstrata.LLM`, the arms alternated round
by round in one run (a noisy box hits them alike):
  unpacked  KVSTRATA_CPU_PACKED_LINEAR=0: torch's F.linear on the plain weights (the path
            before);
  packed    the default: kvstrata's bf16 GEMM (oneDNN's layout where it does not take a
            width; fp32: oneDNN's layout);
  w8a8      --quantization w8a8_int8.
Reported as speed-ups over unpacked per round and their median -- the figures behind
docs/benchmarks.md "Recurrent hybrids on packed linears". The per-setting measurement (decode
of --num-prompts prompts at once, batch 1, one --prefill-len prefill) is
ab_deepseek_packed.py's.

  python benchmarks/ab_hybrid_packed.py                           # qwen3_5 and nemotron_h, bf16
  python benchmarks/ab_hybrid_packed.py --models qwen3_5 --rounds 3 --threads 1
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

import ab_deepseek_packed as ab  # noqa: E402

VOCAB = ab.VOCAB  # the prompts draw from it
# the arms' environments (ab_deepseek_packed.measure: "--quantization" is the flag)
SETTINGS = {"unpacked": {"KVSTRATA_CPU_PACKED_LINEAR": "0"},
            "packed": {"KVSTRATA_CPU_PACKED_LINEAR": "1"},
            "w8a8": {"KVSTRATA_CPU_PACKED_LINEAR": "1", "--quantization": "w8a8_int8"}}
COMMON = dict(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408,
              num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)


def build_qwen3_5(path: str) -> str:
    """Qwen3.5's structure: 3 Gated DeltaNet layers to 1 gated attention layer (8 of them),
    4 key heads and 8 value heads of 64 in the linear layers, a SwiGLU MLP everywhere."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(**COMMON, num_hidden_layers=8, linear_num_key_heads=4,
                            linear_num_value_heads=8, linear_key_head_dim=64,
                            linear_value_head_dim=64, linear_conv_kernel_dim=4)
    return ab._save(Qwen3_5ForCausalLM(cfg), path)


def build_nemotron_h(path: str) -> str:
    """Nemotron-H's structure: Mamba2 (16 heads of 64, state 64, 2 groups), relu^2 MLP and
    attention layers, pattern M-M-M*M- (8 layers)."""
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(**COMMON, num_hidden_layers=8, hybrid_override_pattern="M-M-M*M-",
                          mamba_num_heads=16, mamba_head_dim=64, ssm_state_size=64,
                          n_groups=2, chunk_size=64)
    return ab._save(NemotronHForCausalLM(cfg), path)


BUILDERS = {"qwen3_5": build_qwen3_5, "nemotron_h": build_nemotron_h}


def main(argv=None) -> dict:
    # "kernel": in quantization_info for the packed and the int8 arms, not unpacked
    return ab.build_and_run(ab.parse_args(argv, BUILDERS, SETTINGS, __doc__), BUILDERS,
                            SETTINGS, "ab-hybrid-packed-", "kernel")


if __name__ == "__main__":
    main()
