"""A sliding-window hybrid's prefixes through every cache tier, against transformers (float32,
eager): tiny Gemma 3 (five local layers with a window of 8, then a global one) and gpt-oss
(window 8 on layers 0 and 2, attention sinks, MoE), page size 4 (a window is two pages),
hybrid SWA memory with HiCache L2 and the file store as L3 (cache/swa_hiradix.py,
swa_storage.py).

Every prompt grows from one 50-token base (six windows and a bit), which the first engine
answers cold. Per tier, two new prompts:
- a long prefix: the base and 14 tokens more; its cached prefix is the base's 48 whole-page
  tokens, six windows;
- a straddling prefix: the base's first 22 tokens, then others; its cached prefix (20 tokens)
  ends inside the base's node (which is split there), and the window before it, [12, 20),
  straddles the window edge at 16.
The tiers, the long prompt first each time: a radix hit on the device; an L2 load-back after
every device page was demoted to the host (full pages, and SWA pages only for the window
before the match end); an L3 restore by a second engine with fresh pools over the file store
the first one wrote (full records, SWA records only for the window before the match end).
After a load-back the straddling prompt's end lies among the pages the long one's load-back
left as device tombstones: their host copy's SWA half comes back for its window
(`SWAHiRadixCache._revive`); after a restore that host copy has no SWA half (only the long
prompt's window was read), so the straddling prompt's fetch starts a window before its tree
end and heals them (cache/swa_storage.py). The second engine also answers the first one's radix-tier
prompts again: identically to the first engine's answers.
Tokens equal transformers' greedy ones (near-tie rule); every KV invariant is checked after
every step (KVSTRATA_CHECK_INTEGRITY) and the pools are whole after each drain.
"""
from __future__ import annotations

import json
import random

import pytest

from helpers.compare import assert_tokens_match
from helpers.gemma_ckpt import build_gemma_checkpoint, hf_gemma, hf_greedy
from helpers.gpt_oss import VOCAB, WINDOW, build_checkpoint, load_reference

P = 4
NEW_TOKENS = 8
BASE, LONG_EXTRA, STRADDLE_AT, STRADDLE_EXTRA = 50, 14, 22, 10
LONG_HIT, STRADDLE_HIT = BASE // P * P, (STRADDLE_AT - 1) // P * P  # 48, 20
TIERS = ("radix", "host", "storage")
ARCHS = {"gemma3": (lambda path: build_gemma_checkpoint("gemma3", path), hf_gemma),
         "gpt_oss": (lambda path: build_checkpoint(path, seed=3), load_reference)}
assert LONG_HIT >= 6 * WINDOW and STRADDLE_HIT % WINDOW and STRADDLE_HIT > WINDOW


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


@pytest.fixture(scope="module")
def prompts() -> dict:
    """The base and, per tier, its long and straddling prompts (each tier's own)."""
    rng = random.Random(61)
    base = _tokens(rng, BASE)
    out = {"base": base}
    for tier in TIERS:
        long_, straddle = (base + _tokens(rng, LONG_EXTRA),
                           base[:STRADDLE_AT] + _tokens(rng, STRADDLE_EXTRA))
        assert straddle[STRADDLE_AT] != base[STRADDLE_AT]  # diverges inside page 5
        out[tier] = [long_, straddle]
    return out


def engine_kw(path: str, store) -> dict:
    extra = json.dumps({"file_path": str(store), "prefetch_threshold": P})
    return dict(model_path=path, skip_tokenizer_init=True, dtype="float32", page_size=P,
                max_total_tokens=512, enable_hierarchical_cache=True, hicache_size=0,
                hicache_ratio=2.0, hicache_storage_backend="file",
                hicache_storage_prefetch_policy="wait_complete",
                hicache_storage_backend_extra_config=extra)


def answer(llm, batch: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Greedy answers one after another (each sees the cache the previous one left), and
    each prompt's cached tokens."""
    outs = [llm.generate(input_ids=p, sampling_params={
        "max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "temperature": 0})
        for p in batch]
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def check(outputs: list[list[int]], refs: list, label: str) -> None:
    for i, (ours, (ref_tokens, ref_logits)) in enumerate(zip(outputs, refs)):
        assert_tokens_match(ours, ref_tokens, ref_logits, label=f"{label} prompt {i}")


def demote_every_device_page(llm) -> None:
    """What device pressure does to idle prefixes, all at once: write-through copies and
    their storage backups finish, then every cached device page goes to the host tier."""
    assert llm.engine.finish_storage_backups(timeout=30)
    tree = llm.engine.scheduler.kv.tree
    tree.evict(tree.evictable_pages())
    assert tree.cached_pages() == 0


@pytest.mark.parametrize("arch", list(ARCHS))
def test_long_and_straddling_prefixes_through_radix_host_and_storage(arch, prompts,
                                                                      tmp_path_factory):
    from kvstrata import LLM

    build, reference = ARCHS[arch]
    root = tmp_path_factory.mktemp(f"swa_tiers_{arch}")
    path = build(str(root / "ckpt"))
    store = root / "store"
    order = [prompts["base"]] + [p for tier in TIERS for p in prompts[tier]]
    refs = dict(zip(map(id, order), hf_greedy(reference(path), order, NEW_TOKENS)))

    def refs_of(batch):
        return [refs[id(p)] for p in batch]

    with LLM(**engine_kw(path, store)) as first:
        assert first.server_info()["kv_plan"]["pool_kind"] == "swa"
        out, cached = answer(first, [prompts["base"]])
        check(out, refs_of([prompts["base"]]), f"{arch} cold base")
        assert cached == [0]

        radix, cached = answer(first, prompts["radix"])
        check(radix, refs_of(prompts["radix"]), f"{arch} radix hit")
        assert cached == [LONG_HIT, STRADDLE_HIT]
        assert first.get_load()["hicache_host_hit_tokens"] == 0
        first.check_integrity()

        demote_every_device_page(first)
        out, cached = answer(first, prompts["host"])
        check(out, refs_of(prompts["host"]), f"{arch} L2 load-back")
        assert cached == [LONG_HIT, STRADDLE_HIT]
        load = first.get_load()
        assert load["hicache_host_hit_tokens"] == LONG_HIT, load  # the straddling one: ...
        assert load["hicache_swa_revived_pages"] == WINDOW // P, load  # ... its window revived
        assert load["hicache_h2d_pages"] > 0, load
        first.check_integrity()
    # (leaving the block finished every storage backup)

    with LLM(**engine_kw(path, store)) as second:
        out, cached = answer(second, prompts["storage"])
        check(out, refs_of(prompts["storage"]), f"{arch} L3 restore")
        assert cached == [LONG_HIT, STRADDLE_HIT]
        load = second.get_load()
        # The long restore read the SWA records of its last window only, so the straddling
        # prompt's window lies among tombstones without an SWA half anywhere here: its
        # fetch starts a window early (nothing of its own is stored) and heals them.
        assert load["hicache_storage_hit_tokens"] == LONG_HIT + WINDOW, load
        assert load["hicache_storage_swa_healed_pages"] == WINDOW // P, load
        assert load["hicache_swa_revived_pages"] == WINDOW // P, load
        # full records for every restored page, SWA records for the windows only
        assert 0 < load["hicache_storage_swa_pages_read"] < load["hicache_storage_pages_read"]

        again, cached = answer(second, prompts["radix"])
        assert again == radix  # a restart on a warm store answers as the first engine did
        assert cached == [len(p) - 1 - (len(p) - 1) % P for p in prompts["radix"]]
        second.check_integrity()
