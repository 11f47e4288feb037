"""In-process engines that differ by one environment setting, for A/B benchmarks of a kernel
choice that is read when the engine is built (benchmarks/bench_prefill_attention.py,
benchmarks/bench_gemv.py): both live in one process and are run alternately, so a noisy box
hits them alike."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from unittest import mock


@contextlib.contextmanager
def engines_by_setting(env_name: str, variants: dict[str, str],
                       **llm_kwargs) -> Iterator[dict]:
    """{variant: LLM(**llm_kwargs) built with env_name=value}; shut down on exit."""
    from kvstrata import LLM

    engines = {}
    try:
        for variant, value in variants.items():
            with mock.patch.dict(os.environ, {env_name: value}):
                engines[variant] = LLM(**llm_kwargs)
        yield engines
    finally:
        for llm in engines.values():
            llm.shutdown()
