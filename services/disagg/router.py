"""The cache-aware router's logic: which decode worker, which prefill worker, and what to skip.

Pure bookkeeping, no Ray: the caller polls each worker's ``kv_events(since)`` and
``stats()`` and feeds them in; ``Router.choose`` then routes a prompt.

* **Index.** Page keys are chained (``tiering.page_record.chain_keys``): the key
  of page ``i`` already commits to every token before it and to the namespace
  (model, KV format, layout, tenant). They are keyed by the deployment's KV
  secret, so the router needs the same secret as the workers. A per-worker *set* of keys is therefore a
  radix index over pages: the longest cached prefix is the longest run of the
  prompt's keys found in the set. Each worker has one such set per tier (l1, l2,
  l3), mirrored from its KV events. The index is approximate: events arrive late,
  L3 has no removal events, and each tier set is capped (oldest keys dropped).
* **Scoring.** A held page is worth ``1 - load_cost[tier]`` pages of compute
  saved; a worker's score is the saved pages along its prefix run minus a load
  penalty (queued, running and in-flight requests, KV usage), all in pages.
* **Fallback.** If the best-scored worker's queue is ``> imbalance_ratio`` times
  the shortest queue and longer than ``imbalance_min_queued``, the shortest queue
  wins instead (reason ``"load"``).
* **Prefill.** If the decode worker holds every usable page of the prompt (all
  but the page holding the last token, which the engine always recomputes), the
  prefill worker is skipped. Otherwise a prefill worker is scored the same way
  and the decode worker's leading held pages (``prefix_pages``) are not sent.

Cost: ``choose`` hashes the prompt once (O(prompt)) and does O(pages x workers)
set lookups; applying events is O(keys in the events).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Sequence

from nibble.kernels.errors import RetryableError
from nibble.services.errors import ConfigError
from nibble.tiering.page_record import chain_keys, namespace_root
from nibble.tiering.secret import KVSecret

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode")
TIERS = ("l1", "l2", "l3")
_MAX_ROOTS = 4096                     # cached namespace roots (one per tenant seen)


class NoWorkerAvailableError(RetryableError):
    """No live worker of the needed role is registered (503; retry once one is back)."""


@dataclass(frozen=True)
class RouterConfig:
    # Cost of bringing a held page into L1, as a fraction of computing it (l1 < l2 < l3).
    load_cost: Mapping[str, float] = field(
        default_factory=lambda: {"l1": 0.0, "l2": 0.25, "l3": 0.6})
    queued_cost_pages: float = 4.0    # penalty per queued (or just routed) request, in pages
    running_cost_pages: float = 1.0   # penalty per running request, in pages
    usage_cost_pages: float = 8.0     # penalty at token_usage == 1.0, in pages
    imbalance_ratio: float = 2.0      # best queue > ratio x shortest queue ...
    imbalance_min_queued: int = 4     # ... and > this many queued: shortest queue wins
    skip_max_compute_pages: int = 0   # skip prefill when at most this many usable pages are missing
    skip_short_prompts: bool = False  # skip prefill for prompts with no full usable page
    local_prefill_fallback: bool = True   # no prefill worker: decode worker prefills locally
    count_inflight: bool = True       # routed requests count as queued until the next load update
    shared_l3: bool = False           # L3 is one store shared by all workers (e.g. one Redis)
    max_keys_per_tier: int = 500_000  # per worker and tier; the oldest keys are dropped beyond it

    def __post_init__(self) -> None:
        costs = [self.load_cost.get(t) for t in TIERS]
        if any(c is None or not 0.0 <= c <= 1.0 for c in costs) or \
                not costs[0] <= costs[1] <= costs[2]:
            raise ConfigError(f"load_cost must map l1 <= l2 <= l3 into [0, 1], got "
                              f"{self.load_cost}")
        if self.imbalance_ratio < 1.0 or self.imbalance_min_queued < 0 or \
                self.max_keys_per_tier < 1:
            raise ConfigError("need imbalance_ratio >= 1, imbalance_min_queued >= 0 and "
                              "max_keys_per_tier >= 1")


@dataclass(frozen=True)
class RouteDecision:
    decode_worker: str                # worker id that decodes (and owns the request's pages)
    prefill_worker: str | None        # worker id that prefills; None when skip_prefill
    prefix_pages: int                 # leading prompt pages the decode worker already holds
                                      # (any tier): not computed, not transferred
    skip_prefill: bool                # the decode worker computes the (short) rest itself
    reason: str                       # "cache" | "cold" | "load" | "no_prefill_worker"
    scores: dict[str, float] = field(hash=False)  # decode worker id -> score (higher is better)
    prompt_pages: int = 0             # usable full pages of the prompt ((len - 1) // page_size)
    load_pages: int = 0               # of prefix_pages, those held only in l2/l3 (to load up)
    prefill_reason: str | None = None  # why that prefill worker: "cache" | "cold" | "load"


@dataclass
class WorkerLoad:
    num_running: int = 0
    num_queued: int = 0
    token_usage: float = 0.0          # fraction of the KV pool in use, 0..1
    inflight: int = 0                 # routed here since the last update_load

    @property
    def queued(self) -> int:
        return self.num_queued + self.inflight


class WorkerView:
    """The router's picture of one worker: which content keys it holds per tier, and its load."""

    def __init__(self, worker_id: str, role: str, max_keys_per_tier: int = 500_000,
                 shared_l3: dict[str, int] | None = None):
        if role not in ROLES:
            raise ConfigError(f"worker role must be one of {ROLES}, got {role!r}")
        self.worker_id, self.role = worker_id, role
        self.load = WorkerLoad()
        self.last_seq = 0             # highest event seq applied (poll kv_events(since=last_seq))
        self.bad_events = 0
        self._cap = max_keys_per_tier
        self._shared = shared_l3      # key -> number of workers holding it in l3
        # dicts used as insertion-ordered sets of hex keys (oldest first, for the cap)
        self.tiers: dict[str, dict[str, None]] = {t: {} for t in TIERS}

    l1 = property(lambda self: self.tiers["l1"])
    l2 = property(lambda self: self.tiers["l2"])
    l3 = property(lambda self: self.tiers["l3"])

    def clear(self) -> None:
        for key in self.tiers["l3"]:
            self._unshare(key)
        self.tiers = {t: {} for t in TIERS}

    def apply(self, events: Iterable[Mapping | object]) -> None:
        """Apply KV events in order (``KVEvent`` objects or their ``__dict__``)."""
        for ev in events:
            get = ev.get if isinstance(ev, Mapping) else (lambda k, e=ev: getattr(e, k, None))
            kind, tier, keys, seq = get("kind"), get("tier"), get("keys"), get("seq")
            if kind not in ("stored", "removed") or tier not in TIERS or keys is None \
                    or isinstance(keys, (str, bytes)):
                self.bad_events += 1
                log.warning("worker %s: ignoring malformed KV event %r", self.worker_id, ev)
                continue
            if kind == "stored":
                self._store(tier, keys)
            else:
                self._remove(tier, keys)
            if isinstance(seq, int) and seq > self.last_seq:
                self.last_seq = seq

    def _store(self, tier: str, keys: Iterable[str]) -> None:
        held = self.tiers[tier]
        for key in keys:
            if key in held:
                continue
            held[key] = None
            if tier == "l3":
                self._share(key)
            if len(held) > self._cap:
                oldest = next(iter(held))
                del held[oldest]
                if tier == "l3":
                    self._unshare(oldest)

    def _remove(self, tier: str, keys: Iterable[str]) -> None:
        held = self.tiers[tier]
        for key in keys:
            if key in held:
                del held[key]
                if tier == "l3":
                    self._unshare(key)

    def _share(self, key: str) -> None:
        if self._shared is not None:
            self._shared[key] = self._shared.get(key, 0) + 1

    def _unshare(self, key: str) -> None:
        if self._shared is not None:
            n = self._shared.get(key, 0) - 1
            if n > 0:
                self._shared[key] = n
            else:
                self._shared.pop(key, None)

    def tier_of(self, key: str, shared_l3: Mapping[str, int] | None = None) -> str | None:
        """The fastest tier holding ``key`` here (or in the shared L3), else None."""
        for tier in TIERS:
            if key in self.tiers[tier]:
                return tier
        return "l3" if shared_l3 is not None and key in shared_l3 else None


