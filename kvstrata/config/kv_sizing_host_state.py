"""HiCache L2 sizing of a recurrent model: host pages beside host state slots (the snapshots'
host copies, cache/state_hiradix.py), out of --hicache-size or --hicache-ratio.

The state share, first rule that applies:
  1. --hicache-mamba-size-gb GB (SGLang's flag), taken out of --hicache-size when that is set;
  2. --hicache-mamba-size-gb auto: enough host state slots for the checkpoints the host K/V
     tier can anchor (SGLang's `hicache_mamba_sizing`): one per --chunked-prefill-size tokens
     of host K/V plus FINISH_SLOTS_PER_RUNNING_REQUEST per running request. With
     --hicache-size that is a fixed point (the K/V share shrinks as the states' grows: solved
     in closed form, then once more on the whole-slot remainder so the demand is always
     met); with --hicache-ratio (no fixed budget, SGLang refuses auto there) the host K/V
     tier is ratio x the device tokens whatever the states take, so the demand is read
     off it directly;
  3. --hicache-size split in proportion to the device bytes of K/V and states (SGLang's
     default);
  4. --hicache-ratio x the device state slots.
A model without full-attention layers (Mamba2) keeps no K/V: its page ids are addresses
(the radix tree still names every token by page), so its host pages cost nothing and are
--hicache-ratio x the device pages, and every host byte goes to state slots: rule 1, else
all of --hicache-size, else rule 4; `auto` has no K/V tier to anchor checkpoints to and
takes that same default (the reason says so).
"""
from __future__ import annotations

import logging
import math

from kvstrata.config.resolve_types import Resolution, ResolvedArgs, change

logger = logging.getLogger(__name__)
GB = 1e9  # --hicache-size and --hicache-mamba-size-gb are decimal GB, as in SGLang
AUTO = "auto"
# Finish checkpoints and the states a running request holds, beside one per chunk (SGLang's
# FINISH_SLOTS_PER_RUNNING_REQUEST).
FINISH_SLOTS_PER_RUNNING_REQUEST = 4
RULE = "kv_plan.host_state_slots"


def mamba_host_gb(value: str | None) -> float | str | None:
    """--hicache-mamba-size-gb as GB, "auto", or None (unset)."""
    if value is None:
        return None
    if str(value).strip().lower() == AUTO:
        return AUTO
    try:
        gb = float(value)
    except ValueError:
        raise ValueError(f"--hicache-mamba-size-gb must be a size in GB or 'auto', got "
                         f"{value!r}") from None
    if not math.isfinite(gb) or gb <= 0:
        raise ValueError(f"--hicache-mamba-size-gb must be > 0, got {value}")
    return gb


