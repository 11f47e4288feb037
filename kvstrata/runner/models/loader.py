"""Weight loading: HF safetensors (single or sharded) and GGUF (gguf_weights.py: dequantized,
or kept in its quantized blocks).

Both sources yield (HF parameter name, tensor) pairs; the model copies each into its own
(fused) parameters, and we check every expected parameter was filled. Weights kept quantized
(PackedRows) are staged by the model's load_weight and become packed layers once all are in
(runner/quant/gguf_linear.py).
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterator

import torch
from tqdm import tqdm

from kvstrata import envs
from kvstrata.config.hf_quant import HfQuantScheme, checkpoint_scheme
from kvstrata.config.model_source import ModelSource, gguf_metadata_dir
from kvstrata.runner.models.decoder import DecoderForCausalLM
from kvstrata.runner.models.deepseek import DeepseekForCausalLM
from kvstrata.runner.models.gemma import GemmaForCausalLM
from kvstrata.runner.models.gguf_hybrid_weights import (MODEL_TYPES as HYBRID_GGUF_TYPES,
                                                        iter_hybrid_gguf)
from kvstrata.runner.models.gguf_weights import iter_gguf
from kvstrata.runner.models.gpt_oss import GptOssForCausalLM
from kvstrata.runner.models.hybrids import HYBRID_FAMILIES, hybrid_model
from kvstrata.runner.models.moe_decoder import MoeDecoderForCausalLM
from kvstrata.runner.models.registry import arch_spec
from kvstrata.runner.models.sandwich import SandwichForCausalLM
from kvstrata.runner.quant import gguf_linear
from kvstrata.runner.quant.hf_checkpoint import assemble, quantized_parts

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype, config: Any, device: torch.device) -> torch.dtype:
    """auto: float32 on CPU (fast and exact there); on accelerators the checkpoint's half
    dtype, or bfloat16 for float32/GGUF checkpoints (same range as float32)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype != "auto":
        raise ValueError(f"dtype must be auto, {', '.join(_DTYPES)}; got {dtype!r}")
    if device.type == "cpu":
        return torch.float32
    ckpt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if ckpt in (torch.float16, "float16"):
        return torch.float16
    return torch.bfloat16


# What a model reads of one tensor (`read_spec(name)`, tensor-parallel ranks): None = skip it,
# "all", or ("rows" | "cols", lo, hi) = a slice of its first or second dimension.
ReadSpec = Any


def apply_read_spec(t: torch.Tensor, spec: ReadSpec) -> torch.Tensor:
    """The same slice taken of a tensor already in memory (GGUF, .bin)."""
    if spec == "all":
        return t
    kind, lo, hi = spec
    return t[lo:hi] if kind == "rows" else t[:, lo:hi]


def _read(h, key: str, spec: ReadSpec) -> torch.Tensor:
    """Read only the slice from the safetensors file (lazy: the rest is never touched)."""
    if spec == "all":
        return h.get_tensor(key)
    kind, lo, hi = spec
    sl = h.get_slice(key)
    return sl[lo:hi] if kind == "rows" else sl[:, lo:hi]


def _iter_safetensors(path: str, read_spec=None, scheme: HfQuantScheme | None = None
                      ) -> Iterator[tuple[str, Any]]:
    """Every tensor, or with a quantized checkpoint's `scheme` each quantized linear's parts
    assembled into one (P.weight, PackedRows or dequantized matrix): runner/quant/
    hf_checkpoint.py. A read_spec is asked about P.weight and reads all of its parts."""
    from safetensors import safe_open

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no .safetensors weights in {path}")
    names = []
    for file in files:
        h = safe_open(os.path.join(path, file), framework="pt")
        names.extend((h, k) for k in h.keys())
    parts = {} if scheme is None else quantized_parts(scheme, (k for _, k in names))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for h, k in tqdm(names, desc="Loading safetensors", unit="tensor", leave=False):
            asked = k if k not in parts else f"{parts[k]}.weight"
            spec = "all" if read_spec is None else read_spec(asked)
            if spec is not None and k in parts and spec != "all":
                raise ValueError(f"{asked}: reading a share of a quantized ({scheme.method}) "
                                 f"linear is not built")
            if spec is not None:
                yield k, _read(h, k, spec)

    if scheme is None:
        yield from tensors()
    else:
        yield from assemble(scheme, parts, tensors())


