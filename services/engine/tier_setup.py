"""The tiers below the device pool, from the config tree: L2 host pool, L3 storage, KV secret."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from urllib.parse import urlsplit

from nibble.tiering import KVPool
from nibble.tiering.host_pool import HostPool
from nibble.tiering.radix_cache import RadixCache
from nibble.tiering.secret import KVSecret
from nibble.tiering.storage import create_storage_backend
from nibble.tiering.tier_manager import TierManager, TierPolicy
from nibble.tiering.tier_mirror import TierMirror

from ..config import CacheConfig, HiCacheConfig
from ..credentials import (KV_SECRET_ENV, STORAGE_PASSWORD_ENV, load_kv_secret,
                           load_storage_password)

log = logging.getLogger(__name__)

# The file backend's budget without --hicache-storage-size: this, or half of what the
# directory could use (free space + what it holds), whichever is less.
DEFAULT_STORAGE_BYTES = 16 * 10**9


def default_storage_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "nibble", "kv")


def _bytes_under(path: Path) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                continue
    return total


def storage_budget(cfg: HiCacheConfig, path: str) -> int:
    """Bytes the file backend's directory may hold: ``--hicache-storage-size`` GB, else
    ``DEFAULT_STORAGE_BYTES`` or half of (free disk + what the directory already holds),
    whichever is less."""
    if cfg.hicache_storage_size is not None:
        return max(1, int(cfg.hicache_storage_size * 1e9))
    probe = Path(path)
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    held = _bytes_under(Path(path)) if Path(path).is_dir() else 0
    return max(1, min(DEFAULT_STORAGE_BYTES, (shutil.disk_usage(probe).free + held) // 2))


def load_secret(cfg: CacheConfig, for_storage: bool) -> KVSecret:
    """The deployment's KV secret (``--kv-secret-file`` / ``$NIBBLE_KV_SECRET``), else a random
    one for this process; ``for_storage``: L3 is on, so say what a random one costs."""
    secret = load_kv_secret(cfg.kv_secret_file)
    if secret is not None:
        return secret
    if for_storage:
        log.warning("no --kv-secret-file or $%s: using a random KV secret for this process. "
                    "L3 page records it writes will not verify after a restart or on another "
                    "replica (they are recomputed); give every replica the same secret to "
                    "keep and share L3", KV_SECRET_ENV)
    return KVSecret.generate()


def build_storage(cfg: HiCacheConfig, tp: tuple[int, int] = (1, 0)):
    """The L3 backend of --hicache-storage-backend, or None. ``tp``: (size, rank): with
    several ranks the file backend takes one subdirectory per rank (one process owns a
    directory) and a 1/size share of the budget; Redis is shared (record keys differ)."""
    if cfg.hicache_storage_backend == "redis":
        url = cfg.hicache_storage_url or "redis://127.0.0.1:6379/0"
        try:
            in_url = urlsplit(url).password
        except ValueError:
            in_url = None
        if in_url:
            log.warning("the Redis password in --hicache-storage-url is visible to every local "
                        "user (ps, /proc); use --hicache-storage-password-file or $%s",
                        STORAGE_PASSWORD_ENV)
        password = load_storage_password(cfg.hicache_storage_password_file)
        return create_storage_backend("redis", url, prefix=cfg.hicache_storage_prefix,
                                      ttl_s=cfg.hicache_storage_ttl,
                                      **({"password": password} if password else {}))
    if cfg.hicache_storage_backend == "file":
        path = cfg.hicache_storage_url or default_storage_dir()
        budget = storage_budget(cfg, path)
        if tp[0] > 1:
            path, budget = os.path.join(path, f"tp{tp[0]}-rank{tp[1]}"), max(1, budget // tp[0])
        log.info("L3 file storage: %s, budget %.2f GB", path, budget / 1e9)
        return create_storage_backend("file", path, max_bytes=budget)
    return None


def build_tiers(cfg: HiCacheConfig, pool: KVPool, cache: RadixCache, fingerprint: str,
                secret: KVSecret, storage=None, *, tp: tuple[int, int] = (1, 0),
                host_pages: int | None = None, **tier_kw) -> TierManager:
    """L2 host pool and L3 storage below ``pool``, per --enable-hierarchical-cache.

    Without it the tier manager still runs L1-only: it keys cached pages and
    publishes KV events, so a router can mirror the cache. ``secret`` keys the
    content keys and authenticates L3 records. ``storage``: an L3 backend to use
    instead of --hicache-storage-backend's; ``tier_kw``: TierPolicy fields no flag
    sets (``l3_latency_s``) and the manager's ``clock``. ``tp``: (size, rank) of this
    pool's tensor-parallel shard (the records' namespace; ``TierManager``);
    ``host_pages``: L2 slots (default ``host_pages_for``; the same on every rank).
    """
    clock = {"clock": tier_kw.pop("clock")} if "clock" in tier_kw else {}
    clock["tp"] = tp
    if not cfg.enable_hierarchical_cache:
        return TierManager(pool, cache, fingerprint, None, None, secret=secret, **clock)
    host_pages = host_pages or host_pages_for(cfg, pool)
    host = HostPool(pool.layout, host_pages, pin_memory=pool.device.type == "cuda")
    storage = build_storage(cfg, tp) if storage is None else storage
    policy = TierPolicy(**{"write_policy": cfg.hicache_write_policy,
                           "prefetch_policy": cfg.hicache_prefetch_policy,
                           "prefetch_timeout_s": cfg.hicache_prefetch_timeout, **tier_kw})
    log.info("hierarchical cache: L2 %d pages (%.1f MiB host%s), L3 %s, %s, prefetch %s",
             host.num_pages, host.nbytes / 2**20, ", pinned" if pool.device.type == "cuda" else "",
             cfg.hicache_storage_backend, cfg.hicache_write_policy, cfg.hicache_prefetch_policy)
    return TierManager(pool, cache, fingerprint, host, storage, policy, secret=secret, **clock)


def host_pages_for(cfg: HiCacheConfig, pool: KVPool) -> int:
    """L2 slots below ``pool``: ``--hicache-size`` GB of its pages, else
    ``--hicache-ratio`` times its page count."""
    if cfg.hicache_size is not None:
        return max(1, int(cfg.hicache_size * 1e9) // pool.layout.page_nbytes)
    return max(1, int(pool.num_pages * cfg.hicache_ratio))


def build_tier_mirror(cfg: HiCacheConfig, pool: KVPool, secret: KVSecret, host_pages: int,
                      tp: tuple[int, int]) -> TierMirror:
    """A tensor-parallel follower's L2 slots and L3 records (``tiering.tier_mirror``)."""
    return TierMirror(pool, host_pages, build_storage(cfg, tp), secret=secret, tp=tp)
