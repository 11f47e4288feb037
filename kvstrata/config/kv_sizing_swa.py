"""Sizing with hybrid SWA memory (SGLang's HybridSWAPoolConfigurator): one memory budget split
between the full-attention layers' pool and the sliding-window layers' pool.

Per token, a full pool slot costs the K+V of every full layer (plus a draft's K/V), an SWA pool
slot the K+V of every windowed layer. With r = --swa-full-tokens-ratio:
    cell        = full_per_token * #full + draft_per_token + r * swa_per_token * #swa
    full_tokens = budget // cell                      (whole pages)
    swa_tokens  = full_tokens * r                      (whole pages)
so both pools together fill the budget, and every full-pool token has r of an SWA slot behind
it (the KV manager frees SWA pages once they fall out of every window, so r < 1 still serves
contexts as long as the full pool's). `--max-total-tokens` names full_tokens, as in SGLang.
An all-SWA model (Mistral: no full layer) gives the whole budget to the SWA pool (r is not
used; --max-total-tokens then names the SWA tokens); its full page ids stay the canonical
address of every token (req_to_token, the radix tree) but have no tensors behind them, so
their count is bounded by rows x context, not by memory. With a draft model (STANDALONE /
EAGLE) they do get tensors: the draft's own K/V (and an EAGLE head's features) per full slot,
kept for the request's whole context (a draft may attend to all of it), so the full page ids
are sized like a hybrid model's full pool with no target layer in it (cell = draft + r x SWA,
--max-total-tokens names the draft's slots) and run short, and get evicted, like one.
Refused when the SWA pool cannot hold even one request: swa_tokens <= window + page_size.
"""
from __future__ import annotations

from typing import Any

from kvstrata.config.kv_plan import MHA_K, KVPlan, mha_components
from kvstrata.config.resolve_types import Resolution, ResolvedArgs, change

# (facts: kv_sizing.ModelKVFacts, which imports this module: typed Any to keep imports one-way)


def split_layers(windows) -> tuple[int, int, int]:
    """(#full layers, #windowed layers, widest window) of per-layer windows."""
    n_swa = sum(w is not None for w in windows)
    return len(windows) - n_swa, n_swa, max((w for w in windows if w is not None), default=0)


def swa_pool_tokens(*, full_tokens: int, ratio: float, page_size: int) -> int:
    return int(full_tokens * ratio) // page_size * page_size


def check_swa_pool(swa_tokens: int, window: int, page_size: int, how: str) -> None:
    """SGLang refuses the same way: a request's window plus the page being written must fit."""
    if swa_tokens <= window + page_size:
        raise ValueError(
            f"the SWA pool ({swa_tokens} tokens: {how}) cannot hold even one request, which "
            f"needs more than the sliding window ({window}) + one page ({page_size}) tokens; "
            f"raise the KV memory (--mem-fraction-static / --max-total-tokens) or "
            f"--swa-full-tokens-ratio, or pass --disable-hybrid-swa-memory")


def size_swa_tokens(args: ResolvedArgs, facts: Any, budget_bytes: int | None
                    ) -> tuple[int, int, list[Resolution]]:
    """(full pool tokens, SWA pool tokens, resolutions); full tokens 0 for an all-SWA model
    without a draft."""
    P = args.page_size
    n_full, n_swa, window = split_layers(facts.layer_windows)
    k = next(c for c in facts.components if c.name == MHA_K)
    per_layer = 2 * k.bytes_per_token_per_layer  # K + V of one layer, either pool
    draft = sum(c.bytes_per_token for c in facts.draft_components)
    ratio = args.swa_full_tokens_ratio
    if args.max_total_tokens is None and budget_bytes is None:
        raise ValueError("sizing needs --max-total-tokens or a measured memory budget")
    mib = (budget_bytes or 0) / 2**20
    if not n_full and not draft:  # all-SWA: every byte to the SWA pool
        if args.max_total_tokens is not None:
            swa = args.max_total_tokens // P * P
            how = f"--max-total-tokens {args.max_total_tokens} (an all-SWA model's SWA tokens)"
        else:
            swa = budget_bytes // (per_layer * n_swa) // P * P
            how = (f"{mib:.2f} MiB KV budget / {per_layer * n_swa} bytes per token of "
                   f"{n_swa} windowed layers")
        check_swa_pool(swa, window, P, how)
        return 0, swa, change(args, "max_total_tokens", swa, "kv_plan.swa_memory",
                              f"all-SWA model: the SWA pool's tokens, {how}, whole pages "
                              f"of {P}")
    # (an all-SWA model with a draft: the full slots hold the draft's K/V only)
    pool = "full pool" if n_full else "draft's slots (an all-SWA target)"
    if args.max_total_tokens is not None:
        full = args.max_total_tokens // P * P
        how = f"--max-total-tokens {args.max_total_tokens} (the tokens of the {pool})"
    else:
        cell = per_layer * n_full + draft + ratio * per_layer * n_swa
        full = int(budget_bytes // cell) // P * P
        how = (f"{mib:.2f} MiB KV budget / {cell:g} bytes per full token ({per_layer} B x "
               f"{n_full} full layers{f' + {draft} B draft' if draft else ''} + {ratio} x "
               f"{per_layer} B x {n_swa} windowed layers)")
    if full < P:
        raise ValueError(f"the {pool} would hold {full} tokens ({how}), less than one page "
                         f"of --page-size {P}")
    swa = swa_pool_tokens(full_tokens=full, ratio=ratio, page_size=P)
    check_swa_pool(swa, window, P, f"{full} full tokens x --swa-full-tokens-ratio {ratio}")
    return full, swa, change(args, "max_total_tokens", full, "kv_plan.swa_memory",
                             f"hybrid SWA memory: {pool} {how}, whole pages of {P}; SWA "
                             f"pool {ratio} x that = {swa} tokens")


def swa_plan(args: ResolvedArgs, facts: Any, budget_bytes: int | None,
             context_len: int, default_rows: int, host=lambda tokens: {}
             ) -> tuple[KVPlan, list[Resolution]]:
    """The plan of a model whose windowed layers get their own pool. `host(full tokens)`:
    the HiCache host pool's plan fields ({} without one; the resolution rule keeps hybrid
    SWA memory off for an all-SWA model under HiCache, and where rules/swa.py says)."""
    P = args.page_size
    full, swa, out = size_swa_tokens(args, facts, budget_bytes)
    n_full, n_swa, window = split_layers(facts.layer_windows)
    k = next(c for c in facts.components if c.name == MHA_K)
    heads, head_dim = k.token_shape
    swa_pages = swa // P
    if full:  # full-attention layers, or an all-SWA model's draft slots
        num_pages = full // P
        rows = args.max_running_requests or min(default_rows, num_pages)
        why = f"--max-running-requests unset: min({default_rows}, {num_pages} full pool pages)"
    else:
        rows = args.max_running_requests or min(default_rows, swa_pages)
        # canonical full page ids without tensors: every row's whole context can be named
        num_pages = rows * -(-context_len // P)
        why = f"--max-running-requests unset: min({default_rows}, {swa_pages} SWA pool pages)"
    out += change(args, "max_running_requests", rows, "kv_plan.rows", why)
    plan = KVPlan(P, num_pages, rows, context_len, "swa",
                  mha_components(n_full, heads, head_dim, k.dtype) if n_full else (),
                  draft_components=facts.draft_components, num_swa_pages=swa_pages,
                  swa_window=window,
                  swa_components=mha_components(n_swa, heads, head_dim, k.dtype),
                  **(host(full) if n_full else {}))
    return plan, out
