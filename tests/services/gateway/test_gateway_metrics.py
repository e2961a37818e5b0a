"""/metrics: Prometheus text parsed with prometheus_client's parser; names, types, values."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nibble.services.engine.types import FinishReason, RequestOutput, Usage
from nibble.services.errors import QueueFullError
from nibble.services.frontend.tracking import InFlight, tracked
from nibble.services.metrics import Metrics

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
COMPLETION = {"prompt": "abc", "max_tokens": 4}

GAUGES = {"nibble:num_running_reqs", "nibble:num_queue_reqs", "nibble:token_usage",
          "nibble:max_total_num_tokens", "nibble:kv_bytes_per_token", "nibble:cache_hit_rate",
          "nibble:num_cached_pages"}
COUNTERS = {"nibble:prompt_tokens", "nibble:generation_tokens", "nibble:cached_tokens",
            "nibble:num_requests", "nibble:num_preemptions"}
HISTOGRAMS = {"nibble:time_to_first_token_seconds", "nibble:time_per_output_token_seconds",
              "nibble:e2e_request_latency_seconds"}


def scrape(client) -> dict:
    """{family name: family}; also checks the response's content type."""
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    return {f.name: f for f in text_string_to_metric_families(r.text)}


def value(families: dict, sample_name: str, **labels) -> float:
    family = sample_name.removesuffix("_total").removesuffix("_count").removesuffix("_sum")
    for s in families[family].samples:
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise KeyError(f"{sample_name}{labels}")


def test_names_and_types(client):
    fams = scrape(client)
    for name in GAUGES:
        assert fams[name].type == "gauge", name
    for name in COUNTERS:
        assert fams[name].type == "counter", name
    for name in HISTOGRAMS:
        assert fams[name].type == "histogram", name


def test_engine_gauges_come_from_stats(client, engine):
    engine.stats_extra = {"num_queued": 7, "token_usage": 0.75}
    fams = scrape(client)
    assert value(fams, "nibble:num_queue_reqs") == 7
    assert value(fams, "nibble:token_usage") == 0.75
    assert value(fams, "nibble:max_total_num_tokens") == 4096
    assert value(fams, "nibble:kv_bytes_per_token", kv_cache_dtype="nvfp4") == 1234.5
    assert value(fams, "nibble:cache_hit_rate") == 0.5
    assert value(fams, "nibble:num_cached_pages") == 3
    assert value(fams, "nibble:num_preemptions_total") == 2
    assert value(fams, "nibble:num_running_reqs") == 0
    assert "nibble:request_faults" not in fams          # an engine that does not report them
    engine.stats_extra = {"num_request_faults": 3, "num_fault_recomputes": 1}
    fams = scrape(client)
    assert fams["nibble:request_faults"].type == "counter"
    assert value(fams, "nibble:request_faults_total") == 3
    assert value(fams, "nibble:fault_recomputes_total") == 1


def test_counters_and_histograms_move(FakeEngine, make_client):
    engine = FakeEngine(reply="Hello", cached_tokens=2)
    client = make_client(engine)
    before = scrape(client)
    assert value(before, "nibble:prompt_tokens_total") == 0
    assert value(before, "nibble:e2e_request_latency_seconds_count") == 0
    r1 = client.post("/v1/completions", json=COMPLETION).json()              # length, 4 tokens
    r2 = client.post("/v1/chat/completions", json={**CHAT, "stream": True})  # stop, 5 tokens
    assert r2.status_code == 200 and r2.text.endswith("[DONE]\n\n")
    fams = scrape(client)
    prompt = r1["usage"]["prompt_tokens"] + len(engine.requests[1].prompt_token_ids)
    assert value(fams, "nibble:prompt_tokens_total") == prompt
    assert value(fams, "nibble:generation_tokens_total") == 4 + 5
    assert value(fams, "nibble:cached_tokens_total") == 4
    assert value(fams, "nibble:num_requests_total", finish_reason="length") == 1
    assert value(fams, "nibble:num_requests_total", finish_reason="stop") == 1
    assert value(fams, "nibble:num_requests_total", finish_reason="abort") == 0
    for name in HISTOGRAMS:
        assert value(fams, f"{name}_count") == 2, name
        assert value(fams, f"{name}_sum") >= 0
    inf = [s for s in fams["nibble:e2e_request_latency_seconds"].samples
           if s.name.endswith("_bucket") and s.labels["le"] == "+Inf"]
    assert inf[0].value == 2


def test_tpot_from_ttft_and_e2e(FakeEngine, make_client):
    engine = FakeEngine(reply="abcde", delay=0.02)
    client = make_client(engine)
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5})
    fams = scrape(client)
    ttft = value(fams, "nibble:time_to_first_token_seconds_sum")
    tpot = value(fams, "nibble:time_per_output_token_seconds_sum")
    e2e = value(fams, "nibble:e2e_request_latency_seconds_sum")
    assert 0.02 <= ttft < e2e
    assert tpot == pytest.approx((e2e - ttft) / 4, rel=1e-6)
    assert 0.015 <= tpot < 0.5


def test_single_token_has_no_tpot(FakeEngine, make_client):
    client = make_client(FakeEngine())
    client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    fams = scrape(client)
    assert value(fams, "nibble:time_to_first_token_seconds_count") == 1
    assert value(fams, "nibble:time_per_output_token_seconds_count") == 0


