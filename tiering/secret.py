"""The deployment's KV secret and the keys derived from it.

One secret per deployment (``--kv-secret-file`` or ``$NIBBLE_KV_SECRET``; the
Helm chart mounts it from a Secret) protects everything that leaves the
process with KV content in it. Each use gets its own key, derived with
HMAC-SHA256 under a purpose label, so a key that leaks through one use (say,
a transfer ticket verifier) says nothing about the others:

* ``page-record``: the HMAC over (content key, header, payload) of every page
  record written to L3 (Redis, files), see ``page_record``;
* ``page-key``: the keyed chain of content keys, so a key cannot be computed
  offline from a guessed prompt and ``/kv_events`` or a Redis key listing
  leaks nothing about the prompts;
* ``transfer``: transfer tickets and endpoint descriptions between workers.

The raw secret never appears in ``repr`` (logs, tracebacks).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets as _random

from .errors import CacheArgumentError

MIN_SECRET_BYTES = 16
MAX_SECRET_BYTES = 4096
PURPOSES = ("page-record", "page-key", "transfer")
_DOMAIN = b"nibble-kv-derive-v1\0"


class KVSecret:
    """A deployment secret (at least ``MIN_SECRET_BYTES``); ``derive(purpose)`` gives keys."""

    __slots__ = ("_raw", "ephemeral", "_cache")

    def __init__(self, raw: bytes | str, ephemeral: bool = False):
        raw = raw.encode() if isinstance(raw, str) else bytes(raw)
        if not MIN_SECRET_BYTES <= len(raw) <= MAX_SECRET_BYTES:
            raise CacheArgumentError(f"the KV secret must be {MIN_SECRET_BYTES}.."
                                     f"{MAX_SECRET_BYTES} bytes, got {len(raw)}")
        self._raw = raw
        self.ephemeral = ephemeral      # generated for this process only (nothing survives it)
        self._cache: dict[str, bytes] = {}

    @classmethod
    def generate(cls) -> "KVSecret":
        """A random secret for one process (records it writes are unreadable after a restart);
        hex text, so it can be written to a secret file for child processes."""
        return cls(_random.token_hex(32), ephemeral=True)

    def derive(self, purpose: str) -> bytes:
        """The 32-byte key for ``purpose`` (one of ``PURPOSES``)."""
        if purpose not in PURPOSES:
            raise CacheArgumentError(f"unknown KV secret purpose {purpose!r}; "
                                     f"known: {PURPOSES}")
        key = self._cache.get(purpose)
        if key is None:
            key = self._cache[purpose] = hmac.new(self._raw, _DOMAIN + purpose.encode(),
                                                  hashlib.sha256).digest()
        return key

    def raw(self) -> bytes:
        """The secret itself (only to hand it to a child process through a private file)."""
        return self._raw

    def __repr__(self) -> str:
        return f"KVSecret(<redacted>{', ephemeral' if self.ephemeral else ''})"

    __str__ = __repr__

    def __eq__(self, other: object) -> bool:
        return isinstance(other, KVSecret) and hmac.compare_digest(self._raw, other._raw)

    def __hash__(self) -> int:
        return hash(self.derive("page-key"))
