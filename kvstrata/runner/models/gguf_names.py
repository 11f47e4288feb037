"""llama.cpp's block tensor names (gguf.MODEL_TENSORS; convert_hf_to_gguf.py writes them) ->
transformers' checkpoint names, per model_type of the families config/gguf_families.py
configures: Qwen2-MoE, Qwen3-MoE, Mixtral, Phi-3, OLMo 2, GLM-4, GLM-4.5, DeepSeek V2 / V3
(SmolLM3 reads llama's).

An expert stack (ffn_gate_exps / ffn_up_exps / ffn_down_exps: [experts, out, in], the
converter's torch.stack of each expert's matrix) maps to a name with `{e}` in it: the loader
hands each expert's matrix out under its own checkpoint name, as the HF checkpoint names it
(moe_decoder.py reads per-expert names). The fused weights llama.cpp keeps fused map to the
fused HF names the decoder reads (Phi-3's attn_qkv -> qkv_proj; Phi-3's and GLM-4's ffn_up,
gate rows then up rows -> gate_up_proj).
"""
from __future__ import annotations

# llama's tensors (gguf_weights.py: llama / mistral / qwen2 / qwen3 files)
LLAMA_BLOCK = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
               "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
               "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj"}
_ATTENTION = {k: v for k, v in LLAMA_BLOCK.items() if not k.startswith("ffn_")}
_QWEN_EXPERTS = {"ffn_norm": "post_attention_layernorm", "ffn_gate_inp": "mlp.gate",
                 "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
                 "ffn_up_exps": "mlp.experts.{e}.up_proj",
                 "ffn_down_exps": "mlp.experts.{e}.down_proj"}
# DeepSeek-V3's MoE block (GLM-4.5 has it too): router, its correction bias, experts, shared
# experts under `shared_experts`
_V3_EXPERTS = {"ffn_gate_inp": "mlp.gate", "exp_probs_b": "mlp.gate.e_score_correction_bias",
               "ffn_gate_exps": "mlp.experts.{e}.gate_proj",
               "ffn_up_exps": "mlp.experts.{e}.up_proj",
               "ffn_down_exps": "mlp.experts.{e}.down_proj",
               "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
               "ffn_up_shexp": "mlp.shared_experts.up_proj",
               "ffn_down_shexp": "mlp.shared_experts.down_proj"}
FAMILY_BLOCKS: dict[str, dict[str, str]] = {
    "qwen3_moe": {**_ATTENTION, **_QWEN_EXPERTS},
    "qwen2_moe": {**_ATTENTION, **_QWEN_EXPERTS,
                  "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                  "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                  "ffn_up_shexp": "mlp.shared_expert.up_proj",
                  "ffn_down_shexp": "mlp.shared_expert.down_proj"},
    # Mixtral's checkpoint names (w1 gate, w3 up, w2 down), as LlamaModel's converter reads them
    "mixtral": {**_ATTENTION, "ffn_norm": "post_attention_layernorm",
                "ffn_gate_inp": "block_sparse_moe.gate",
                "ffn_gate_exps": "block_sparse_moe.experts.{e}.w1",
                "ffn_up_exps": "block_sparse_moe.experts.{e}.w3",
                "ffn_down_exps": "block_sparse_moe.experts.{e}.w2"},
    "phi3": {**LLAMA_BLOCK, "attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    # no input norms; the outputs' norms (gguf's post_attention_norm / post_ffw_norm)
    "olmo2": {k: v for k, v in LLAMA_BLOCK.items() if k not in ("attn_norm", "ffn_norm")}
    | {"post_attention_norm": "post_attention_layernorm",
       "post_ffw_norm": "post_feedforward_layernorm"},
    # GLM-4.5: leading dense layers (ffn_gate / _up / _down), then V3's router (sigmoid
    # scores, exp_probs_b its correction bias) and shared experts
    "glm4_moe": {**LLAMA_BLOCK, **_V3_EXPERTS,
                 "post_attention_norm": "post_attention_layernorm"},
    # DeepSeek V2 / V3 (MLA): attn_k_b / attn_v_b, the converter's split of kv_b_proj, are
    # joined back (gguf_weights.py); an older file's attn_kv_b is kv_b_proj itself
    "deepseek_v2": {**LLAMA_BLOCK, **_V3_EXPERTS, "attn_q_a": "self_attn.q_a_proj",
                    "attn_q_a_norm": "self_attn.q_a_layernorm",
                    "attn_q_b": "self_attn.q_b_proj",
                    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
                    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
                    "attn_kv_b": "self_attn.kv_b_proj",
                    "attn_k_b": "self_attn.kv_b_proj.k", "attn_v_b": "self_attn.kv_b_proj.v"},
    "glm4": {**LLAMA_BLOCK, "ffn_up": "mlp.gate_up_proj",
             "post_attention_norm": "post_self_attn_layernorm",
             "post_ffw_norm": "post_mlp_layernorm"},
}
# Global tensors recomputed from the config, not loaded: llama3's rope_freqs, Phi-3's
# LongRoPE factors (config/gguf_families.py read them into rope_parameters)
RECOMPUTED = {"rope_freqs.weight", "rope_factors_short.weight", "rope_factors_long.weight"}
# HF weights of shape [1, hidden] that llama.cpp may store as a vector [hidden]
ROW_VECTORS = ("mlp.shared_expert_gate.weight",)

FAMILY_BLOCKS["deepseek_v3"] = FAMILY_BLOCKS["deepseek_v2"]

__all__ = ["FAMILY_BLOCKS", "LLAMA_BLOCK", "RECOMPUTED", "ROW_VECTORS"]
