"""The orchestrator's stream always ends with a finished output (no Ray: ``_serve`` is faked).

The gateway reads outputs until one says ``finished``; a stream that just stopped (a client
abort in the disaggregated engine did) surfaced as a StopAsyncIteration 500 mid-stream.
"""

from __future__ import annotations

import asyncio

from nibble.services.disagg.orchestrator import Orchestrator
from nibble.services.engine.types import (FinishReason, GenerateRequest, RequestOutput,
                                          SamplingParams, Usage)

RID = "req-1"


def _orchestrator(outputs: list[RequestOutput], abort_after: int | None = None) -> Orchestrator:
    orch = object.__new__(Orchestrator)           # no Ray actor, no metrics: only the stream
    orch.inflight, orch.aborted = {}, set()

    async def serve(req, sent):
        for i, out in enumerate(outputs):
            if abort_after is not None and i == abort_after:
                orch.aborted.add(req.request_id)
            yield out
            await asyncio.sleep(0)

    orch._serve = serve
    return orch


def _out(tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput(RID, tokens, "x" * len(tokens), finished,
                         FinishReason.LENGTH if finished else None, Usage(3, len(tokens)))


def _collect(orch: Orchestrator) -> list[RequestOutput]:
    req = GenerateRequest(RID, [1, 2, 3], SamplingParams(max_tokens=8))

    async def run():
        return [o async for o in orch.generate(req)]
    return asyncio.run(run())


def test_a_client_abort_ends_the_stream_with_finish_reason_abort():
    got = _collect(_orchestrator([_out([5]), _out([6]), _out([7]), _out([8], True)],
                                 abort_after=1))
    assert [o.new_token_ids for o in got] == [[5], [6], []]
    last = got[-1]
    assert last.finished and last.finish_reason == FinishReason.ABORT and last.error is None
    assert last.usage.completion_tokens == 2


def test_a_stream_that_stops_early_ends_with_an_error():
    got = _collect(_orchestrator([_out([5])]))
    assert got[-1].finished and got[-1].error == "the decode stream ended early"


def test_a_finished_stream_passes_through_unchanged():
    outs = [_out([5]), _out([6], True)]
    assert _collect(_orchestrator(outs)) == outs
