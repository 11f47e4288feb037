"""Step 4b: hybrid SWA memory (SGLang's SWAKVPool): do the sliding-window layers keep their K/V
in a second, smaller device pool that drops out-of-window K/V?

On by default for a model with windowed layers (config.json: Mistral's sliding_window, Qwen's
use_sliding_window, Gemma's and gpt-oss' layer_types), as in SGLang, except where the rest of
kvstrata does not handle the second pool yet; each such gate turns it off and says why
(`hybrid_swa_memory` False, rule swa.off). Off, the windowed layers keep every token's K/V in
the one uniform pool and the attention backend still applies their windows (what SGLang does
for Gemma 2/3). The pool sizes follow in config/kv_sizing_swa.py once the model is loaded.

Later rules see the pool as it will be: `model_info_after` turns the model's kind into
"swa" (with the full-attention tokens per layer where --max-total-tokens names them), which
the decode-retraction gate (rules/retraction.py) reads.
"""
from __future__ import annotations

import dataclasses

from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, change
from kvstrata.platform import Platform

RULE_ON = "swa.on"
RULE_OFF = "swa.off"


def blockers(args: ResolvedArgs, info: ModelInfo | None = None) -> list[str]:
    """Why hybrid SWA memory cannot be on with these flags ([] = it can) for this model."""
    out = []
    if args.disable_hybrid_swa_memory:
        out.append("--disable-hybrid-swa-memory")
    # HiCache L2 and L3 keep SWA pages (cache/swa_hiradix.py, swa_storage.py), and so does
    # the decode KV offload (the decode tree's L3 backups through that host tier: full
    # records for every page, SWA records for the pages whose window K/V the decode held).
    # PD works (the prefill sends the last window's SWA pages, the decode allocates SWA pages
    # for that tail only: cache/swa_pd.py, transfer/disagg/regions.py), with the tcp and
    # mooncake backends, at any --tp-size equal on both servers (each rank's SWA pool is a
    # region of its own; a mismatch is refused with SGLang's message, rank_map.py), and so do
    # the decode radix cache, decode HiCache with its KV offload and host_pool retraction
    # backups. An all-SWA model's full pool crosses as a region of
    # zero-byte pages (kv/device_pool.page_buffers_of), its SWA pages as the second region.
    if args.disaggregation_decode_retraction_backup == "host_pool" and info is not None \
            and not info.num_full_layers:
        out.append("--disaggregation-decode-retraction-backup host_pool with an all-SWA model: "
                   "the host-pool backup holds full-attention pages, which an all-SWA model "
                   "does not have")
    return out


def hybrid_swa_memory(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                      env: dict) -> list[Resolution]:
    info = model_info
    if info is None or not info.num_swa_layers:
        return []  # no windowed layers (or an unknown model): nothing to decide
    full, swa = info.num_full_layers, info.num_swa_layers
    layers = (f"all {swa} layers windowed" if not full
              else f"{swa} windowed and {full} full-attention layers")
    why = blockers(args, info)
    if not full and args.enable_hierarchical_cache:
        # (the host tier is sized and keyed by the full pool: docs/architecture.md, "All-SWA
        # models keep one uniform pool under HiCache"; SGLang's all-SWA tree has none either)
        why.append("HiCache with an all-SWA model: the host tier copies the full layers' "
                   "pool, which an all-SWA model does not have")
    if why:
        return change(args, "hybrid_swa_memory", False, RULE_OFF,
                      f"{layers}; one uniform pool because " + "; ".join(why))
    split = ("the whole KV budget to the SWA pool (an all-SWA model)" if not full else
             f"SWA pool tokens = {args.swa_full_tokens_ratio} x full pool tokens "
             f"(--swa-full-tokens-ratio)")
    return change(args, "hybrid_swa_memory", True, RULE_ON,
                  f"{layers}: their K/V in a second pool that drops out-of-window K/V; {split}")


def model_info_after(args: ResolvedArgs, info: ModelInfo | None) -> ModelInfo | None:
    """The model as the later rules see it: kind "swa" when hybrid SWA memory is on, with the
    full-attention tokens per layer (0 for an all-SWA model; --max-total-tokens, which names
    the full pool's tokens, else None: known once the pool is sized)."""
    if info is None or not args.hybrid_swa_memory:
        return info
    tokens = 0 if not info.num_full_layers else args.max_total_tokens
    return dataclasses.replace(info, kv_pool_kind="swa",
                               full_attention_tokens_per_layer=tokens)
