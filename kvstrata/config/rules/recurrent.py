"""Step 4c: a model with recurrent state (SSM / linear-attention layers: Qwen3-Next, Qwen3.5,
Nemotron-H, Granite-4.0-H, Falcon-H1, Mamba2). What its state pool and snapshot prefix cache run
as, and what is refused beside them (by name, with the reason) until it is built: draft heads
(EAGLE / EAGLE3, NEXTN beyond Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's MTP layers) and
draft trees, the decode radix cache of PD, a decode server's HiCache, tensor parallelism
beside NEXTN on other than Qwen3-Next and Qwen3.5,
--quantization other than QUANTIZATIONS (deterministic inference: rules/deterministic.py; GGUF files of the archs not
built: config/gguf_config.py). Without --quantization the projections
run on kvstrata's packed linears (runner/models/hybrid_packed.py).
HiCache's host state slots are sized with the pools (config/kv_sizing_host_state.py); this step
says how `--hicache-mamba-size-gb auto` will be solved (`state.host_split`), so that
`config --explain` shows it, and refuses it without chunked prefill (its cadence).

The prefix cache keeps state snapshots in slots of the state pool (cache/state_radix.py);
SGLang's `--mamba-radix-cache-strategy`:
  no_buffer     snapshots where a request finished (it donates its working slot: the state
                after prompt + output[:-1]) and where a prefill chunk ended. Page size 1 only,
                as SGLang ("Page size must be 1 for MambaRadixCache v1"): with larger pages a
                request's end is rarely page-aligned and it would cache nothing.
  extra_buffer  also a track slot per request: its state is copied there every
                --mamba-track-interval tokens (a multiple of the page size; default: every
                page end, `track_interval` says why not SGLang's 256), and a finished
                request whose end is not page-aligned leaves its last tracked state instead.
  auto          no_buffer at page size 1, else extra_buffer (SGLang's auto without the overlap
                scheduler, which kvstrata does not have).
State slots per running request (SGLang's `_calculate_mamba_ratio`, which sizes the pool's
share left to snapshots): 1 with the radix cache disabled (the working slot only), 3 with
no_buffer (MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO), 4 with extra_buffer (+1 for the track
slot; SGLang's overlap schedule adds another, not built here). The pool's slots // this
bound --max-running-requests once the pool is sized (config/kv_sizing_state.py).
"""
from __future__ import annotations

from kvstrata.config.kv_sizing_host_state import (AUTO, FINISH_SLOTS_PER_RUNNING_REQUEST,
                                                  auto_chunk)
from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, change
from kvstrata.platform import Platform

RULE_STRATEGY = "state.strategy"
RULE_TRACK = "state.track_interval"
RULE_SLOTS = "state.slots_per_request"
RULE_HOST_SPLIT = "state.host_split"
SGLANG_TRACK_INTERVAL = 256
SLOTS_PER_REQUEST = {"no_buffer": 3, "extra_buffer": 4}
# Speculative decoding over recurrent layers: chains whose verify keeps each draft step's
# state and commits the accepted one (runner/recurrent/backend.py; SGLang's intermediate
# states). Drafts come from the n-gram cache, a second checkpoint without recurrent state,
# or (NEXTN) Qwen3-Next's, Qwen3.5's or Qwen3.5-MoE's MTP layer, a full-attention layer
# (runner/spec/mtp_hybrid.py; Qwen3.5-MoE's with an MoE MLP).
SPEC_ALGORITHMS = ("NGRAM", "STANDALONE")
NEXTN_ARCHITECTURES = ("Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM")
NO_BUFFER_PAGE_MESSAGE = "Page size must be 1 for MambaRadixCache v1"
# --quantization on the hybrids' projections (attention, in_proj / out_proj, MLPs, experts,
# the output head; the conv, scan and norms stay float): w8a8_int8 (runner/quant/hybrid_w8a8.py,
# the dense path's per-channel int8 weights and per-token int8 activations, without
# SmoothQuant) and gguf (a GGUF file's matrices kept in their blocks:
# runner/models/gguf_hybrid_weights.py). Deterministic inference with either:
# rules/deterministic.py refuses it.
QUANTIZATIONS = ("w8a8_int8", "gguf")
# Tensor parallelism (runner/parallel/tp_hybrid.py).
TP_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM", "NemotronHForCausalLM",
                    "Mamba2ForCausalLM", "GraniteMoeHybridForCausalLM", "FalconH1ForCausalLM")
# NEXTN under TP: each rank's MTP layer holds its heads' and MLP width's share, as the
# target's full-attention layers (runner/models/qwen3_next_mtp.py, tp_hybrid_split.py).
NEXTN_TP_ARCHITECTURES = ("Qwen3_5ForCausalLM", "Qwen3NextForCausalLM")


def effective_strategy(strategy: str, page_size: int) -> str:
    """The strategy that runs: auto is no_buffer at page size 1, else extra_buffer."""
    if strategy == "auto":
        return "no_buffer" if page_size == 1 else "extra_buffer"
    return strategy


