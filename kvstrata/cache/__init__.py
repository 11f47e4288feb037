"""KV bookkeeping without tensors: page allocator, radix prefix cache, eviction policies.

Pure Python by rule (no torch): the scheduler uses these and must stay testable in milliseconds.
"""
from kvstrata.cache.page_allocator import PageAllocator
from kvstrata.cache.radix_cache import MatchResult, RadixCache, TreeNode

__all__ = ["MatchResult", "PageAllocator", "RadixCache", "TreeNode"]
