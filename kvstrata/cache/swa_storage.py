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
earlier batch end, or the tree's own part), and recomputed from there.

Straddling-window heal. Where the window before the tree's end has pages without SWA K/V
after a load-back (a device tombstone whose host copy lacks the SWA half or that has none, a
host copy written without it: a restore that read only a longer prefix's window, SWA
eviction), the tree's own prefix is cut there, and so is every fetched end whose window
reaches back into it (a fetch shorter than a window). So the fetch then starts a window
earlier (`_lead_pages`: min(window, tree pages), only when one of them is dead; a fetch of
nothing past the tree's end is started for it too), and at its end each such tree node takes
the fetched pages as its host copy, both halves (`_heal`): a host-only node swaps its copy, a
device tombstone gets one, whose SWA half the load-back then brings to the device
(SWAHiRadixCache._revive; its full pages stay). A node being written, read by a backup, or
not wholly read with its SWA half stays as it is (that end is then cut, as before). Healed
lead pages count as storage hits; the others were read for nothing
(`swa_lead_unused_pages`): the price, one window of full records, paid whenever the fetch
brings a window or more past the tree's end (its own end's window is then fetched, and the
job reads the SWA records of that one only).
"""
from __future__ import annotations

import dataclasses

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

    # ------------------------------------------------------------------ straddling-window heal
    def _path(self, token_ids: list[int], first: int, end: int, split: bool
              ) -> list[tuple[TreeNode, int]] | None:
        """The tree nodes holding pages [first, end) of `token_ids`, with their first page;
        None when the tree lacks part of them. `split`: cut nodes at `first` and `end` so each
        lies wholly inside (else the nodes around them are listed as they are)."""
        tree, P = self.tree, self.page_size
        node, page, out = tree.root, 0, []
        while page < end:
            child = node.children.get(tree.page_key(token_ids, page * P))
            if child is None:
                return None
            matched = tree.matching_pages(child.key, token_ids, page * P, end * P)
            if split and page < first < page + matched:
                child, matched = tree.split_node(child, first - page), first - page
            elif split and matched < len(child.key) // P:
                child = tree.split_node(child, matched)
            if page + matched > first:
                out.append((child, page))
            if matched < len(child.key) // P and page + matched < end:
                return None
            page += matched
            node = child
        return out

    def _lead_pages(self, token_ids: list[int], start: int, n: int) -> int:
        lead = min(start, self.tree.swa.window_pages)
        if lead <= 0:
            return 0
        path = self._path(token_ids, start - lead, start, split=False)
        if path is None or all(self.tree.swa_after_load(node) for node, _ in path):
            return 0
        return lead

    def _insert_host(self, pf: Prefetch, keep: int) -> list[int]:
        lead = pf.lead_pages
        if not lead:
            return super()._insert_host(pf, keep)
        healed = self._heal(pf, min(keep, lead))
        spare = [p for i, p in enumerate(pf.host_pages[:min(keep, lead)]) if i not in healed]
        # (the caller counts every kept page a hit; these joined nothing)
        self.stats.swa_lead_unused_pages += len(spare)
        self.stats.hit_tokens -= len(spare) * self.page_size
        if keep <= lead:  # nothing past the tree's end came: the heal is all
            return spare
        rest = dataclasses.replace(pf, start_page=pf.start_page + lead,
                                   host_pages=pf.host_pages[lead:], lead_pages=0,
                                   swa_read={i - lead for i in pf.swa_read if i >= lead})
        return spare + super()._insert_host(rest, keep - lead)

    def _heal(self, pf: Prefetch, n: int) -> set[int]:
        """Give the dead tree nodes among the first `n` (read) lead pages the fetched copies
        (module docstring); returns the indices (from pf.start_page) of the pages adopted."""
        tree, first = self.tree, pf.start_page
        path = self._path(pf.token_ids, first, first + n, split=True)
        healed: set[int] = set()
        for node, page in path or []:
            idx = range(page - first, page - first + len(node.key) // self.page_size)
            if (tree.swa_after_load(node) or not all(i in pf.swa_read for i in idx)
                    or node.pending_job is not None or node.host_ref):
                continue
            if node.host_pages:
                tree.host_allocator.free(node.host_pages)
            node.host_pages = [pf.host_pages[i] for i in idx]
            node.host_swa = True
            healed.update(idx)
            self.stats.swa_healed_pages += len(idx)
        return healed
