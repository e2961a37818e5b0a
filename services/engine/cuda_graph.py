"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A pure-decode step (every sequence runs one token on top of its cached
prefix) has the same shapes every time once the batch is padded to a bucket,
so its whole forward (embedding, all layers with store + paged decode, final
norm, LM head) is captured once per bucket and replayed: one launch instead of
hundreds of small ones, which is most of a decode step's time at small batches.

Static buffers (capacity ``max_bs`` rows, see :class:`DecodeBuffers`) are what
the graphs read; a replay copies the step's values into their first ``B``
rows and pads rows ``B..bucket`` so that padding is harmless: slot ``-1``
(the store kernel skips it) and length 1 (the decode kernel reads one token of
page 0 and the row is never sampled).

On a device without CUDA graphs (CPU, for tests) :class:`DecodeGraphRunner`
runs the same static-buffer path eagerly (``use_graphs=False``), so the
padding and copying logic is tested everywhere.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from ..attention import AttentionBackend
from ..errors import ConfigError
from ..host_copy import copy_to
from .step_inputs import kv_slots, padded_block_tables
from .types import ScheduledSeq

log = logging.getLogger(__name__)

BASE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


def graph_buckets(max_bs: int) -> tuple[int, ...]:
    """Batch sizes that get a graph: the base list below ``max_bs``, then ``max_bs`` itself."""
    if max_bs < 1:
        raise ConfigError(f"--cuda-graph-max-bs must be >= 1, got {max_bs}")
    return tuple(b for b in BASE_BUCKETS if b < max_bs) + (max_bs,)


@dataclass
class DecodeBuffers:
    """What the captured graphs read; rows ``[0, B)`` are live, the rest padding."""

    input_ids: torch.Tensor      # int64 [max_bs]: the token each sequence runs
    positions: torch.Tensor      # int64 [max_bs]: its position (= cached tokens)
    slots: torch.Tensor          # int64 [max_bs]: page * page_size + offset; -1 = padding
    block_tables: torch.Tensor   # int32 [max_bs, max_pages]: page ids per sequence
    seq_lens: torch.Tensor       # int32 [max_bs]: cached + 1 (padding: 1)

    @classmethod
    def allocate(cls, max_bs: int, max_pages: int, device: torch.device) -> DecodeBuffers:
        i64 = dict(dtype=torch.int64, device=device)
        return cls(torch.zeros(max_bs, **i64), torch.zeros(max_bs, **i64),
                   torch.full((max_bs,), -1, **i64),
                   torch.zeros((max_bs, max_pages), dtype=torch.int32, device=device),
                   torch.ones(max_bs, dtype=torch.int32, device=device))


class DecodeGraphRunner:
    """Captures and replays the decode forward per batch-size bucket.

    Args:
        model: a ``CausalLM`` (``forward(ids, positions, attn)``, ``compute_logits``).
        backend: an attention backend with ``supports_cuda_graph`` (the Triton one).
        device: where the model and the pool live.
        max_bs: the largest batch replayed (``--cuda-graph-max-bs``).
        max_context: tokens per sequence at most (sets the block-table width and
            the split-K grid, which must not depend on the step's lengths).
        page_size: tokens per KV page.
        use_graphs: capture real CUDA graphs (CUDA only); False runs the same
            static-buffer path eagerly.
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 max_bs: int, max_context: int, page_size: int, use_graphs: bool = True):
        if not getattr(backend, "supports_cuda_graph", False):
            raise ConfigError(f"the {backend.name!r} attention backend cannot be captured in "
                              f"CUDA graphs")
        if use_graphs and device.type != "cuda":
            raise ConfigError("CUDA graphs need a CUDA device")
        self.model, self.backend, self.device = model, backend, device
        self.buckets = graph_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.max_context = max_context
        self.max_pages = -(-max_context // page_size)
        self.use_graphs = use_graphs
        self.buf = DecodeBuffers.allocate(self.max_bs, self.max_pages, device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._logits: dict[int, torch.Tensor] = {}
        self.replays = 0        # steps served from a graph (or the static path)

    # ------------------------------------------------------------------ capture

    def _forward(self, b: int) -> torch.Tensor:
        """The captured body for bucket ``b``: logits ``[b, vocab]`` float32."""
        buf = self.buf
        meta = self.backend.bind_decode_graph(buf.block_tables[:b], buf.seq_lens[:b],
                                              buf.slots[:b], self.max_context)
        hidden = self.model(buf.input_ids[:b], buf.positions[:b], self.backend.bind(meta))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first, sharing one memory pool."""
        self.model.reserve_positions(self.model.arch.max_position_embeddings)
        if not self.use_graphs:
            return
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):      # warm-up: JIT compiles, library workspaces
                for _ in range(2):
                    self._forward(b)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._logits[b] = self._forward(b)
            self._graphs[b] = graph
        torch.cuda.synchronize(self.device)
        log.info("captured decode CUDA graphs for batch sizes %s in %.1fs",
                 list(self.buckets), time.perf_counter() - start)

    def recapture(self) -> None:
        """Drop every graph and capture again (after the model's kernels changed, e.g. fused
        kernels switched off for an A/B run). The static buffers are reset to padding first,
        so the warm-up forwards store nothing into live pages."""
        self.buf.slots.fill_(-1)
        self.buf.seq_lens.fill_(1)
        self._graphs.clear()
        self._logits.clear()
        self.capture()

    # ------------------------------------------------------------------ replay

    def applies(self, seqs: list[ScheduledSeq]) -> bool:
        """Whether this step is a pure decode that fits the captured shapes."""
        return (0 < len(seqs) <= self.max_bs
                and all(len(s.token_ids) == 1 and s.num_cached > 0 and s.sample
                        and len(s.block_table) <= self.max_pages for s in seqs))

    def bucket(self, batch: int) -> int:
        return next(b for b in self.buckets if b >= batch)

    def _fill(self, seqs: list[ScheduledSeq], page_size: int, b: int,
              ids: torch.Tensor | None = None) -> None:
        """Copy the step into the static buffers (one H2D copy each) and pad to ``b`` rows;
        ``ids``: the input ids already on the device (overlap scheduling)."""
        n = len(seqs)
        table = padded_block_tables(seqs)
        width = table.shape[1]
        pos = torch.tensor([s.start_pos for s in seqs], dtype=torch.int64)
        buf = self.buf
        if ids is None:
            ids = torch.tensor([s.token_ids[0] for s in seqs])
        copy_to(buf.input_ids[:n], ids)
        copy_to(buf.positions[:n], pos)
        copy_to(buf.slots[:n], kv_slots(table, torch.arange(n), pos, page_size))
        copy_to(buf.seq_lens[:n], (pos + 1).to(torch.int32))
        copy_to(buf.block_tables[:n, :width], table)
        if b > n:
            buf.input_ids[n:b].zero_()
            buf.positions[n:b].zero_()
            buf.slots[n:b].fill_(-1)
            buf.seq_lens[n:b].fill_(1)

    @torch.inference_mode()
    def run(self, seqs: list[ScheduledSeq], page_size: int,
            ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[len(seqs), vocab]`` float32 for a step where :meth:`applies` holds;
        ``ids``: int64 ``[len(seqs)]`` input ids on the device, else from ``token_ids``."""
        b = self.bucket(len(seqs))
        self._fill(seqs, page_size, b, ids)
        self.backend.prepare_graph_replay()
        self.replays += 1
        if not self.use_graphs:
            return self._forward(b)[:len(seqs)]
        self._graphs[b].replay()
        return self._logits[b][:len(seqs)]
