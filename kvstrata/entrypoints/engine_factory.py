"""Builds an EngineCore from ServerArgs. Start-up runs each decision once, in order:
resolve the flags (with the model's facts from config.json), load the model, size one KVPlan
(config/kv_sizing.py) and hand it to the runner (tensors), the scheduler and the KV manager.
Shared by `kvstrata.LLM` and the scheduler process."""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Any

import msgspec

from kvstrata import envs
from kvstrata.config.kv_plan import KVPlan
from kvstrata.config.kv_sizing import host_pool_use, size_kv_plan
from kvstrata.config.model_source import load_tokenizer
from kvstrata.config.resolve import (log_resolutions, platform_for, refuse_unimplemented,
                                     resolve)
from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, apply
from kvstrata.config.server_args import ServerArgs
from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.scheduler.core import SchedulerConfig
from kvstrata.engine.sides.registry import pd_side
from kvstrata.frontend.tokenizer_loader import DeferredTokenizer
from kvstrata.version import __version__

logger = logging.getLogger(__name__)


# Host-pool options that only mean something with --enable-hierarchical-cache.
_L2_OPTIONS = {"hicache_ratio": None, "hicache_size": 0, "hicache_write_policy": "write_through",
               "hicache_io_backend": "kernel", "hicache_mem_layout": "page_first",
               "hicache_storage_backend": None, "hicache_storage_prefetch_policy": "timeout",
               "hicache_storage_backend_extra_config": None}


# What also sizes and lays out a decode server's retraction host pool (SGLang builds it with
# the HiCache host stack): allowed there without --enable-hierarchical-cache.
_RETRACTION_POOL_OPTIONS = ("hicache_ratio", "hicache_size", "hicache_io_backend",
                            "hicache_mem_layout")


def refuse_l2_options_without_hicache(args: ServerArgs, retraction_host_pool: bool = False) -> None:
    """A HiCache option without HiCache would be a silent no-op: refuse it, naming the flag.
    `retraction_host_pool`: the resolved decode retraction backup is host_pool, whose pool
    the sizing and layout options do apply to."""
    if (args.enable_hierarchical_cache or args.disaggregation_decode_enable_hicache
            or args.disaggregation_decode_enable_offload_kvcache):  # (both turn HiCache on)
        return
    for name, default in _L2_OPTIONS.items():
        if retraction_host_pool and name in _RETRACTION_POOL_OPTIONS:
            continue
        if getattr(args, name) != default:
            raise ValueError(f"--{name.replace('_', '-')} needs --enable-hierarchical-cache")


def build_runner(server_args: ServerArgs, tp: Any = None
                 ) -> tuple[Any, ResolvedArgs, KVPlan, list[Resolution]]:
    """Resolve once (with the model's facts), load the model, size the one KVPlan and
    allocate the runner's KV from it. Returns (runner, resolved args, plan, resolutions):
    the args include what sizing filled in, the resolutions list every change in order.
    `tp` (a TPPlacement): this process is that tensor-parallel rank; every rank runs this
    same start-up in step (entrypoints/tp_ranks.py) and the runner's `tp_rank` holds the
    group and the links to the other ranks."""
    refuse_unimplemented(server_args)
    device, joined = server_args.device, None
    if tp is not None:  # join first: every rank then starts from rank 0's flags
        from kvstrata.entrypoints import tp_ranks  # noqa: PLC0415
        server_args, device, joined = tp_ranks.join(server_args, tp)
    try:
        return _build_runner(server_args, tp, device, joined)
    except BaseException:
        if joined is not None:  # leave the group: a later LLM(tp_size=N) can join again
            tp_ranks.leave(joined)
        raise


