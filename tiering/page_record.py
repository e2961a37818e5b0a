"""A page as it leaves L1: self-describing bytes with a checksum, and its content key.

Record layout (little endian)::

    magic      4s   b"NBPG"
    version    H    RECORD_VERSION
    header_len I    length of the JSON header that follows
    header     JSON {format, layout_version, page_size, num_layers, num_kv_heads,
                     head_dim, scale_version, global_scales: [[k, v] per layer],
                     recipe: digest of the K-recipe parameters or ""}
    checksum   32s  SHA-256 over header + payload
    payload    the page's bytes exactly as in the pool (all layers, codes and scales)

Codes, block scales, the global scales and their version, and the digest of the
K-recipe parameters travel together, so a page read back from any tier either
reproduces the original bit for bit or is rejected (checksum, format, geometry,
scale-version or recipe-parameter mismatch).

Keys: ``page_key(prev, tokens)`` chains SHA-256 over the previous page's key and
this page's token ids; the chain starts at ``namespace_root(...)``, which hashes
the model fingerprint, KV format, layout, K-recipe parameters and tenant salt, so
no two models, formats, layouts, calibrations or tenants can share a key.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from typing import Sequence

import torch

from nibble.kernels import PageLayout
from nibble.kernels.errors import NibbleError

MAGIC = b"NBPG"
RECORD_VERSION = 1
_PREFIX = struct.Struct("<4sHI")


class PageRecordError(NibbleError):
    """A stored page is corrupt or does not fit this pool; the caller recomputes."""


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

    @classmethod
    def for_pool(cls, layout: PageLayout, scale_version: int, global_scales: torch.Tensor,
                 recipe: str = "") -> "PageHeader":
        scales = tuple((float(k), float(v)) for k, v in global_scales.tolist())
        return cls(layout.kv_format, layout.VERSION, layout.page_size, layout.num_layers,
                   layout.num_kv_heads, layout.head_dim, scale_version, scales, recipe)


def _digest(head: bytes, body) -> bytes:
    h = hashlib.sha256(head)
    h.update(body)
    return h.digest()


def encode_page(header: PageHeader, payload: torch.Tensor | bytes) -> bytes:
    """Serialize one page. ``payload``: uint8 ``[num_layers, layer_nbytes]`` (or raw bytes)."""
    body = payload if isinstance(payload, bytes) else memoryview(
        payload.contiguous().numpy()).cast("B")
    head = json.dumps(header.__dict__, separators=(",", ":")).encode()
    return b"".join((_PREFIX.pack(MAGIC, RECORD_VERSION, len(head)), head, _digest(head, body),
                     body))


def decode_page(blob: bytes, expect: PageHeader) -> memoryview:
    """Check a record against the pool it is loaded into; return its payload (a view of ``blob``).

    Raises PageRecordError on a bad magic, checksum, or any header field that
    differs from ``expect`` (other format, geometry, or global-scale version).
    """
    if len(blob) < _PREFIX.size + 32:
        raise PageRecordError("page record is truncated")
    magic, version, head_len = _PREFIX.unpack_from(blob)
    if magic != MAGIC or version != RECORD_VERSION:
        raise PageRecordError(f"not a page record (magic {magic!r}, version {version})")
    view = memoryview(blob)
    start = _PREFIX.size
    head = bytes(view[start:start + head_len])
    digest, body = view[start + head_len:start + head_len + 32], view[start + head_len + 32:]
    if _digest(head, body) != digest:
        raise PageRecordError("page record checksum mismatch")
    try:
        got = json.loads(head)
        got["global_scales"] = tuple(tuple(x) for x in got["global_scales"])
        header = PageHeader(**got)
    except (ValueError, TypeError) as e:
        raise PageRecordError(f"page record header is unreadable: {e}") from None
    if header.recipe != expect.recipe:
        raise PageRecordError(
            f"page record was written with K-recipe parameters {header.recipe or 'none'!r}, "
            f"this pool uses {expect.recipe or 'none'!r} (another calibration): recompute")
    if header != expect:
        raise PageRecordError(f"page record header {header} does not match the pool {expect}")
    return body


def namespace_root(model_fingerprint: str, layout: PageLayout, tenant: str,
                   recipe: str = "") -> bytes:
    """The chain's first key: model, format, layout geometry, tenant salt and the
    K-recipe parameters' digest (``KVPool.recipe_digest``; "" adds nothing)."""
    ident = [model_fingerprint, layout.kv_format, layout.VERSION, layout.page_size,
             layout.num_layers, layout.num_kv_heads, layout.head_dim, tenant]
    ident = json.dumps(ident + [recipe] if recipe else ident)
    return hashlib.sha256(b"nibble-ns\0" + ident.encode()).digest()


def page_key(prev: bytes, tokens: Sequence[int]) -> bytes:
    """Key of a page: SHA-256 of the previous key and this page's token ids (int32 LE)."""
    return hashlib.sha256(prev + struct.pack(f"<{len(tokens)}i", *tokens)).digest()


def chain_keys(root: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Keys of every full page of ``tokens``."""
    keys, prev = [], root
    for i in range(len(tokens) // page_size):
        prev = page_key(prev, tokens[i * page_size:(i + 1) * page_size])
        keys.append(prev)
    return keys
