"""The radix tree's node and match result (no torch). A node's key is whole pages of token
ids; what it holds grows with the features on the tree -- device pages (radix_cache.py), a
host copy and its write (hiradix_cache.py), HiCache L3 pins and page keys (storage_tier.py),
SWA locks and tombstones (swa_radix.py, swa_hiradix.py), a recurrent state snapshot
(state_radix.py) -- in one slotted class shared by every tree.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

_node_ids = itertools.count()


class TreeNode:
    __slots__ = (
        "id", "key", "device_pages", "children", "parent", "lock_ref",
        "last_access_time", "hit_count", "host_pages", "pending_job", "pending_host",
        "host_ref", "hash_keys", "swa_lock_ref", "swa_tombstone", "host_swa", "state_slot",
        "state_pin", "host_state",
    )

    def __init__(self, key: tuple[int, ...] = (), device_pages: list[int] | None = None,
                 parent: TreeNode | None = None, last_access_time: int = 0):
        self.id = next(_node_ids)  # creation order: the final eviction tie-breaker
        self.key = key
        self.device_pages: list[int] = device_pages if device_pages is not None else []
        # Keyed by the child's first page of tokens: siblings never share a first page,
        # because a shared first page would have been merged into a common parent.
        self.children: dict[tuple[int, ...], TreeNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.last_access_time = last_access_time
        self.hit_count = 0
        # Host residency (HiCache, see hiradix_cache.py): the backed-up copy, and a copy being
        # written (job id + destination pages) that becomes host_pages when the job finishes.
        self.host_pages: list[int] | None = None
        self.pending_job: int | None = None
        self.pending_host: list[int] | None = None
        # HiCache L3 (cache/storage_tier.py): backups reading the host copy (it must not be
        # freed meanwhile), and the storage key of each page (computed when first needed).
        self.host_ref = 0
        self.hash_keys: list[str] | None = None
        # Hybrid SWA memory (cache/swa_radix.py): locks on this node's sliding-window pages,
        # and whether those pages were freed while the full pages stay (a tombstone).
        self.swa_lock_ref = 0
        self.swa_tombstone = False
        # HiCache with hybrid SWA memory (cache/swa_hiradix.py): the host copy (or the one
        # being written) holds the window layers' K/V too, not only the full layers'.
        self.host_swa = False
        # Recurrent state (cache/state_radix.py): the state pool slot holding the state after
        # this node's last token (0: none, a "state tombstone"), and the copies of it still
        # to be made into requests' working slots (it must not be freed before).
        self.state_slot = 0
        self.state_pin = 0
        # ... and with HiCache (cache/state_hiradix.py): the host state slot holding a copy
        # of that state (0: none); only a node with a host copy of its pages has one.
        self.host_state = 0

    @property
    def num_pages(self) -> int:
        """Device pages held (0 for a host-only node)."""
        return len(self.device_pages)

    def __repr__(self) -> str:
        return (
            f"TreeNode(id={self.id}, tokens={len(self.key)}, pages={self.device_pages}, "
            f"lock_ref={self.lock_ref}, t={self.last_access_time}, hits={self.hit_count}, "
            f"children={len(self.children)})"
        )


@dataclass
class MatchResult:
    device_pages: list[int]  # pages covering the matched prefix: len(device_pages) * page_size tokens
    last_node: TreeNode  # deepest matched node (root when nothing matched); lock it to pin the prefix
