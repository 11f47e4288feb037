"""Storage page keys (cache/page_keys.py) against an independent hashlib computation, across
processes; the storage namespace separates model/dtype/geometry/tp/salt, never the layout."""
from __future__ import annotations

import hashlib
import json
import random

import pytest

from helpers.storage import spawn_child, stop_child, wait_ready
from kvstrata.cache.page_keys import (chain_page_keys, component_key, page_key, salt_offset,
                                      salted_ids)
from kvstrata.config.kv_plan import KVPlan
from kvstrata.kv.storage import StorageNamespace


def reference_keys(tokens: list[int], page_size: int) -> list[str]:
    """SHA-256 per full page, seeded with the previous digest's bytes, ids as 4-byte LE."""
    keys, prior = [], b""
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        data = prior + b"".join(t.to_bytes(4, "little") for t in tokens[start:start + page_size])
        prior = hashlib.sha256(data).digest()
        keys.append(prior.hex())
    return keys


def test_keys_match_independent_sha256_chain():
    rng = random.Random(7)
    tokens = [rng.randrange(0, 2**32) for _ in range(43)] + [0, 2**32 - 1]
    for page_size in (1, 4, 16):
        keys = chain_page_keys(tokens, page_size)
        assert keys == reference_keys(tokens, page_size)
        assert len(keys) == len(tokens) // page_size  # a partial last page has no key
    # continuing a chain from a prior key gives the tail of the whole chain
    whole = chain_page_keys(tokens, 4)
    assert chain_page_keys(tokens[12:], 4, prior_key=whole[2]) == whole[3:]
    assert page_key(tokens[:4]) == whole[0]
    assert page_key(tokens[4:8], whole[0]) == whole[1] != page_key(tokens[4:8])


def test_bad_token_ids():
    with pytest.raises(ValueError, match="32 bits"):
        page_key([1, 2**160])
    with pytest.raises(ValueError, match="32 bits"):
        page_key([-1])


def test_salted_ids_key_apart_and_leave_plain_keys_alone():
    """A request's cache salt (SGLang's extra_key / cache_salt) moves its ids into the salt's
    own range: its page keys differ per salt and from the unsalted chain, which keeps the
    plain 4-byte hashing (keys already in a store stay valid)."""
    tokens = list(range(100, 116))
    assert salted_ids(tokens, None) is tokens and salted_ids(tokens, "") is tokens
    a, b = salted_ids(tokens, "tenant-a"), salted_ids(tokens, "tenant-b")
    assert a != b and not set(a) & set(tokens) and not set(a) & set(b)
    assert [t - salt_offset("tenant-a") for t in a] == tokens
    assert salted_ids(tokens, "tenant-a") == a  # deterministic (no interpreter salt)
    plain = chain_page_keys(tokens, 4)
    assert plain == reference_keys(tokens, 4)
    keys_a, keys_b = chain_page_keys(a, 4), chain_page_keys(b, 4)
    assert len(keys_a) == 4 and not set(keys_a) & set(plain) and not set(keys_a) & set(keys_b)
    assert chain_page_keys(a[8:], 4, prior_key=keys_a[1]) == keys_a[2:]


def test_keys_stable_across_processes():
    tokens = list(range(1000, 1037))
    child = spawn_child("keys", tokens=tokens, page_size=4)
    try:
        line = wait_ready(child)
    finally:
        stop_child(child)
    assert json.loads(line.split(" ", 1)[1]) == chain_page_keys(tokens, 4)


def _plan(dtype="float32", layout="page_first", heads=3, page_size=16):
    return KVPlan.mha(num_layers=30, num_kv_heads=heads, head_dim=64, dtype=dtype,
                      page_size=page_size, num_pages=8, num_host_pages=16, host_layout=layout,
                      io_backend="direct" if layout == "page_first_direct" else "kernel")


def test_namespace_separates_what_must_not_mix_but_not_the_layout():
    base = StorageNamespace.from_plan(_plan(), "SmolLM2-135M")
    # the host layout changes nothing: any layout reads pages written from any other
    for layout in ("layer_first", "page_first_direct", "page_head"):
        assert StorageNamespace.from_plan(_plan(layout=layout), "SmolLM2-135M").name == base.name
    others = [StorageNamespace.from_plan(_plan(), "SmolLM2-360M"),
              StorageNamespace.from_plan(_plan(dtype="bfloat16"), "SmolLM2-135M"),
              StorageNamespace.from_plan(_plan(heads=4), "SmolLM2-135M"),
              StorageNamespace.from_plan(_plan(page_size=8), "SmolLM2-135M"),
              StorageNamespace.from_plan(_plan(), "SmolLM2-135M", tp_rank=1, tp_size=2),
              StorageNamespace.from_plan(_plan(), "SmolLM2-135M", tp_size=2),
              StorageNamespace.from_plan(_plan(), "SmolLM2-135M", salt="tenant-a"),
              StorageNamespace.from_plan(_plan(), "SmolLM2-135M", component="full"),
              StorageNamespace.from_plan(_plan(), "SmolLM2-135M", component="swa")]
    names = [ns.name for ns in others]
    assert base.name not in names and len(set(names)) == len(names)
    # MLA KV is the same on every rank: the rank is not part of an MLA namespace
    mla = [StorageNamespace("m", "bfloat16", "p1:latent", rank, 4, is_mla=True)
           for rank in range(4)]
    assert len({ns.name for ns in mla}) == 1
    # a path- and key-safe name that still says which model it is
    odd = StorageNamespace.from_plan(_plan(), "../org/Model name:v2")
    assert "org-Model-name-v2-float32-" in odd.name
    assert all(c.isalnum() or c in "._-" for c in odd.name)  # one path component, any OS


def test_swa_pool_records_name_their_component():
    """Hybrid SWA memory (cache/swa_storage.py): the full and the SWA record of a page have
    their own keys, neither equal to a uniform pool's (the bare chained digest), and their
    own namespaces, named after the component; a uniform pool's namespace stays as it was."""
    key = chain_page_keys(list(range(8)), 4)[1]
    full, swa = component_key(key, "full"), component_key(key, "swa")
    assert len({key, full, swa}) == 3 and full == "full-" + key and swa == "swa-" + key
    with pytest.raises(ValueError, match="component"):
        component_key(key, "mamba")
    uniform = StorageNamespace.from_plan(_plan(), "m")
    assert uniform == StorageNamespace.from_plan(_plan(), "m", component="")
    assert "-full-" in StorageNamespace.from_plan(_plan(), "m", component="full").name
    assert "-swa-" in StorageNamespace.from_plan(_plan(), "m", component="swa").name