def iter_checkpoint(source: ModelSource, config: Any, permute_qk: bool = False,
                    read_spec=None, keep_quantized: bool = False,
                    scheme: HfQuantScheme | None = None) -> Iterator[tuple[str, Any]]:
    """(HF name, tensor) of every weight: GGUF, safetensors, or (EAGLE heads are often
    published so) a single pytorch_model.bin, read with weights_only. `read_spec(name)`: only
    that part of each tensor (safetensors reads nothing else; the others slice in memory).
    keep_quantized: a GGUF's quantized weights come as PackedRows (gguf_weights.py).
    scheme: a quantized HF checkpoint's (config/hf_quant.py) linears come assembled."""
    if source.kind == "gguf" and getattr(config, "model_type", None) in HYBRID_GGUF_TYPES:
        # transforms undone; float weights, or PackedRows kept in their blocks
        it = iter_hybrid_gguf(source.gguf_path, config, keep_quantized)
    elif source.kind == "gguf":
        it = iter_gguf(source.gguf_path, config, permute_qk, keep_quantized)
    else:
        bin_path = os.path.join(source.path, "pytorch_model.bin")
        if not (os.path.isfile(bin_path) and not any(f.endswith(".safetensors")
                                                      for f in os.listdir(source.path))):
            return _iter_safetensors(source.path, read_spec, scheme)
        if scheme is not None:
            raise ValueError(f"{source.display_name}: a {scheme.method} checkpoint in "
                             f"pytorch_model.bin is not built (its safetensors release is)")
        it = iter(torch.load(bin_path, map_location="cpu", weights_only=True,
                             mmap=True).items())
    if read_spec is None:
        return it
    return ((k, apply_read_spec(t, read_spec(k))) for k, t in it if read_spec(k) is not None)


# Model families whose GGUF files nothing here maps (llama.cpp names their tensors or
# metadata in ways this loader does not read) are refused by arch before this, at the config
# (config/gguf_config.py, gguf_families.py, gguf_hybrid.py); every family built here maps its
# files (the hybrids': gguf_hybrid_weights.py).
# Families whose GGUF weights load dequantized only (no packed path for their layers)
_NO_PACKED_GGUF = {"gpt_oss": ("gpt-oss", "no packed kernel for its MXFP4 experts"),
                   "deepseek": (None, "no packed path for MLA and its expert stacks")}


def load_model(source: ModelSource, config: Any, dtype: str | torch.dtype = "auto",
               device: torch.device | str = "cpu", keep_quantized: bool = False
               ) -> DecoderForCausalLM | DeepseekForCausalLM:
    """The model filled from `source`; keep_quantized (--quantization gguf): a GGUF's
    quantized weights stay in their blocks (runner/quant/gguf_linear.py)."""
    device = torch.device(device)
    name, spec = arch_spec(config)
    torch_dtype = resolve_dtype(dtype, config, device)
    if keep_quantized and spec.family in _NO_PACKED_GGUF:  # a draft's flag too
        label, why = _NO_PACKED_GGUF[spec.family]
        raise ValueError(f"{name}: GGUF weights kept in their blocks (--quantization gguf) are "
                         f"not built for {label or name} ({why}); its GGUF files load "
                         f"dequantized (--load-format gguf_dequantize)")
    if spec.family == "deepseek":
        config_dir = gguf_metadata_dir(source) if source.kind == "gguf" else source.path
        with open(os.path.join(config_dir, "config.json"), encoding="utf-8") as fh:
            raw_config = json.load(fh)  # the fields as written, to refuse unknown ones
        model = DeepseekForCausalLM(config, raw_config, torch_dtype, device)
    elif spec.family == "gpt_oss":
        model = GptOssForCausalLM(config, spec, torch_dtype, device)
    elif spec.family in HYBRID_FAMILIES:
        model = hybrid_model(name, config, torch_dtype, device)
    elif spec.family == "moe":
        model = MoeDecoderForCausalLM(config, spec, torch_dtype, device)
    elif spec.family == "gemma":
        model = GemmaForCausalLM(config, spec, torch_dtype, device)
        # llama.cpp's converter stores Gemma's norm weights as the scale 1 + w itself.
        model.norms_hold_scale = source.kind == "gguf"
    elif spec.family in ("olmo2", "glm4"):
        model = SandwichForCausalLM(config, spec, torch_dtype, device)
    else:
        act = getattr(config, "hidden_act", None) or "silu"
        if act != "silu":  # the llama decoder's MLP is silu(gate) * up
            raise ValueError(f"{name}: hidden_act {act!r} is not supported (silu only)")
        model = DecoderForCausalLM(config, spec, torch_dtype, device)
    return fill_weights(model, source, config, spec.gguf_permute_qk,
                        keep_quantized=keep_quantized)


