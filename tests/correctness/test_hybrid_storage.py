"""HiCache L3 for a hybrid recurrent model end to end (cache/state_storage.py, the HiCache
executor's state store): a tiny Qwen3.5 (Gated DeltaNet) and a tiny Nemotron-H (Mamba2
layers) from tests/helpers/hybrid_ckpt.py at page sizes 1 and 16, with HiCache write_through
and the file store. A first engine answers two prompts (chunked prefill: snapshots at chunk
ends and where each request finished) and is shut down (its backups drained); a second one
with fresh pools over the same directory gets the follow-up turns: their pages and the last
stored snapshot of each come back from storage only. Greedy tokens must equal transformers'
(float32) in both engines; the storage counters show restored tokens and states; every pool
and slot store is whole after the drain (and every invariant after every step:
KVSTRATA_CHECK_INTEGRITY, tests/conftest.py). With Mooncake (if its client imports), the same
restart on the Qwen3.5 case, the first engine kept up (Mooncake keeps records in the
clients' memory)."""
from __future__ import annotations

import json
import os

import pytest
import torch

from helpers.hybrid_ckpt import VOCAB, HFGreedy
from kvstrata import LLM
from tests.correctness.test_hybrid_hicache import paths, whole  # noqa: F401 (fixture)
from tests.correctness.test_swa_memory_storage import mooncake  # noqa: F401 (fixture)

NEW = 6
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def refs(paths):
    return {arch: HFGreedy(path) for arch, path in paths.items()}


def engine(path: str, page_size: int, extra: dict, backend: str = "file", tp: int = 1) -> LLM:
    return LLM(path, tp_size=tp, skip_tokenizer_init=True, dtype="float32", page_size=page_size,
               max_total_tokens=512, max_mamba_cache_size=12, chunked_prefill_size=32,
               enable_hierarchical_cache=True, hicache_ratio=4.0,
               hicache_write_policy="write_through", hicache_storage_backend=backend,
               hicache_storage_prefetch_policy="wait_complete",
               hicache_storage_backend_extra_config=json.dumps(
                   {"prefetch_threshold": 8, **extra}))


def answer(llm: LLM, ref, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    outs, cached = [], []
    for prompt in prompts:
        out = llm.generate(input_ids=[prompt], sampling_params=GREEDY)[0]
        assert out["output_ids"] == ref(prompt, NEW), f"prompt of {len(prompt)} tokens"
        outs.append(out["output_ids"])
        cached.append(out["meta_info"]["cached_tokens"])
        whole(llm)
    return outs, cached


def restart(paths, refs, arch, page_size, extra, backend="file", tp=1):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, VOCAB, (45 + 13 * i,), generator=g).tolist() for i in range(2)]
    first = engine(paths[arch], page_size, extra, backend, tp)
    try:
        outs, _ = answer(first, refs[arch], prompts)
        assert first.engine.finish_storage_backups(timeout=30)
        written = first.engine.get_load()
        assert written["hicache_storage_state_backups"] >= 2, written
        assert written["hicache_storage_state_pages_written"] >= 2, written
        if backend == "file":
            first.shutdown()
        follow = [p + o + [5, 6, 7] for p, o in zip(prompts, outs)]
        second = engine(paths[arch], page_size, extra, backend, tp)
        try:
            _, cached = answer(second, refs[arch], follow)
            load = second.engine.get_load()
            whole(second)
        finally:
            second.shutdown()
    finally:
        first.shutdown()
    # each follow-up resumed past its first prompt, from storage alone
    assert all(c >= len(p) // page_size * page_size - page_size
               for c, p in zip(cached, prompts)), (cached, load)
    assert load["hicache_storage_state_hits"] == 2, load
    assert load["hicache_storage_hit_tokens"] == sum(cached), (cached, load)
    assert load["hicache_storage_state_pages_read"] == 2, load
    assert load["hicache_states_from_host"] == 2 and load["hicache_storage_errors"] == 0, load
    return load


# tp 2 (soak, ~30 s): each rank stores and reads back its heads' share of every state
# record under its own namespace; a prefix resumes where every rank read its state
# (runner/executors/tp_merge.py).
@pytest.mark.parametrize("arch, page_size, tp", [
    ("qwen3_5", 1, 1), ("qwen3_5", 16, 1), ("nemotron_h", 1, 1), ("nemotron_h", 16, 1),
    pytest.param("nemotron_h", 16, 2, marks=pytest.mark.soak)])
def test_restart_on_a_warm_file_store_answers_like_the_cold_engine(arch, page_size, tp, paths,
                                                                   refs, tmp_path):
    restart(paths, refs, arch, page_size, {"file_path": str(tmp_path)}, tp=tp)
    names = sorted(os.listdir(tmp_path))  # pages (bare keys) and states, namespaces apart
    assert len(names) == 2 * tp and sum("-state-" in n for n in names) == tp, names


def test_restart_on_mooncake(paths, refs, mooncake):  # noqa: F811 (fixture)
    restart(paths, refs, "qwen3_5", 1, dict(
        master_server_address=mooncake.address, protocol="tcp",
        metadata_server="P2PHANDSHAKE", local_hostname="127.0.0.1",
        global_segment_size=256 << 20, local_buffer_size=16 << 20), backend="mooncake")