@dataclass(frozen=True)
class _Hit:
    run: int                          # leading pages held in any tier
    slow: int                         # of those, held only in l2/l3
    saved: float                      # pages of compute saved, weighted by tier


class Router:
    """Routes prompts to decode/prefill workers by cached prefix and load (thread-safe)."""

    def __init__(self, root_fn: Callable[[str], bytes], config: RouterConfig | None = None, *,
                 secret: KVSecret):
        """``root_fn(namespace) -> bytes``: the chain root for a tenant namespace, e.g.
        ``lambda ns: namespace_root(fingerprint, layout, ns, secret=secret)`` (see
        ``for_model``); ``secret``: the deployment's KV secret, which keys the chain."""
        self.cfg = config or RouterConfig()
        self._root_fn = root_fn
        self._secret = secret
        self._roots: dict[str, bytes] = {}
        self._workers: dict[str, WorkerView] = {}
        self._shared_l3: dict[str, int] | None = {} if self.cfg.shared_l3 else None
        self._lock = threading.Lock()

    @classmethod
    def for_model(cls, fingerprint: str, layout, config: RouterConfig | None = None,
                  recipe: str = "", *, secret: KVSecret) -> "Router":
        """A router keyed like the workers' tier managers (same fingerprint, PageLayout,
        K-recipe parameter digest and KV secret)."""
        return cls(lambda ns: namespace_root(fingerprint, layout, ns, recipe, secret=secret),
                   config, secret=secret)

    # ---- membership ----
    def add_worker(self, worker_id: str, role: str) -> WorkerView:
        """Register a worker with an empty view (a restarted worker replaces its old view)."""
        view = WorkerView(worker_id, role, self.cfg.max_keys_per_tier, self._shared_l3)
        with self._lock:
            old = self._workers.pop(worker_id, None)
            if old is not None:
                old.clear()
            self._workers[worker_id] = view
        return view

    def remove_worker(self, worker_id: str) -> bool:
        """Forget a worker (its actor died); False if it was not registered."""
        with self._lock:
            view = self._workers.pop(worker_id, None)
            if view is not None:
                view.clear()
        return view is not None

    def workers(self, role: str | None = None) -> list[WorkerView]:
        with self._lock:
            return [w for w in self._workers.values() if role is None or w.role == role]

    def view(self, worker_id: str) -> WorkerView | None:
        return self._workers.get(worker_id)

    # ---- feeds ----
    def apply_events(self, worker_id: str, events: Sequence, lost: bool = False) -> bool:
        """Mirror a batch of a worker's KV events; False if the worker is unknown (ignored).

        ``lost``: events before this batch were dropped, so the view is stale; it is
        cleared, then rebuilt from this batch and later ones.
        """
        with self._lock:
            view = self._workers.get(worker_id)
            if view is None:
                log.debug("KV events from unregistered worker %s ignored", worker_id)
                return False
            if lost:
                log.info("worker %s: KV events were lost; rebuilding its view", worker_id)
                view.clear()
            view.apply(events)
        return True

    def apply_poll(self, worker_id: str, reply: Mapping) -> bool:
        """Apply one ``AsyncEngine.kv_events(since)`` reply: ``{events, last_seq, lost}``.

        A ``last_seq`` below what was already applied means the worker's event log
        restarted (a restarted actor under the same name): the view is cleared and
        ``last_seq(worker_id)`` drops to 0, so the next poll replays the new log.
        """
        with self._lock:
            view = self._workers.get(worker_id)
            if view is not None and int(reply.get("last_seq", view.last_seq)) < view.last_seq:
                log.info("worker %s: KV event log restarted; rebuilding its view", worker_id)
                view.clear()
                view.last_seq = 0
                return True
        return self.apply_events(worker_id, reply.get("events", []), bool(reply.get("lost")))

    def last_seq(self, worker_id: str) -> int:
        """The ``since`` to poll next for this worker (0 for an unknown one)."""
        view = self._workers.get(worker_id)
        return view.last_seq if view is not None else 0

    def update_load(self, worker_id: str, num_running: int, num_queued: int,
                    token_usage: float) -> bool:
        """Record a worker's gauges (``stats()``); resets its in-flight count."""
        with self._lock:
            view = self._workers.get(worker_id)
            if view is None:
                return False
            view.load = WorkerLoad(int(num_running), int(num_queued), float(token_usage))
        return True

    # ---- routing ----
    def prompt_keys(self, namespace: str, prompt_tokens: Sequence[int], page_size: int
                    ) -> list[str]:
        """Hex keys of the prompt's usable pages (full pages, less the one with the last token)."""
        usable = max(0, (len(prompt_tokens) - 1) // page_size)
        root = self._roots.get(namespace)
        if root is None:
            if len(self._roots) >= _MAX_ROOTS:
                self._roots.clear()
            root = self._roots[namespace] = self._root_fn(namespace)
        return [k.hex() for k in chain_keys(root, prompt_tokens[:usable * page_size], page_size,
                                            secret=self._secret)]

    def choose(self, namespace: str, prompt_tokens: Sequence[int], page_size: int
               ) -> RouteDecision:
        """Pick a decode worker, and a prefill worker unless the decode worker holds the prefix.

        Raises NoWorkerAvailableError when no decode worker is registered (or no
        prefill worker is needed but none exists and ``local_prefill_fallback`` is off).
        """
        if page_size <= 0:
            raise ConfigError(f"page_size must be > 0, got {page_size}")
        keys = self.prompt_keys(namespace, prompt_tokens, page_size)
        with self._lock:
            decoders = [w for w in self._workers.values() if w.role == "decode"]
            if not decoders:
                raise NoWorkerAvailableError("no decode worker is available")
            hits = {w.worker_id: self._hit(w, keys) for w in decoders}
            scores = {w.worker_id: self._score(w, hits[w.worker_id]) for w in decoders}
            dec, reason = self._pick(decoders, hits, scores)
            hit = hits[dec.worker_id]
            skip = len(keys) - hit.run <= self.cfg.skip_max_compute_pages and (
                hit.run > 0 or self.cfg.skip_short_prompts)
            prefill, prefill_reason = None, None
            if not skip:
                prefill, prefill_reason = self._pick_prefill(keys)
                if prefill is None:
                    skip, reason = True, "no_prefill_worker"
            if self.cfg.count_inflight:
                dec.load.inflight += 1
                if prefill is not None:
                    prefill.load.inflight += 1
        return RouteDecision(dec.worker_id, prefill.worker_id if prefill else None, hit.run, skip,
                             reason, scores, len(keys), hit.slow, prefill_reason)

    def _pick_prefill(self, keys: list[str]) -> tuple[WorkerView | None, str | None]:
        prefillers = [w for w in self._workers.values() if w.role == "prefill"]
        if not prefillers:
            if not self.cfg.local_prefill_fallback:
                raise NoWorkerAvailableError("no prefill worker is available")
            log.warning("no prefill worker registered; the decode worker prefills locally")
            return None, None
        hits = {w.worker_id: self._hit(w, keys) for w in prefillers}
        scores = {w.worker_id: self._score(w, hits[w.worker_id]) for w in prefillers}
        return self._pick(prefillers, hits, scores)

    def _hit(self, view: WorkerView, keys: list[str]) -> _Hit:
        cost, run, slow, saved = self.cfg.load_cost, 0, 0, 0.0
        for key in keys:
            tier = view.tier_of(key, self._shared_l3)
            if tier is None:
                break
            run += 1
            slow += tier != "l1"
            saved += 1.0 - cost[tier]
        return _Hit(run, slow, saved)

    def _score(self, view: WorkerView, hit: _Hit) -> float:
        c, load = self.cfg, view.load
        return (hit.saved - c.queued_cost_pages * load.queued
                - c.running_cost_pages * load.num_running
                - c.usage_cost_pages * min(max(load.token_usage, 0.0), 1.0))

    def _pick(self, views: list[WorkerView], hits: Mapping[str, _Hit],
              scores: Mapping[str, float]) -> tuple[WorkerView, str]:
        """Best score (ties: shorter queue, fewer running, id); shortest queue under imbalance."""
        best = min(views, key=lambda w: (-scores[w.worker_id], w.load.queued, w.load.num_running,
                                         w.worker_id))
        idle = min(views, key=lambda w: (w.load.queued, w.load.num_running,
                                         -hits[w.worker_id].saved, w.worker_id))
        c = self.cfg
        if best.load.queued > c.imbalance_ratio * idle.load.queued and \
                best.load.queued > c.imbalance_min_queued:
            return idle, "load"
        return best, "cache" if hits[best.worker_id].run > 0 else "cold"
