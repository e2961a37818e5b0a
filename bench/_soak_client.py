"""The client side of the soak run: prompts with secret codes, and one request as planned.

Each prompt is a page-spanning paragraph of filler words with a secret code of its own
and a question asking for it, so an answer carrying another prompt's code is evidence
of a cache record served to the wrong request. ``run_one`` streams one chat completion
and ends it as its plan says: finish, disconnect after a few chunks, or abort it
through ``/abort_request`` with its own tenant's key. It never raises: every outcome
is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass

import httpx

WORDS = ("river stone lantern meadow copper violet harbor quiet orbit maple signal "
         "granite willow ember canvas thunder velvet pepper saddle marble cobalt fern "
         "anchor prism tundra basil comet dune glacier hollow ivory juniper").split()


@dataclass(frozen=True)
class SoakPrompt:
    code: str            # the secret only this prompt holds, e.g. "KX-4821-QZ"
    text: str            # the user message


@dataclass(frozen=True)
class RequestPlan:
    prompt: int          # index into the prompt list
    tenant: str          # "tenant-a" | "tenant-b"
    key: str             # that tenant's API key
    action: str          # "finish" | "disconnect" | "abort"
    after_chunks: int    # content chunks to read before disconnecting or aborting


@dataclass
class SoakResult:
    prompt: int
    tenant: str
    action: str
    start: float                 # seconds from the run's start
    end: float = 0.0
    ttft: float | None = None    # seconds to the first content chunk
    outcome: str = "ok"          # ok | disconnected | aborted | refused | error:<kind>
    retry_after: float = 0.0     # a refusal's Retry-After (s): no worker can take requests now
    text: str = ""
    detail: str = ""             # the error message, if any


def make_prompts(n: int, rng: random.Random, words: int = 90) -> list[SoakPrompt]:
    """``n`` prompts, each about ``words`` filler words (several KV pages) plus a code."""
    out = []
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    for _ in range(n):
        code = (f"{rng.choice(letters)}{rng.choice(letters)}-{rng.randrange(1000, 9999)}-"
                f"{rng.choice(letters)}{rng.choice(letters)}")
        filler = " ".join(rng.choice(WORDS) for _ in range(words))
        text = (f"{filler}\n\nThe secret code is {code}. Remember it.\n"
                f"Question: what is the secret code? Answer with the code only.")
        out.append(SoakPrompt(code, text))
    return out


def _body(prompt: SoakPrompt, max_tokens: int) -> dict:
    return {"messages": [{"role": "user", "content": prompt.text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}


async def _abort(client: httpx.AsyncClient, url: str, rid: str, key: str) -> None:
    with contextlib.suppress(httpx.HTTPError):    # the request may have finished meanwhile
        await client.post(f"{url}/abort_request", json={"rid": rid},
                          headers={"Authorization": f"Bearer {key}"}, timeout=10)


def _apply_event(res: SoakResult, obj: dict, t0: float) -> str | None:
    """Fold one SSE event into ``res``; returns the request id it names."""
    if "error" in obj:
        res.outcome, res.detail = "error:stream", str(obj["error"].get("message"))[:300]
        return None
    for choice in obj.get("choices") or []:
        content = (choice.get("delta") or {}).get("content")
        if content:
            res.text += content
            if res.ttft is None:
                res.ttft = time.monotonic() - t0 - res.start
        if choice.get("finish_reason") == "abort" and res.outcome == "ok":
            res.outcome = "aborted"
    return obj.get("id")


async def _stream(client: httpx.AsyncClient, url: str, plan: RequestPlan, body: dict,
                  res: SoakResult, t0: float) -> None:
    headers = {"Authorization": f"Bearer {plan.key}"}
    chunks, aborting = 0, None
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                             headers=headers) as r:
        if r.status_code == 503 and r.headers.get("retry-after"):
            res.outcome, res.detail = "refused", (await r.aread()).decode(errors="replace")[:300]
            res.retry_after = float(r.headers["retry-after"])
            return
        if r.status_code != 200:
            res.outcome = f"error:http_{r.status_code}"
            res.detail = (await r.aread()).decode(errors="replace")[:300]
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            rid = _apply_event(res, json.loads(line[6:]), t0)
            chunks += 1
            if chunks >= plan.after_chunks and plan.action == "disconnect":
                res.outcome = "disconnected"
                return                          # leaving the block closes the connection
            if chunks >= plan.after_chunks and plan.action == "abort" and aborting is None \
                    and rid:
                aborting = asyncio.create_task(_abort(client, url, rid, plan.key))
    if aborting is not None:
        await aborting


async def run_one(client: httpx.AsyncClient, url: str, prompts: list[SoakPrompt],
                  plan: RequestPlan, max_tokens: int, t0: float) -> SoakResult:
    """One request per ``plan``; times are seconds since ``t0`` (``time.monotonic``)."""
    res = SoakResult(plan.prompt, plan.tenant, plan.action, time.monotonic() - t0)
    try:
        await _stream(client, url, plan, _body(prompts[plan.prompt], max_tokens), res, t0)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.outcome, res.detail = "error:transport", f"{type(e).__name__}: {e}"[:300]
    res.end = time.monotonic() - t0
    return res