def _build_runner(server_args: ServerArgs, tp: Any, device: Any, joined: Any
                  ) -> tuple[Any, ResolvedArgs, KVPlan, list[Resolution]]:
    import torch  # noqa: PLC0415 - entrypoints may; only seeds unseeded sampling

    # Model facts the rules need (pool kind, recurrent state); None for GGUF/short names,
    # which resolution treats as a plain MHA model (all kvstrata supports today).
    info = ModelInfo.from_model_path(server_args.model_path)
    platform = platform_for(server_args)
    if server_args.dtype == "auto":
        # on a CPU the dtype table has no row for: its linears timed in both dtypes
        from kvstrata.runner.cpu.dtype_probe import measured_platform  # noqa: PLC0415 - torch

        platform = measured_platform(server_args, platform, info)
    args, resolutions = resolve(server_args, platform, model_info=info)
    refuse_l2_options_without_hicache(server_args, host_pool_use(args) == "retraction")
    if tp is None and args.random_seed is not None:
        torch.manual_seed(args.random_seed)
    from kvstrata.runner.model_runner import ModelRunner  # noqa: PLC0415 - heavy import

    # STANDALONE / EAGLE: the draft in the runner. A PD prefill server never decodes: it
    # runs an EAGLE-family draft's extend only (its KV and state cross to the decode
    # server, runner/spec/handoff.py); a STANDALONE draft is rebuilt on the decode server.
    drafts = (args.speculative_algorithm in ("EAGLE", "EAGLE3") or (
        args.speculative_algorithm == "STANDALONE" and args.disaggregation_mode != "prefill"))
    draft_quant = args.speculative_draft_model_quantization
    runner = ModelRunner(args.model_path, dtype=args.dtype, device=device,
                         quantization=args.quantization,
                         dsa_fused_topk=args.dsa_fused_topk is not False,
                         dsa_remap_pd_seed=bool(args.dsa_remap_pd_seed_to_local_slots),
                         draft_model_path=args.speculative_draft_model_path if drafts else None,
                         draft_quantization=None if draft_quant == "unquant" else draft_quant,
                         draft_algorithm=args.speculative_algorithm,
                         draft_tree=(args.speculative_eagle_topk or 1,
                                     args.speculative_num_steps or 1),
                         draft_token_map=args.speculative_token_map,
                         tp_group=None if joined is None else joined.group,
                         deterministic=bool(args.enable_deterministic_inference))
    runner.tp_rank = joined
    if runner.model.pool_kind == "mla" and args.speculative_algorithm == "NGRAM" and (
            (args.speculative_ngram_max_bfs_breadth or 1) > 1
            or args.speculative_ngram_match_type == "PROB"):
        raise NotImplementedError("not implemented yet: NGRAM tree drafts "
                                  "(--speculative-ngram-max-bfs-breadth > 1 or match type "
                                  "PROB) on an MLA / DSA model")
    runner.spec_accept_thresholds = (args.speculative_accept_threshold_single,
                                     args.speculative_accept_threshold_acc)
    if args.grammar_backend != "none" and not args.skip_tokenizer_init:  # runner/sampling/grammar.py
        from kvstrata.protocol.grammar import json_options  # noqa: PLC0415
        from kvstrata.runner.sampling.grammar import GrammarBackend  # noqa: PLC0415
        runner.grammar = GrammarBackend(
            args.model_path, args.tokenizer_path, runner.vocab_size, runner.eos_token_ids,
            json_options(args.constrained_json_disable_any_whitespace,
                         args.constrained_json_whitespace_pattern))
    budget = (None if args.max_total_tokens is not None
              else runner.kv_budget_bytes(args.mem_fraction_static))
    if joined is not None and budget is not None:
        from kvstrata.runner.parallel.tp_comm import agree_min  # noqa: PLC0415
        # Ranks on one CPU share its RAM; every rank takes the smallest rank's budget.
        budget = agree_min(budget // (tp.per_node if runner.device.type == "cpu" else 1))
    plan, sized = size_kv_plan(args, runner.kv_facts(), budget)
    args = apply(args, sized)
    resolutions = resolutions + sized
    if joined is not None:
        from kvstrata.entrypoints.tp_ranks import check_same_plan  # noqa: PLC0415
        check_same_plan(plan.to_json())
    if tp is None or tp.rank == 0:
        log_resolutions(resolutions)
    runner.allocate_kv(plan)
    if args.hicache_storage_backend is not None:
        runner.enable_storage(args.hicache_storage_backend, storage_model_name(args),
                              args.hicache_storage_extra_config(),
                              *((tp.rank, tp.size) if tp is not None else ()))
    return runner, args, plan, resolutions


def build_runner_or_ranks(server_args: ServerArgs
                          ) -> tuple[Any, ResolvedArgs, KVPlan, list[Resolution]]:
    """build_runner, or under --tp-size > 1 rank 0 of it: this node's other ranks start
    first (they meet rank 0 in the group), and the runner the engine core sees is a
    TPDriver that sends every step to them (runner/parallel/tp_runner.py)."""
    if server_args.tp_size == 1:
        return build_runner(server_args)
    from kvstrata.entrypoints import tp_ranks  # noqa: PLC0415
    from kvstrata.runner.parallel.tp_runner import TPDriver  # noqa: PLC0415

    if server_args.node_rank != 0:
        raise ValueError("--node-rank > 0 runs ranks only: start it with `kvstrata serve`")
    store = None
    if server_args.dist_init_addr:
        init_addr = server_args.dist_init_addr
    else:  # one node: rank 0's store listens before the other ranks are told its port
        from kvstrata.runner.parallel.tp_comm import listen_store  # noqa: PLC0415

        store, init_addr = listen_store(server_args.tp_size, float(server_args.watchdog_timeout))
    p = tp_ranks.placement(server_args, 0, init_addr, store)
    procs = tp_ranks.spawn_ranks(server_args, init_addr, p.local_ranks()[1:])
    # Until the heartbeat starts (below), rank 0 watches its rank processes itself: while
    # the group forms (a rank that dies first fails start-up at once) and after a failure.
    p = dataclasses.replace(p, watch=tp_ranks.watch_ranks(procs))
    try:
        runner, args, plan, resolutions = build_runner(server_args, p)
    except BaseException as e:
        raise tp_ranks.stop_ranks(procs, e)  # e, or one naming the ranks that died
    joined = runner.tp_rank
    driver = TPDriver(runner, joined.links, procs, joined.restore)
    driver.reply_timeout_s = p.timeout_s
    joined.links.beats.processes = dict(zip(p.local_ranks()[1:], procs))
    joined.links.beats.start(envs.KVSTRATA_TP_HEARTBEAT_TIMEOUT.get(), driver.on_rank_lost)
    return driver, args, plan, resolutions


def storage_model_name(args: Any) -> str:
    """The model part of the L3 storage namespace: the served model name, else the model
    path's last component (so the same weights at another path share stored pages)."""
    return args.served_model_name or os.path.basename(os.path.normpath(args.model_path))


def build_engine(server_args: ServerArgs, defer_tokenizer: bool = False
                 ) -> tuple[EngineCore, Any]:
    """Returns (engine core, HF tokenizer with chat template). `defer_tokenizer`: a
    DeferredTokenizer the caller starts loading when it likes (the scheduler process: after
    reporting ready)."""
    runner, args, plan, resolutions = build_runner_or_ranks(server_args)
    # --skip-tokenizer-init: token ids in and out only (no text, no stop strings).
    tokenizer = None
    if not args.skip_tokenizer_init:
        load = functools.partial(load_tokenizer, runner.source, args.tokenizer_path)
        tokenizer = DeferredTokenizer(load) if defer_tokenizer else load()
        if getattr(runner, "grammar", None) is not None:
            runner.grammar.hf_tokenizer = tokenizer  # one load, never two at once
    engine = EngineCore(runner, SchedulerConfig.from_args(args, plan), tokenizer)
    pd = pd_side(engine.scheduler)
    if pd is not None:
        # PD: the transfer manager over the device pool (the prefill side also starts its
        # bootstrap server on --host:--disaggregation-bootstrap-port), with one metadata slot
        # per slot the scheduler hands out.
        runner.enable_disagg(args.disaggregation_mode, args.disaggregation_transfer_backend,
                             args.host, args.disaggregation_bootstrap_port, pd.num_slots)
        # (under TP, TPDriver.enable_disagg sets every rank's up with its tp rank)
    engine.stream_interval = args.stream_interval
    engine.server_args = args
    engine.resolutions = resolutions
    return engine, tokenizer


def start_up_info(engine: Any) -> dict:
    """What start-up decided, JSON-ready, for `/server_info` and `LLM.server_info()`: the
    resolved args, every Resolution in order, and the KV plan (each only if the engine has
    it: fake engines in tests may not)."""
    info: dict = {}
    args = getattr(engine, "server_args", None)
    if dataclasses.is_dataclass(args):
        info["server_args"] = dataclasses.asdict(args)
    resolutions = getattr(engine, "resolutions", None)
    if resolutions is not None:
        info["resolutions"] = [r.to_json() for r in resolutions]
    plan = getattr(engine, "kv_plan", None)
    if plan is not None:
        info["kv_plan"] = plan.to_json()
    quant = getattr(getattr(engine, "runner", None), "quantization_info", None)
    if quant is not None:
        info["quantization_info"] = quant  # the resolved scheme, its kernel, weight bytes
    return info


def server_info_dict(args: Any, engine_info: dict) -> dict:
    """The `/server_info` body: version, the resolved args (as the one start-up resolution
    left them; the args as given if the engine did not report them), the KV plan, every
    resolution and what --quantization ran; the rest of engine_info stays nested under "engine_info"."""
    rest = dict(engine_info)
    resolved = rest.pop("server_args", None)
    if resolved is None:
        resolved = dataclasses.asdict(args) if dataclasses.is_dataclass(args) else vars(args)
    info = {"version": __version__, **resolved}
    for key in ("kv_plan", "resolutions", "quantization_info"):
        if key in rest:
            info[key] = rest.pop(key)
    # The start-up load snapshot is not state: live counters are in internal_states.
    for key in rest.pop("load", None) or {}:
        rest.pop(key, None)
    info["engine_info"] = rest
    # JSON-ready: unknown objects (from a fake engine, say) become their repr.
    return msgspec.json.decode(msgspec.json.encode(info, enc_hook=repr))
