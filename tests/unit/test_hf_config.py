"""config/hf_config.py reads config.json without transformers: what the runner takes from a
config must equal what transformers' AutoConfig gives, on the tiny checkpoints of every
decoder family, the SmolLM2 GGUF's converted config, and config.json files written the older
way (transformers 4: rope_theta + rope_scaling with "type", torch_dtype, omitted fields)."""
from __future__ import annotations

import json
import os

import pytest

from kvstrata.config.hf_config import CLASS_DEFAULTS, HFConfig, read_hf_config
from kvstrata.config.hf_config import ModelDims, layer_windows
from kvstrata.config.model_source import gguf_metadata_dir, resolve_model_path
from kvstrata.runner.models.registry import architecture_name
from kvstrata.runner.models.rope import rope_parameters

MISSING = "<missing>"


def what_the_runner_reads(config) -> dict:
    """Everything the runner derives from a config (decoder dims, rope, window, per-layer
    windows and layer types, eos, dtype, context, architecture)."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        window = None
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    return {"dims": ModelDims.from_config(config), "rope": rope_parameters(config),
            "window": window, "layer_windows": layer_windows(config),
            "layer_types": getattr(config, "layer_types", None),
            "eos": getattr(config, "eos_token_id", None),
            "bos": getattr(config, "bos_token_id", None),
            "dtype": None if dtype is None else str(dtype).removeprefix("torch."),
            "max_pos": getattr(config, "max_position_embeddings", None),
            "arch": architecture_name(config), "rms": config.rms_norm_eps,
            "act": getattr(config, "hidden_act", None), **gemma_fields(config)}


def gemma_fields(config) -> dict:
    """What runner/models/gemma.py reads beyond the decoder's (Gemma configs only: other
    transformers classes carry some of these names, e.g. Qwen2's layer_types)."""
    if not str(getattr(config, "model_type", "")).startswith("gemma"):
        return {}
    from kvstrata.runner.models.gemma import layer_rope_parameters

    fields = ("layer_types", "sliding_window", "query_pre_attn_scalar", "hidden_activation",
              "final_logit_softcapping", "attn_logit_softcapping",
              "use_bidirectional_attention", "tie_word_embeddings", "pad_token_id")
    out = {f: getattr(config, f, MISSING) for f in fields}
    out["rope_per_type"] = {t: layer_rope_parameters(config, t) for t in config.layer_types}
    return out


def auto_config(path: str):
    from transformers import AutoConfig
    return AutoConfig.from_pretrained(path)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_tiny_checkpoints_read_as_transformers_does(arch, tiny_checkpoints):
    path = tiny_checkpoints[arch]
    assert what_the_runner_reads(read_hf_config(path)) == what_the_runner_reads(auto_config(path))


def test_smollm2_gguf_config_reads_as_transformers_does():
    path = gguf_metadata_dir(resolve_model_path("smollm2-135m"))
    assert what_the_runner_reads(read_hf_config(path)) == what_the_runner_reads(auto_config(path))


OLD_STYLE = [
    {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
     "num_attention_heads": 8, "intermediate_size": 96, "rope_theta": 50000.0,
     "rope_scaling": {"type": "linear", "factor": 2.0}, "torch_dtype": "bfloat16"},
    {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4,
     "num_key_value_heads": 2, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                "original_max_position_embeddings": 64}},
    {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64,
     "num_attention_heads": 4, "sliding_window": 131072, "use_sliding_window": False,
     "rope_theta": 1000000.0, "eos_token_id": [7, 8]},
    {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
     "sliding_window": 32, "use_sliding_window": True, "max_window_layers": 0},
    {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,  # layers 3.. slide
     "num_hidden_layers": 5, "sliding_window": 16, "use_sliding_window": True,
     "max_window_layers": 3},
    {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,  # no window: full
     "num_hidden_layers": 2, "sliding_window": 16, "max_window_layers": 0},
    {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
     "num_hidden_layers": 3, "sliding_window": 8, "use_sliding_window": True,
     "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
    {"model_type": "qwen3", "hidden_size": 64, "num_attention_heads": 4},  # head_dim 128
    {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4},  # window 4096
    {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4,
     "sliding_window": None, "head_dim": 32, "tie_word_embeddings": True},
    {"model_type": "mistral", "hidden_size": 64, "num_attention_heads": 4,
     "num_hidden_layers": 2, "sliding_window": 8},
]


