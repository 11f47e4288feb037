"""Step 0c: prefill/decode disaggregation (SGLang's PD disaggregation hook).

Runs before the HiCache steps because it decides the decode server's prefix cache:
- a decode server keeps the KV it receives in a chunk cache: `disable_radix_cache` is forced
  to True with SGLang's warning, unless `--disaggregation-decode-enable-radix-cache` asks for
  the (experimental) decode radix cache — then the radix cache stays on;
- a prefill server cannot use the `fake` transfer backend (it moves no KV; a request is sent
  through `fake` only when the router addresses it to the warm-up host);
- HiCache extends the radix tree, so `--enable-hierarchical-cache` on a decode server (or
  SGLang's spelling, `--disaggregation-decode-enable-hicache`) needs the decode radix cache:
  a host tier behind the decode tree; without it the combination is an error (a decode host
  pool for retraction is `--disaggregation-decode-retraction-backup`).
The decode-only options are refused on other servers (they would be silent no-ops).
"""
from __future__ import annotations

from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, apply, change
from kvstrata.platform import Platform

# SGLang's own log lines (pd_disaggregation_hook), so operators grep the same text.
DECODE_CHUNK_CACHE_WARNING = "KV cache is forced as chunk cache for decode server"
DECODE_RADIX_CACHE_WARNING = "EXPERIMENTAL: Radix cache is enabled for decode server"

# SGLang: extra req_to_token rows for requests being pre-allocated / transferred on a decode
# server default to 2 x max_running_requests when that is small, else 0.
EXTRA_SLOTS_SMALL_BATCH = 32

_DECODE_ONLY = ("disaggregation_decode_enable_radix_cache", "disaggregation_decode_extra_slots",
                "disaggregation_decode_enable_hicache",
                "disaggregation_decode_enable_offload_kvcache")
OFFLOAD_REASON = ("--disaggregation-decode-enable-offload-kvcache writes finished requests' KV "
                  "to L3 through the decode tree's host tier (kvstrata's design)")


def decode_extra_slots(explicit: int | None, max_running_requests: int | None) -> int | None:
    """--disaggregation-decode-extra-slots once max_running_requests is known: an explicit
    value as is; unset -> 2 x max_running_requests if that is <= 32, else 0. None while
    max_running_requests is still unknown (the KV sizing step fills it in)."""
    if explicit is not None:
        return explicit
    if max_running_requests is None:
        return None
    return 2 * max_running_requests if max_running_requests <= EXTRA_SLOTS_SMALL_BATCH else 0


def pd_disaggregation(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                      env: dict) -> list[Resolution]:
    mode = args.disaggregation_mode
    if mode != "decode":
        for name in _DECODE_ONLY:
            value = getattr(args, name)
            if value not in (None, False):
                flag = "--" + name.replace("_", "-")
                raise ValueError(f"{flag} requires --disaggregation-mode decode, got {mode}")
    if mode == "null":
        return []
    if mode == "prefill":
        if args.disaggregation_transfer_backend == "fake":
            raise ValueError("--disaggregation-transfer-backend fake cannot be used with "
                             "--disaggregation-mode prefill: it moves no KV (a warm-up request "
                             "uses it by itself); use tcp or mooncake")
        return []
    # decode
    out: list[Resolution] = []
    if args.disaggregation_decode_enable_offload_kvcache:
        # (its --hicache-storage-backend is required by step 1, rules/hicache.py)
        for name in ("disaggregation_decode_enable_radix_cache", "enable_hierarchical_cache"):
            if not getattr(args, name):
                out += change(args, name, True, "disagg.decode_offload", OFFLOAD_REASON)
        args = apply(args, out)
    if args.disaggregation_decode_enable_hicache and not args.enable_hierarchical_cache:
        out += change(args, "enable_hierarchical_cache", True, "disagg.decode_hicache",
                      "--disaggregation-decode-enable-hicache is SGLang's spelling of "
                      "--enable-hierarchical-cache on a decode server")
        args = apply(args, out)
    if args.disaggregation_decode_enable_radix_cache:
        if args.disaggregation_transfer_backend == "fake":
            raise ValueError("--disaggregation-decode-enable-radix-cache is not supported with "
                             "--disaggregation-transfer-backend fake")
        if args.enable_hisparse:
            raise ValueError("--disaggregation-decode-enable-radix-cache is not supported with "
                             "--enable-hisparse")
        if args.disable_radix_cache:
            raise ValueError("--disaggregation-decode-enable-radix-cache and "
                             "--disable-radix-cache contradict each other")
        # The radix cache is already on: nothing changes, but say so as SGLang does.
        out.append(Resolution("disable_radix_cache", False, False, "disagg.decode_radix_cache",
                              DECODE_RADIX_CACHE_WARNING, warning=True))
    else:
        if args.enable_hierarchical_cache:
            raise ValueError("--enable-hierarchical-cache needs a radix cache, and a decode "
                             "server (--disaggregation-mode decode) keeps its KV in a chunk "
                             "cache: add --disaggregation-decode-enable-radix-cache, or drop "
                             "--enable-hierarchical-cache (a decode host pool for retracted "
                             "requests is --disaggregation-decode-retraction-backup host_pool)")
        out += change(args, "disable_radix_cache", True, "disagg.decode_chunk_cache",
                      DECODE_CHUNK_CACHE_WARNING, warning=True)
    if args.disaggregation_decode_extra_slots is None and args.max_running_requests is not None:
        slots = decode_extra_slots(None, args.max_running_requests)
        out += change(args, "disaggregation_decode_extra_slots", slots,
                      "disagg.decode_extra_slots",
                      f"--disaggregation-decode-extra-slots unset: {slots} (2 x "
                      f"--max-running-requests when that is <= {EXTRA_SLOTS_SMALL_BATCH}, "
                      f"else 0)")
    return out
