"""Errors of the KV cache parts (pool, allocator, radix tree, tiers, the cache manager).

They sit under the one hierarchy (``nibble.kernels.errors``) and also subclass
the builtin a caller would expect (ValueError for a bad argument,
RuntimeError for a call the current state forbids).
"""

from __future__ import annotations

from nibble.kernels.errors import FatalError


class CacheArgumentError(FatalError, ValueError):
    """A bad argument to a cache part (a size, a page-size mismatch, a token run
    that does not fit its pages, an unknown tier policy)."""


class CacheStateError(FatalError, RuntimeError):
    """A call the cache part's current state does not allow (e.g. changing the
    global scales while pages are in use)."""


class CacheIntegrityError(CacheStateError):
    """``check_integrity`` found the cache's bookkeeping inconsistent (a bug)."""
