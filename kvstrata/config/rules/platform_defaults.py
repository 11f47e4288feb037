"""Step 0: values whose default depends on the platform."""
from __future__ import annotations

from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs, change
from kvstrata.platform import Platform

# A CPU prefill is slow per token, so smaller chunks keep decode latency of running requests
# bounded; accelerators amortise launch cost over bigger chunks (SGLang's GPU default 8192).
CHUNKED_PREFILL_CPU = 2048
CHUNKED_PREFILL_ACCELERATOR = 8192


def platform_defaults(args: ResolvedArgs, platform: Platform,
                      model_info: ModelInfo | None, env: dict) -> list[Resolution]:
    out: list[Resolution] = []
    if args.device is None:
        out += change(args, "device", platform.device_type, "platform.device",
                      f"--device unset: the {platform.kind} platform runs on "
                      f"'{platform.device_type}' devices")
    elif args.device not in ("cpu", platform.device_type):
        raise ValueError(f"--device {args.device} is not available on the {platform.kind} "
                         f"platform (use {platform.device_type} or cpu)")
    if args.chunked_prefill_size is None:
        device = args.device or platform.device_type
        base = CHUNKED_PREFILL_CPU if device == "cpu" else CHUNKED_PREFILL_ACCELERATOR
        # Chunks are cut to whole pages: align the default (rules/page_geometry.py refuses
        # an explicit size that is not a multiple of the page, as SGLang does).
        size = max(args.page_size, base // args.page_size * args.page_size)
        aligned = f", aligned to whole pages of --page-size {args.page_size}" \
            if size != base else ""
        out += change(args, "chunked_prefill_size", size, "platform.chunked_prefill_size",
                      f"--chunked-prefill-size unset: {base} on "
                      f"{'CPU' if device == 'cpu' else 'an accelerator'}{aligned}")
    return out
