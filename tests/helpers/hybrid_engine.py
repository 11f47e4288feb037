"""What the one-model hybrid engine tests (test_falcon_h1.py, test_nemotron_h_moe.py) share:
their module fixtures (the checkpoint, transformers' greedy reference, prompts, engines), an
engine per (page size, chunk) over the checkpoint, greedy generation that checks every pool
and state slot whole after the drain, and the greedy + second-chat-turn check against
transformers (tests/helpers/hybrid_ckpt.py HFGreedy)."""
from __future__ import annotations

from typing import Callable

import pytest

from helpers.hybrid_ckpt import VOCAB, HFGreedy


def one_model_fixtures(build: Callable[[str], str], prompt_seed: int, lens: tuple[int, ...],
                       **engine_kw) -> tuple:
    """Module-scoped fixtures `path` (build(dir)), `ref` (HFGreedy), `prompts` (random ids of
    `lens` tokens) and `engines` (Engines with engine_kw, closed at the end); a test module
    binds them to those names."""
    @pytest.fixture(scope="module")
    def path(tmp_path_factory) -> str:
        return build(str(tmp_path_factory.mktemp("model")))

    @pytest.fixture(scope="module")
    def ref(path) -> HFGreedy:
        return HFGreedy(path)

    @pytest.fixture(scope="module")
    def prompts() -> list[list[int]]:
        import torch

        g = torch.Generator().manual_seed(prompt_seed)
        return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lens]

    @pytest.fixture(scope="module")
    def engines(path):
        built = Engines(path, **engine_kw)
        yield built
        built.close()

    return path, ref, prompts, engines


class Engines:
    """kvstrata.LLM engines over one checkpoint, one per (page size, chunk), built once and
    flushed before each use; `close()` shuts them down."""

    def __init__(self, path: str, **kw):
        self.path, self.kw, self.built = path, kw, {}

    def get(self, page_size: int, chunk: int | None = None):
        from kvstrata import LLM

        key = (page_size, chunk)
        if key not in self.built:
            self.built[key] = LLM(self.path, skip_tokenizer_init=True, dtype="float32",
                                  page_size=page_size, chunked_prefill_size=chunk or -1,
                                  **self.kw)
        llm = self.built[key]
        assert llm.flush_cache()
        return llm

    def close(self) -> None:
        for llm in self.built.values():
            llm.shutdown()
        self.built.clear()


def whole(llm) -> None:
    """Drained: no request left, every pool and the state slots whole (free + cached)."""
    sched = llm.engine.scheduler
    assert not sched.live_requests() and not sched.waiting
    llm.check_integrity()
    states = sched.kv.states
    assert states.allocator.available_pages() + states.tree.cached_states() == states.num_slots


def generate(llm, prompts: list[list[int]], new: int) -> tuple[list[list[int]], list[int]]:
    """(greedy output ids, cached prompt tokens) per prompt; the engine whole afterwards."""
    outs = llm.generate(input_ids=prompts, sampling_params={
        "max_new_tokens": new, "temperature": 0, "ignore_eos": True})
    whole(llm)
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def check_greedy_and_second_turn(llm, prompts: list[list[int]], ref, page_size: int,
                                 new: int, label: str) -> None:
    """Greedy tokens equal transformers' (`ref(prompt, new)`); then each chat's second turn
    (prompt + answer + a new message) hits the snapshot its first turn left: every computed
    token at page size 1, the last whole page at 16."""
    first, hits = generate(llm, prompts, new)
    assert hits == [0] * len(prompts)
    for p, got in zip(prompts, first):
        assert got == ref(p, new), f"{label}: prompt of {len(p)}"
    turn2 = [p + a + [5, 6, 7] for p, a in zip(prompts, first)]
    second, hits = generate(llm, turn2, new)
    for p, got in zip(turn2, second):
        assert got == ref(p, new), f"{label}: turn 2 of {len(p)}"
    done = [len(p) + new - 1 for p in prompts]  # the first turn's computed tokens
    assert hits == [d // page_size * page_size for d in done], label
