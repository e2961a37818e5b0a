"""A page as it leaves L1: self-describing bytes with an authentication tag, and its content key.

Record layout (little endian)::

    magic      4s   b"NBPG"
    version    H    RECORD_VERSION
    header_len I    length of the JSON header that follows
    header     JSON {format, layout_version, page_size, num_layers, num_kv_heads,
                     head_dim, scale_version, global_scales: [[k, v] per layer],
                     recipe: digest of the K-recipe parameters or "",
                     tp_size, tp_rank: the tensor-parallel shard the page holds}
    tag        32s  HMAC-SHA256 under the secret's "page-record" key over
                    (content key, magic/version/header_len, header, payload)
    payload    the page's bytes exactly as in the pool (all layers, codes and scales)

The tag binds a record to the content key it was written under: a record
copied onto another key, forged with a recomputed checksum, or made of random
bytes fails ``decode_page``. Codes, block scales, the global scales and their
version, and the digest of the K-recipe parameters travel together, so a page
read back from any tier either reproduces the original bit for bit or is
rejected (tag, format, geometry, scale-version or recipe-parameter mismatch).
``check_finite`` then refuses a page whose scales (or bf16/fp8 values) are not
finite, whoever wrote it.

Keys: ``page_key(prev, tokens)`` chains HMAC-SHA256 under the secret's
"page-key" key over the previous page's key and this page's token ids; the
chain starts at ``namespace_root(...)``, which (under the same key) covers the
model fingerprint, KV format, layout, K-recipe parameters, tenant salt and the
tensor-parallel size, so no two models, formats, layouts, calibrations, tenants or
TP sizes share a key, and no key can be computed, or a guessed prompt confirmed,
without the secret.

Tensor parallelism: every rank holds its own KV heads in the same page ids, so a
page is one record per rank. The chain key is the page's *logical* key (the same on
every rank: what the radix tree, L2 and KV events use); the key a rank stores its
record under in L3 is ``record_key(key, tp_size, tp_rank)``, and the authenticated
header carries ``tp_size`` and ``tp_rank``: a record cannot be read under another
rank's key (its key is in the tag), nor pass for another shard or TP size (its
header is in the tag and must equal the pool's). With one rank the record key is the
chain key, as before.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from nibble.kernels import PageLayout
from nibble.kernels.errors import NibbleError

from .secret import KVSecret

MAGIC = b"NBPG"
RECORD_VERSION = 2
TAG_BYTES = 32
_PREFIX = struct.Struct("<4sHI")
_LEN = struct.Struct("<I")
_MAC_DOMAIN = b"nibble-page-record-v2\0"
_NS_DOMAIN = b"nibble-ns-v2\0"
_PAGE_DOMAIN = b"nibble-page-v2\0"
_RANK_DOMAIN = b"nibble-rank-v1\0"

#: Why a record was refused (the ``reason`` label of the rejected-records metric).
REJECT_REASONS = ("auth", "malformed", "stale", "nonfinite")


class PageRecordError(NibbleError):
    """A stored page is corrupt, forged, or does not fit this pool; the caller recomputes.

    ``reason``: one of ``REJECT_REASONS``: ``auth`` (the tag does not verify: forged,
    moved to another key, or damaged), ``malformed`` (not a record of this version),
    ``stale`` (a genuine record for another pool state: scale version, recipe),
    ``nonfinite`` (NaN or infinite scales or values).
    """

    def __init__(self, message: str, reason: str = "malformed"):
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class PageHeader:
    format: str
    layout_version: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    scale_version: int
    global_scales: tuple[tuple[float, float], ...]
    recipe: str = ""            # KVPool.recipe_digest: the K-recipe parameters ("" = none)
    tp_size: int = 1            # tensor-parallel group size the page was written by
    tp_rank: int = 0            # and the rank (its shard of KV heads)

    @classmethod
    def for_pool(cls, layout: PageLayout, scale_version: int, global_scales: torch.Tensor,
                 recipe: str = "", tp: tuple[int, int] = (1, 0)) -> "PageHeader":
        """``global_scales``: float32 ``[num_layers, 2]``; ``tp``: (size, rank)."""
        scales = tuple((float(k), float(v)) for k, v in global_scales.tolist())
        return cls(layout.kv_format, layout.VERSION, layout.page_size, layout.num_layers,
                   layout.num_kv_heads, layout.head_dim, scale_version, scales, recipe,
                   tp[0], tp[1])


def _tag(secret: KVSecret, key: bytes, prefix: bytes, head: bytes, body) -> bytes:
    h = hmac.new(secret.derive("page-record"), _MAC_DOMAIN, hashlib.sha256)
    h.update(_LEN.pack(len(key)) + key + prefix + head)
    h.update(body)
    return h.digest()


def encode_page(header: PageHeader, payload: torch.Tensor | bytes, *, key: bytes,
                secret: KVSecret) -> bytes:
    """Serialize one page stored under content ``key``.

    ``payload``: uint8 ``[num_layers, layer_nbytes]`` (or raw bytes)."""
    body = payload if isinstance(payload, bytes) else memoryview(
        payload.contiguous().numpy()).cast("B")
    fields = dict(header.__dict__)
    if header.tp_size == 1:           # one rank: the header of the records before TP (readable
        del fields["tp_size"], fields["tp_rank"]   # by every version; they decode as 1, 0)
    head = json.dumps(fields, separators=(",", ":")).encode()
    prefix = _PREFIX.pack(MAGIC, RECORD_VERSION, len(head))
    return b"".join((prefix, head, _tag(secret, key, prefix, head, body), body))


def decode_page(blob: bytes, expect: PageHeader, *, key: bytes, secret: KVSecret) -> memoryview:
    """Verify a record read under content ``key`` against the pool it is loaded into; return
    its payload (a view of ``blob``).

    Raises PageRecordError (see its ``reason``) on a bad magic or version, a tag that
    does not verify for ``key``, or any header field that differs from ``expect``.
    """
    if len(blob) < _PREFIX.size + TAG_BYTES:
        raise PageRecordError("page record is truncated")
    magic, version, head_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC or version != RECORD_VERSION:
        raise PageRecordError(f"not a page record (magic {magic!r}, version {version})")
    view = memoryview(blob)
    start = _PREFIX.size
    if len(blob) < start + head_len + TAG_BYTES:
        raise PageRecordError("page record is truncated")
    head = bytes(view[start:start + head_len])
    tag = bytes(view[start + head_len:start + head_len + TAG_BYTES])
    body = view[start + head_len + TAG_BYTES:]
    if not hmac.compare_digest(_tag(secret, key, bytes(view[:start]), head, body), tag):
        raise PageRecordError("page record does not authenticate for its key (forged, moved "
                              "from another key, or damaged)", "auth")
    try:
        got = json.loads(head)
        got["global_scales"] = tuple(tuple(x) for x in got["global_scales"])
        header = PageHeader(**got)
    except (ValueError, TypeError, KeyError) as e:
        raise PageRecordError(f"page record header is unreadable: {e}") from None
    if header.recipe != expect.recipe:
        raise PageRecordError(
            f"page record was written with K-recipe parameters {header.recipe or 'none'!r}, "
            f"this pool uses {expect.recipe or 'none'!r} (another calibration): recompute",
            "stale")
    if (header.tp_size, header.tp_rank) != (expect.tp_size, expect.tp_rank):
        raise PageRecordError(
            f"page record holds tensor-parallel rank {header.tp_rank} of {header.tp_size}, "
            f"this pool is rank {expect.tp_rank} of {expect.tp_size} (another shard): recompute",
            "stale")
    if header != expect:
        raise PageRecordError(f"page record header {header} does not match the pool {expect}",
                              "stale")
    return body


# E4M3 (fn) has no infinity; NaN is S.1111.111. bf16 NaN/inf: exponent all ones.
def _e4m3_bad(section: np.ndarray) -> bool:
    return bool(((section & 0x7F) == 0x7F).any())


def _bf16_bad(section: np.ndarray) -> bool:
    halves = section.view("<u2")
    return bool(((halves & 0x7F80) == 0x7F80).any())


# element format name -> (codes check, scales check); None = every bit pattern is finite
_FINITE_CHECKS = {"nvfp4": (None, _e4m3_bad), "fp8_e4m3": (_e4m3_bad, None),
                  "bf16": (_bf16_bad, None)}


def check_finite(layout: PageLayout, payload, header: PageHeader | None = None) -> None:
    """Refuse a page whose block scales or values decode to NaN/inf, or whose global scales
    are not finite positive numbers. ``payload``: the page's bytes (``page_nbytes``).

    Raises PageRecordError(reason="nonfinite")."""
    if header is not None and not all(math.isfinite(s) and s > 0
                                      for pair in header.global_scales for s in pair):
        raise PageRecordError("page record has non-finite global scales", "nonfinite")
    data = np.frombuffer(payload, np.uint8)
    if data.size != layout.page_nbytes:
        raise PageRecordError(f"page payload is {data.size} bytes, the layout needs "
                              f"{layout.page_nbytes}")
    layers = data.reshape(layout.num_layers, layout.layer_nbytes)
    fmt = layout.fmt
    elem = {"k_data": (fmt.k, 0), "v_data": (fmt.v, 0), "k_scale": (fmt.k, 1),
            "v_scale": (fmt.v, 1)}
    offset = 0
    for name, size, _ in layout.sections():
        ef, which = elem[name]
        check = _FINITE_CHECKS.get(ef.name, (None, None))[which]
        if check is not None and check(np.ascontiguousarray(layers[:, offset:offset + size])):
            raise PageRecordError(f"page has non-finite {name.replace('_', ' ')}", "nonfinite")
        offset += size


def namespace_root(model_fingerprint: str, layout: PageLayout, tenant: str,
                   recipe: str = "", *, secret: KVSecret, tp_size: int = 1) -> bytes:
    """The chain's first key: model, format, layout geometry, tenant salt, the
    K-recipe parameters' digest (``KVPool.recipe_digest``; "" adds nothing) and the
    tensor-parallel size (1 adds nothing), keyed. The rank is not in it: the chain is
    the page's logical key, the same on every rank (``record_key`` adds the rank)."""
    ident = [model_fingerprint, layout.kv_format, layout.VERSION, layout.page_size,
             layout.num_layers, layout.num_kv_heads, layout.head_dim, tenant]
    if recipe:
        ident.append(recipe)
    if tp_size != 1:
        ident.append(f"tp{tp_size}")
    return hmac.digest(secret.derive("page-key"), _NS_DOMAIN + json.dumps(ident).encode(),
                       "sha256")


