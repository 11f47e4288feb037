"""Sizing with recurrent state (SGLang's `_handle_max_mamba_cache`): one memory budget split
between the state pool (a slot per running request plus the prefix cache's snapshots) and the
full-attention layers' K/V.

A state slot holds every StateComponent of every recurrent layer (`per_slot` bytes; the ssm
component in --mamba-ssm-dtype when given); a KV token the K/V of every full-attention layer.
The state pool's usable slots, first rule that applies:
  1. --max-mamba-cache-size;
  2. --disable-radix-cache with --max-running-requests: one slot per running request;
  3. a model without full-attention layers (Mamba2): slots per running request x
     --max-running-requests (else 256), fewer when the whole budget holds fewer. The ratio
     has no K/V to weigh the states against there, and slots past the running requests'
     share would be zeroed memory nothing uses (SGLang's `max_mamba_cache_size // ratio`
     bound on running requests, read the other way);
  4. the ratio r = --mamba-full-memory-ratio (0.9): state memory / full-attention KV memory,
     so with a measured budget the states get budget * r / (1 + r) and the K/V the rest;
     with --max-total-tokens (the K/V tokens, as in SGLang) the states get r x their bytes.
A STANDALONE draft's K/V (a slot for every target slot) joins each token's bytes in step 3's
K/V share; the ratio weighs the states against the target's K/V only. Running requests are
then bounded by slots // slots per running request (resolved by
config/rules/recurrent.py: 1 without the radix cache, 3 no_buffer, 4 extra_buffer), SGLang's
`max_mamba_cache_size // ratio`; fewer than one: "Hybrid (mamba/linear-attention) state cache is
too small". A model without full-attention layers keeps no K/V: its page ids are addresses
only (req_to_token, the radix tree), bounded by rows x context as for an all-SWA model
(`KVPlan.pages_hold_kv` False). HiCache's host pages and host state slots:
config/kv_sizing_host_state.py.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from kvstrata.config.kv_plan import KVPlan
from kvstrata.config.kv_sizing_host_state import host_state_fields
from kvstrata.config.resolve_types import Resolution, ResolvedArgs, change
from kvstrata.config.rules.recurrent import check_strategy, slots_per_request
from kvstrata.config.state_plan import STATE_SSM, StateComponent, state_bytes_per_slot

TOO_SMALL_MESSAGE = "Hybrid (mamba/linear-attention) state cache is too small"


def state_components(facts: Any, ssm_dtype: str | None) -> tuple[StateComponent, ...]:
    """The model's per-slot state, the ssm component in `ssm_dtype` when given."""
    return tuple(dataclasses.replace(c, dtype=ssm_dtype) if ssm_dtype and c.name == STATE_SSM
                 else c for c in facts.state_components)


def per_request(args: ResolvedArgs) -> int:
    """State slots per running request: the resolved value, else the rule's (tests that size
    without resolving)."""
    if args.state_slots_per_request is not None:
        return args.state_slots_per_request
    radix = not args.disable_radix_cache
    strategy = check_strategy(args.mamba_radix_cache_strategy, args.page_size,
                              args.mamba_track_interval) if radix else "no_buffer"
    return slots_per_request(radix, strategy)


def _ratio_slots(args: ResolvedArgs, kv_bytes: int, per_slot: int) -> tuple[int, str]:
    r = args.mamba_full_memory_ratio
    slots = int(kv_bytes * r) // per_slot
    return slots, (f"--mamba-full-memory-ratio {r} x {kv_bytes / 2**20:.2f} MiB of "
                   f"full-attention K/V / {per_slot} bytes per slot")


def state_slots(args: ResolvedArgs, budget_bytes: int | None, per_slot: int, kv_per_token: int,
                per_req: int, default_rows: int) -> tuple[int, str]:
    """(usable state slots, how) by the rules of the module docstring, before the K/V."""
    if args.max_mamba_cache_size is not None:
        return args.max_mamba_cache_size, "--max-mamba-cache-size"
    if args.disable_radix_cache and args.max_running_requests is not None:
        return args.max_running_requests, ("--disable-radix-cache: one slot per "
                                           "--max-running-requests")
    if not kv_per_token:
        rows = args.max_running_requests or default_rows
        usable = per_req * rows
        how = (f"a model without full-attention layers: {per_req} per running request x "
               f"{rows} running requests")
        # the padding slot 0 takes one slot's bytes too
        fits = None if budget_bytes is None else budget_bytes // per_slot - 1
        if fits is not None and fits < usable:
            return fits, (f"a model without full-attention layers: the whole "
                          f"{budget_bytes / 2**30:.2f} GiB KV budget / {per_slot} bytes per "
                          f"slot (fewer than {usable}: {per_req} per running request x "
                          f"{rows} running requests)")
        return usable, how
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens // args.page_size * args.page_size
        return _ratio_slots(args, tokens * kv_per_token, per_slot)
    if budget_bytes is not None:
        r = args.mamba_full_memory_ratio
        share = int(budget_bytes * r / (1 + r))
        return share // per_slot - 1, (f"{r}/(1+{r}) of the {budget_bytes / 2**30:.2f} GiB KV "
                                       f"budget (--mamba-full-memory-ratio {r}) / {per_slot} "
                                       f"bytes per slot")
    raise ValueError("sizing the state pool needs --max-mamba-cache-size, --max-total-tokens "
                     "or a measured memory budget")


