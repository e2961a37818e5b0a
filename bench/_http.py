"""HTTP side of the serving benchmarks: one timed streaming completion, and server probes.

- ``stream_completion``: POST /v1/completions (token-id prompt, SSE, usage in the last
  chunk) and time it: TTFT = first chunk with text, ITL = gaps between text chunks, E2E.
- ``server_info`` / ``probe_vocab_size`` / ``flush_cache`` / ``scrape_counters``: what
  the server says about itself (Nibble's /get_server_info, /metrics).
- ``StatsSampler``: polls /get_server_info while a run goes on (running / queued
  requests, KV usage, preemptions), the signal iso-capacity stops on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from ._server import BenchServerError

COUNTER_NAMES = ("nibble:prompt_tokens", "nibble:cached_tokens", "nibble:generation_tokens",
                 "nibble:tier_hit_pages", "nibble:num_preemptions")


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from ``start`` (perf_counter)."""

    ok: bool = False
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)   # gaps between text chunks
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=dict)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None with fewer than two tokens."""
        if self.completion_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.completion_tokens - 1)


def completion_body(prompt: list[int], max_tokens: int, salt: str, temperature: float = 0.0
                    ) -> dict[str, Any]:
    """A streaming /v1/completions body that generates exactly ``max_tokens`` tokens."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": salt}


def _apply_usage(res: RequestResult, usage: dict[str, Any]) -> None:
    res.prompt_tokens = int(usage.get("prompt_tokens", 0))
    res.completion_tokens = int(usage.get("completion_tokens", 0))
    details = usage.get("prompt_tokens_details") or {}
    res.cached_tokens = int(details.get("cached_tokens") or 0)
    res.cached_by_tier = {k: int(v) for k, v in (details.get("cached_tokens_by_tier") or {}).items()}


def _handle_event(res: RequestResult, data: str, start: float, last: list[float]) -> None:
    obj = json.loads(data)
    if "error" in obj:
        res.error = str(obj["error"].get("message", obj["error"]))
        return
    if obj.get("usage"):
        _apply_usage(res, obj["usage"])
    choices = obj.get("choices") or []
    if choices and choices[0].get("text"):
        now = time.perf_counter()
        if not last:
            res.ttft = now - start
        else:
            res.itl.append(now - last[0])
        last[:] = [now]


async def stream_completion(client: httpx.AsyncClient, base_url: str, body: dict[str, Any]
                            ) -> RequestResult:
    """Send one streaming completion and time it; errors are recorded, never raised."""
    res = RequestResult(start=time.perf_counter())
    last: list[float] = []
    try:
        async with client.stream("POST", f"{base_url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    _handle_event(res, line[6:], res.start, last)
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.e2e = time.perf_counter() - res.start
    if not res.error and not last:
        res.error = "the stream carried no text"
    if not res.error and res.completion_tokens == 0:
        res.completion_tokens = len(res.itl) + 1     # server sent no usage: count chunks
    res.ok = not res.error
    return res


# ---------------------------------------------------------------- server probes

def server_info(base_url: str) -> dict[str, Any]:
    """Nibble's /get_server_info, or {} when the server has none."""
    r = httpx.get(f"{base_url}/get_server_info", timeout=30)
    return r.json() if r.status_code == 200 else {}


def context_length(base_url: str) -> int | None:
    r = httpx.get(f"{base_url}/v1/models", timeout=30)
    if r.status_code != 200 or not r.json().get("data"):
        return None
    return r.json()["data"][0].get("max_model_len")


_VOCAB_RE = re.compile(r"vocab size (\d+)")


def probe_vocab_size(base_url: str) -> int:
    """The tokenizer's vocab size, from the 400 that Nibble answers to an out-of-range token id
    (no generation happens). Raises BenchServerError when the server does not say."""
    body = {"prompt": [2**31 - 1], "max_tokens": 1}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=30)
    match = _VOCAB_RE.search(r.text) if r.status_code == 400 else None
    if match is None:
        raise BenchServerError("the server does not report its vocab size; pass --vocab-size")
    return int(match.group(1))


def flush_cache(base_url: str) -> bool:
    """POST /flush_cache (cold prefix cache before a run); False when refused or absent."""
    try:
        return httpx.post(f"{base_url}/flush_cache", timeout=30).status_code == 200
    except httpx.HTTPError:
        return False


def parse_counters(text: str) -> dict[str, float]:
    """Prometheus text -> {"name" or "name{label=value}": value} for ``COUNTER_NAMES``
    (a counter's ``_total`` suffix dropped, its ``_created`` sample skipped)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            name = s.name[:-len("_total")] if s.name.endswith("_total") else s.name
            if name not in COUNTER_NAMES:
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


def scrape_counters(base_url: str) -> dict[str, float]:
    r = httpx.get(f"{base_url}/metrics", timeout=30)
    return parse_counters(r.text) if r.status_code == 200 else {}


def counter_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after}


# ---------------------------------------------------------------- sampler

@dataclass(frozen=True)
class StatsSample:
    t: float
    num_running: int
    num_queued: int
    token_usage: float
    num_preemptions: int


class StatsSampler:
    """Polls /get_server_info every ``interval_s`` in the background of an asyncio run."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, interval_s: float = 0.2):
        self.client, self.base_url, self.interval_s = client, base_url, interval_s
        self.samples: list[StatsSample] = []
        self.missed = 0                   # polls that failed (counted, not fatal)
        self._task: asyncio.Task | None = None

    async def _poll_once(self) -> None:
        r = await self.client.get(f"{self.base_url}/get_server_info", timeout=30)
        if r.status_code != 200:
            return
        s = r.json().get("stats") or {}
        if "num_running" in s:
            self.samples.append(StatsSample(time.perf_counter(), int(s["num_running"]),
                                            int(s.get("num_queued", 0)),
                                            float(s.get("token_usage", 0.0)),
                                            int(s.get("num_preemptions", 0))))

    async def _loop(self) -> None:
        while True:
            try:
                await self._poll_once()
            except httpx.HTTPError:
                self.missed += 1
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> list[StatsSample]:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        return self.samples
