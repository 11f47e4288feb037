"""Sizing: resolved args + the loaded model's KV facts + a memory budget -> one KVPlan.

Runs once, in the engine factory, after resolution (which already checked the page-geometry
flags, rules/page_geometry.py) and after the model is loaded (its dtype, heads and weights
are known only then). Pure: the budget in bytes is measured by the runner and passed in, so
every sizing rule is testable without torch. Each value sizing fills in is returned as a
Resolution, so the start log, `/server_info` and the resolved args show it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from kvstrata.config.kv_plan import KVComponent, KVPlan
from kvstrata.config.kv_sizing_state import state_plan
from kvstrata.config.kv_sizing_swa import swa_plan
from kvstrata.config.resolve_types import Resolution, ResolvedArgs, change
from kvstrata.config.state_plan import StateComponent

logger = logging.getLogger("kvstrata.config")

GB = 1e9  # --hicache-size is in decimal GB, as in SGLang
DEFAULT_MAX_RUNNING_REQUESTS = 256
DEFAULT_CONTEXT_LEN = 4096  # a config without max_position_embeddings


@dataclass(frozen=True)
class ModelKVFacts:
    """What the loaded model says about its KV: the per-token components of its pool kind,
    the context it was trained for, and a sliding window its attention does NOT apply (the
    context is then capped at it; None for models whose windows the attention backend
    honours: runner/attention/window.py)."""
    pool_kind: str
    components: tuple[KVComponent, ...]
    max_position_embeddings: int | None = None
    sliding_window: int | None = None
    # A STANDALONE draft model's K/V per token: sized into the same device budget.
    draft_components: tuple[KVComponent, ...] = ()
    # Per layer the window its attention applies (None = full attention), as the model
    # hands them to the attention backend; None when no layer has one. With hybrid SWA
    # memory the windowed layers' K/V get a pool of their own (kv_sizing_swa.py).
    layer_windows: tuple[int | None, ...] | None = None
    # SSM / linear-attention models: the per-slot state of the recurrent layers (conv and
    # ssm, config/state_plan.py; `components` then cover the full-attention layers only).
    # Empty for models without recurrent state.
    state_components: tuple[StateComponent, ...] = ()


def host_pool_num_pages(*, device_pool_tokens: int, page_size: int, bytes_per_token: int,
                        hicache_ratio: float | None, hicache_size: float,
                        warn_small: bool = True) -> int:
    """Usable host pages (page 0 not included). `hicache_size` (GB) wins when > 0.
    `warn_small`: warn when not larger than the device pool (HiCache; a retraction pool is
    meant to be small: 0.2 by default)."""
    if hicache_size and hicache_size > 0:
        tokens = int(hicache_size * GB // bytes_per_token)
    elif hicache_ratio is not None and hicache_ratio > 0:
        tokens = int(device_pool_tokens * hicache_ratio)
    else:
        raise ValueError("the host KV pool needs a size: set --hicache-size (GB) or "
                         "--hicache-ratio (multiple of the device pool)")
    num_pages = tokens // page_size
    if num_pages < 1:
        raise ValueError(f"the host KV pool would hold {tokens} tokens, less than one page of "
                         f"{page_size}; increase {host_size_flag(hicache_size)}")
    if warn_small and num_pages * page_size <= device_pool_tokens:
        # Allowed (SGLang's current version only warns too): a small host pool still helps.
        logger.warning("host KV pool (%d tokens) is not larger than the device pool (%d tokens)",
                       num_pages * page_size, device_pool_tokens)
    return num_pages


def host_size_flag(hicache_size: float) -> str:
    return "--hicache-size" if hicache_size and hicache_size > 0 else "--hicache-ratio"


def host_pool_use(args: ResolvedArgs) -> str | None:
    """What the host pool is for: "hicache" (--enable-hierarchical-cache), "retraction" (a
    decode server whose resolved retraction backup is host_pool: allocated even without
    HiCache, SGLang attaches its HiCache host stack for it), or None (no host pool)."""
    if args.enable_hierarchical_cache:
        return "hicache"
    if (args.disaggregation_mode == "decode"
            and args.disaggregation_decode_retraction_backup == "host_pool"):
        return "retraction"
    return None


def _device_tokens(args: ResolvedArgs, bytes_per_token: int,
                   budget_bytes: int | None) -> tuple[int, list[Resolution]]:
    """Whole pages of the explicit --max-total-tokens, else of the memory budget."""
    P = args.page_size
    if args.max_total_tokens is not None:
        tokens = args.max_total_tokens // P * P  # >= P: checked by rules/page_geometry.py
        return tokens, change(args, "max_total_tokens", tokens, "kv_plan.whole_pages",
                              f"rounded down to whole pages of --page-size {P}")
    if budget_bytes is None:
        raise ValueError("sizing needs --max-total-tokens or a measured memory budget")
    tokens = budget_bytes // bytes_per_token // P * P
    if tokens < P:
        fits = budget_bytes // bytes_per_token
        raise ValueError(f"the KV memory budget ({budget_bytes / 2**20:.2f} MiB at "
                         f"{bytes_per_token} bytes per token) holds {fits} tokens, less than "
                         f"one page of --page-size {P}; raise --mem-fraction-static or set "
                         f"--max-total-tokens")
    return tokens, change(args, "max_total_tokens", tokens, "kv_plan.memory_budget",
                          f"--max-total-tokens unset: {budget_bytes / 2**30:.2f} GiB KV budget "
                          f"/ {bytes_per_token} bytes per token, whole pages of {P}")


def _context_len(args: ResolvedArgs, facts: ModelKVFacts) -> tuple[int, list[Resolution]]:
    model_ctx = int(facts.max_position_embeddings or DEFAULT_CONTEXT_LEN)
    out = change(args, "context_length", int(args.context_length or model_ctx),
                 "kv_plan.context_length",
                 f"--context-length unset: the model's max_position_embeddings ({model_ctx})")
    ctx = out[0].new if out else args.context_length
    window = facts.sliding_window
    if window is not None and ctx > window:
        # A window the model's attention does not apply (facts.sliding_window: the runner
        # leaves it None for models that hand their windows to the attention backend):
        # capping the context at it keeps such a model exact (no position can ever see a
        # key the window would have hidden).
        out = [Resolution("context_length", args.context_length, window,
                          "kv_plan.sliding_window",
                          f"model uses sliding-window attention ({window}); capping context "
                          f"length {ctx} -> {window}", warning=True)]
        ctx = window
    return ctx, out


def size_kv_plan(args: ResolvedArgs, facts: ModelKVFacts,
                 budget_bytes: int | None = None) -> tuple[KVPlan, list[Resolution]]:
    """The plan and the Resolutions that produced its numbers. `budget_bytes`: device memory
    the KV pool may take (only read when --max-total-tokens is unset)."""
    if facts.state_components:  # recurrent state: the budget split (kv_sizing_state.py)
        ctx, resolutions = _context_len(args, facts)
        plan, sized = state_plan(args, facts, budget_bytes, ctx, DEFAULT_MAX_RUNNING_REQUESTS,
                                 lambda per_token, budget: _device_tokens(args, per_token, budget),
                                 host=lambda tokens, gb: _host_fields(args, facts, tokens, gb))
        return plan, sized + resolutions
    if args.hybrid_swa_memory and facts.layer_windows and facts.pool_kind == "mha":
        ctx, resolutions = _context_len(args, facts)
        plan, sized = swa_plan(args, facts, budget_bytes, ctx, DEFAULT_MAX_RUNNING_REQUESTS,
                               host=lambda tokens: _host_fields(args, facts, tokens))
        return plan, sized + resolutions
    bytes_per_token = sum(c.bytes_per_token for c in facts.components)
    draft_bytes = sum(c.bytes_per_token for c in facts.draft_components)
    P = args.page_size
    # The draft pool has a slot for every target slot: a token costs both.
    tokens, resolutions = _device_tokens(args, bytes_per_token + draft_bytes, budget_bytes)
    num_pages = tokens // P
    ctx, ctx_res = _context_len(args, facts)
    resolutions += ctx_res
    rows = args.max_running_requests or min(DEFAULT_MAX_RUNNING_REQUESTS, num_pages)
    resolutions += change(args, "max_running_requests", rows, "kv_plan.rows",
                          f"--max-running-requests unset: min({DEFAULT_MAX_RUNNING_REQUESTS}, "
                          f"{num_pages} device pages)")
    plan = KVPlan(P, num_pages, rows, ctx, facts.pool_kind, facts.components,
                  **_host_fields(args, facts, tokens), draft_components=facts.draft_components)
    return plan, resolutions


def _host_fields(args: ResolvedArgs, facts: ModelKVFacts, tokens: int,
                 hicache_size: float | None = None) -> dict:
    """The host pool's KVPlan fields ({} without one), sized from `tokens` device tokens (the
    full pool's with hybrid SWA memory: a host page holds every layer's K/V of its tokens,
    cache/swa_hiradix.py). `hicache_size`: the GB left to K/V pages (a recurrent model's
    states take their share first: kv_sizing_state.py)."""
    use = host_pool_use(args)
    hicache_size = args.hicache_size if hicache_size is None else hicache_size
    if use is None:
        return {}
    # A retraction-only pool is sized like HiCache's: the ratio step 5 resolved (0.2 of
    # the device pool when it exists only for backups), or --hicache-size.
    bytes_per_token = sum(c.bytes_per_token for c in facts.components)
    return dict(num_host_pages=host_pool_num_pages(
        device_pool_tokens=tokens, page_size=args.page_size, bytes_per_token=bytes_per_token,
        hicache_ratio=args.hicache_ratio, hicache_size=hicache_size,
        warn_small=use == "hicache"),
        host_layout=args.hicache_mem_layout, io_backend=args.hicache_io_backend,
        host_size_flag=host_size_flag(hicache_size), host_pool_use=use)
