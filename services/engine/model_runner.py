"""Runs one ScheduledBatch through the model and samples the next tokens."""

from __future__ import annotations

import dataclasses
import time

import torch

from ..attention import AttentionBackend, AttentionMetadata
from ..host_copy import ints_to_device, to_device
from .cuda_graph import DecodeGraphRunner
from .grammar import GrammarBackend, GrammarError, Matcher
from .logits_process import StepLogprobs, logprobs_of, process_logits, prompt_logprobs
from .sampling import make_generator, sample
from .step_inputs import kv_slots, padded_block_tables, positions_of
from ..parallel.group import SingleGroup
from .types import ScheduledBatch, ScheduledSeq, WorkerOutput


class ModelRunner:
    """Owns the model, the attention backend and the per-request RNGs.

    Args:
        model: a ``CausalLM`` (``forward(input_ids[T], positions[T], attn)``,
            ``compute_logits(hidden[N, H]) -> [N, V] float32``).
        backend: the attention backend bound to the KV pool.
        device: where activations live.
        graphs: replays pure-decode steps from captured CUDA graphs, if given.
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, device: torch.device,
                 graphs: DecodeGraphRunner | None = None):
        self.model = model
        self.backend = backend
        self.device = device
        self.graphs = graphs
        self._generators: dict[str, torch.Generator | None] = {}
        self.eos_ids: frozenset[int] = frozenset()   # set by the engine (min_tokens masks them)
        self.grammar: GrammarBackend | None = None   # set by the builder (--grammar-backend)
        self._matchers: dict[str, Matcher] = {}
        self._prompt_lps: dict = {}                 # this step's prompt logprobs (execute)
        self.tp = getattr(model, "tp", None) or SingleGroup()   # the model's TP group
        self.tier_sync = None      # TP rank 0 with tiers: TierManager.sync, before each step
        self.tier_mirror = None    # TP follower with tiers: its TierMirror
        # Host seconds the last forward took to plan and enqueue (its kernels may still run):
        # beside a step's interval in the step trace, it tells a host-bound step.
        self.enqueue_s = 0.0

    def release(self, request_id: str) -> None:
        """Forget a finished request's RNG and grammar state."""
        self._generators.pop(request_id, None)
        self._matchers.pop(request_id, None)

    def _metadata(self, seqs: list[ScheduledSeq], page_size: int, pos: torch.Tensor,
                  rows: torch.Tensor) -> AttentionMetadata:
        starts, lens, cached = [], [], []
        at = 0
        for s in seqs:
            starts.append(at)
            lens.append(len(s.token_ids))
            cached.append(s.num_cached)
            at += len(s.token_ids)
        tables = padded_block_tables(seqs)
        return AttentionMetadata(starts, lens, cached, kv_slots(tables, rows, pos, page_size),
                                 tables)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, page_size: int) -> WorkerOutput:
        seqs = batch.seqs
        if not seqs:
            return WorkerOutput({})
        self.announce(("step", batch, page_size))
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.applies(seqs):
            logits = self.graphs.run(seqs, page_size)
            self.enqueue_s = time.perf_counter() - t0
            return self._sample(seqs, logits)
        picked = [s for s in seqs if s.sample]
        self._prompt_lps = {}
        logits = self._forward(seqs, page_size, rows=True if picked else None)
        self.enqueue_s = time.perf_counter() - t0
        if not picked:
            out = WorkerOutput({})
        else:
            out = self._sample(picked, logits)
        return dataclasses.replace(out, prompt_logprobs=self._prompt_lps) if self._prompt_lps \
            else out

    def announce(self, msg: tuple) -> None:
        """Tensor parallel, rank 0: have the followers replay the tier moves so far, then send
        them this step (``follower.follow`` runs the same forward); nothing at TP=1."""
        if self.tp.size > 1:
            if self.tier_sync is not None:
                self.tier_sync()
            self.tp.broadcast_object(msg)

    def forward_ids(self, seqs: list[ScheduledSeq], page_size: int,
                    ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """A step's forward without sampling: the sampled rows' logits ``[N, vocab]`` float32,
        None when no entry samples; a captured graph where one applies. ``ids``: int64 ``[T]``
        input ids already on the device (a launched step, overlap scheduling), else built from
        ``token_ids``."""
        t0 = time.perf_counter()
        if self.graphs is not None and self.graphs.applies(seqs):
            logits = self.graphs.run(seqs, page_size, ids)
        else:
            rows = True if any(e.sample for e in seqs) else None
            logits = self._forward(seqs, page_size, rows=rows, ids=ids)
        self.enqueue_s = time.perf_counter() - t0
        return logits

    @torch.inference_mode()
    def forward_only(self, batch: ScheduledBatch, page_size: int) -> None:
        """A tensor-parallel follower's share of ``execute``: the same forward (and the same
        logits, gathered over the ranks), no sampling: rank 0 samples."""
        self.forward_ids(batch.seqs, page_size)

    def _forward(self, seqs: list[ScheduledSeq], page_size: int, rows: bool | None,
                 ids: torch.Tensor | None = None) -> torch.Tensor | None:
        """Eager forward of the step; logits ``[N, vocab]`` float32 of the sampled rows.
        ``ids``: the step's input ids (int64 ``[T]`` on the device) when they are not all
        known on the host (overlap scheduling); else built from ``token_ids``."""
        # every input goes through to_device: a blocking host copy would wait for the step
        # still running on the device and so undo overlap scheduling (host_copy.py)
        if ids is None:
            ids = ints_to_device([t for s in seqs for t in s.token_ids], self.device)
        pos, token_rows = positions_of(seqs)
        positions = to_device(pos, self.device)
        meta = self._metadata(seqs, page_size, pos, token_rows)
        self.backend.plan(meta)
        bound = max(s.start_pos + len(s.token_ids) for s in seqs)
        hidden = self.model(ids, positions, self.backend.bind(meta), num_positions=bound)
        if any(s.sampling.prompt_logprobs is not None for s in seqs):
            self._prompt_lps = prompt_logprobs(self.model.compute_logits, seqs,
                                               meta.seq_starts, hidden)
        if rows is None:
            return None
        last = [meta.seq_starts[i] + meta.new_lens[i] - 1 for i, s in enumerate(seqs) if s.sample]
        return self.model.compute_logits(hidden.index_select(0, ints_to_device(last, self.device)))

    def _sample(self, picked: list[ScheduledSeq], logits: torch.Tensor) -> WorkerOutput:
        """One token per row of ``logits`` ``[len(picked), vocab]`` float32.

        A row holding NaN or inf (its request's input or cached pages went bad) is
        not sampled: it is reported in ``WorkerOutput.failed``. The check costs no
        extra device sync: bad rows are zeroed before sampling and marked -1 in
        the one token transfer.
        """
        tokens_dev, lps = self.sample_tokens(picked, logits)
        tokens = tokens_dev.tolist()
        for s, t in zip(picked, tokens):
            matcher = self._matchers.get(s.request_id)
            if matcher is not None and t >= 0 and not matcher.accept(t):
                raise GrammarError(f"{s.request_id}: the grammar refused token {t} it allowed")
        sampled = {s.request_id: t for s, t in zip(picked, tokens) if t >= 0}
        failed = {s.request_id: "non-finite logits (NaN or inf)"
                  for s, t in zip(picked, tokens) if t < 0}
        by_row = lps.to_host(tokens) if lps is not None else {}
        logprobs = {picked[r].request_id: lp for r, lp in by_row.items() if tokens[r] >= 0}
        return WorkerOutput(sampled, failed, logprobs)

    def sample_tokens(self, picked: list[ScheduledSeq], logits: torch.Tensor
                      ) -> tuple[torch.Tensor, StepLogprobs | None]:
        """int64 ``[len(picked)]`` on the logits' device: one token per row, -1 for a row
        holding NaN or inf (zeroed before sampling, so it costs no device sync); and the
        log-probabilities of the rows that asked for them (on the device too)."""
        gens = []
        for s in picked:
            if s.request_id not in self._generators:
                self._generators[s.request_id] = make_generator(s.sampling.seed, self.device)
            gens.append(self._generators[s.request_id])
        bad = ~torch.isfinite(logits).all(dim=-1)
        clean = process_logits(logits.masked_fill(bad.unsqueeze(1), 0.0), picked, self.eos_ids)
        masked = self._grammar_mask(picked, clean)
        tokens = sample(masked, [s.sampling for s in picked], gens).masked_fill(bad, -1)
        return tokens, logprobs_of(clean, picked, tokens)

    def _new_matcher(self, s: ScheduledSeq):
        """A matcher for ``s``'s grammar. A disaggregated decode worker meets the request at
        its second token: the first, sampled (under the grammar) by the prefill worker, is
        this step's input and is accepted first."""
        matcher = self.grammar.matcher(s.sampling.grammar)
        if s.num_output == 1 and not matcher.accept(s.token_ids[-1]):
            raise GrammarError(f"{s.request_id}: the grammar refuses the first token")
        if s.num_output > 1:
            raise GrammarError(f"{s.request_id}: a grammar cannot start after "
                               f"{s.num_output} tokens")
        return matcher

    def _grammar_mask(self, picked: list[ScheduledSeq], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` with each grammar row's disallowed tokens at -inf (a copy; the
        logprobs are reported from the unmasked logits, as OpenAI does)."""
        rows = [i for i, s in enumerate(picked) if s.sampling.grammar is not None]
        if not rows:
            return logits
        if self.grammar is None:
            raise GrammarError("structured outputs need --grammar-backend xgrammar")
        mask = self.grammar.new_mask(len(picked))
        for i in rows:
            s = picked[i]
            matcher = self._matchers.get(s.request_id)
            if matcher is None:
                matcher = self._matchers[s.request_id] = self._new_matcher(s)
            matcher.fill_mask(mask, i)
        return self.grammar.apply(logits.clone(), mask)
