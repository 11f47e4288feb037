"""The integrity checks of the radix tree (no torch), run after every step under
KVSTRATA_CHECK_INTEGRITY: the structure every tree keeps (also run by the HiCache tree), then
the device pages and the eviction counters of the plain tree."""
from __future__ import annotations


def check_tree_shape(tree) -> None:
    """The structural invariants every radix tree keeps, whatever its nodes hold (the
    HiCache tree runs this too): an empty root locked once, parent pointers, children
    filed under their first page, keys of whole pages, a lock_ref covering the locks of
    the children (each lock walks up to the root)."""
    page_size = tree.page_size
    assert tree.root.lock_ref == 1 and not tree.root.key and not tree.root.device_pages, \
        "root must be empty with lock_ref 1"
    for node in [tree.root, *tree.nodes()]:
        child_locks = 0
        for first_page, child in node.children.items():
            assert child.parent is node, f"{child!r} has a wrong parent pointer"
            assert first_page == child.key[:page_size], f"{child!r} is filed under {first_page}"
            child_locks += child.lock_ref
        if node is tree.root:
            continue
        assert node.key and len(node.key) % page_size == 0, f"{node!r}: key not whole pages"
        assert node.lock_ref >= child_locks, f"{node!r}: lock_ref below its children's sum"


def check_device_tree(tree) -> None:
    """Raise AssertionError if the tree, its counters or the allocator disagree."""
    check_tree_shape(tree)
    page_size = tree.page_size
    seen: dict = {}  # page -> the node owning it
    evictable = protected = 0
    for node in tree.nodes():
        assert len(node.key) == node.num_pages * page_size, f"{node!r}: key/page count mismatch"
        for page in node.device_pages:
            assert page not in seen, f"page {page} owned by {node!r} and {seen[page]!r}"
            assert tree.allocator.is_allocated(page), f"page {page} of {node!r} is not allocated"
            seen[page] = node
        if node.lock_ref > 0:
            protected += node.num_pages
        else:
            evictable += node.num_pages
    counted = (tree.evictable_pages(), tree.protected_pages())
    assert (evictable, protected) == counted, (
        f"counters (evictable, protected)={counted} != "
        f"tree (evictable={evictable}, protected={protected})"
    )
    if tree.disable:
        assert not seen, "disabled cache holds pages"
    tree.allocator.check_integrity()


__all__ = ["check_device_tree", "check_tree_shape"]
