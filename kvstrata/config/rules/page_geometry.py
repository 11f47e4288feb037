"""Step 0b: flags measured in tokens must fit the page (checked before the model loads).

A chunk of `--chunked-prefill-size` tokens is cut to whole pages by the prefill adder, so a
chunk smaller than a page can never make progress (it used to be accepted, then hung). SGLang
asserts `chunked_prefill_size % page_size == 0` when chunking is on; a value that is not a
multiple is refused the same way here, naming both flags. (The platform default is already
page-aligned by step 0, so only an explicit choice can fail.) A `--max-total-tokens` below
one page would give a KV pool without a single page.
"""
from __future__ import annotations

from kvstrata.config.resolve_types import ModelInfo, Resolution, ResolvedArgs
from kvstrata.platform import Platform


def page_geometry(args: ResolvedArgs, platform: Platform, model_info: ModelInfo | None,
                  env: dict) -> list[Resolution]:
    P = args.page_size
    if args.max_total_tokens is not None and args.max_total_tokens < P:
        raise ValueError(f"--max-total-tokens {args.max_total_tokens} is less than one page "
                         f"(--page-size {P}): the KV pool would hold no page")
    chunk = args.chunked_prefill_size
    # A decode server never prefills a prompt in chunks (SGLang skips the check there too).
    if chunk is not None and chunk > 0 and chunk % P and args.disaggregation_mode != "decode":
        raise ValueError(f"--chunked-prefill-size {chunk} must be a multiple of --page-size "
                         f"{P} (chunks are cut to whole pages), or -1 to disable chunking")
    return []
