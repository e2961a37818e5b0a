"""What happens to a step's logits between the model and the draw: logit bias, repetition /
presence / frequency penalties and min_tokens (``process_logits``), and the log-probabilities
reported to clients (``logprobs_of``), computed from the same processed logits the sampler
uses, after temperature (as OpenAI reports them).

Rows that ask for none of it are untouched and cost nothing; the per-row work is a few
vocab-sized ops on the logits' device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..host_copy import floats_to_device, ints_to_device
from .types import ScheduledSeq, TokenLogprob


def process_logits(logits: torch.Tensor, picked: list[ScheduledSeq],
                   eos_ids: frozenset[int]) -> torch.Tensor:
    """``logits`` float32 ``[N, V]`` (row i for ``picked[i]``) -> the logits to sample from.

    Per row, in order: repetition penalty over prompt + output (HF's rule: a seen token's
    positive logit is divided by it, a negative one multiplied), frequency and presence
    penalties over the output (OpenAI's rule), logit bias, and while fewer than
    ``min_tokens`` were generated, EOS (unless ignored) and the stop tokens at -inf.
    """
    rows = [i for i, e in enumerate(picked)
            if e.sampling.logit_bias or e.sampling.needs_history]
    if not rows:
        return logits
    out = logits.clone()
    vocab, device = logits.shape[1], logits.device
    for i in rows:
        e, sp = picked[i], picked[i].sampling
        row = out[i]
        if e.history is not None and (sp.repetition_penalty != 1.0 or sp.presence_penalty
                                      or sp.frequency_penalty):
            hist = ints_to_device([t for t in e.history if 0 <= t < vocab], device)
            if sp.repetition_penalty != 1.0:
                seen = torch.zeros(vocab, dtype=torch.bool, device=device)
                seen[hist] = True
                r = sp.repetition_penalty
                row = torch.where(seen, torch.where(row > 0, row / r, row * r), row)
            if sp.presence_penalty or sp.frequency_penalty:
                gen = hist[max(0, len(hist) - e.num_output):]
                counts = torch.bincount(gen, minlength=vocab)[:vocab].to(row.dtype)
                row = row - sp.frequency_penalty * counts - sp.presence_penalty * (counts > 0)
        if sp.logit_bias:
            ids = ints_to_device([t for t, _ in sp.logit_bias], device)
            vals = floats_to_device([b for _, b in sp.logit_bias], device, row.dtype)
            row = row.index_add(0, ids, vals)
        if e.num_output < sp.min_tokens:
            stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(eos_ids))
            stops = [t for t in stops if 0 <= t < vocab]
            if stops:
                row = row.index_fill(0, ints_to_device(stops, device), float("-inf"))
        out[i] = row
    return out


@dataclass
class StepLogprobs:
    """Log-probabilities of one step's rows that asked for them, still on the device."""

    rows: list[int]                  # rows of the step (into ``picked``)
    chosen: torch.Tensor             # float32 [R]: the sampled token's logprob
    top_ids: torch.Tensor            # int64 [R, K] (K = the largest N asked; may be 0)
    top_lp: torch.Tensor             # float32 [R, K]
    widths: list[int]                # N per row (<= K)

    def start_copy(self) -> "StepLogprobs":
        """A copy on the host (pinned on CUDA) started without waiting: read it with
        ``to_host`` once the step's copy event has completed (overlap scheduling)."""
        pin = self.chosen.is_cuda

        def host(t: torch.Tensor) -> torch.Tensor:
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=pin)
            out.copy_(t, non_blocking=True)
            return out
        return StepLogprobs(self.rows, host(self.chosen), host(self.top_ids), host(self.top_lp),
                            self.widths)

    def to_host(self, tokens: list[int]) -> dict[int, TokenLogprob]:
        """``{row: TokenLogprob}`` given the step's sampled ``tokens`` (host list)."""
        chosen = self.chosen.tolist()
        ids, lps = self.top_ids.tolist(), self.top_lp.tolist()
        return {r: TokenLogprob(tokens[r], chosen[j],
                                tuple(zip(ids[j][:self.widths[j]], lps[j][:self.widths[j]])))
                for j, r in enumerate(self.rows)}


def logprobs_of(processed: torch.Tensor, picked: list[ScheduledSeq],
                tokens: torch.Tensor) -> StepLogprobs | None:
    """``log_softmax(processed / temperature)`` of the rows whose ``logprobs`` is set (a
    greedy row at temperature 1): the chosen token's value and the top N. ``tokens`` int64
    ``[N]`` on the device (-1 for a bad row, reported as token 0 and dropped later)."""
    rows = [i for i, e in enumerate(picked) if e.sampling.logprobs is not None]
    if not rows:
        return None
    device = processed.device
    idx = ints_to_device(rows, device)
    temps = floats_to_device([picked[i].sampling.temperature or 1.0 for i in rows], device)
    lp = torch.log_softmax(processed.index_select(0, idx).float() / temps.unsqueeze(1), dim=-1)
    chosen = lp.gather(1, tokens.index_select(0, idx).clamp(min=0).unsqueeze(1)).squeeze(1)
    widths = [picked[i].sampling.logprobs for i in rows]
    k = min(max(widths), lp.shape[1])
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    return StepLogprobs(rows, chosen, top_ids, top_lp, widths)


PROMPT_ROWS = 256      # prompt positions per LM-head block: bounds the [rows, vocab] logits


def prompt_logprobs(compute_logits, seqs: list[ScheduledSeq], starts: list[int],
                    hidden: torch.Tensor) -> dict[str, tuple[int, list[TokenLogprob]]]:
    """Each prompt token's logprob for the chunks of ``seqs`` that ask for them:
    ``request id -> (position of the first token scored, [TokenLogprob])``.

    ``hidden`` ``[T, H]``: the step's last hidden states, ``starts[i]`` the first row of
    ``seqs[i]``. Row ``j`` of a chunk scores the prompt token after it (the chunk's next
    token, then ``next_token`` for the last row), from the model's raw logits
    (``compute_logits``: ``[N, H] -> [N, V]`` float32), with the ``prompt_logprobs`` best
    alternatives; the LM head runs ``PROMPT_ROWS`` rows at a time."""
    out = {}
    for s, start in zip(seqs, starts):
        k = s.sampling.prompt_logprobs
        if k is None:
            continue
        targets = list(s.token_ids[1:]) + ([s.next_token] if s.next_token is not None else [])
        lps: list[TokenLogprob] = []
        for b in range(0, len(targets), PROMPT_ROWS):
            tgt = targets[b:b + PROMPT_ROWS]
            logp = torch.log_softmax(compute_logits(hidden[start + b:start + b + len(tgt)]), -1)
            idx = ints_to_device(tgt, logp.device).unsqueeze(1)
            chosen = logp.gather(1, idx).squeeze(1).tolist()
            top_v, top_i = (logp.topk(k, dim=-1) if k else (logp[:, :0], logp[:, :0].long()))
            for t, c, vs, ids in zip(tgt, chosen, top_v.tolist(), top_i.tolist()):
                lps.append(TokenLogprob(t, c, tuple(zip(ids, vs))))
        out[s.request_id] = (s.start_pos + 1, lps)
    return out
