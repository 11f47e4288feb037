"""The start-up resolution pipeline: ServerArgs + Platform + ModelInfo -> ResolvedArgs.

Ordered pure steps (docs/configuration.md has the full table):
  0-. GGUF weights (kept quantized or dequantized at load: --quantization gguf, --load-format)
  0. platform defaults (device, chunked prefill size)
  0b. page geometry (chunk and pool sizes vs --page-size)
  0c. prefill/decode disaggregation (decode chunk cache, backend per role)
  1. HiCache host-memory mode (validations)
  2. HiCache layout/IO (R1, R2, page_head)
  3. storage/layout (Mooncake needs a page-major layout)
  4. HiCache ratio default (non-decode servers)
  4b. hybrid SWA memory (a second pool for sliding-window layers; later steps see its kind)
  4c. recurrent state (the snapshot prefix cache's strategy, state slots per request; what
      is refused beside an SSM / linear-attention model)
  5. decode-retraction backup + ratio
  6. DSA gates
  7. speculative decoding (NEXTN -> EAGLE, auto draft shape, chain draft tokens)
  8. deterministic inference (the kernels it pins; where it is refused)
The KV pool itself is sized afterwards, once the model is loaded (config/kv_sizing.py).
Every change is a `Resolution(field, old, new, rule, reason)`; the engine logs the list once at
start, `/server_info` returns it and `kvstrata config --explain` prints it. An invalid
combination raises ValueError naming the flags.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

from kvstrata import envs
from kvstrata.config.resolve_types import (ModelInfo, Resolution, ResolvedArgs, apply,
                                           to_resolved)
from kvstrata.config.rules import (deterministic, disagg, dsa, gguf_weights, hicache,
                                   page_geometry, platform_defaults, recurrent, retraction,
                                   speculative, swa)
from kvstrata.config.server_args import QUANTIZATION_BUILT, ServerArgs, flag
from kvstrata.platform import Platform, current_platform, detected_platform, simulated

logger = logging.getLogger("kvstrata.config")

Step = Callable[[ResolvedArgs, Platform, "ModelInfo | None", dict], "list[Resolution]"]

STEPS: tuple[tuple[str, Step], ...] = (
    ("gguf weights", gguf_weights.gguf_weights),
    ("platform defaults", platform_defaults.platform_defaults),
    ("page geometry", page_geometry.page_geometry),
    ("pd disaggregation", disagg.pd_disaggregation),
    ("hicache host-memory mode", hicache.host_memory_mode),
    ("hicache layout/io", hicache.layout_io),
    ("hicache storage/layout", hicache.storage_layout),
    ("hicache ratio default", hicache.ratio_default),
    ("hybrid swa memory", swa.hybrid_swa_memory),
    ("recurrent state", recurrent.recurrent_state),
    ("decode retraction backup", retraction.retraction_backup),
    ("dsa gates", dsa.dsa_gates),
    ("speculative decoding", speculative.speculative),
    ("deterministic inference", deterministic.deterministic_inference),
)


def platform_for(args: ServerArgs, platform: Platform | str | None = None) -> Platform:
    """The platform to resolve for: an explicit argument, else --platform (simulated), else
    the detected hardware."""
    if isinstance(platform, Platform):
        return platform
    kind = platform or args.platform
    if kind is None:
        return current_platform()
    return simulated(kind)


def resolve(args: ServerArgs, platform: Platform | str | None = None,
            model_info: ModelInfo | None = None,
            env: Mapping[str, Any] | None = None, *,
            record_dsa_gates: bool | None = None) -> tuple[ResolvedArgs, list[Resolution]]:
    """Run every step in order; returns the new frozen args and the changes, in order.

    `env` is the typed snapshot of KVSTRATA_* variables (default: `envs.snapshot()`), passed
    explicitly so the steps stay pure. `model_info=None` means "unknown": a plain MHA model
    without recurrent state is assumed. The DSA gates are always applied but listed only for
    a DSA model unless `record_dsa_gates` says otherwise (explain lists them)."""
    plat = platform_for(args, platform)
    env_values = dict(envs.snapshot() if env is None else env)
    current = to_resolved(args)
    resolutions: list[Resolution] = []
    for _name, step in STEPS:
        changes = step(current, plat, model_info, env_values)
        current = apply(current, changes)
        if step is swa.hybrid_swa_memory:  # the pool kind the later rules gate on
            model_info = swa.model_info_after(current, model_info)
        if step is dsa.dsa_gates and not dsa.gates_are_recorded(model_info, record_dsa_gates):
            continue
        resolutions.extend(changes)
    return current, resolutions


def log_resolutions(resolutions: list[Resolution], log: logging.Logger = logger) -> None:
    """One line per change; rewrites of explicit choices (R1/R2/storage) at WARNING with the
    rule's exact message. KVSTRATA_LOG_RESOLUTIONS=0 keeps only the warnings."""
    verbose = envs.KVSTRATA_LOG_RESOLUTIONS.get()
    for r in resolutions:
        if r.warning:
            log.warning("%s (%s: %r -> %r, rule %s)", r.reason, r.field, r.old, r.new, r.rule)
        elif verbose:
            log.info("resolved %s", r.line())


