"""KV page storage tiers. L1 (the device pool) and the page allocator live here."""

from .allocator import PageAllocator, PageAllocError, PageId
from .kv_pool import KVPool, PoolCapacity, pages_for_budget

__all__ = ["PageAllocator", "PageAllocError", "PageId", "KVPool", "PoolCapacity", "pages_for_budget"]
