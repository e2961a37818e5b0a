"""``PageChunk`` data messages on the wire without protobuf copies (the gRPC transport).

A data message is ``PageChunk{page_index=3, offset=4, data=5}`` in the standard
protobuf encoding (``proto/nibble/v1/kv_transfer.proto``), so any protobuf peer
reads and writes it. What changes is how the bytes are made and read:

* sending: ``RawChunk`` names the page bytes as host tensors, views of the
  pool (host memory) or a pinned staging copy of it (device memory);
  ``serialize`` writes the field header and joins them into the message
  bytes, one copy into gRPC's buffer.
* receiving: ``deserialize`` reads the fields of a data message in place and
  hands the payload on as a ``memoryview`` of the received bytes (no copy);
  any other message (the first one, with the ticket) goes through protobuf.
  An unreadable message becomes a ``BadChunk``, which the receiver refuses as
  INVALID like any other malformed chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import torch

from nibble.proto.nibble.v1 import kv_transfer_pb2 as pb

DEFAULT_CHUNK_BYTES = 4 << 20     # page bytes per data message (grpc_transport's default)

_PAGE_INDEX, _OFFSET, _DATA = 3, 4, 5
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


@dataclass
class RawChunk:
    """One data message: bytes for ticket page ``page_index`` at byte ``offset``.

    ``parts`` (sending): contiguous uint8 host tensors (ranges of the sender's pool or
    a pinned copy of them), joined in order; ``data`` (received): the payload, a view of the
    message bytes.
    """

    page_index: int
    offset: int
    parts: list[torch.Tensor] = field(default_factory=list)
    data: memoryview = memoryview(b"")

    def nbytes(self) -> int:
        return sum(int(p.numel()) for p in self.parts) if self.parts else len(self.data)


@dataclass
class BadChunk:
    """A message that is not a readable ``PageChunk``."""

    detail: str


Chunk = Union[pb.PageChunk, RawChunk, BadChunk]


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated or overlong varint")
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def header(page_index: int, offset: int, nbytes: int) -> bytes:
    """The encoded fields of a data message before its payload of ``nbytes`` bytes."""
    out = b""
    if page_index:
        out += _varint(_PAGE_INDEX << 3 | _VARINT) + _varint(page_index)
    if offset:
        out += _varint(_OFFSET << 3 | _VARINT) + _varint(offset)
    return out + _varint(_DATA << 3 | _LEN) + _varint(nbytes)


def plan_chunks(runs: list[tuple[int, int]], page_nbytes: int, chunk: int
                ) -> list[tuple[int, list[tuple[int, int]]]]:
    """Cut the byte stream of source page ``runs`` (``(first page, pages)``, in order) into
    chunks of at most ``chunk`` bytes: ``(stream byte, [(pool byte, nbytes), ...])`` each,
    one segment per run the chunk touches (a run is contiguous in the pool)."""
    plan: list[tuple[int, list[tuple[int, int]]]] = []
    size = stream = 0
    for first, pages in runs:
        at, end = first * page_nbytes, (first + pages) * page_nbytes
        while at < end:
            if not plan or size == chunk:
                plan.append((stream, []))
                size = 0
            take = min(end - at, chunk - size)
            plan[-1][1].append((at, take))
            at, size, stream = at + take, size + take, stream + take
    return plan


def serialize(msg: Chunk) -> bytes:
    """A ``RawChunk`` as header + its parts joined (one copy of the page bytes); any other
    message through protobuf."""
    if not isinstance(msg, RawChunk):
        return msg.SerializeToString()
    head = header(msg.page_index, msg.offset, msg.nbytes())
    return b"".join([head] + [memoryview(p.numpy()) for p in msg.parts])


def deserialize(raw: bytes) -> Chunk:
    """A data message as a ``RawChunk`` (payload viewed in place), anything else parsed by
    protobuf; ``BadChunk`` when unreadable."""
    buf, pos, fields = memoryview(raw), 0, {}
    try:
        while pos < len(buf):
            key, pos = _read_varint(buf, pos)
            num, kind = key >> 3, key & 7
            if kind == _VARINT:
                fields[num], pos = _read_varint(buf, pos)
            elif kind == _LEN:
                n, pos = _read_varint(buf, pos)
                if pos + n > len(buf):
                    raise ValueError("field runs past the message")
                fields[num], pos = buf[pos:pos + n], pos + n
            elif kind in (_I64, _I32):
                pos += 8 if kind == _I64 else 4
            else:
                raise ValueError(f"wire type {kind}")
    except ValueError as e:
        return BadChunk(f"unreadable chunk: {e}")
    if fields.keys() - {_PAGE_INDEX, _OFFSET, _DATA}:
        try:
            return pb.PageChunk.FromString(raw)
        except Exception as e:  # protobuf's DecodeError and friends
            return BadChunk(f"unreadable message: {type(e).__name__}")
    data = fields.get(_DATA, memoryview(b""))
    if not isinstance(data, memoryview) or not isinstance(fields.get(_PAGE_INDEX, 0), int) \
            or not isinstance(fields.get(_OFFSET, 0), int):
        return BadChunk("a data chunk field has the wrong wire type")
    return RawChunk(fields.get(_PAGE_INDEX, 0), fields.get(_OFFSET, 0), data=data)
