"""HiCache L3 with hybrid SWA memory (no torch): StorageTier over SWAHiRadixCache's host
copies, whose pages have two halves (cache/swa_hiradix.py: the full-attention layers' K/V
in the host pool, the sliding-window layers' under the same host page id in the host SWA
pool).

What is stored: what the host copy holds. Every backed-up page gets a full record, and a
page whose host copy holds its SWA half (`node.host_swa`: the node was live when written) an
SWA record too. Under write_through a prompt's pages enter the tree (and are written) before
the request drops their out-of-window SWA pages, so nearly every page gets both records: the
store costs about what a uniform pool's records cost. Chosen over storing only the last
window of each backed-up node because any page boundary can become a match end later (a
request whose prompt diverges mid-node), and only a stored window there makes that end
restorable; pages written as tombstones (write_back / selective writes after SWA eviction)
get a full record only.

Keys name the record's component (cache/page_keys.py `component_key`: "full-<key>",
"swa-<key>"), and each component lives in its own storage namespace (the runner opens one
backend per host pool: runner/executors/hicache.py), so neither a uniform-pool server (bare
keys, every layer in one record) nor an SWA-pool server ever reads the other's records.

Restoring reads only windows. A prefetch ("s2h" with `swa_keys`) reads the full records of
the leading hit pages and, after each batch, the SWA records of the window before the batch's
end (`swa_window_pages` = SWAPages.window_pages; transfer/storage_jobs.py), where the store
has them (`StorageProgress.swa_read`). The pages join the tree as host-only nodes split by
that: `host_swa` where the SWA half was read. Nothing else is special: the window-aware match
of SWAHiRadixCache counts a prefix only up to an end whose last window is SWA-resident after
load-back, so a prefix whose window is not in storage is cut back to where it is exact (an
earlier batch end, or the tree's own part), and recomputed from there. Not done: a window
that straddles the start of the fetch, where the tree holds a tombstone (full layers only),
is not healed from storage -- that end is recomputed.
"""
from __future__ import annotations

from kvstrata.cache.page_keys import component_key
from kvstrata.cache.radix_cache import TreeNode
from kvstrata.cache.storage_tier import Prefetch, StorageTier
from kvstrata.protocol import StorageProgress, TransferOp


def full_keys(keys: list[str]) -> list[str]:
    return [component_key(k, "full") for k in keys]


def swa_keys(keys: list[str]) -> list[str]:
    return [component_key(k, "swa") for k in keys]


class SWAStorageTier(StorageTier):
    """Owned by SWAHiRadixCache (`tree.storage`); see the module docstring."""

    def _backup_op(self, job: int, node: TreeNode) -> TransferOp:
        keys = self.node_keys(node)
        return TransferOp(job, "h2s", [], list(node.host_pages), sync=False,
                          keys=full_keys(keys), swa_keys=swa_keys(keys) if node.host_swa else [])

    def _prefetch_op(self, job: int, host_pages: list[int], keys: list[str]) -> TransferOp:
        return TransferOp(job, "s2h", [], list(host_pages), sync=False, keys=full_keys(keys),
                          swa_keys=swa_keys(keys), swa_window_pages=self.tree.swa.window_pages)

    def _on_prefetch_progress(self, pf: Prefetch, p: StorageProgress) -> None:
        super()._on_prefetch_progress(pf, p)
        pf.swa_read.update(p.swa_read)

    def _new_host_nodes(self, parent: TreeNode, pf: Prefetch, first: int, end: int,
                        pages: list[int], keys: list[str], now: int) -> None:
        """One host-only node per run of pages with / without their SWA half read (a node's
        host copy has it or not as a whole), chained under `parent`."""
        P, read = self.page_size, pf.swa_read
        i = first
        while i < end:
            live = i - pf.start_page in read
            j = i + 1
            while j < end and (j - pf.start_page in read) == live:
                j += 1
            node = TreeNode(tuple(pf.token_ids[i * P:j * P]), [], parent, now)
            node.host_pages, node.hash_keys = pages[i - first:j - first], keys[i - first:j - first]
            node.host_swa = live
            parent.children[node.key[:P]] = node
            parent, i = node, j
