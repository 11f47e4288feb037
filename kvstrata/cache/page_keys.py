"""Storage keys of KV pages (HiCache L3), no torch.

A page's key is a SHA-256 hex digest chained over the pages before it: the hasher is seeded
with the previous page's digest (as bytes), then each token id of the page is appended as a
4-byte little-endian unsigned integer. Only full pages have keys. Because every key depends
on the whole prefix, "the first n keys exist" means "the first n pages of this prefix are
stored", which is what `StorageBackend.batch_exists` answers.

Keys are deterministic across processes and machines (no Python `hash()`, no salt of the
interpreter). What makes two servers' keys incompatible (model, dtype, geometry, tp rank,
a tenant salt) is not hashed here: it is the storage namespace (kv/storage/base.py), which
the backend applies as a directory or key suffix. The host layout is never part of either.
"""
from __future__ import annotations

import hashlib
import struct


def page_key(page_token_ids, prior_key: str | None = None) -> str:
    """The key of one page whose tokens are `page_token_ids`, chained after `prior_key`."""
    h = hashlib.sha256()
    if prior_key is not None:
        h.update(bytes.fromhex(prior_key))
    ids = list(page_token_ids)
    if any(t < 0 or t > 0xFFFFFFFF for t in ids):
        raise ValueError("token ids of a storage page key must fit in 32 bits unsigned")
    h.update(struct.pack(f"<{len(ids)}I", *ids))
    return h.hexdigest()


def chain_page_keys(token_ids, page_size: int, prior_key: str | None = None) -> list[str]:
    """Keys of every full page of `token_ids` (a trailing partial page has none), chained
    after `prior_key` (the key of the page just before `token_ids[0]`, None at position 0)."""
    keys: list[str] = []
    prior = prior_key
    full = len(token_ids) - len(token_ids) % page_size
    for start in range(0, full, page_size):
        prior = page_key(token_ids[start:start + page_size], prior)
        keys.append(prior)
    return keys
