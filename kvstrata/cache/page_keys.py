"""Storage keys of KV pages (HiCache L3), no torch.

A page's key is a SHA-256 hex digest chained over the pages before it: the hasher is seeded
with the previous page's digest (as bytes), then each token id of the page is appended as a
4-byte little-endian unsigned integer. Only full pages have keys. Because every key depends
on the whole prefix, "the first n keys exist" means "the first n pages of this prefix are
stored", which is what `StorageBackend.batch_exists` answers.

Keys are deterministic across processes and machines (no Python `hash()`, no salt of the
interpreter). A request's cache salt is in its ids already (salted_ids: the radix tree and
these keys see the same salted ids). What makes two servers' keys incompatible (model,
dtype, geometry, tp rank, the server's `key_salt`) is not hashed here: it is the storage
namespace (kv/storage/base.py), which the backend applies as a directory or key suffix.
The host layout is never part of either.

With hybrid SWA memory a page is stored as two records, one per pool: the full-attention
layers' K/V and the sliding-window layers' K/V (cache/swa_storage.py). Their keys name the
component (`component_key`: "full-<key>", "swa-<key>"), and each component has its own
namespace (kv/storage/base.py `StorageNamespace.component`), so a uniform-pool server (whose
keys are the bare digests, every layer in one record) and an SWA-pool server never find each
other's records, whatever the store. A recurrent model's state snapshot is stored as a
"state-<key>" record under the key of the page it ends (cache/state_storage.py), in a
"state" namespace of its own.
"""
from __future__ import annotations

import functools
import hashlib
import struct

# A salted id (salted_ids below) is a token id (< 2**32) plus the salt's offset: 128 bits of
# the salt's SHA-256 shifted past the token, so it fits in SALTED_ID_BYTES bytes.
_TOKEN_BITS = 32
SALTED_ID_BYTES = 20
_SALTED_PAGE = b"kvstrata:salted-page"


@functools.lru_cache(maxsize=4096)
def salt_offset(salt: str) -> int:
    """What a cache salt adds to every token id: nonzero, so a salted id is never a token."""
    digest = hashlib.sha256(salt.encode("utf-8", "surrogatepass")).digest()
    return (int.from_bytes(digest[:16], "little") | 1) << _TOKEN_BITS


def salted_ids(token_ids: list[int], salt: str | None) -> list[int]:
    """The prefix cache's key of a request with a cache salt (SGLang's extra_key / cache_salt,
    vLLM's cache_salt): its token ids moved into the salt's own id range, so a radix tree
    (and a storage key chain) shares pages only among requests with the same salt. Without
    a salt, the ids themselves (the same list)."""
    if not salt:
        return token_ids
    offset = salt_offset(salt)
    return [t + offset for t in token_ids]


def page_key(page_token_ids, prior_key: str | None = None) -> str:
    """The key of one page whose tokens are `page_token_ids`, chained after `prior_key`.
    Salted ids hash in their own domain (a tag, then 20 bytes each), so a salted page's key
    never equals an unsalted one's and unsalted keys stay what they were."""
    h = hashlib.sha256()
    if prior_key is not None:
        h.update(bytes.fromhex(prior_key))
    ids = list(page_token_ids)
    if any(t < 0 or t >= 1 << (8 * SALTED_ID_BYTES) for t in ids):
        raise ValueError("token ids of a storage page key must be non-negative and fit in "
                         "32 bits, or be salted ids")
    if any(t >> _TOKEN_BITS for t in ids):
        h.update(_SALTED_PAGE)
        h.update(b"".join(t.to_bytes(SALTED_ID_BYTES, "little") for t in ids))
    else:
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


# Record kinds beside a uniform pool's bare page keys: hybrid SWA memory's full-attention
# layers' K/V of a page and its sliding-window layers' K/V (cache/swa_storage.py), and a
# recurrent model's state snapshot after the page (cache/state_storage.py).
COMPONENTS = ("full", "swa", "state")


def component_key(key: str, component: str) -> str:
    """The storage key of one component's record of the page whose chained key is `key`."""
    if component not in COMPONENTS:
        raise ValueError(f"a page record component is one of {COMPONENTS}, got {component!r}")
    return f"{component}-{key}"