def quant_scheme(source: ModelSource) -> HfQuantScheme | None:
    """The quantization an HF checkpoint was saved with (config/hf_quant.py), None for a
    float one or a GGUF file (its blocks say it per tensor)."""
    return None if source.kind == "gguf" else checkpoint_scheme(source.path)


# Models whose load_weight stages PackedRows (DecoderForCausalLM._copy) for every linear:
# the plain llama-family decoder. The others (experts, MLA, recurrent mixers, ...) take
# float weights only.
_PACKED_HF_MODELS = (DecoderForCausalLM,)


def refuse_packed_model(model, scheme: HfQuantScheme, where: str) -> None:
    if type(model) not in _PACKED_HF_MODELS:
        raise ValueError(f"{where}: {scheme.describe()} weights are built for the "
                         f"llama-family decoder only, not {type(model).__name__}")


def fill_weights(model, source: ModelSource, config: Any, permute_qk: bool = False,
                 what: str = "", keep_quantized: bool = False):
    """Every checkpoint tensor into `model` (its load_weight maps, fuses, slices, or returns []
    for what is not its own: a draft head's share of a checkpoint), then the "every expected
    weight exactly once" check, the weights kept quantized into packed layers, then the
    model's `finish_load(loaded)` if it has one. `what` names the model in errors
    ("EAGLE head ", "MTP layer of ")."""
    where = f"{what}{source.display_name}"
    scheme = quant_scheme(source)
    packed_scheme = scheme is not None and scheme.is_int  # GPTQ / AWQ / compressed-tensors
    if packed_scheme:
        refuse_packed_model(model, scheme, where)
    weights = iter_checkpoint(source, config, permute_qk, getattr(model, "read_spec", None),
                              keep_quantized, scheme)
    loaded: list[str] = []
    for name, tensor in weights:
        try:
            loaded.extend(model.load_weight(name, tensor))
        except KeyError as e:
            raise ValueError(f"unexpected weight {name!r} in {where}: {e}") from None
    expected = model.expected_keys()
    missing = expected - set(loaded)
    if source.kind == "gguf" and missing == {"lm_head"}:
        # llama.cpp uses token_embd as the output matrix when a GGUF has no output.weight,
        # whatever the derived config says about tying.
        model.lm_head = model.embed
        missing = set()
    if missing:
        raise ValueError(f"{where}: missing weights {sorted(missing)[:8]}")
    if len(loaded) != len(set(loaded)):
        raise ValueError(f"{where}: some weights appear more than once")
    if keep_quantized or packed_scheme:
        # float activations, or a GGUF file's layers on 8-bit ones (llama.cpp's scheme) with
        # KVSTRATA_GGUF_INT8_ACTIVATIONS=1 (faster at batch 1 only); a converted HF
        # checkpoint's always on float ones (their bounds against transformers are float's)
        int8 = not packed_scheme and envs.KVSTRATA_GGUF_INT8_ACTIVATIONS.get()
        model.gguf_info = gguf_linear.replace_packed_weights(model, int8_activations=int8)
    if packed_scheme:
        model.gguf_info.update(quantization=scheme.method, checkpoint_scheme=scheme.describe())
    if hasattr(model, "finish_load"):
        model.finish_load(loaded)
    return model.eval()


def fill_mtp_layer(make_head: Callable[[], Any], source: ModelSource, config: Any, target,
                   names: str):
    """NEXTN's draft: the MTP layer (`make_head()`, which counts in `num_loaded` the tensors
    it took) filled from `source`'s checkpoint, usually the target's own; the target's
    tensors are not the head's. `names` says where the layer's weights live, for the refusal
    of a checkpoint that claims an MTP layer but has none (transformers' DeepseekV3Config
    writes num_nextn_predict_layers 1 by default)."""
    if getattr(config, "architectures", None) != getattr(target.config, "architectures", None):
        raise ValueError(f"--speculative-algorithm NEXTN: the draft checkpoint "
                         f"{source.display_name} is not a {type(target).__name__}")
    head = make_head()
    try:
        return fill_weights(head, source, config, what="MTP layer of ")
    except ValueError:
        if head.num_loaded:
            raise
        raise ValueError(f"--speculative-algorithm NEXTN: {source.display_name} has no MTP "
                         f"layer weights ({names})") from None
