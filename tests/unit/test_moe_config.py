"""runner/models/moe_config.py: the MoE members of the llama family (Qwen3-MoE, Qwen2-MoE,
Mixtral, GLM-4.5) accept the fields they build and refuse the others by name, on
transformers' own config classes (no model is built). A field a new transformers adds to
one of these classes fails the first test until it is built or refused on purpose."""
from __future__ import annotations

import pytest

from kvstrata.config.hf_config import layer_windows
from kvstrata.runner.models.moe_config import check_moe_config

CLASSES = {"qwen3_moe": "Qwen3MoeConfig", "qwen2_moe": "Qwen2MoeConfig",
           "mixtral": "MixtralConfig", "glm4_moe": "Glm4MoeConfig"}


def config(model_type: str, **fields):
    import transformers

    return getattr(transformers, CLASSES[model_type])(**fields)


@pytest.mark.parametrize("model_type", list(CLASSES))
def test_class_defaults_and_training_only_fields_are_accepted(model_type):
    check_moe_config(config(model_type))
    # the router's auxiliary loss, Mixtral's jitter (training only), dropout: no effect here
    check_moe_config(config(model_type, router_aux_loss_coef=0.02, output_router_logits=True,
                            router_jitter_noise=0.1, attention_dropout=0.1))


# The fields of released config.json files (values shrunk): Qwen3-30B-A3B's and GLM-4.5's,
# with what they carry beside their transformers class's own (head_dim, max_window_layers,
# rope_theta + rope_scaling null, torch_dtype, partial_rotary_factor).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 151643, "decoder_sparse_step": 1,
    "eos_token_id": 151645, "head_dim": 16, "hidden_act": "silu", "hidden_size": 64,
    "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 40960,
    "max_window_layers": 4, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 4,
    "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-6,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 300}
GLM_4_5 = {
    "architectures": ["Glm4MoeForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
    "pad_token_id": 151329, "eos_token_id": [151329, 151336, 151338], "head_dim": 16,
    "hidden_act": "silu", "hidden_size": 64, "partial_rotary_factor": 0.5,
    "initializer_range": 0.02, "intermediate_size": 96, "max_position_embeddings": 131072,
    "model_type": "glm4_moe", "moe_intermediate_size": 32, "norm_topk_prob": True,
    "num_attention_heads": 4, "n_group": 1, "topk_group": 1, "n_routed_experts": 8,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "num_hidden_layers": 3, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5, "rope_scaling": None, "rope_theta": 1000000,
    "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "transformers_version": "4.54.0", "use_cache": True, "use_qk_norm": True,
    "vocab_size": 300}


@pytest.mark.parametrize("raw", [QWEN3_30B_A3B, GLM_4_5], ids=["qwen3_moe", "glm4_moe"])
def test_released_config_fields_are_accepted(raw):
    import transformers

    check_moe_config(transformers.AutoConfig.for_model(**raw))


@pytest.mark.parametrize("model_type,fields,match", [
    # an unknown field: it could change the arithmetic
    ("qwen3_moe", {"moe_layer_freq": 2}, r"config fields not implemented by kvstrata: "
                                         r"\['moe_layer_freq'\]"),
    # transformers' Qwen3-MoE windows every layer and reads no layer_types
    ("qwen3_moe", {"layer_types": ["full_attention"] * 24}, r"\['layer_types'\]"),
    ("glm4_moe", {"scoring_func": "softmax"}, r"\['scoring_func'\]"),
    ("mixtral", {"shared_expert_intermediate_size": 64},
     r"\['shared_expert_intermediate_size'\]"),
    # biases transformers' model never builds
    ("mixtral", {"attention_bias": True}, r"attention_bias=True is not supported"),
    ("qwen2_moe", {"attention_bias": True}, r"attention_bias=True is not supported"),
    ("qwen3_moe", {"mlp_bias": True}, r"mlp_bias=True is not supported"),
    ("glm4_moe", {"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
])
def test_fields_not_built_are_refused_by_name(model_type, fields, match):
    with pytest.raises(ValueError, match=match):
        check_moe_config(config(model_type, architectures=["X"], **fields))


def test_qwen_moe_windows_are_the_reference_layers():
    """use_sliding_window: Qwen3-MoE windows every layer (its attention reads
    config.sliding_window), Qwen2-MoE the "sliding_attention" layer_types its config derives
    from max_window_layers; without it neither has a window."""
    dims = dict(num_hidden_layers=4, sliding_window=16)
    assert layer_windows(config("qwen3_moe", use_sliding_window=True, **dims)) == [16] * 4
    qwen2 = config("qwen2_moe", use_sliding_window=True, max_window_layers=3, **dims)
    assert layer_windows(qwen2) == [16 if t == "sliding_attention" else None
                                    for t in qwen2.layer_types] == [16, None, 16, None]
    for model_type in ("qwen3_moe", "qwen2_moe"):
        assert layer_windows(config(model_type, use_sliding_window=False, **dims)) is None
