"""Step timing: how long each engine step takes to land, by kind, for /metrics and a trace.

A streaming user waits one step between two tokens, so the interval between two steps'
landings (their sampled tokens reach the host) is the inter-token latency the engine
causes. ``StepTimer.landed`` records it per step *kind*: ``decode`` (generated tokens
only), ``prefill`` (prompt chunks only) or ``mixed`` (both: the steps that stretch a
decode's ITL). The histogram goes to ``/metrics`` as ``nibble:step_interval_seconds``;
``--step-trace-file`` also writes one JSON line per step with its shape and the host pauses
inside it (garbage collection, device-allocator segments: :mod:`.pauses`), to find which
steps are slow and why (``nibble.bench.serving`` summarizes it).

An interval starts at the previous landing, or, after the engine idled, when the step
that follows began (``begin``), so time the engine spent without work is never counted.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Callable, TextIO

from .pauses import PauseMeter, cuda_alloc_stats
from .step_budget import chunk_cost

log = logging.getLogger(__name__)

KINDS = ("decode", "mixed", "prefill")
# Upper bounds in seconds: a decode step is 5-40 ms, a long mixed step up to seconds.
BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0,
           5.0, math.inf)
MAX_TRACE_LINES = 1_000_000     # about 150 MB of trace; later steps are counted, not written


@dataclass(frozen=True)
class StepShape:
    """What one step ran (from its ``ScheduledBatch``)."""

    decodes: int           # rows running one generated token (a decoding request each)
    chunk_tokens: int      # prompt tokens of the step's chunks (prefill and extend rows)
    prefix_tokens: int     # tokens cached before those chunks, summed: their attention reads
    cost: float            # the chunks' step-budget cost (step_budget.chunk_cost)

    @property
    def kind(self) -> str:
        if not self.chunk_tokens:
            return "decode"
        return "mixed" if self.decodes else "prefill"


def shape_of(entries, num_prompt: Callable[[str], int], cost_ctx: int) -> StepShape:
    """The shape of a step's ``ScheduledSeq`` entries; ``num_prompt(request_id)`` tells a
    prompt chunk (it starts inside the prompt) from a generated token."""
    decodes = tokens = prefix = 0
    cost = 0.0
    for e in entries:
        n = len(e.token_ids)
        if e.start_pos >= num_prompt(e.request_id):
            decodes += 1
            continue
        tokens += n
        prefix += e.start_pos
        cost += chunk_cost(n, e.start_pos, cost_ctx)
    return StepShape(decodes, tokens, prefix, cost)


class StepTimer:
    """Step intervals by kind (cumulative histograms), and an optional JSON-lines trace.

    ``clock``: seconds, monotonic (injected by tests). ``trace``: an open text file or None.
    ``pauses``: a meter whose counts since the previous step go into each trace line.
    """

    def __init__(self, trace: TextIO | None = None, clock: Callable[[], float] = time.perf_counter,
                 max_trace_lines: int = MAX_TRACE_LINES, pauses: PauseMeter | None = None):
        self.clock = clock
        self.trace = trace
        self.pauses = pauses
        self.max_trace_lines = max_trace_lines
        self.trace_lines = 0
        self._start = clock()
        self._last: float | None = None          # previous landing or end of an idle wait
        self.counts = {k: [0] * len(BUCKETS) for k in KINDS}   # per bucket, not cumulative
        self.sums = dict.fromkeys(KINDS, 0.0)

    @classmethod
    def open(cls, path: str | None, device=None) -> "StepTimer":
        """A timer writing its trace to ``path`` (truncated), or without a trace; a traced
        timer meters the host pauses (and ``device``'s allocator on CUDA)."""
        if not path:
            return cls(None)
        return cls(open(path, "w", buffering=1 << 16),
                   pauses=PauseMeter(alloc_stats=cuda_alloc_stats(device)))

    def idle(self) -> None:
        """The engine had no work: the next interval starts when it gets some."""
        self._last = None

    def begin(self) -> None:
        """A step starts (called before scheduling it): after idling, intervals count from
        now."""
        if self._last is None:
            self._last = self.clock()
            if self.pauses is not None:         # pauses while idle belong to no step
                self.pauses.take()

    def landed(self, shape: StepShape, host: tuple[float, float] | None = None) -> None:
        """A step's tokens reached the host now. ``host``: seconds its scheduling and its
        forward's planning and enqueueing took on the host (trace only)."""
        now = self.clock()
        last, self._last = self._last, now
        interval = now - last if last is not None else 0.0
        kind = shape.kind
        self.counts[kind][next(i for i, b in enumerate(BUCKETS) if interval <= b)] += 1
        self.sums[kind] += interval
        if self.trace is not None and self.trace_lines < self.max_trace_lines:
            self.trace_lines += 1
            rec = {"t": round(now - self._start, 6), "kind": kind,
                   "interval_ms": round(interval * 1e3, 3), **asdict(shape)}
            rec["cost"] = round(rec["cost"], 1)
            if host is not None:
                rec["sched_ms"], rec["enqueue_ms"] = (round(x * 1e3, 3) for x in host)
            if self.pauses is not None:
                rec.update(self.pauses.take())
            self.trace.write(json.dumps(rec) + "\n")

    def snapshot(self) -> dict[str, dict]:
        """Per kind with steps: ``{"buckets": [[le, cumulative count], ...], "sum": s,
        "count": n}`` (``le`` in seconds, finite bounds only: the ``+Inf`` bucket is
        ``count``; plain JSON), for the Prometheus histogram."""
        out = {}
        for kind in KINDS:
            total, cum = 0, []
            for le, c in zip(BUCKETS, self.counts[kind]):
                total += c
                if le != math.inf:
                    cum.append([le, total])
            if total:
                out[kind] = {"buckets": cum, "sum": self.sums[kind], "count": total}
        return out

    def close(self) -> None:
        if self.pauses is not None:
            self.pauses.close()
        if self.trace is not None:
            try:
                self.trace.close()
            except OSError as exc:
                log.warning("closing the step trace failed: %s", exc)
            self.trace = None