def track_interval(value: int | None, page_size: int) -> int:
    """extra_buffer's track cadence: the flag, else the page size (every page end), or
    SGLang's 256 at page size 1 (where a finish is always page-aligned: track points decide
    no hit). SGLang tracks every 256 decode tokens and, inside an extend, at the last
    multiple of max(64, page size); kvstrata has one cadence for both (cache/state_slots.py:
    every track point a decode step ends on, and the last one inside a prompt's last
    chunk), so with fewer track points a short chat turn would leave no snapshot at all
    (vLLM's 0%-hit trap; measured: tests/unit/test_state_cache.py)."""
    if value is not None:
        return value
    return page_size if page_size > 1 else SGLANG_TRACK_INTERVAL


def check_strategy(strategy: str, page_size: int, interval: int | None) -> str:
    """The effective strategy, or ValueError for a combination it cannot run."""
    every = track_interval(interval, page_size)
    resolved = effective_strategy(strategy, page_size)
    if resolved == "no_buffer" and page_size != 1:
        raise ValueError(f"{NO_BUFFER_PAGE_MESSAGE} (--mamba-radix-cache-strategy no_buffer "
                         f"with --page-size {page_size}); use extra_buffer or auto")
    if resolved == "extra_buffer" and every % page_size:
        raise ValueError(f"--mamba-track-interval {every} must be a multiple of "
                         f"--page-size {page_size}: snapshots are taken at page ends")
    return resolved


def slots_per_request(radix_cache: bool, strategy: str) -> int:
    return SLOTS_PER_REQUEST[strategy] if radix_cache else 1


def unbuilt(args: ResolvedArgs, architecture: str = "") -> list[str]:
    """What a recurrent model (`architecture`: config.json's) cannot run with yet, each with
    its reason."""
    out = []
    algo = args.speculative_algorithm
    nextn = algo == "NEXTN" and architecture in NEXTN_ARCHITECTURES
    if algo is not None and algo not in SPEC_ALGORITHMS and not nextn:
        out.append(f"--speculative-algorithm {algo}: a draft head over a recurrent target "
                   f"(EAGLE / EAGLE3; NEXTN on {architecture or 'this model'}: only "
                   f"Qwen3-Next's, Qwen3.5's and Qwen3.5-MoE's MTP layers are built) is not "
                   f"built; NGRAM and STANDALONE are")
    if nextn and (args.speculative_eagle_topk or 1) > 1:
        out.append(f"--speculative-eagle-topk {args.speculative_eagle_topk}: a recurrent "
                   f"layer verifies chains only (one state per draft step)")
    if algo == "NGRAM" and ((args.speculative_ngram_max_bfs_breadth or 1) > 1
                            or args.speculative_ngram_match_type == "PROB"):
        out.append("NGRAM tree drafts (--speculative-ngram-max-bfs-breadth > 1 or match type "
                   "PROB): a recurrent layer verifies chains only (one state per draft step)")
    if algo == "STANDALONE" and (args.speculative_eagle_topk or 1) > 1:
        out.append(f"--speculative-eagle-topk {args.speculative_eagle_topk}: a recurrent "
                   f"layer verifies chains only (one state per draft step)")
    if args.disaggregation_decode_enable_radix_cache:
        out.append("--disaggregation-decode-enable-radix-cache: incompatible with Mamba/SSM "
                   "models (SGLang refuses it too)")
    out += unbuilt_under_tp(args, architecture)
    if args.quantization is not None and args.quantization not in QUANTIZATIONS:
        out.append(f"--quantization {args.quantization}: the recurrent hybrids run "
                   f"{' and '.join(QUANTIZATIONS)} (their projections quantized, the "
                   f"recurrent kernels float); other schemes are wired into the "
                   f"llama-family decoder only")
    if args.disaggregation_decode_enable_hicache or \
            args.disaggregation_decode_enable_offload_kvcache:
        out.append("a PD decode server's HiCache / KV offload: a decode server keeps no "
                   "prefix cache for these models (its decode radix cache is refused too)")
    if args.hicache_mamba_size_gb is not None and not args.enable_hierarchical_cache:
        out.append("--hicache-mamba-size-gb without --enable-hierarchical-cache")
    return out


