"""The synchronous engine core: add requests, step, abort.

This is the interface prefill and decode workers reuse: ``add_request``,
``step() -> list[RequestOutput]``, ``abort``. It is single-threaded; the async
wrapper runs it on its own thread. A step is schedule -> run -> process
outputs; the KV cache is reached only through the ``KVCacheManager`` (``kv``),
and disaggregated serving attaches a ``KVConnector`` (none when colocated).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from nibble.tiering import KVPool
from nibble.tiering.kv_cache_manager import KVCacheManager
from nibble.tiering.radix_cache import RadixCache
from nibble.tiering.tier_manager import TierManager

from ..config import SchedulerConfig
from ..errors import (ContextLengthExceededError, DeviceFaultError, InvalidRequestError,
                      RequestFaultError)
from .detokenizer import IncrementalDetokenizer
from .faults import StepIsolator, describe, is_device_fault
from .kv_connector import KVConnector
from .model_runner import ModelRunner
from .overlap import OverlapStepper
from .scheduler import Scheduler
from .sequence import Sequence
from .step_stats import StepShape, StepTimer, shape_of
from .stop import StopStringMatcher
from .types import FinishReason, GenerateRequest, RequestOutput, TokenLogprob

log = logging.getLogger(__name__)
MAX_RECOMPUTES = 1      # a request that failed on reused KV is recomputed at most this often
MAX_FAULT_STREAK = 4    # requests failing in a row, with no request running cleanly meanwhile,
                        # after which the engine itself is taken to be broken


@dataclass
class _Stream:
    """Text-side state of one request."""

    detok: IncrementalDetokenizer
    stop: StopStringMatcher

    def push(self, token: int) -> tuple[str, bool]:
        """Text of one more token, and whether a stop string ended the stream there."""
        return self.stop.feed(self.detok.push([token]))

    def flush(self) -> str:
        """The text still held back (an incomplete character or a possible stop string)."""
        return self.stop.feed(self.detok.flush())[0] + self.stop.flush()


class EngineCore:
    """Continuous batching over one model and one KV pool.

    Args:
        runner: executes scheduled batches.
        pool: the KV pool the scheduler allocates from.
        tokenizer: ``decode`` for streaming text; ``eos_token_ids``.
        sched_cfg: the scheduler's slice of the config.
        context_length: max prompt + output tokens per request.
        cache: the prefix cache, or None when it is disabled.
        tiers: the tier manager (L2/L3 below the pool), or None.
        max_fault_streak: see ``MAX_FAULT_STREAK``.
    """

    def __init__(self, runner: ModelRunner, pool: KVPool, tokenizer, sched_cfg: SchedulerConfig,
                 context_length: int, cache: RadixCache | None = None,
                 tiers: TierManager | None = None, max_fault_streak: int = MAX_FAULT_STREAK,
                 overlap: bool = False):
        self.runner = runner
        self.kv = KVCacheManager(pool, cache, tiers)
        # The parts themselves, for the runner's owner, benchmarks and tests; the scheduler
        # and the connector see only ``kv``.
        self.pool, self.cache, self.tiers = pool, cache, tiers
        self.tokenizer = tokenizer
        self.scheduler = Scheduler(sched_cfg, self.kv)
        self.connector: KVConnector | None = None
        self.debug_checks = sched_cfg.debug_checks
        self.context_length = context_length
        self.eos = frozenset(tokenizer.eos_token_ids)
        runner.eos_ids = self.eos
        self._seqs: dict[str, Sequence] = {}
        self._streams: dict[str, _Stream] = {}
        self.isolator = StepIsolator(runner, pool.layout.page_size)
        self.max_fault_streak = max_fault_streak
        self.fault_streak = 0          # requests failed since a step last ran a request cleanly
        self.num_request_faults = 0    # totals, for metrics and tests
        self.num_fault_recomputes = 0
        self.num_prompt_tokens_computed = 0   # prompt tokens run through the model (not reused)
        # Overlap scheduling (services/engine/overlap.py): step N+1 planned while N runs.
        self.overlap = OverlapStepper(self) if overlap else None
        self.tp_info: dict | None = None      # tensor parallel: the group's capacity (builder)
        # Step intervals by kind for /metrics, and the --step-trace-file lines.
        self.step_timer = StepTimer.open(sched_cfg.step_trace_file, pool.device)
        self.sched_s = 0.0      # host seconds of the last scheduling (step trace)

    @property
    def max_request_tokens(self) -> int:
        """Longest request (prompt + output) the engine can ever hold."""
        return min(self.context_length, self.pool.num_pages * self.pool.layout.page_size)

    def validate(self, req: GenerateRequest) -> None:
        """Raise InvalidRequestError for a request that can never run."""
        n, m = len(req.prompt_token_ids), req.sampling.max_tokens
        if n == 0:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        req.sampling.check()
        vocab = getattr(self.tokenizer, "vocab_size", None)
        if vocab and any(not 0 <= t < vocab for t in req.prompt_token_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        if n + m > self.max_request_tokens:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {self.max_request_tokens} tokens. "
                f"However, you requested {n + m} tokens ({n} in the prompt, {m} for the "
                f"completion). Please reduce the prompt or max_tokens.",
                param="max_tokens", code="context_length_exceeded")
        if req.request_id in self._seqs:
            raise InvalidRequestError(f"duplicate request id {req.request_id}")

    def add_request(self, req: GenerateRequest) -> None:
        """Validate ``req`` and queue it (callers that drive the core directly)."""
        self.validate(req)
        self.register(req)

    def add_validated(self, req: GenerateRequest) -> None:
        """Queue ``req``, which the engine client validated when it entered (``validate``);
        only the duplicate id, which depends on what is running now, is checked here."""
        assert req.prompt_token_ids and len(req.prompt_token_ids) + req.sampling.max_tokens \
            <= self.max_request_tokens, "add_validated: the request was not validated"
        if req.request_id in self._seqs:
            raise InvalidRequestError(f"duplicate request id {req.request_id}")
        self.register(req)

    def register(self, req: GenerateRequest, queue: bool = True) -> Sequence:
        """Create the request's sequence and text state, and queue it (``queue``)."""
        seq = Sequence(req, list(req.prompt_token_ids), len(req.prompt_token_ids))
        if req.sampling.prompt_logprobs is not None:
            seq.no_reuse = True            # every prompt token is computed, so it has a logprob
        self._seqs[req.request_id] = seq
        self._streams[req.request_id] = _Stream(
            IncrementalDetokenizer(self.tokenizer, list(req.prompt_token_ids)),
            StopStringMatcher(tuple(req.sampling.stop)))
        if queue:
            self.scheduler.add(seq)
        return seq

    def attach_connector(self, connector: KVConnector) -> None:
        """Serve disaggregated: ``connector`` keeps reservations and held pages."""
        self.connector = self.scheduler.connector = connector
        connector.bind(self.scheduler, self.validate)

    def add_prefilled(self, req: GenerateRequest, first_token: int,
                      first_logprob: TokenLogprob | None = None) -> RequestOutput:
        """Run ``req`` from its first sampled token (and its logprob, when the request asked
        for them) on the pages a prefill worker wrote into the connector's reservation.
        InvalidRequestError when there is none (expired)."""
        if req.request_id in self._seqs:
            raise InvalidRequestError(f"duplicate request id {req.request_id}")
        seq = self.register(req, queue=False)
        try:
            self.scheduler.start_prefilled(seq)
        except InvalidRequestError:
            self._seqs.pop(req.request_id, None)
            self._streams.pop(req.request_id, None)
            raise
        out = self._on_token(seq, first_token)
        if first_logprob is not None and out.new_token_ids:
            out.logprobs = [first_logprob]
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or (
            self.overlap is not None and self.overlap.inflight is not None)

    def num_running(self) -> int:
        return len(self.scheduler.running)

    def flush_cache(self) -> bool:
        """Clear the prefix cache; False (nothing changed) while requests run or wait."""
        return self.scheduler.flush_cache()

    def abort_all(self) -> list[RequestOutput]:
        return [out for rid in list(self._seqs) if (out := self.abort(rid)) is not None]

    def stats(self) -> dict:
        """Gauges for /metrics and /get_server_info."""
        sch, kv, lay = self.scheduler, self.kv, self.pool.layout
        return {
            "num_running": len(sch.running),
            "num_queued": len(sch.waiting),
            "token_usage": (kv.num_pages - kv.num_free) / kv.num_pages,
            "max_total_tokens": kv.num_pages * lay.page_size,
            "kv_bytes_per_token": lay.bytes_per_token,
            "kv_cache_dtype": lay.kv_format,
            "cache_hit_rate": sch.cached_tokens_admitted / max(1, sch.prompt_tokens_admitted),
            "num_preemptions": sch.num_preemptions,
            "num_request_faults": self.num_request_faults,
            "num_fault_recomputes": self.num_fault_recomputes,
            "prompt_tokens_computed": self.num_prompt_tokens_computed,
            "num_cached_pages": kv.num_cached_pages,
            "tiers": self.tiers.stats() if self.tiers is not None else None,
            "step_intervals": self.step_timer.snapshot(),
        }

    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages; returns its final output (None if unknown)."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        return self._finish(seq, "")

    def fail_all(self, message: str, error_type: str | None = None) -> list[RequestOutput]:
        """Finish every request with an error (shutdown, a bug, a dead device)."""
        return [self._fail(seq, message, error_type, cache=True)
                for seq in list(self._seqs.values())]

    def _fail(self, seq: Sequence, message: str, error_type: str | None,
              cache: bool = False) -> RequestOutput:
        """End ``seq`` with an error; its pages are cached only if ``cache`` (not suspect)."""
        seq.finish_reason = FinishReason.ABORT
        out = self._finish(seq, "", cache)
        out.error, out.error_type = message, error_type
        return out

    def _finish(self, seq: Sequence, text: str, cache: bool = True) -> RequestOutput:
        self.scheduler.remove(seq, cache)      # a connector may keep a hold_pages request's pages
        self.runner.release(seq.request_id)
        self._seqs.pop(seq.request_id, None)
        self._streams.pop(seq.request_id, None)
        return RequestOutput(seq.request_id, [], text, True, seq.finish_reason, seq.usage())

    def poll_background(self) -> None:
        """An idle engine's turn: apply finished tier work (backups give back the L1 pages
        they pinned) and expired leases, which ``schedule`` does each step, so they come
        back without a next step; in debug mode (``--debug-checks``) check the cache."""
        self.kv.poll()
        if self.connector is not None:
            self.connector.expire()
        if self.debug_checks and not self.scheduler.has_work():
            self.kv.check_integrity()
        self.step_timer.idle()

    def step(self) -> list[RequestOutput]:
        """Run one batch; return an update for every request that produced a token (with
        overlap scheduling, the updates of the step before, which landed meanwhile)."""
        self.step_timer.begin()
        if self.overlap is not None:
            return self.overlap.step()
        batch = self.schedule()
        sampled, failed, logprobs = self._execute(batch)
        return self._process(batch, sampled, failed, logprobs)

    def schedule(self):
        """The scheduler's next batch; its host time is kept for the step trace."""
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        self.sched_s = time.perf_counter() - t0
        return batch

    def host_times(self) -> tuple[float, float]:
        """(scheduling, forward enqueue) host seconds of the step just run or launched."""
        return self.sched_s, self.runner.enqueue_s

    def _process(self, batch, sampled: dict[str, int], failed: dict[str, str],
                 logprobs: dict[str, TokenLogprob] | None = None) -> list[RequestOutput]:
        """Advance every sequence that ran cleanly, emit its token; handle the failed ones.
        A failed entry's state is left exactly as scheduled."""
        outputs, logprobs = [], logprobs or {}
        for entry in batch.seqs:
            seq = self._seqs[entry.request_id]
            if entry.request_id in failed:
                continue
            self.num_prompt_tokens_computed += max(
                0, min(len(entry.token_ids), seq.num_prompt - seq.num_computed))
            seq.num_computed += len(entry.token_ids)
            if entry.sample:
                prompt_done = seq.num_output == 0
                if prompt_done:
                    # Prompt done: share its pages with requests that arrive meanwhile.
                    self.scheduler.cache_computed(seq)
                out = self._emit_token(seq, sampled[entry.request_id],
                                       logprobs.get(entry.request_id))
                if prompt_done and seq.request.sampling.prompt_logprobs is not None:
                    out.prompt_logprobs = self._prompt_logprobs(seq)
                outputs.append(out)
        for rid, why in failed.items():
            out = self._on_fault(self._seqs[rid], why)
            if out is not None:
                outputs.append(out)
        return outputs

    @staticmethod
    def _prompt_logprobs(seq: Sequence) -> list[TokenLogprob]:
        """One per prompt token; the first (nothing before it) has logprob and top None."""
        got = seq.prompt_lps or {}
        ids = seq.token_ids[:seq.num_prompt]
        return [TokenLogprob(ids[0], None, None)] + [
            got.get(p, TokenLogprob(ids[p], None, None)) for p in range(1, seq.num_prompt)]

    def _execute(self, batch) -> tuple[dict[str, int], dict[str, str], dict]:
        """Run ``batch``: ``(request id -> token, request id -> why it failed, request id ->
        TokenLogprob)``.

        A failed step is re-run without its culprits (faults.StepIsolator).
        Raises DeviceFaultError when the device is broken, or when
        ``max_fault_streak`` requests failed in a row with none running cleanly.
        """
        if not batch.seqs:
            self.step_timer.idle()
            return {}, {}, {}
        t0 = time.perf_counter()
        try:
            result = self.runner.execute(batch, self.pool.layout.page_size)
        except Exception as exc:  # noqa: BLE001 - classified: device fault or isolated culprit
            if is_device_fault(exc):
                raise DeviceFaultError(f"device fault in an engine step: {describe(exc)}") from exc
            log.warning("an engine step of %d requests failed (%s); isolating the culprit",
                        len(batch.seqs), describe(exc))
            iso = self.isolator.isolate(batch.seqs, exc)
            self._count_faults(iso.failed, iso.any_ok)
            return iso.sampled, iso.failed, iso.logprobs
        prefill = sum(len(e.token_ids) for e in batch.seqs if len(e.token_ids) > 1)
        self.kv.observe_prefill(prefill, time.perf_counter() - t0)
        self.step_timer.landed(self.step_shape(batch.seqs), self.host_times())
        self._count_faults(result.failed, len(result.failed) < len(batch.seqs))
        for rid, (first_pos, lps) in result.prompt_logprobs.items():
            if rid not in result.failed:
                seq = self._seqs[rid]
                seq.prompt_lps = {**(seq.prompt_lps or {}),
                                  **{first_pos + j: lp for j, lp in enumerate(lps)}}
        return result.sampled, result.failed, result.logprobs

    def step_shape(self, entries) -> StepShape:
        """What a step of these ``ScheduledSeq`` entries runs (for the step timer)."""
        return shape_of(entries, lambda rid: self._seqs[rid].num_prompt,
                        self.scheduler.cost_ctx)

    def _count_faults(self, failed: dict[str, str], any_ok: bool) -> None:
        if any_ok:
            self.fault_streak = 0
        self.fault_streak += len(failed)
        self.num_request_faults += len(failed)
        if failed and self.fault_streak >= self.max_fault_streak:
            raise DeviceFaultError(
                f"{self.fault_streak} requests failed in a row and no step ran a request "
                f"cleanly meanwhile; the engine is unusable (last: {next(iter(failed.values()))})")

    def _on_fault(self, seq: Sequence, why: str) -> RequestOutput | None:
        """A step failed for ``seq`` alone: recompute it once without cached pages if it
        reused any (they may be the poison), else end it with a RequestFaultError."""
        seq.num_faults += 1
        dropped = self.scheduler.drop_from_cache(seq)
        if seq.reused_tokens and seq.num_faults <= MAX_RECOMPUTES:
            log.warning("%s failed in a step (%s) on %d reused tokens; dropped %d pages from the "
                        "prefix cache, recomputing it", seq.request_id, why, seq.reused_tokens,
                        len(dropped))
            self.num_fault_recomputes += 1
            self.scheduler.requeue(seq)
            return None
        log.warning("%s failed in a step (%s); ending it alone", seq.request_id, why)
        return self._fail(seq, f"the engine could not run this request: {why}",
                          RequestFaultError.__name__)

    def _emit_token(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None
                    ) -> RequestOutput:
        """``_on_token``, failing only this request if its text handling raises."""
        try:
            out = self._on_token(seq, token)
            if logprob is not None and out.new_token_ids:
                out.logprobs = [logprob]
            return out
        except Exception as exc:  # noqa: BLE001 - one request's bug must not end the others
            if is_device_fault(exc):
                raise
            log.exception("%s: handling its token failed", seq.request_id)
            return self._fail(seq, f"the engine could not run this request: {describe(exc)}",
                              RequestFaultError.__name__)

    def _on_token(self, seq: Sequence, token: int) -> RequestOutput:
        if seq.num_pending:          # overlap: the oldest placeholder is this token
            seq.token_ids[len(seq.token_ids) - seq.num_pending] = token
            seq.num_pending -= 1
        else:
            seq.token_ids.append(token)
        sp = seq.request.sampling
        stream = self._streams[seq.request_id]
        is_stop_token = (token in self.eos and not sp.ignore_eos) or token in sp.stop_token_ids
        text, stopped = stream.push(token) if not is_stop_token else ("", False)
        if is_stop_token or stopped:
            seq.finish_reason = FinishReason.STOP
        elif seq.num_output >= sp.max_tokens or \
                seq.num_prompt + seq.num_output >= self.context_length:
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is None:
            return RequestOutput(seq.request_id, [token], text, False, None, seq.usage())
        if not stopped:
            text += stream.flush()
        out = self._finish(seq, text)
        out.new_token_ids = [token]
        return out
