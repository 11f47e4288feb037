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


def generate_times(engines: dict, batch: int, tokens: int, rounds: int,
                   seed: int = 2) -> dict[str, dict[int, float]]:
    """{variant: {1: s, tokens: s}}: the best of `rounds` times each engine (alternated)
    generates 1 and `tokens` greedy tokens for `batch` random 32-token prompts; a decode step
    is (t[tokens] - t[1]) / (tokens - 1), t[1] the prefill and first token. Each engine
    generates once untimed first: a suite run saw t[1] > t[3] from the first call's costs."""
    import time

    import torch

    g = torch.Generator().manual_seed(seed + batch)
    ids = torch.randint(100, 20000, (batch, 32), generator=g).tolist()
    runs = {v: {1: float("inf"), tokens: float("inf")} for v in engines}
    for llm in engines.values():  # untimed: first-call costs (oneDNN primitives, page faults)
        llm.generate(input_ids=ids, sampling_params={"max_new_tokens": 2, "temperature": 0.0,
                                                     "ignore_eos": True})
    for _ in range(rounds):
        for v, llm in engines.items():
            for n in runs[v]:
                p = {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True}
                start = time.perf_counter()
                llm.generate(input_ids=ids, sampling_params=p)
                runs[v][n] = min(runs[v][n], time.perf_counter() - start)
    return runs
