"""Builds an EngineCore from ServerArgs: resolve flags, load the model runner, size the
scheduler from the runner's pool. Shared by `kvstrata.LLM` and the scheduler process."""
from __future__ import annotations

import logging
from typing import Any

from kvstrata.config.model_source import load_tokenizer
from kvstrata.config.resolve import log_resolutions, refuse_unimplemented, resolve
from kvstrata.config.resolve_types import ModelInfo
from kvstrata.config.server_args import ServerArgs
from kvstrata.engine.engine_core import EngineCore
from kvstrata.engine.scheduler import SchedulerConfig

logger = logging.getLogger(__name__)


# Host-pool options that only mean something with --enable-hierarchical-cache.
_L2_OPTIONS = {"hicache_ratio": None, "hicache_size": 0, "hicache_write_policy": "write_through",
               "hicache_io_backend": "kernel", "hicache_mem_layout": "page_first"}


def refuse_l2_options_without_hicache(args: ServerArgs) -> None:
    """A HiCache option without HiCache would be a silent no-op: refuse it, naming the flag."""
    if args.enable_hierarchical_cache:
        return
    for name, default in _L2_OPTIONS.items():
        if getattr(args, name) != default:
            raise ValueError(f"--{name.replace('_', '-')} needs --enable-hierarchical-cache")


def build_engine(server_args: ServerArgs) -> tuple[EngineCore, Any]:
    """Returns (engine core, HF tokenizer with chat template)."""
    refuse_unimplemented(server_args)
    refuse_l2_options_without_hicache(server_args)
    # Model facts the rules need (pool kind, recurrent state); None for GGUF/short names,
    # which resolution treats as a plain MHA model (all kvstrata supports today).
    args, resolutions = resolve(server_args, model_info=ModelInfo.from_model_path(
        server_args.model_path))
    log_resolutions(resolutions)
    if args.random_seed is not None:
        import torch  # noqa: PLC0415 - entrypoints may; only seeds unseeded sampling

        torch.manual_seed(args.random_seed)
    from kvstrata.runner.model_runner import ModelRunner  # noqa: PLC0415 - heavy import

    hicache = None
    if args.enable_hierarchical_cache:
        hicache = dict(layout=args.hicache_mem_layout, io_backend=args.hicache_io_backend,
                       hicache_ratio=args.hicache_ratio, hicache_size=args.hicache_size)
    runner = ModelRunner(
        args.model_path, dtype=args.dtype, page_size=args.page_size,
        max_total_tokens=args.max_total_tokens, max_running_requests=args.max_running_requests,
        max_context_len=args.context_length, device=args.device, hicache=hicache,
        mem_fraction_static=args.mem_fraction_static,
    )
    # --skip-tokenizer-init: token ids in and out only (no text, no stop strings).
    tokenizer = (None if args.skip_tokenizer_init
                 else load_tokenizer(runner.source, args.tokenizer_path))
    config = SchedulerConfig(
        num_pages=runner.num_pages, page_size=runner.page_size,
        max_running_requests=runner.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=args.chunked_prefill_size,
        schedule_policy=args.schedule_policy,
        schedule_conservativeness=args.schedule_conservativeness,
        disable_radix_cache=args.disable_radix_cache,
        radix_eviction_policy=args.radix_eviction_policy,
        num_host_pages=runner.num_host_pages,
        hicache_write_policy=args.hicache_write_policy,
    )
    engine = EngineCore(runner, config, tokenizer)
    engine.stream_interval = args.stream_interval
    engine.server_args = args
    engine.resolutions = resolutions
    return engine, tokenizer
