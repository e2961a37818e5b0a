"""Radix prefix cache: a compressed radix tree over page-aligned token runs.

Each node holds a run of tokens (``key``, a multiple of ``page_size`` long) and
the pages that hold their KV (``pages``, one per ``page_size`` tokens). A
node's children are keyed by the token tuple of their first page, so one step
down the tree is one dict lookup. Every namespace (tenant / ``cache_salt``;
``""`` is the default) has its own root, so one namespace never matches
another's tokens.

The tree holds no page references. Page lifetime is the allocator's refcount:
running requests hold references; a page released to refcount 0 goes to the
allocator's free-list tail but stays cached (in the tree) until the allocator
hands it out again. The free-list head is therefore the least recently released
page, and eviction is lazy: a reused page, and everything hanging after it,
leaves the tree as ``KVPool.allocate`` hands it out. A bare cache over a pool
sets that reuse hook itself; under a ``KVCacheManager`` the manager owns the
hook and calls ``evict_page``. Pages must therefore be allocated through
``KVPool.allocate`` (not the bare allocator) once a cache is attached.

Invariants:
- every page in the tree is in ``_node_of`` exactly once, mapped to its node;
- ``len(node.key) == len(node.pages) * page_size`` and every non-root node has
  at least one page; only roots are empty;
- a child's dict key equals ``child.key[:page_size]``; sibling keys differ.
  (A node may keep a single child after an eviction; matching is unaffected.)

Complexity: ``match`` and ``insert`` are O(matched length) (one dict lookup per
node, a page-by-page compare inside a node); ``evict_page`` is O(size of what
is dropped); ``flush`` is O(tree). ``node_visits`` counts the nodes those
operations touch, so tests can check that no operation scans the tree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

from .allocator import PageId
from .errors import CacheArgumentError, CacheIntegrityError, CacheStateError

if TYPE_CHECKING:
    from .kv_pool import KVPool

# ("stored" | "removed", namespace, pages): lets a router mirror the tree.
CacheEvent = Callable[[str, str, list[PageId]], None]


@dataclass(frozen=True)
class PrefixMatch:
    """The cached prefix of a prompt: its pages and ``len(pages) * page_size`` tokens."""

    pages: list[PageId] = field(default_factory=list)
    num_tokens: int = 0


class _Node:
    __slots__ = ("key", "pages", "parent", "children", "namespace")

    def __init__(self, key: tuple[int, ...], pages: list[PageId],
                 parent: _Node | None, namespace: str):
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.namespace = namespace


class RadixCache:
    """Page-aligned prefix cache over a ``KVPool`` (see the module docstring).

    ``pool`` may be None for a tree without refcounts (``lock``/``unlock``
    then raise). With a pool, the constructor sets the pool's reuse hook to this
    tree's lazy eviction (a ``KVCacheManager`` built over the pool takes it over).
    """

    def __init__(self, page_size: int, pool: KVPool | None = None,
                 events: CacheEvent | None = None):
        if page_size <= 0:
            raise CacheArgumentError(f"page_size must be > 0, got {page_size}")
        if pool is not None and pool.layout.page_size != page_size:
            raise CacheArgumentError(
                f"page_size {page_size} != pool page_size {pool.layout.page_size}")
        self.page_size = page_size
        self.pool = pool
        self.events = events
        self.node_visits = 0
        self._roots: dict[str, _Node] = {}
        self._node_of: dict[PageId, _Node] = {}
        if pool is not None:
            pool.set_reuse_hook(self._on_reuse)

    # ---- queries ---------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return len(self._node_of)

    def is_cached(self, page: PageId) -> bool:
        return page in self._node_of

    def namespaces(self) -> list[str]:
        """Namespaces holding at least one cached page, sorted."""
        return sorted(self._roots)

    def match(self, tokens: Sequence[int], namespace: str = "",
              max_pages: int | None = None) -> PrefixMatch:
        """Longest cached page-aligned prefix of ``tokens`` in ``namespace``.

        At most ``max_pages`` pages (callers pass ``(len(prompt) - 1) // page_size``
        so one token is left to compute); a partial last page is ignored.
        Refcounts are unchanged, so the caller must ``lock`` the pages before
        anything else allocates (LRU order is the allocator's free list).
        """
        ps = self.page_size
        limit = len(tokens) // ps
        if max_pages is not None:
            limit = min(limit, max_pages)
        pages: list[PageId] = []
        node = self._roots.get(namespace)
        if node is None or limit <= 0:
            return PrefixMatch()
        while len(pages) < limit:
            pos = len(pages) * ps
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            self.node_visits += 1
            n = self._common_pages(child, tokens, pos, limit - len(pages))
            pages.extend(child.pages[:n])
            if n < len(child.pages):
                break
            node = child
        return PrefixMatch(pages, len(pages) * ps)

    def _common_pages(self, node: _Node, tokens: Sequence[int], pos: int, limit: int) -> int:
        """How many leading pages of ``node`` equal ``tokens[pos:]`` (first one known equal)."""
        ps, n = self.page_size, 1
        stop = min(len(node.pages), limit)
        while n < stop:
            a = pos + n * ps
            if tuple(tokens[a:a + ps]) != node.key[n * ps:(n + 1) * ps]:
                break
            n += 1
        return min(n, stop)

    # ---- refcounts -------------------------------------------------------

    def lock(self, pages: Sequence[PageId]) -> None:
        """Take a reference on matched pages (cached free pages leave the free list)."""
        self._require_pool().allocator.incref(pages)

    def unlock(self, pages: Sequence[PageId]) -> None:
        """Drop one reference each; pages reaching 0 go to the free-list tail in
        the given order (pass a sequence's pages deepest-first so its prefix
        stays cached longest)."""
        self._require_pool().allocator.free(pages)

    def _require_pool(self) -> KVPool:
        if self.pool is None:
            raise CacheStateError("RadixCache has no pool; lock/unlock need one")
        return self.pool

    # ---- insert ----------------------------------------------------------

    def insert(self, tokens: Sequence[int], pages: Sequence[PageId], namespace: str = "") -> int:
        """Cache the run ``tokens`` (``len(pages) * page_size`` of them) held by ``pages``.

        Where a page-chunk is already cached, the tree keeps its page and the
        caller's page stays uncached. Returns the number of leading chunks that
        were already present (``len(pages)`` for a repeated insert).
        Raises CacheArgumentError (a ValueError) on a length mismatch or when a page
        to be stored is already cached elsewhere or repeated.
        """
        ps, total = self.page_size, len(pages)
        if len(tokens) != total * ps:
            raise CacheArgumentError(f"{len(tokens)} tokens for {total} pages of {ps}")
        if total == 0:
            return 0
        node = self._roots.get(namespace) or _Node((), [], None, namespace)
        done = 0
        while done < total:
            pos = done * ps
            child = node.children.get(tuple(tokens[pos:pos + ps]))
            if child is None:
                break
            self.node_visits += 1
            n = self._common_pages(child, tokens, pos, total - done)
            done += n
            if n < len(child.pages):
                if done < total:
                    node = self._split(child, n)
                break
            node = child
        if done < total:
            self._add_leaf(node, tuple(tokens[done * ps:]), list(pages[done:]))
        return done

    def _add_leaf(self, parent: _Node, key: tuple[int, ...], pages: list[PageId]) -> None:
        if len(set(pages)) != len(pages) or any(p in self._node_of for p in pages):
            raise CacheArgumentError(f"pages {pages} repeat or are already cached elsewhere")
        ns = parent.namespace
        if parent.parent is not None and not parent.children:
            # Growing a leaf (e.g. one sequence inserted chunk by chunk) keeps the tree compressed.
            leaf = parent
            leaf.key, leaf.pages = leaf.key + key, leaf.pages + pages
        else:
            leaf = _Node(key, pages, parent, ns)
            parent.children[key[:self.page_size]] = leaf
        if parent.parent is None:
            self._roots[ns] = parent
        for p in pages:
            self._node_of[p] = leaf
        self._emit("stored", ns, pages)

    def _split(self, node: _Node, n: int) -> _Node:
        """Cut ``node`` after its first ``n`` pages; returns the new upper node.

        The upper node takes the first ``n`` pages and ``node``'s place under its
        parent; ``node`` keeps the rest, its children and its identity. O(n).
        """
        ps, parent = self.page_size, node.parent
        assert parent is not None and 0 < n < len(node.pages)
        head = _Node(node.key[:n * ps], node.pages[:n], parent, node.namespace)
        parent.children[head.key[:ps]] = head
        node.key, node.pages, node.parent = node.key[n * ps:], node.pages[n:], head
        head.children[node.key[:ps]] = node
        for p in head.pages:
            self._node_of[p] = head
        return head

    # ---- eviction --------------------------------------------------------

    def _on_reuse(self, pages: list[PageId]) -> None:
        for p in pages:
            if p in self._node_of:
                self.evict_page(p)

    def evict_page(self, page: PageId) -> list[PageId]:
        """Drop ``page`` and everything after it (rest of its node, all descendants).

        Refcounts are untouched: dropped pages still held by requests just become
        uncached, free ones stay on the free list as plain free pages. Returns
        the dropped pages (empty when ``page`` is not cached). O(dropped).
        """
        node = self._node_of.get(page)
        if node is None:
            return []
        idx = len(node.pages) - 1
        while node.pages[idx] != page:  # scan from the end: O(pages dropped here)
            idx -= 1
        dropped = node.pages[idx:]
        for p in dropped:
            del self._node_of[p]
        self.node_visits += 1
        for child in node.children.values():
            dropped.extend(self._drop_subtree(child))
        node.children = {}
        parent = node.parent
        assert parent is not None
        if idx == 0:
            del parent.children[node.key[:self.page_size]]
            node.parent = None
            if parent.parent is None and not parent.children:
                del self._roots[parent.namespace]
        else:
            node.key, node.pages = node.key[:idx * self.page_size], node.pages[:idx]
        self._emit("removed", node.namespace, dropped)
        return dropped

    def _drop_subtree(self, top: _Node) -> list[PageId]:
        """Forget ``top`` and its descendants (iteratively: trees can be deep)."""
        out: list[PageId] = []
        stack = [top]
        while stack:
            node = stack.pop()
            self.node_visits += 1
            for p in node.pages:
                del self._node_of[p]
            out.extend(node.pages)
            stack.extend(node.children.values())
            node.children, node.parent = {}, None
        return out

    def flush(self) -> None:
        """Forget every cached page (refcounts untouched; no request may be running)."""
        for ns, root in list(self._roots.items()):
            pages = [p for child in root.children.values() for p in self._drop_subtree(child)]
            self._emit("removed", ns, pages)
        self._roots.clear()
        self._node_of.clear()

    def _emit(self, kind: str, namespace: str, pages: list[PageId]) -> None:
        if self.events is not None and pages:
            self.events(kind, namespace, list(pages))

    # ---- debugging -------------------------------------------------------

    def cached_pages(self) -> set[PageId]:
        """Every page in the tree (O(cached pages); integrity checks and tests)."""
        return set(self._node_of)

    def check_integrity(self) -> None:
        """Raise CacheIntegrityError unless the tree keeps its invariants (module
        docstring): parent links, keys of whole pages, child keys, every page once in
        ``_node_of`` and mapped to its node, within the pool. O(tree)."""
        ps, problems, seen = self.page_size, [], 0
        num_pages = self.pool.num_pages if self.pool is not None else None
        for ns, root in self._roots.items():
            if root.parent is not None or root.pages or root.namespace != ns or not root.children:
                problems.append(f"namespace {ns!r}: a root must be empty, parentless, non-leaf")
            stack = [root]
            while stack:
                node = stack.pop()
                for key, child in node.children.items():
                    if child.parent is not node or key != child.key[:ps] or child.namespace != ns:
                        problems.append(f"child {key[:4]}.. of {ns!r}: bad link, key or namespace")
                    stack.append(child)
                if node is root:
                    continue
                if not node.pages or len(node.key) != len(node.pages) * ps:
                    problems.append(f"node of {len(node.pages)} pages has {len(node.key)} tokens")
                for p in node.pages:
                    seen += 1
                    if self._node_of.get(p) is not node:
                        problems.append(f"page {p} is not mapped to its node")
                    if num_pages is not None and not 0 <= p < num_pages:
                        problems.append(f"page {p} is outside the pool")
        if seen != len(self._node_of):
            problems.append(f"{seen} pages in nodes, {len(self._node_of)} mapped")
        if problems:
            raise CacheIntegrityError("radix tree: " + "; ".join(problems[:8]))

    def iter_runs(self, namespace: str = "") -> Iterator[tuple[tuple[int, ...], list[PageId]]]:
        """``(tokens, pages)`` of every root-to-node path in ``namespace`` (O(tree); tests)."""
        root = self._roots.get(namespace)
        stack = [((), [], c) for c in root.children.values()] if root else []
        while stack:
            key, pages, node = stack.pop()
            key, pages = key + node.key, pages + node.pages
            yield key, pages
            stack.extend((key, pages, c) for c in node.children.values())
