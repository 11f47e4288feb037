"""Values shared by the resolution pipeline and its rules."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

from kvstrata.config import hf_recurrent
from kvstrata.config.hf_quant import method_name, read_quant_config
from kvstrata.config.server_args import ServerArgs, opt

KV_POOL_KINDS = ("mha", "swa", "mla", "other")


@dataclass(frozen=True)
class Resolution:
    """One change made at start-up: `field` went from `old` to `new` because of `rule`.

    `warning` marks rewrites of an explicit user choice (R1/R2, storage/layout): they are
    logged at WARNING level with `reason` as the exact message."""
    field: str
    old: Any
    new: Any
    rule: str
    reason: str
    warning: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"field": self.field, "old": self.old, "new": self.new, "rule": self.rule,
                "reason": self.reason}

    def line(self) -> str:
        return f"{self.field}: {self.old!r} -> {self.new!r} [{self.rule}] {self.reason}"


@dataclass(frozen=True)
class ResolvedArgs(ServerArgs):
    """ServerArgs after resolution, plus values derived from it (not CLI flags)."""
    # DSA gates (docs/configuration.md, step 6); only consulted by DSA models.
    dsa_remap_pd_seed_to_local_slots: bool | None = opt(
        None, "Remap PD-transported DSA seeds (request positions) to decode-local KV slots.",
        cli=False, group="derived")
    dsa_fused_topk: bool | None = opt(
        None, "Use the fused DSA top-k for a seed that comes from draft-extend.",
        cli=False, group="derived")
    # Deterministic inference (config/rules/deterministic.py): the kernels it pins, by name.
    deterministic_linear_kernel: str | None = opt(
        None, "The one GEMM every linear layer runs at every row count.", cli=False,
        group="derived")
    deterministic_attention_kernel: str | None = opt(
        None, "The one attention kernel every query token runs.", cli=False, group="derived")
    deterministic_recurrent_kernel: str | None = opt(
        None, "How every token advances a recurrent layer's state (recurrent models).",
        cli=False, group="derived")
    # Hybrid SWA memory (config/rules/swa.py): True = the sliding-window layers' K/V in a
    # second device pool; None for a model without windowed layers.
    hybrid_swa_memory: bool | None = opt(
        None, "The sliding-window layers keep their K/V in their own, smaller pool.",
        cli=False, group="derived")
    # Recurrent state (config/rules/recurrent.py): the state slots the pool keeps per running
    # request (a working slot plus the prefix cache's share); None without recurrent state.
    state_slots_per_request: int | None = opt(
        None, "State slots per running request: the state pool bounds concurrency to "
              "slots // this.", cli=False, group="derived")


# config.json fields that count a model's routed experts (Qwen2/3-MoE, Mixtral / gpt-oss,
# DeepSeek / GLM-4.5)
MOE_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")


@dataclass(frozen=True)
class ModelInfo:
    """What resolution needs to know about the model and its KV pool.

    kv_pool_kind: mha | swa | mla | other. full_attention_tokens_per_layer: for an SWA pool,
    the full-attention tokens per layer once the pool is sized (None = not known yet)."""
    kv_pool_kind: str = "mha"
    has_recurrent_state: bool = False  # Mamba/SSM/linear-attention state per request
    # Where config.json says which layers keep that state (config/hf_recurrent.py), for
    # `config --explain`; "" for a model without any.
    recurrent_layers: str = ""
    full_attention_tokens_per_layer: int | None = None
    uses_dsa: bool = False
    # What its attention adds to the softmax (runner/attention/window.py): "attention
    # sinks", "attention logit soft-capping"; deterministic inference refuses them.
    softmax_extras: tuple[str, ...] = ()
    # Per layer its sliding window (None = full attention), from config.json; None when no
    # layer has one. The hybrid-SWA rule (rules/swa.py) reads it.
    layer_windows: tuple[int | None, ...] | None = None
    # The quantization the checkpoint is saved in (config/hf_quant.py: gptq, awq,
    # compressed-tensors, fp8, mxfp4), "" for a float one; the dtype and deterministic
    # rules read it (its packed layers are not the float GEMMs they measured).
    quant_method: str = ""
    # Routed (MoE) experts (num_experts / num_local_experts / n_routed_experts): the
    # config's model_type ("" for a dense model). Their per-expert matmuls take however many
    # tokens the router sends them; deterministic inference pins them to the fixed GEMM for
    # the families it built and refuses the others by name (rules/deterministic.py).
    routed_experts: str = ""
    # config.json's first `architectures` entry ("" when it names none): NEXTN over a
    # recurrent model is built for Qwen3-Next's and Qwen3.5's MTP layer only
    # (rules/recurrent.py).
    architecture: str = ""

    @property
    def num_swa_layers(self) -> int:
        return sum(w is not None for w in self.layer_windows or ())

    @property
    def num_full_layers(self) -> int:
        return sum(w is None for w in self.layer_windows or ())

    def __post_init__(self) -> None:
        if self.kv_pool_kind not in KV_POOL_KINDS:
            raise ValueError(f"kv_pool_kind must be one of {', '.join(KV_POOL_KINDS)}, got "
                             f"{self.kv_pool_kind!r}")

    @classmethod
    def from_model_path(cls, path: str) -> "ModelInfo | None":
        """Best effort from a local HF `config.json` (no weights read), or a Gemma, gpt-oss
        or config/gguf_families.py GGUF file's header (its windows, soft-caps, sinks, experts:
        config/gguf_config.py); None otherwise, in which case resolution assumes a plain MHA
        model and says so."""
        if os.path.isfile(path) and path.lower().endswith(".gguf"):
            from kvstrata.config.gguf_config import gguf_model_fields  # noqa: PLC0415

            fields = gguf_model_fields(path)
            return cls.from_hf_config(fields) if fields else None
        cfg_path = os.path.join(path, "config.json") if os.path.isdir(path) else None
        if not cfg_path or not os.path.exists(cfg_path):
            return None
        with open(cfg_path, encoding="utf-8") as fh:
            cfg = json.load(fh)
        info = cls.from_hf_config(cfg)
        # AutoGPTQ / AutoAWQ of old: the scheme in a file of its own
        quant = method_name(read_quant_config(path)[0])
        return dataclasses.replace(info, quant_method=quant) if quant else info

    @classmethod
    def from_hf_config(cls, cfg: dict) -> "ModelInfo":
        model_type = str(cfg.get("model_type", "")).lower()
        found = hf_recurrent.recurrent_layers(cfg)
        recurrent = found is not None
        # A sliding-window model is "mha" here, as its config describes it: whether its
        # windowed layers get a pool of their own ("swa") is resolution's decision
        # (rules/swa.py), which then hands the later rules the "swa" kind.
        kind = "mla" if cfg.get("kv_lora_rank") else "mha"
        extras = tuple(name for name, on in (
            ("attention sinks", model_type == "gpt_oss"),
            ("attention logit soft-capping", bool(cfg.get("attn_logit_softcapping"))))
            if on)
        windows = None if recurrent or kind != "mha" else _config_windows(cfg)
        return cls(kv_pool_kind=kind, has_recurrent_state=recurrent,
                   recurrent_layers=found[2] if found else "",
                   uses_dsa=bool(cfg.get("index_topk")), softmax_extras=extras,
                   layer_windows=windows,
                   quant_method=method_name(cfg.get("quantization_config")),
                   routed_experts=(model_type or "moe") if any(
                       bool(cfg.get(k)) for k in MOE_EXPERT_FIELDS) else "",
                   architecture=str((cfg.get("architectures") or [""])[0]))


def _config_windows(cfg: dict) -> tuple[int | None, ...] | None:
    """Each layer's window as the runner's models apply it (hf_config.layer_windows, over
    the class defaults where kvstrata has a config reader: Gemma's derived layer_types,
    Qwen's use_sliding_window); other configs (gpt-oss) as written."""
    from types import SimpleNamespace  # noqa: PLC0415

    from kvstrata.config.hf_config import CLASS_DEFAULTS, HFConfig, layer_windows  # noqa: PLC0415

    if cfg.get("model_type") in CLASS_DEFAULTS and "text_config" not in cfg:
        config = HFConfig(cfg)
    else:
        config = SimpleNamespace(**cfg)
        if not isinstance(getattr(config, "num_hidden_layers", None), int):
            return None
    windows = layer_windows(config)
    return tuple(windows) if windows else None


def to_resolved(args: ServerArgs) -> ResolvedArgs:
    if isinstance(args, ResolvedArgs):
        return args
    return ResolvedArgs(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})


def apply(args: ResolvedArgs, resolutions: list[Resolution]) -> ResolvedArgs:
    if not resolutions:
        return args
    return dataclasses.replace(args, **{r.field: r.new for r in resolutions})


def change(args: ServerArgs, name: str, new: Any, rule: str, reason: str,
           warning: bool = False) -> list[Resolution]:
    """A one-element list if `name` would change, else [] (rules return lists)."""
    old = getattr(args, name)
    if old == new and type(old) is type(new):
        return []
    return [Resolution(name, old, new, rule, reason, warning)]