def checkpoint_demand(kv_tokens: int, chunk: int, rows: int) -> int:
    """Host state slots that anchor `kv_tokens` host K/V tokens: one per prefill chunk of
    them, plus the finish checkpoints of `rows` running requests."""
    return -(-kv_tokens // chunk) + FINISH_SLOTS_PER_RUNNING_REQUEST * rows


def auto_chunk(args: ResolvedArgs) -> int:
    """The checkpoint cadence `auto` solves with: --chunked-prefill-size (ValueError when
    chunked prefill is off, as SGLang: no cadence to count)."""
    chunk = args.chunked_prefill_size
    if chunk is None or chunk <= 0:
        raise ValueError("--hicache-mamba-size-gb auto needs chunked prefill "
                         "(--chunked-prefill-size > 0): one host state slot per chunk is "
                         "its cadence; give a size in GB instead")
    return chunk


def solve_auto_split(size_gb: float, kv_per_token: int, per_slot: int, chunk: int,
                     rows: int) -> int:
    """Host state slots out of `size_gb` such that the K/V pages get the rest and the slots
    cover their checkpoint demand (module docstring, rule 2)."""
    budget = size_gb * GB
    finish = FINISH_SLOTS_PER_RUNNING_REQUEST * rows * per_slot
    if budget <= finish:
        raise ValueError(f"--hicache-size {size_gb:g} cannot hold the "
                         f"{FINISH_SLOTS_PER_RUNNING_REQUEST} x {rows} finish checkpoints "
                         f"({finish / GB:.4g} GB) that --hicache-mamba-size-gb auto keeps; "
                         f"raise --hicache-size or give a size in GB")
    # kv_bytes + demand(kv_bytes) * per_slot = budget, demand = kv_bytes / (bytes per token
    # x chunk) + finish slots: linear in kv_bytes
    kv_bytes = (budget - finish) / (1 + per_slot / (kv_per_token * chunk))
    slots = checkpoint_demand(int(kv_bytes // kv_per_token), chunk, rows)
    left = int((budget - slots * per_slot) // kv_per_token)
    slots = max(slots, checkpoint_demand(max(left, 0), chunk, rows))
    if slots * per_slot >= budget:
        raise ValueError(f"--hicache-mamba-size-gb auto leaves no K/V share of --hicache-size "
                         f"{size_gb:g} ({slots} state slots of {per_slot} bytes); raise "
                         f"--hicache-size")
    return slots


def host_state_fields(args: ResolvedArgs, host, device_tokens: int, kv_per_token: int,
                      slots: int, per_slot: int, rows: int) -> tuple[dict, list[Resolution]]:
    """The host pool's KVPlan fields with `num_host_state_slots` (the module docstring's
    rules), and the Resolution saying how. `host(device tokens, GB for pages or None)`:
    kv_sizing's host page fields; `rows`: the running requests."""
    knob = mamba_host_gb(args.hicache_mamba_size_gb)
    size = args.hicache_size if args.hicache_size and args.hicache_size > 0 else 0.0
    ratio = args.hicache_ratio or 2.0
    state_bytes, kv_bytes = (slots + 1) * per_slot, device_tokens * kv_per_token
    page_gb = None
    fields = None
    if not kv_per_token:
        page_gb = 0.0  # addresses only: the ratio of the device pages, no bytes
        unanchored = (" (--hicache-mamba-size-gb auto: a model without full-attention "
                      "layers has no host K/V tier to anchor checkpoints to, so its states "
                      "take the default)" if knob == AUTO else "")
        if isinstance(knob, float):
            if size and knob > size:
                raise ValueError(f"--hicache-mamba-size-gb {knob} exceeds --hicache-size "
                                 f"{size} (a model without K/V keeps only state slots on "
                                 f"the host)")
            host_slots, how = int(knob * GB) // per_slot, f"--hicache-mamba-size-gb {knob}"
        elif size:
            host_slots = int(size * GB) // per_slot
            how = (f"--hicache-size {size}, all of it (a model without full-attention layers "
                   f"keeps no K/V: its host pages are addresses only){unanchored}")
        else:
            host_slots = int(slots * ratio)
            how = f"--hicache-ratio {ratio} x {slots} device state slots{unanchored}"
    elif knob == AUTO:
        chunk = auto_chunk(args)
        if size:
            host_slots = solve_auto_split(size, kv_per_token, per_slot, chunk, rows)
            page_gb = size - host_slots * per_slot / GB
            kv_host = int(page_gb * GB) // kv_per_token
            where = f"the rest of --hicache-size {size}"
        else:
            fields = host(device_tokens, None)
            kv_host = fields["num_host_pages"] * args.page_size
            host_slots = checkpoint_demand(kv_host, chunk, rows)
            where = f"--hicache-ratio {ratio} x {device_tokens} device tokens"
        how = (f"--hicache-mamba-size-gb auto: one per --chunked-prefill-size {chunk} tokens "
               f"of the host K/V tier ({kv_host} tokens, {where}) + "
               f"{FINISH_SLOTS_PER_RUNNING_REQUEST} per running request x {rows} (SGLang's "
               f"checkpoint demand)")
    elif knob is not None:
        host_slots = int(knob * GB) // per_slot
        how = f"--hicache-mamba-size-gb {knob}"
        if size and knob >= size:
            raise ValueError(f"--hicache-mamba-size-gb {knob} leaves no host memory for K/V "
                             f"pages out of --hicache-size {size}")
        page_gb = size - knob if size else None
    elif size:
        share = state_bytes / (state_bytes + kv_bytes)
        host_slots = int(size * share * GB) // per_slot
        how = f"--hicache-size {size} x {share:.3f} (the states' share of device bytes)"
        page_gb = size * (1 - share)
    else:
        host_slots = int(slots * ratio)
        how = f"--hicache-ratio {ratio} x {slots} device state slots"
    if host_slots < 1:
        raise ValueError(f"the host state store ({how}) holds no state slot of {per_slot} "
                         f"bytes; raise --hicache-mamba-size-gb")
    if fields is None:
        fields = host(device_tokens, page_gb)
    fields["num_host_state_slots"] = host_slots
    logger.info("HiCache host state store: %s: %d slots of %d bytes", how, host_slots,
                per_slot)
    if isinstance(knob, float):
        return fields, []
    return fields, change(args, "hicache_mamba_size_gb", f"{host_slots * per_slot / GB:.6g}",
                          RULE, f"{how}: {host_slots} host state slots of {per_slot} bytes")