def unbuilt_under_tp(args: ResolvedArgs, architecture: str = "") -> list[str]:
    """--tp-size > 1 runs the hybrids of runner/parallel/tp_hybrid.py (each rank its heads'
    share of every recurrent layer and its own state pool) through the plain serving path:
    prefill, chunked prefill, decode, the snapshot prefix cache, retraction, and NGRAM /
    STANDALONE chains (each rank's verify keeps its heads' per-step states), NEXTN on
    Qwen3-Next and Qwen3.5 (each rank's MTP layer runs its heads' and MLP width's share, its
    one-layer K/V pool holds its KV heads; the drafts, from all-gathered logits, are the same
    on every rank), HiCache's host
    tier and storage (each rank's host state slots and state records hold its heads'
    share), PD at the same --tp-size on both servers (decode rank r receives prefill rank r's share of the final state; other
    sizes are refused by transfer/disagg/rank_map.py as for any model whose KV heads are
    split). What is
    refused beside it has not been built or checked per rank yet."""
    if args.tp_size == 1:
        return []
    tp = f"--tp-size {args.tp_size}"
    out = []
    if architecture and architecture not in TP_ARCHITECTURES:
        out.append(f"{tp}: tensor parallelism over {architecture}'s recurrent layers is not "
                   f"built (it is for {', '.join(TP_ARCHITECTURES)})")
    if args.speculative_algorithm == "NEXTN" and architecture not in NEXTN_TP_ARCHITECTURES:
        # (draft heads and trees: unbuilt() above)
        out.append(f"{tp} with --speculative-algorithm NEXTN on {architecture or 'this model'}"
                   f": the MTP layer is split across ranks for "
                   f"{' and '.join(NEXTN_TP_ARCHITECTURES)} only (NGRAM and STANDALONE run)")
    if args.quantization is not None:  # (gguf at any TP size: model_setup.py refuses it too)
        out.append(f"{tp} with --quantization {args.quantization}: a rank's share of the "
                   f"hybrids' int8 / GGUF layers is not built or checked yet")
    return out


def recurrent_state(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                    env: dict) -> list[Resolution]:
    if model_info is None or not model_info.has_recurrent_state:
        return []
    refused = unbuilt(args, model_info.architecture)
    if refused:
        raise ValueError("not built yet for a model with recurrent (SSM / linear-attention) "
                         "state: " + "; ".join(refused))
    P, strategy = args.page_size, args.mamba_radix_cache_strategy
    # a PD decode server keeps no prefix cache (its decode radix cache is refused above)
    decode = args.disaggregation_mode == "decode"
    radix = not args.disable_radix_cache and not decode
    resolved = check_strategy(strategy, P, args.mamba_track_interval) if radix else strategy
    out: list[Resolution] = []
    if radix and resolved == "extra_buffer" and args.mamba_track_interval is None:
        every = track_interval(None, P)
        out += change(args, "mamba_track_interval", every, RULE_TRACK,
                      f"extra_buffer at --page-size {P}: " + (
                          "every page end (one cadence here for decode steps and the last "
                          "point inside a prompt; SGLang's 256 would leave no snapshot for a "
                          "chat turn shorter than that)" if P > 1
                          else "SGLang's (at page size 1 a finish is always page-aligned)"))
    if radix and strategy == "auto":
        every = track_interval(args.mamba_track_interval, P)
        what = ("snapshots where requests finish and prefill chunks end" if resolved ==
                "no_buffer" else f"a track slot per request, its state copied every "
                                 f"--mamba-track-interval {every} tokens")
        out += change(args, "mamba_radix_cache_strategy", resolved, RULE_STRATEGY,
                      f"auto at --page-size {P}: {resolved} ({what})")
    per_request = slots_per_request(radix, resolved)
    why = ("a PD decode server keeps no prefix cache: each request holds the slot its "
           "prompt's final state is received into" if decode else
           f"the radix cache is disabled: each running request holds its working slot only"
           if not radix else
           f"{resolved}: each running request holds a working slot"
           f"{' and a track slot' if resolved == 'extra_buffer' else ''}, the prefix cache "
           f"keeps snapshots in the rest (SGLang's ratio)")
    layers = f" ({model_info.recurrent_layers})" if model_info.recurrent_layers else ""
    out += change(args, "state_slots_per_request", per_request, RULE_SLOTS,
                  f"recurrent state{layers}: the state pool's slots "
                  f"// {per_request} bound --max-running-requests; {why}")
    return out + host_split_note(args)


def host_split_note(args: ResolvedArgs) -> list[Resolution]:
    """`--hicache-mamba-size-gb auto` stays until the pools are sized (the GB it becomes is
    kv_plan.host_state_slots'); recorded here so that config --explain says how."""
    value = args.hicache_mamba_size_gb
    if not args.enable_hierarchical_cache or value is None or str(value).strip().lower() != AUTO:
        return []
    chunk = auto_chunk(args)
    budget = (f"out of --hicache-size {args.hicache_size} (a fixed point: the K/V pages get "
              f"the rest)" if args.hicache_size and args.hicache_size > 0 else
              f"beside --hicache-ratio {args.hicache_ratio} x the device K/V tokens")
    return [Resolution("hicache_mamba_size_gb", value, AUTO, RULE_HOST_SPLIT,
                       f"auto, solved when the pools are sized: host state slots for one "
                       f"checkpoint per --chunked-prefill-size {chunk} tokens of the host K/V "
                       f"tier + {FINISH_SLOTS_PER_RUNNING_REQUEST} per running request "
                       f"(SGLang's checkpoint demand), {budget}; a model without "
                       f"full-attention layers (Mamba2) has no K/V tier to anchor them and "
                       f"takes the default (all of --hicache-size, else --hicache-ratio x "
                       f"the device state slots)")]