def test_failed_and_rejected_requests(FakeEngine, make_client):
    engine = FakeEngine(error_after=(2, "engine fault"))
    client = make_client(engine)
    client.post("/v1/completions", json=COMPLETION)
    fams = scrape(client)
    assert value(fams, "nibble:num_requests_total", finish_reason="error") == 1
    assert value(fams, "nibble:generation_tokens_total") == 2
    engine.error_after, engine.raise_before = None, QueueFullError("full")
    assert client.post("/v1/completions", json=COMPLETION).status_code == 503
    fams = scrape(client)                     # refused before admission: not a served request
    assert value(fams, "nibble:e2e_request_latency_seconds_count") == 1


def test_aborted_requests_are_counted(FakeEngine, make_client):
    engine = FakeEngine(hang_after=2)
    app = make_client(engine).app

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            task = asyncio.create_task(
                c.post("/v1/completions", json={**COMPLETION, "stream": True}))
            while not engine.hanging:                    # two tokens are out
                await asyncio.sleep(0.005)
            assert (await c.post("/abort_request", json={"abort_all": True})).status_code == 200
            return (await task).text

    text = asyncio.run(main())
    assert '"finish_reason":"abort"' in text and '"text":"e"' in text
    fams = {f.name: f for f in text_string_to_metric_families(
        app.state.metrics.render()[0].decode())}
    assert value(fams, "nibble:num_requests_total", finish_reason="abort") == 1
    assert value(fams, "nibble:generation_tokens_total") == 2
    assert value(fams, "nibble:time_to_first_token_seconds_count") == 1
    assert value(fams, "nibble:time_per_output_token_seconds_count") == 1
    assert engine.active == set() and app.state.inflight == set()


def test_stats_failure_keeps_request_metrics(FakeEngine, make_client, caplog):
    engine = FakeEngine()

    def broken():
        raise RuntimeError("boom")

    engine.stats = broken
    client = make_client(engine)
    client.post("/v1/completions", json=COMPLETION)
    fams = scrape(client)
    assert "nibble:num_running_reqs" not in fams
    assert value(fams, "nibble:generation_tokens_total") == 4
    assert "engine.stats() failed" in caplog.text


def test_registries_are_independent():
    a, b = Metrics(), Metrics()
    a.start_request().finish("stop", 3, 2, 0)
    fam_b = {f.name: f for f in text_string_to_metric_families(b.render()[0].decode())}
    assert value(fam_b, "nibble:prompt_tokens_total") == 0
    assert "nibble:num_running_reqs" not in fam_b        # no engine: no engine gauges


def test_timer_finishes_once():
    m = Metrics()
    t = m.start_request()
    t.first_token()
    t.finish("stop", 3, 2, 1)
    t.finish("abort", 3, 2, 1)
    fams = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}
    assert value(fams, "nibble:num_requests_total", finish_reason="stop") == 1
    assert value(fams, "nibble:num_requests_total", finish_reason="abort") == 0
    assert value(fams, "nibble:prompt_tokens_total") == 3


def test_openmetrics_on_request(client):
    r = client.get("/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"})
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("application/openmetrics-text")
    assert r.text.rstrip().endswith("# EOF")


def _outputs(n: int, finish: bool, exc: BaseException | None = None):
    """An engine stream of ``n`` one-token outputs; the last finishes ("length") if
    ``finish``; then ``exc`` is raised if given."""
    async def gen():
        for i in range(n):
            last = finish and i == n - 1
            yield RequestOutput("r1", [7], "x", last, FinishReason.LENGTH if last else None,
                                Usage(3, i + 1, 1))
        if exc is not None:
            raise exc
    return gen()


def _track(source, consume: int | None = None, raises: type | None = None) -> tuple[dict, set]:
    """Run ``tracked`` over ``source``, reading ``consume`` outputs (None: all) then closing;
    ``raises``: the source's exception, which must reach the consumer unchanged."""
    m, inflight = Metrics(), InFlight()

    async def main():
        gen = tracked(source, "r1", m.start_request(), inflight)
        seen = 0
        try:
            async for _ in gen:
                seen += 1
                assert inflight == {"r1"}
                if consume is not None and seen == consume:
                    break
        finally:
            await gen.aclose()

    with pytest.raises(raises) if raises else contextlib.nullcontext():
        asyncio.run(main())
    return {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}, inflight


@pytest.mark.parametrize("source, consume, raises, reason, gen_tokens", [
    (lambda: _outputs(3, True), None, None, "length", 3),
    (lambda: _outputs(5, False), 2, None, "abort", 2),              # closed early (client gone)
    (lambda: _outputs(2, False, RuntimeError("boom")), None, RuntimeError, "error", 2),
])
def test_tracked_finish_reasons(source, consume, raises, reason, gen_tokens):
    fams, inflight = _track(source(), consume, raises)
    assert inflight == set()
    assert value(fams, "nibble:num_requests_total", finish_reason=reason) == 1
    assert value(fams, "nibble:generation_tokens_total") == gen_tokens
    assert value(fams, "nibble:cached_tokens_total") == 1


def test_tracked_skips_requests_refused_before_output():
    fams, inflight = _track(_outputs(0, False, QueueFullError("full")), raises=QueueFullError)
    assert inflight == set()
    assert value(fams, "nibble:e2e_request_latency_seconds_count") == 0
