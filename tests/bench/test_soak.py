"""bench/soak.py: outcome classification, leak checks, fault plan, record tampering against a
private Redis, and one short bounded run against the real server with every fault injected."""

from __future__ import annotations

import random
import shutil

import pytest

redis = pytest.importorskip("redis")

from nibble.bench import soak
from nibble.bench._faults import PrivateRedis, corrupt_records, process_figures
from nibble.bench._soak_client import SoakResult, make_prompts


def _res(prompt: int, text: str, outcome: str = "ok", end: float = 1.0) -> SoakResult:
    return SoakResult(prompt, "tenant-a", "finish", 0.0, end=end, outcome=outcome, text=text)


def test_prompts_have_distinct_codes_and_are_seeded():
    a, b = make_prompts(8, random.Random(1)), make_prompts(8, random.Random(1))
    assert a == b
    assert len({p.code for p in a}) == 8
    assert all(p.code in p.text for p in a)


def test_an_answer_with_another_prompts_code_is_wrong():
    prompts = make_prompts(3, random.Random(0))
    results = [_res(0, f"The code is {prompts[0].code}."),          # its own code: fine
               _res(1, f"It is {prompts[2].code}"),                 # another prompt's: wrong
               _res(2, "I do not know")]
    out = soak.classify(results, [], prompts)
    assert out["wrong_answers"] == 1
    assert out["wrong_examples"][0]["prompt"] == 1


def test_errors_count_as_stray_outside_a_fault_window():
    prompts = make_prompts(2, random.Random(0))
    faults = [{"t": 10.0, "fault": "redis-kill"}]
    results = [_res(0, "", "error:stream", end=12.0),        # 2 s after the fault: explained
               _res(1, "", "error:http_500", end=30.0)]      # long after: stray
    out = soak.classify(results, faults, prompts)
    assert out["errors"] == 2 and out["errors_outside_fault_windows"] == 1


def test_leak_check_flags_pages_rss_and_fds():
    base = {"rss_mib": 1000.0, "open_fds": 40, "pages_in_use": 0}
    good = soak.leak_check(base, {"rss_mib": 1100.0, "open_fds": 42, "pages_in_use": 0})
    assert good["pages_returned"] and good["rss_returned"] and good["fds_returned"]
    bad = soak.leak_check(base, {"rss_mib": 1300.0, "open_fds": 60, "pages_in_use": 3})
    assert not (bad["pages_returned"] or bad["rss_returned"] or bad["fds_returned"])


def test_pages_that_tier_backups_pin_keep_the_server_busy():
    """The idle snapshot waits for in-flight backups: their pinned pages are not leaks."""
    idle = {"running_requests": 0, "queued_requests": 0,
            "stats": {"tiers": {"backup_pinned_pages": 0}}}
    pinned = {"running_requests": 0, "queued_requests": 0,
              "stats": {"tiers": {"backup_pinned_pages": 2}}}
    workers = {"workers": {"d": {"num_running": 0, "num_queued": 0,
                                 "tiers": {"backup_pinned_pages": 1}},
                           "p": {"num_running": 0, "num_queued": 0, "tiers": None}}}
    assert soak.busy(idle) == 0
    assert soak.busy(pinned) == 2
    assert soak.busy(workers) == 1


def test_fault_plan_follows_the_setup():
    args = soak.parse_args(["--l3", "redis", "--disaggregate"])
    assert [f for _, f in soak.fault_plan(args)] == [
        "corrupt-records", "redis-kill", "redis-restart", "kill-decode-worker"]
    assert soak.fault_plan(soak.parse_args(["--l3", "file"])) == []
    assert soak.fault_plan(soak.parse_args(["--no-faults"])) == []


def test_process_figures_of_this_process():
    import os
    fig = process_figures(os.getpid())
    assert fig.rss_mib > 10 and fig.open_fds > 2


@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_corrupt_records_swaps_overwrites_and_flips(tmp_path):
    srv = PrivateRedis(str(tmp_path))
    try:
        client = redis.Redis.from_url(srv.url)
        values = {f"p:{i}".encode(): bytes([i]) * 64 for i in range(6)}
        client.mset(values)
        done = corrupt_records(srv.url, "p:", random.Random(0), count=3)
        assert [c.kind for c in done] == ["swap", "random", "flip"]
        changed = {k for k, v in values.items() if client.get(k) != v}
        assert changed == {k.encode() for c in done for k in c.keys}
        srv.kill()                                   # a crash loses everything (no persistence)
        srv.start()
        assert client.dbsize() == 0
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.redis
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_short_soak_with_faults_against_the_real_server(tmp_path):
    """Bounded: 4 streams for 20 s with disconnects, aborts, Redis killed and restarted and
    records tampered with. No wrong answer, no error outside a fault window, nothing leaks."""
    rec = soak.run(soak.parse_args([
        "--duration", "20", "--concurrency", "4", "--num-prompts", "8", "--max-tokens", "8",
        "--pool-tokens", "1024",
        "--disconnect-rate", "0.2", "--abort-rate", "0.2", "--l3", "redis",
        "--out-dir", str(tmp_path)]))
    assert [f["fault"] for f in rec["faults"]] == ["corrupt-records", "redis-kill",
                                                   "redis-restart"]
    assert rec["faults"][0]["detail"], "no record was in Redis to tamper with"
    assert rec["requests"] > 4
    assert rec["wrong_answers"] == 0, rec["wrong_examples"]
    assert rec["errors_outside_fault_windows"] == 0, rec["error_examples"]
    leaks = rec["leaks"]
    assert leaks["pages_returned"] and leaks["fds_returned"], leaks
    assert rec["server_exit_code"] == 0
    assert (tmp_path / "soak.json").exists() and (tmp_path / "soak.png").exists()
