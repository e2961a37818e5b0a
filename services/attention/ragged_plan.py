"""One step's prefill and extend sequences as one ragged causal attention (GPU backends).

Built once per step by :meth:`RaggedPlan.build`; each layer then runs one
:func:`~nibble.kernels.ragged.ragged_causal_attention` over every prefill and extend
sequence of the step. Keys of sequence ``b`` are its cached prefix (``c_b`` rows,
dequantized from the pages into a workspace shared by all layers) followed by its
``n_b`` fresh rows; a step with no cached prefix attends over the fresh K/V in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from nibble.kernels.ragged import ragged_causal_attention

from ..host_copy import ints_to_device, to_device
from .base import AttentionMetadata

# gather(block_tables, prefix_lens, starts, out) dequantizes each prefix into out's rows.
GatherFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple], None]


def _cumsum(values: list[int]) -> list[int]:
    out = [0]
    for x in values:
        out.append(out[-1] + x)
    return out


@dataclass
class RaggedPlan:
    """Device indices of the step's prefill + extend sequences (in batch order)."""

    spans: list[tuple[int, int, int, int]]  # (q start, n_b, k start, c_b + n_b) per sequence
    cu_q: torch.Tensor                      # int32 [B + 1] on the device
    cu_k: torch.Tensor                      # int32 [B + 1]
    max_q: int
    max_k: int
    row0: int                               # first stream row when the rows are one block
    rows: torch.Tensor | None               # int64 [sum n]: stream rows, None when one block
    num_q: int                              # sum n_b
    num_k: int                              # sum (c_b + n_b)
    prefix_bt: torch.Tensor | None          # int32 [B, M] block tables (None: no prefix)
    prefix_lens: torch.Tensor | None        # int32 [B] c_b
    prefix_starts: torch.Tensor | None      # int32 [B] workspace row of each prefix (cu_k[:-1])
    fresh_rows: torch.Tensor | None         # int64 [sum n] workspace rows of the fresh K/V

    @classmethod
    def build(cls, meta: AttentionMetadata, bt: torch.Tensor, device: torch.device
              ) -> RaggedPlan | None:
        """The plan for ``meta``'s prefill and extend sequences, or None if it has none."""
        seqs = sorted(meta.prefill + meta.extend)
        if not seqs:
            return None
        n = [meta.new_lens[b] for b in seqs]
        c = [meta.cached_lens[b] for b in seqs]
        cq, ck = _cumsum(n), _cumsum([x + y for x, y in zip(c, n)])
        starts = [meta.seq_starts[b] for b in seqs]
        block = all(starts[i] == starts[0] + cq[i] for i in range(len(seqs)))
        rows = None if block else ints_to_device(
            [s + i for s, m in zip(starts, n) for i in range(m)], device)
        i32 = torch.int32
        plan = cls(spans=[(cq[i], n[i], ck[i], c[i] + n[i]) for i in range(len(seqs))],
                   cu_q=ints_to_device(cq, device, i32), cu_k=ints_to_device(ck, device, i32),
                   max_q=max(n), max_k=max(x + y for x, y in zip(c, n)), row0=starts[0], rows=rows,
                   num_q=cq[-1], num_k=ck[-1], prefix_bt=None, prefix_lens=None,
                   prefix_starts=None, fresh_rows=None)
        if any(c):
            plan.prefix_bt = to_device(bt[seqs], device)      # bt: int32 on the host
            plan.prefix_lens = ints_to_device(c, device, i32)
            plan.prefix_starts = ints_to_device(ck[:-1], device, i32)
            plan.fresh_rows = ints_to_device([ck[i] + c[i] + j for i in range(len(seqs))
                                              for j in range(n[i])], device)
        return plan

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This plan's rows of a ``[T, ...]`` stream tensor."""
        if self.rows is None:
            return x[self.row0:self.row0 + self.num_q]
        return x.index_select(0, self.rows)

    def put(self, out: torch.Tensor, o: torch.Tensor) -> None:
        """Write ``o`` (``[sum n, ...]``) back to this plan's rows of ``out``."""
        if self.rows is None:
            out[self.row0:self.row0 + self.num_q] = o
        else:
            out.index_copy_(0, self.rows, o)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
               scale: float, gather: GatherFn, workspace: tuple[torch.Tensor, torch.Tensor]
               | None, kernel: str = "auto") -> None:
        """``q [T, Hq, D]``, fresh ``k``/``v`` ``[T, H, D]`` in q's dtype; writes ``out``'s rows.

        ``workspace`` is ``(k, v)`` ``[>= num_k, H, D]`` (needed when there is a prefix);
        ``gather`` fills its prefix rows, this writes the fresh rows after them. ``kernel``:
        ``--prefill-attention-kernel``.
        """
        qr, kr, vr = self.take(q), self.take(k), self.take(v)
        if self.prefix_bt is None:
            kk, vv = kr, vr
        else:
            ws = (workspace[0][:self.num_k], workspace[1][:self.num_k])
            gather(self.prefix_bt, self.prefix_lens, self.prefix_starts, ws)
            kk, vv = (w if w.dtype == q.dtype else w.to(q.dtype) for w in ws)
            kk.index_copy_(0, self.fresh_rows, kr)
            vv.index_copy_(0, self.fresh_rows, vr)
        o = ragged_causal_attention(qr, kk, vv, self.cu_q, self.cu_k, self.max_q, self.max_k,
                                    scale, spans=self.spans, kernel=kernel)
        self.put(out, o)
