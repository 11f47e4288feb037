"""Step 6: DSA (DeepSeek sparse attention) gates.

Under PD, the prefill server ships each request's DSA top-k seed as request-relative
*positions* (the two servers' allocators are independent). The decode server can feed the
fused top-k (which works in KV slots) only after remapping those positions to its own slots;
the remap is implemented for CUDA and ROCm. Without the remap, a seed from draft-extend must
take the unfused path. Both gates are pure functions so the truth table is testable.
"""
from __future__ import annotations

from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, change
from kvstrata.platform import Platform

FUSE_TOPK_ENV = "KVSTRATA_DSA_FUSE_TOPK"


def remap_pd_seed_to_local_slots(platform_kind: str, fuse_topk: bool, disaggregation_mode: str,
                                 enable_hisparse: bool, dcp_enabled: bool) -> bool:
    # DCP is excluded because the fused top-k is wrong under DCP (SGLang #31821); hisparse
    # keeps KV on the host, so decode-local device slots do not exist for every position.
    return (platform_kind in ("cuda", "hip") and fuse_topk and disaggregation_mode == "decode"
            and not enable_hisparse and not dcp_enabled)


def use_fused_topk(fuse_topk: bool, disaggregation_mode: str, seed_from_draft_extend: bool,
                   remap: bool) -> bool:
    pd_index_share_seed = disaggregation_mode != "null" and seed_from_draft_extend
    return fuse_topk and (not pd_index_share_seed or remap)


def dsa_gates(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
              env: dict) -> list[Resolution]:
    fuse = bool(env.get(FUSE_TOPK_ENV, True))
    remap = remap_pd_seed_to_local_slots(platform.kind, fuse, args.disaggregation_mode,
                                         args.enable_hisparse, args.dcp_size > 1)
    fused = use_fused_topk(fuse, args.disaggregation_mode, True, remap)
    why_remap = ("CUDA/ROCm decode server, fused top-k on, no hisparse, no DCP" if remap else
                 "needs CUDA or ROCm, " + FUSE_TOPK_ENV + "=1, --disaggregation-mode decode, "
                 "no --enable-hisparse and --dcp-size 1; got "
                 f"platform={platform.kind}, {FUSE_TOPK_ENV}={int(fuse)}, "
                 f"mode={args.disaggregation_mode}, hisparse={args.enable_hisparse}, "
                 f"dcp_size={args.dcp_size}")
    if not fuse:
        why_fused = f"{FUSE_TOPK_ENV}=0"
    elif args.disaggregation_mode == "null":
        why_fused = "no PD: a draft-extend seed is local"
    elif remap:
        why_fused = "PD seed is remapped to decode-local slots"
    else:
        why_fused = "PD seed stays in request positions (no remap), so the unfused path is used"
    out = change(args, "dsa_remap_pd_seed_to_local_slots", remap, "dsa.remap_pd_seed",
                 why_remap)
    out += change(args, "dsa_fused_topk", fused, "dsa.fused_topk",
                  "draft-extend seed: " + why_fused)
    return out


def gates_are_recorded(model_info: ModelInfo | None, requested: bool | None = None) -> bool:
    """The gates are always applied, but listed as Resolutions only where they matter (a DSA
    model, or when the caller asks, as --explain does), so a plain model's start log stays
    short."""
    if requested is not None:
        return requested
    return model_info is not None and model_info.uses_dsa
