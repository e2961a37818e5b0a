"""Both real engines and the gateway tests' fake speak ``EngineClient``: every control method
a coroutine, ``generate`` an async generator, health a plain call."""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

import pytest

from nibble.services.disagg.client import DisaggEngine
from nibble.services.engine.async_engine import AsyncEngine
from nibble.services.engine.client import EngineClient, EngineStats, protocol_violations

from .conftest import make_engine
from .faulty import async_engine

FAKE = Path(__file__).parents[1] / "gateway" / "fake_engine.py"


def _fake_engine_class():
    spec = importlib.util.spec_from_file_location("nibble_tests_engine_client_fake", FAKE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.FakeEngine


@pytest.mark.parametrize("cls", [AsyncEngine, DisaggEngine, _fake_engine_class()],
                         ids=["AsyncEngine", "DisaggEngine", "FakeEngine"])
def test_method_kinds_match_the_protocol(cls):
    assert protocol_violations(cls) == []


def test_the_check_can_fail():
    class Sync:
        def abort(self, request_id): ...

        def generate(self, req): ...

    bad = protocol_violations(Sync)
    assert "abort is not a coroutine function" in bad
    assert "generate is not an async generator function" in bad


def test_instances_are_engine_clients(bf16_model):
    fake = _fake_engine_class()()
    assert isinstance(fake, EngineClient)
    engine = async_engine(make_engine(bf16_model))
    try:
        assert isinstance(engine, EngineClient) and protocol_violations(engine) == []
        stats = asyncio.run(engine.stats())
        assert isinstance(stats, EngineStats) and stats.num_running == 0
        assert stats.max_total_tokens == 64 * 16 and stats.kv_cache_dtype == "bf16"
    finally:
        asyncio.run(engine.shutdown())


def test_engine_stats_from_a_dict_keeps_known_fields():
    s = EngineStats.from_dict({"num_running": 2, "token_usage": 0.5, "pid": 7})
    assert (s.num_running, s.token_usage, s.num_queued) == (2, 0.5, None)
    assert "pid" not in s.as_dict()
