"""Overlap scheduling: the host schedules and prepares step N+1 while the device runs step N.

A pure decode step, or one that also runs prompt chunks which sample nothing, is
*launched*, not waited for: its sampled ids stay in a device tensor
(``Launched.tokens``) that the next step reads as its input ids, and a non-blocking copy
brings them to pinned host memory for the text one step later. Each sequence of a launched
step gets a placeholder token (``Sequence.num_pending``) and its ``num_computed`` advances
at once, so the scheduler can plan the next step before the token is known.

``OverlapStepper.step``: schedule N+1 -> launch it (reading N's ids on the device) ->
resolve N (wait for its copy, fill the placeholders, stop conditions, detokenize). So stop
conditions are resolved one step late: a sequence that ended at N has also run in N+1, and
that extra token is dropped (``Sequence.incarnation`` tells which tokens are stale). Any
other step (a prompt's last chunk, a first token, rows needing the host's tokens, a failed
launch) resolves N first, hands N's tokens out, and runs synchronously at the next call
(``deferred``), so no stream waits two steps for one token. Pages stay correct because
every step and every tier copy runs in order on one device stream: a page freed while N+1
still writes it is reused only by later work.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from ..errors import DeviceFaultError
from ..host_copy import ints_to_device, to_device
from .faults import describe, is_device_fault
from .logits_process import StepLogprobs
from .step_stats import StepShape
from .types import RequestOutput, ScheduledBatch, ScheduledSeq

log = logging.getLogger(__name__)


@dataclass
class Launched:
    """A decode step whose sampled ids are still on their way to the host."""

    picked: list[ScheduledSeq]       # the step's sampling entries, in row order
    incarnations: list[int]          # each entry's Sequence.incarnation at launch
    tokens: torch.Tensor             # int64 [B] on the device: sampled ids, -1 for a bad row
    host: torch.Tensor               # int64 [>= B] host copy (pinned on CUDA)
    event: torch.cuda.Event | None   # recorded after the copy (None on CPU: already done)
    rows: dict[str, int] = field(default_factory=dict)   # request id -> row in ``tokens``
    logprobs: StepLogprobs | None = None   # host copy, valid once ``event`` is done
    shape: StepShape | None = None   # what the step ran (for the engine's step timer)
    host_s: tuple[float, float] | None = None   # its scheduling and enqueue host seconds

    def wait(self) -> list[int]:
        """The sampled ids on the host (blocks until the device is done with the step)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host[:len(self.picked)].tolist()