def record_key(key: bytes, tp_size: int, tp_rank: int, *, secret: KVSecret) -> bytes:
    """The L3 key of rank ``tp_rank``'s record of the page with logical ``key`` (keyed:
    HMAC over the key, the size and the rank); ``key`` itself when ``tp_size`` is 1."""
    if tp_size == 1:
        return key
    return hmac.digest(secret.derive("page-key"),
                       _RANK_DOMAIN + key + struct.pack("<II", tp_size, tp_rank), "sha256")


def page_key(prev: bytes, tokens: Sequence[int], *, secret: KVSecret) -> bytes:
    """Key of a page: HMAC of the previous key and this page's token ids (int32 LE)."""
    return hmac.digest(secret.derive("page-key"),
                       _PAGE_DOMAIN + prev + struct.pack(f"<{len(tokens)}i", *tokens), "sha256")


def chain_keys(root: bytes, tokens: Sequence[int], page_size: int, *,
               secret: KVSecret) -> list[bytes]:
    """Keys of every full page of ``tokens``."""
    k = secret.derive("page-key")
    keys, prev = [], root
    for i in range(len(tokens) // page_size):
        chunk = tokens[i * page_size:(i + 1) * page_size]
        prev = hmac.digest(k, _PAGE_DOMAIN + prev + struct.pack(f"<{len(chunk)}i", *chunk),
                           "sha256")
        keys.append(prev)
    return keys
