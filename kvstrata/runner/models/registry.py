"""Architecture name (config.architectures[0]) -> how to build our decoder for it."""
from __future__ import annotations

from typing import Any

from kvstrata.runner.models.decoder import ArchSpec

ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec(gguf_permute_qk=True),
    "MistralForCausalLM": ArchSpec(gguf_permute_qk=True),
    "Qwen2ForCausalLM": ArchSpec(qkv_bias=True),
    "Qwen3ForCausalLM": ArchSpec(qk_norm=True),
    # MoE members of the llama family: moe_decoder.py (the decoder with expert MLPs).
    "Qwen3MoeForCausalLM": ArchSpec(family="moe", qk_norm=True),
    "Qwen2MoeForCausalLM": ArchSpec(family="moe", qkv_bias=True),
    "MixtralForCausalLM": ArchSpec(family="moe", gguf_permute_qk=True),  # llama.cpp's llama
    "Glm4MoeForCausalLM": ArchSpec(family="moe"),  # GLM-4.5: DeepSeek-V3's MoE block
    # MLA + MoE (deepseek.py); V3.2 adds the DSA indexer. Kimi-K2 checkpoints name V3.
    "DeepseekV2ForCausalLM": ArchSpec(family="deepseek"),
    "DeepseekV3ForCausalLM": ArchSpec(family="deepseek"),
    "DeepseekV32ForCausalLM": ArchSpec(family="deepseek"),
    # Text-only Gemma 3 (model_type gemma3_text) and Gemma 2: runner/models/gemma.py.
    "Gemma3ForCausalLM": ArchSpec(family="gemma", qk_norm=True),
    "Gemma2ForCausalLM": ArchSpec(family="gemma", attn_logit_softcapping=True),
    "GptOssForCausalLM": ArchSpec(family="gpt_oss"),
    # Hybrids with recurrent state (a state pool beside the KV pool): qwen3_next.py (Gated
    # DeltaNet), nemotron_h.py and granite_hybrid.py (Mamba2), falcon_h1.py (attention and
    # Mamba2 side by side in every layer).
    "Qwen3NextForCausalLM": ArchSpec(family="qwen3_next"),
    "Qwen3_5ForCausalLM": ArchSpec(family="qwen3_next"),
    "Qwen3_5MoeForCausalLM": ArchSpec(family="qwen3_next"),
    "NemotronHForCausalLM": ArchSpec(family="nemotron_h"),
    "Mamba2ForCausalLM": ArchSpec(family="nemotron_h"),
    "GraniteMoeHybridForCausalLM": ArchSpec(family="granite_hybrid"),
    "FalconH1ForCausalLM": ArchSpec(family="falcon_h1"),
    # Dense families on the llama decoder: Phi-3 / Phi-4-mini (fused qkv_proj / gate_up_proj
    # in the checkpoint, LongRoPE, partial rotary), SmolLM3 (no_rope_layers: NoPE layers).
    "Phi3ForCausalLM": ArchSpec(),
    "SmolLM3ForCausalLM": ArchSpec(gguf_permute_qk=True),  # llama.cpp: LlamaModel's rows
    # Sandwich norms (sublayer outputs normed before the residual add): sandwich.py.
    "Olmo2ForCausalLM": ArchSpec(family="olmo2"),
    "Glm4ForCausalLM": ArchSpec(family="glm4"),
}

# GGUF-derived configs carry model_type but no `architectures` list.
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                       "gpt_oss": "GptOssForCausalLM"}


def architecture_name(config: Any) -> str:
    archs = getattr(config, "architectures", None) or []
    if archs:
        return archs[0]
    model_type = getattr(config, "model_type", None)
    return _MODEL_TYPE_TO_ARCH.get(model_type, f"<model_type {model_type!r}>")


def arch_spec(config: Any) -> tuple[str, ArchSpec]:
    name = architecture_name(config)
    spec = ARCHITECTURES.get(name)
    if spec is None:
        raise ValueError(f"unsupported model architecture {name!r}; supported: "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return name, spec