class HostRing:
    """Two reusable host buffers for the sampled ids (pinned on CUDA): step N+1 writes one
    while the host still reads step N's from the other."""

    def __init__(self, device: torch.device):
        self.device = device
        self._bufs: list[torch.Tensor] = []
        self._next = 0

    def take(self, n: int) -> torch.Tensor:
        pin = self.device.type == "cuda"
        if not self._bufs or self._bufs[0].numel() < n:
            size = max(n, 64)
            self._bufs = [torch.empty(size, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._next ^= 1
        return self._bufs[self._next]


def is_pure_decode(batch: ScheduledBatch, seqs: dict) -> bool:
    """Every entry runs one generated token and samples (no prefill chunk, no first token),
    and no entry's sampling needs the host's tokens (penalties, min_tokens, a grammar)."""
    return bool(batch.seqs) and all(_decodes(e, seqs) for e in batch.seqs)


def _decodes(e: ScheduledSeq, seqs: dict) -> bool:
    return len(e.token_ids) == 1 and e.sample and \
        e.start_pos >= seqs[e.request_id].num_prompt and e.sampling.overlappable


def _mid_chunk(e: ScheduledSeq) -> bool:
    """A chunk that samples nothing and whose ids are all known: the host needs nothing
    back from it (no token, no prompt logprobs)."""
    return not e.sample and e.sampling.prompt_logprobs is None and min(e.token_ids) >= 0


def _last_chunk(e: ScheduledSeq, seqs: dict) -> bool:
    """A prompt's last chunk, whose first generated token can stay on the device like a
    decode's (ids all known, sampling that needs no host tokens, no prompt logprobs)."""
    seq = seqs[e.request_id]
    return e.sample and e.sampling.overlappable and min(e.token_ids) >= 0 and \
        e.start_pos < seq.num_prompt == e.start_pos + len(e.token_ids) == len(seq.token_ids)


def _last_chunk_done(e: ScheduledSeq, seqs: dict) -> bool:
    """After the optimistic advance: ``e`` ran a prompt's last chunk."""
    seq = seqs[e.request_id]
    return e.sample and e.start_pos < seq.num_prompt == e.start_pos + len(e.token_ids)


def is_overlappable(batch: ScheduledBatch, seqs: dict) -> bool:
    """Pure decodes, prefill chunks and prompts' last chunks: launched without waiting, so
    a long prompt's chunks overlap the host's work like decode steps do and a prompt's end
    leaves no gap in the pipeline (a synchronous step there cost every decoding stream a
    step of host work plus a whole step of the device: their slowest inter-token gaps)."""
    return bool(batch.seqs) and all(_decodes(e, seqs) or _mid_chunk(e) or _last_chunk(e, seqs)
                                    for e in batch.seqs)


class OverlapStepper:
    """The overlapped step loop of an ``EngineCore`` (``--disable-overlap-schedule`` off).

    It uses the core's scheduler, runner and output handling; the core keeps the state.
    """

    def __init__(self, core):
        self.core = core
        self.inflight: Launched | None = None
        self.ring = HostRing(core.runner.device)
        self.launches = 0           # steps launched without waiting (for tests and metrics)
        self.chunk_launches = 0     # of which ran prompt chunks
        self.first_token_launches = 0   # of which ended a prompt (its first token sampled)
        # A batch that must run synchronously, planned while a launched step was in flight:
        # that step's tokens go out first, the batch runs at the next call.
        self.deferred: ScheduledBatch | None = None

    def step(self) -> list[RequestOutput]:
        core = self.core
        if self.deferred is not None:
            batch, self.deferred = self.deferred, None
            return self._run_sync(batch)
        batch = core.schedule()
        prev = self.inflight
        if is_overlappable(batch, core._seqs):
            launched = self._launch(batch, prev)
            if launched is not None:
                self.inflight = launched
                return self._resolve(prev) if prev is not None else []
        if prev is None:
            return self._run_sync(batch)
        # Deliver the landed step's tokens now rather than after this batch has run too:
        # every running stream would otherwise wait two steps for one token (a prompt's last
        # chunk after launched chunks doubled the inter-token latency of all decodes).
        self.inflight, self.deferred = None, batch
        return self._resolve(prev)

    def _run_sync(self, batch: ScheduledBatch) -> list[RequestOutput]:
        """Run ``batch`` now, waiting for it (nothing is in flight)."""
        core = self.core
        batch = self._settle(batch)
        sampled, failed, logprobs = core._execute(batch)
        return core._process(batch, sampled, failed, logprobs)

    def drain(self) -> list[RequestOutput]:
        """Resolve the step in flight and run a deferred batch, if any (idle engine,
        shutdown)."""
        prev, self.inflight = self.inflight, None
        outputs = self._resolve(prev) if prev is not None else []
        if self.deferred is not None:
            batch, self.deferred = self.deferred, None
            outputs += self._run_sync(batch)
        return outputs

    # ---- launch ----
    def _launch(self, batch: ScheduledBatch, prev: Launched | None) -> Launched | None:
        """Start ``batch`` on the device and advance its sequences; None when it could not
        start (the caller runs it synchronously, with fault isolation)."""
        core, seqs = self.core, batch.seqs
        runner, page_size = core.runner, core.pool.layout.page_size
        announced = False
        try:
            with torch.inference_mode():
                known, src = self._id_sources(seqs, prev)
                runner.announce(("launch", batch, page_size, src))
                announced = runner.tp.size > 1
                ids = launch_ids(known, src, prev.tokens if prev is not None else None,
                                 runner.device)
                picked = [e for e in seqs if e.sample]
                logits = runner.forward_ids(seqs, page_size, ids)
                if picked:
                    tokens, lps = runner.sample_tokens(picked, logits)
                    runner.tp.broadcast_tensor(tokens)     # the followers' next input ids
                else:                   # prompt chunks only: nothing comes back
                    tokens, lps = torch.empty(0, dtype=torch.int64, device=runner.device), None
                host = self.ring.take(len(picked))
                host[:len(picked)].copy_(tokens, non_blocking=True)
                lps = lps.start_copy() if lps is not None else None
                event = None
                if tokens.is_cuda:
                    event = torch.cuda.Event()
                    event.record()
        except Exception as exc:  # noqa: BLE001 - classified: device fault, else run it in sync
            if is_device_fault(exc) or announced:   # followers are inside the step: no retry
                raise DeviceFaultError(f"device fault in an engine step: {describe(exc)}") from exc
            log.warning("launching an overlapped step failed (%s); running it synchronously",
                        describe(exc))
            return None
        launched = Launched(picked, [core._seqs[e.request_id].incarnation for e in picked],
                            tokens, host, event, {e.request_id: i for i, e in enumerate(picked)},
                            lps, core.step_shape(seqs), core.host_times())
        for e in seqs:              # optimistic: the step ran, its token is on its way
            seq = core._seqs[e.request_id]
            core.num_prompt_tokens_computed += max(
                0, min(len(e.token_ids), seq.num_prompt - seq.num_computed))
            seq.num_computed += len(e.token_ids)
            if e.sample:            # a decode or a prompt's last chunk: a token to come
                seq.token_ids.append(-1)
                seq.num_pending += 1
        self.launches += 1
        self.chunk_launches += any(len(e.token_ids) > 1 or not e.sample for e in seqs)
        self.first_token_launches += any(_last_chunk_done(e, core._seqs) for e in seqs)
        return launched

    @staticmethod
    def _id_sources(seqs: list[ScheduledSeq], prev: Launched | None
                    ) -> tuple[list[int], list[int] | None]:
        """The step's known ids (-1 for a placeholder: a decode's only id, not yet on the host)
        and, when there are placeholders, each one's row in the previous step's device tensor
        (-1 for a known id); None when every id is known."""
        known = [t for e in seqs for t in e.token_ids]
        if all(t >= 0 for t in known):
            return known, None
        assert prev is not None, "a placeholder input without a step in flight"
        return known, [prev.rows[e.request_id] if t < 0 else -1
                       for e in seqs for t in e.token_ids]

    # ---- resolve ----
    def _resolve(self, launched: Launched) -> list[RequestOutput]:
        """Land ``launched``'s tokens: fill placeholders, apply stops, emit outputs."""
        core = self.core
        outputs: list[RequestOutput] = []
        tokens = launched.wait()
        if launched.shape is not None:
            core.step_timer.landed(launched.shape, launched.host_s)
        lps = launched.logprobs.to_host(tokens) if launched.logprobs is not None else {}
        failed: dict[str, str] = {}
        for row, (e, inc, token) in enumerate(zip(launched.picked, launched.incarnations, tokens)):
            seq = core._seqs.get(e.request_id)
            if seq is None or seq.incarnation != inc:
                continue            # ended or rolled back meanwhile: the token is stale
            if token < 0:
                self._roll_back(seq, e)
                failed[e.request_id] = "non-finite logits (NaN or inf)"
                continue
            if seq.num_output == 0:     # its prompt is done: share the prompt's pages
                core.scheduler.cache_computed(seq, seq.num_prompt)
            outputs.append(core._emit_token(seq, token, lps.get(row)))
        if failed:
            core._count_faults(failed, len(failed) < len(launched.picked))
            for rid, why in failed.items():
                out = core._on_fault(core._seqs[rid], why)
                if out is not None:
                    outputs.append(out)
        return outputs

    @staticmethod
    def _roll_back(seq, entry: ScheduledSeq) -> None:
        """Undo the optimistic advance of a failed entry and of anything after it: the
        sequence is back where it was when ``entry`` was scheduled (a prompt chunk's ids
        stay: they are the prompt's)."""
        del seq.token_ids[entry.start_pos + len(entry.token_ids):]
        seq.num_pending = 0
        seq.num_computed = entry.start_pos
        seq.incarnation += 1

    def _settle(self, batch: ScheduledBatch) -> ScheduledBatch:
        """A batch scheduled while a step was in flight, to run synchronously now that it
        has landed: placeholders become the landed ids; entries of sequences that ended or
        were rolled back meanwhile are dropped."""
        core, out = self.core, []
        for e in batch.seqs:
            seq = core._seqs.get(e.request_id)
            if seq is None or seq.num_computed != e.start_pos or \
                    seq.num_computed + len(e.token_ids) > len(seq.token_ids):
                continue
            ids = seq.token_ids[e.start_pos:e.start_pos + len(e.token_ids)]
            if any(t < 0 for t in ids):
                continue
            out.append(dataclasses.replace(e, token_ids=ids))
        return ScheduledBatch(out)


def launch_ids(known: list[int], src: list[int] | None, prev_tokens: torch.Tensor | None,
               device: torch.device) -> torch.Tensor:
    """int64 ``[T]`` on ``device``: the known ids, placeholders filled from ``prev_tokens``
    (the previous launched step's sampled ids, int64 on the device) at rows ``src``, with no
    wait for that step. Tensor-parallel followers build the same ids from rank 0's ``src`` and
    their copy of ``prev_tokens``."""
    if src is None:
        return ints_to_device(known, device)
    packed = to_device(torch.tensor([known, src], dtype=torch.int64), device)
    # a bad row's -1 becomes 0: that sequence is rolled back and this step's token dropped
    from_prev = prev_tokens.clamp(min=0)[packed[1].clamp(min=0)]
    return torch.where(packed[1] >= 0, from_prev, packed[0])