# ---- flags whose feature is not built yet ---------------------------------------------------
# serve must refuse these instead of silently ignoring them. Each entry: field -> predicate
# on its value saying "the user asked for the unbuilt feature". Remove an entry in the commit
# that implements the feature (tests/unit/test_resolution_unimplemented.py lists them).
UNIMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    # HiCache L2 (host pool) and L3 (storage, prefetch policies) are built; buffer_only
    # (the host pool only stages pages between device and storage) is not.
    "hicache_host_memory_mode": lambda v: v != "cache",
    # Prefill/decode disaggregation: the roles, backends, decode admission, decode
    # retraction (cpu_tensor | host_pool backup), the decode radix cache, its host tier and
    # decode KV offload (through that tier to L3) are all built.
    # Sparse attention, parallelism.
    "enable_hisparse": bool,
    "dcp_size": lambda v: v > 1,
    # Weight quantisation: w8a8_int8 at load, gguf, and the schemes checkpoints are saved in.
    "quantization": lambda v: v is not None and v not in QUANTIZATION_BUILT,
    # Structured output: the llguidance backend (or none) is built.
    "grammar_backend": lambda v: v not in ("llguidance", "none"),
}
# Flags whose refusal names the value too: the flag itself is built for other values.
_REFUSAL_SHOWS_VALUE = {"quantization", "grammar_backend"}


def unimplemented_flags(args: ServerArgs) -> list[str]:
    """CLI spellings of the flags in `args` that ask for a feature kvstrata lacks, in field
    order, e.g. ["--enable-hierarchical-cache", "--tp-size", "--quantization fp8"]."""
    return [flag(name) + (f" {getattr(args, name)}" if name in _REFUSAL_SHOWS_VALUE else "")
            for name in ServerArgs.field_names()
            if name in UNIMPLEMENTED and UNIMPLEMENTED[name](getattr(args, name))
            ] + speculative.unbuilt(args) + _unbuilt_combinations(args)


def _unbuilt_combinations(args: ServerArgs) -> list[str]:
    """Flags built alone but not together."""
    # Under TP a STANDALONE draft and an EAGLE head run whole on every rank (the head through
    # the target's vocabulary-parallel embedding and output head); EAGLE3 heads (their own
    # vocabulary) and FR-Spec token maps (rows of the output head) are not built there.
    # NEXTN's MTP layer is split per rank on Qwen3-Next and Qwen3.5 only: which model it is
    # is known at resolution (rules/recurrent.py for the hybrids, rules/speculative.py for
    # the others; runner/spec/drafts.py also refuses EAGLE over a DeepSeek target).
    if args.tp_size > 1 and args.speculative_algorithm not in (None, "NGRAM", "STANDALONE",
                                                               "EAGLE", "NEXTN"):
        return [f"--speculative-algorithm {args.speculative_algorithm} with --tp-size > 1"]
    if args.tp_size > 1 and getattr(args, "speculative_token_map", None):
        return ["--speculative-token-map with --tp-size > 1"]
    return []


def refuse_unimplemented(args: ServerArgs) -> None:
    """What `serve` / `LLM(...)` call before starting: NotImplementedError listing every
    unbuilt flag, and a --platform that is not the machine's (only --explain may simulate)."""
    missing = unimplemented_flags(args)
    if missing:
        raise NotImplementedError("not implemented yet: " + ", ".join(missing))
    check_serve_platform(args)


def check_serve_platform(args: ServerArgs, detected: Platform | None = None) -> None:
    if args.platform is None:
        return
    real = detected or detected_platform()
    if args.platform != real.kind:
        raise ValueError(f"--platform {args.platform} does not match this machine "
                         f"({real.kind}); --platform only simulates for `kvstrata config "
                         f"--explain`")