GEMMA_STYLES = [
    {"model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"]},  # all defaults
    # As Google's Gemma 3 1B config.json: pattern, rope_theta + rope_local_base_freq.
    {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
     "num_hidden_layers": 7, "sliding_window_pattern": 3, "sliding_window": 512,
     "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": None,
     "final_logit_softcapping": None, "torch_dtype": "bfloat16"},
    # As the 4B's text part: linear rope scaling on the global layers only.
    {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
     "num_hidden_layers": 6, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
    # transformers keeps rope_type "default" when the older "type" key names the scaling.
    {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
     "num_hidden_layers": 2, "rope_scaling": {"type": "linear", "factor": 8.0}},
    {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
     "num_hidden_layers": 3, "layer_types": ["full_attention"] * 3,
     "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                            "rope_theta": 5e5}}},
    {"model_type": "gemma3_text", "hidden_size": 64, "num_attention_heads": 4,
     "use_bidirectional_attention": True, "sliding_window": 9},
    {"model_type": "gemma2", "architectures": ["Gemma2ForCausalLM"]},
    {"model_type": "gemma2", "hidden_size": 64, "num_attention_heads": 4, "head_dim": 16,
     "num_hidden_layers": 5, "rope_theta": 50000.0, "attn_logit_softcapping": None,
     "hidden_act": "gelu_pytorch_tanh"},
]


@pytest.mark.parametrize("raw", GEMMA_STYLES, ids=lambda r: r["model_type"])
def test_gemma_config_files_read_as_transformers_does(raw, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours, theirs = read_hf_config(str(tmp_path)), auto_config(str(tmp_path))
    assert what_the_runner_reads(ours) == what_the_runner_reads(theirs)


@pytest.mark.parametrize("arch", ["gemma3", "gemma2"])
def test_tiny_gemma_checkpoints_read_as_transformers_does(arch, tmp_path):
    from helpers.gemma_ckpt import build_gemma_checkpoint

    path = build_gemma_checkpoint(arch, str(tmp_path / arch))
    assert what_the_runner_reads(read_hf_config(path)) == what_the_runner_reads(auto_config(path))


@pytest.mark.parametrize("raw", OLD_STYLE, ids=lambda r: r["model_type"])
def test_older_and_sparse_config_files_read_as_transformers_does(raw, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ours, theirs = read_hf_config(str(tmp_path)), auto_config(str(tmp_path))
    assert what_the_runner_reads(ours) == what_the_runner_reads(theirs)


@pytest.mark.parametrize("model_type", sorted(CLASS_DEFAULTS))
def test_class_defaults_are_transformers_defaults(model_type):
    import transformers as tf

    cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config,
           "qwen3": tf.Qwen3Config, "gemma3_text": tf.Gemma3TextConfig,
           "gemma2": tf.Gemma2Config}[model_type]
    theirs = cls()
    for field, value in CLASS_DEFAULTS[model_type].items():
        if value is None and field in ("num_key_value_heads", "head_dim") or field in (
                "rope_scaling", "rope_parameters", "sliding_window", "layer_types"):
            continue  # derived in __init__ (compared through what_the_runner_reads above)
        assert getattr(theirs, field, MISSING) == value, field


def test_other_model_types_fall_back_to_autoconfig(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v32"}))
    assert read_hf_config(str(tmp_path)) is None
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        HFConfig({"model_type": "gpt2"})


def test_no_transformers_import(tiny_checkpoints):
    """The point of the reader: a fresh interpreter reads a config without importing
    transformers (or torch)."""
    import subprocess
    import sys

    code = ("import sys; from kvstrata.config.model_source import load_hf_config, "
            "resolve_model_path; load_hf_config(resolve_model_path(sys.argv[1])); "
            "print('transformers' in sys.modules, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, tiny_checkpoints["qwen3"]],
                         capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.stdout.split() == ["False", "False"]


def test_layer_windows_follow_transformers_models(tmp_path):
    """What each layer's attention uses in transformers' modeling code: Mistral's window on
    every layer (it ignores layer_types), Qwen2's on its "sliding_attention" layers only."""
    from transformers import AutoModelForCausalLM

    for raw, want in (
            ({"model_type": "mistral", "sliding_window": 8}, [8, 8, 8]),
            ({"model_type": "qwen2", "sliding_window": 8, "use_sliding_window": True,
              "max_window_layers": 1}, [None, 8, 8]),
            ({"model_type": "qwen2", "sliding_window": 8}, None)):
        raw = {**raw, "hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 3,
               "intermediate_size": 16, "vocab_size": 64}
        (tmp_path / "config.json").write_text(json.dumps(raw))
        config = auto_config(str(tmp_path))
        model = AutoModelForCausalLM.from_config(config)
        theirs = [getattr(layer.self_attn, "sliding_window", config.sliding_window)
                  for layer in model.model.layers]
        assert theirs == (want or [None] * 3), raw
        assert layer_windows(read_hf_config(str(tmp_path))) == want
