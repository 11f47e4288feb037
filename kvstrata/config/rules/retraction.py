"""Step 5: where a retracted decode request's KV is kept, and the host ratio that follows.

`host_pool` copies the KV into a (HiCache-style) host pool and restores it with the same IO
path as HiCache; `cpu_tensor` copies it into a plain CPU tensor per request. The automatic
choice is `host_pool` only where every precondition holds; ROCm keeps it opt-in because large
host-pool restores can fault the GPU there (SGLang PR #36343).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, change
from kvstrata.platform import Platform

# Host slots of a backup-only retraction pool, as a fraction of the device pool: overflow
# aborts the retraction instead of pre-reserving a full copy.
BACKUP_ONLY_HICACHE_RATIO = 0.2
SHARED_HICACHE_RATIO = 2.0


@dataclass(frozen=True)
class RetractionInputs:
    """Every input of the decision, explicitly (so a test can flip exactly one)."""
    disaggregation_mode: str
    explicit: str | None
    platform_kind: str
    dcp_enabled: bool
    decode_radix_cache: bool
    decode_offload: bool
    priority_scheduling: bool
    disable_priority_preemption: bool
    has_recurrent_state: bool
    kv_pool_kind: str
    full_attention_tokens_per_layer: int | None

    @property
    def priority_preemption(self) -> bool:
        return self.priority_scheduling and not self.disable_priority_preemption


def pool_supports_host_pool(kv_pool_kind: str, full_attention_tokens: int | None) -> bool:
    """SGLang's gate: an MHA pool, or a hybrid SWA pool (full-attention tokens > 0; None =
    not sized yet but hybrid: model_info_after gives an all-SWA model 0). The host-pool
    backup keeps the full pages in the host pool and the live window's SWA pages in its SWA
    half under the same host page ids (runner/executors/retraction_backup.py); an all-SWA
    pool has no full pages for it to hold."""
    return kv_pool_kind == "mha" or (kv_pool_kind == "swa" and full_attention_tokens != 0)


def decide_backup(x: RetractionInputs) -> tuple[str, str]:
    """(backend, reason) for an unset --disaggregation-decode-retraction-backup."""
    blockers = []
    if x.disaggregation_mode != "decode":
        blockers.append("not a decode server")
    if x.platform_kind == "hip":
        blockers.append("ROCm (large host-pool restores can fault the GPU; opt in explicitly)")
    if x.dcp_enabled:
        blockers.append("decode context parallel (--dcp-size > 1)")
    if x.decode_radix_cache:
        blockers.append("--disaggregation-decode-enable-radix-cache")
    if x.decode_offload:
        blockers.append("--disaggregation-decode-enable-offload-kvcache already owns a host pool")
    if x.priority_preemption:
        blockers.append("priority preemption (--enable-priority-scheduling without "
                        "--disable-priority-preemption)")
    if x.has_recurrent_state:
        blockers.append("the model keeps recurrent/SSM state")
    if not pool_supports_host_pool(x.kv_pool_kind, x.full_attention_tokens_per_layer):
        blockers.append("KV pool kind swa has no full-attention pages to back up"
                        if x.kv_pool_kind == "swa" else f"KV pool kind {x.kv_pool_kind}")
    if blockers:
        return "cpu_tensor", "auto: cpu_tensor because " + "; ".join(blockers)
    swa = ("; a hybrid SWA pool: the full pages and the live window's SWA pages"
           if x.kv_pool_kind == "swa" else "")
    return "host_pool", f"auto: host_pool (decode server, every precondition holds{swa})"


def check_explicit_host_pool(x: RetractionInputs) -> None:
    flag = "--disaggregation-decode-retraction-backup host_pool"
    if x.disaggregation_mode != "decode":
        raise ValueError(f"{flag} requires --disaggregation-mode decode, got "
                         f"{x.disaggregation_mode}")
    if x.dcp_enabled:
        raise ValueError(f"{flag} is not supported with --dcp-size > 1")
    if x.priority_preemption:
        raise ValueError(f"{flag} with --enable-priority-scheduling requires "
                         f"--disable-priority-preemption")
    if x.decode_offload:
        raise ValueError(f"{flag} and --disaggregation-decode-enable-offload-kvcache are "
                         f"mutually exclusive (both build a decode host pool)")
    if x.has_recurrent_state:
        raise ValueError(f"{flag} does not support models with recurrent/SSM state")
    if x.kv_pool_kind == "swa" and x.full_attention_tokens_per_layer == 0:
        raise ValueError(f"{flag} does not support a pure sliding-window KV pool")


def inputs_from(args: ResolvedArgs, platform: Platform,
                model_info: ModelInfo | None) -> RetractionInputs:
    info = model_info or ModelInfo()
    return RetractionInputs(
        disaggregation_mode=args.disaggregation_mode,
        explicit=args.disaggregation_decode_retraction_backup,
        platform_kind=platform.kind,
        dcp_enabled=args.dcp_size > 1,
        decode_radix_cache=args.disaggregation_decode_enable_radix_cache,
        decode_offload=args.disaggregation_decode_enable_offload_kvcache,
        priority_scheduling=args.enable_priority_scheduling,
        disable_priority_preemption=args.disable_priority_preemption,
        has_recurrent_state=info.has_recurrent_state,
        kv_pool_kind=info.kv_pool_kind,
        full_attention_tokens_per_layer=info.full_attention_tokens_per_layer,
    )


def retraction_backup(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                      env: dict) -> list[Resolution]:
    x = inputs_from(args, platform, model_info)
    out: list[Resolution] = []
    if x.explicit == "host_pool":
        check_explicit_host_pool(x)  # kept as is, on ROCm too
        backend = "host_pool"
    elif x.explicit is None:
        backend, reason = decide_backup(x)
        out += change(args, "disaggregation_decode_retraction_backup", backend,
                      "retraction.backup", reason)
    else:
        backend = x.explicit
    if args.hicache_ratio is None:
        if backend == "host_pool" and not args.enable_hierarchical_cache:
            ratio, why = BACKUP_ONLY_HICACHE_RATIO, "a backup-only host pool for retraction"
        else:
            ratio, why = SHARED_HICACHE_RATIO, (
                "the host pool is shared with HiCache" if backend == "host_pool"
                else "standard default (retraction backup is not a host pool)")
        out += change(args, "hicache_ratio", ratio, "retraction.ratio",
                      f"--hicache-ratio unset: {ratio} for {why}")
    return out