def state_plan(args: ResolvedArgs, facts: Any, budget_bytes: int | None, context_len: int,
               default_rows: int, device_tokens, host=None) -> tuple[KVPlan, list[Resolution]]:
    """The plan of a model with recurrent state. `device_tokens(bytes per token, budget)`:
    kv_sizing's whole-page K/V sizing (explicit --max-total-tokens, else the budget);
    `host(device tokens, GB for pages or None)`: kv_sizing's host pool fields (HiCache)."""
    P = args.page_size
    comps = state_components(facts, args.mamba_ssm_dtype)
    per_slot = state_bytes_per_slot(comps)
    per_req = per_request(args)
    kv_per_token = sum(c.bytes_per_token for c in facts.components)
    # A STANDALONE draft's K/V has a slot for every target slot: a token costs both (the
    # state ratio still weighs the states against the target's full-attention K/V only).
    draft_per_token = sum(c.bytes_per_token for c in facts.draft_components)
    if draft_per_token and not kv_per_token:
        raise ValueError("--speculative-algorithm STANDALONE on a model without attention "
                         "K/V (Mamba2): its page ids are addresses only, and the draft's K/V "
                         "would need a slot for every one of them")
    slots, how = state_slots(args, budget_bytes, per_slot, kv_per_token, per_req, default_rows)
    if slots < per_req:
        raise ValueError(
            f"{TOO_SMALL_MESSAGE}: {max(slots, 0)} state slots ({how}) hold fewer than one "
            f"running request's {per_req}; raise --max-mamba-cache-size, "
            f"--mamba-full-memory-ratio or the KV memory (--mem-fraction-static)")
    out = change(args, "max_mamba_cache_size", slots, "kv_plan.state_slots",
                 f"{how}: {slots} slots of {per_slot} bytes "
                 f"({(slots + 1) * per_slot / 2**20:.2f} MiB with the padding slot)")
    cap = slots // per_req
    if kv_per_token:
        budget = None if budget_bytes is None else budget_bytes - (slots + 1) * per_slot
        if budget is not None and budget < kv_per_token * P and args.max_total_tokens is None:
            raise ValueError(f"the state pool ({slots} slots) leaves no room for one page of "
                             f"full-attention K/V; lower --mamba-full-memory-ratio or "
                             f"--max-mamba-cache-size")
        tokens, sized = device_tokens(kv_per_token + draft_per_token, budget)
        out += sized
        num_pages = tokens // P
        want = args.max_running_requests or min(default_rows, num_pages)
        unset = f"min({default_rows}, {num_pages} device pages)"
    else:
        want = args.max_running_requests or default_rows
        unset = str(default_rows)
    rows = min(want, cap)
    bound = (f"state slots bound concurrency: {slots} slots // {per_req} per running request "
             f"= {cap}")
    if args.max_running_requests is not None and rows < args.max_running_requests:
        out.append(Resolution("max_running_requests", args.max_running_requests, rows,
                              "kv_plan.state_rows", bound, warning=True))
    elif rows < want:
        out += change(args, "max_running_requests", rows, "kv_plan.state_rows", bound)
    else:
        out += change(args, "max_running_requests", rows, "kv_plan.rows",
                      f"--max-running-requests unset: {unset}; {bound}")
    if not kv_per_token:  # addresses only: every row's whole context can be named
        num_pages = rows * -(-context_len // P)
    host_fields = {}
    if args.enable_hierarchical_cache and host is not None:
        host_fields, sized = host_state_fields(args, host, num_pages * P, kv_per_token, slots,
                                               per_slot, rows)
        out += sized
    plan = KVPlan(P, num_pages, rows, context_len, facts.pool_kind if kv_per_token else "none",
                  facts.components, num_state_slots=slots, state_components=comps,
                  draft_components=facts.draft_components, pages_hold_kv=bool(kv_per_token),
                  **host_fields)
    return plan, out
