"""bench/e2e.py on a tiny dummy model (CPU): the runs, the capacity arithmetic and the JSON."""

from __future__ import annotations

import json

from nibble.bench import e2e

TINY = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 300, "max_position_embeddings": 256,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-6, "eos_token_id": 2}


def test_pct():
    assert e2e.pct([], 0.5) == 0.0
    assert e2e.pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert e2e.pct(list(range(101)), 0.99) == 99


def test_runs_write_consistent_json(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "out"
    # 40 + 8 tokens = 3 pages of 16; 480 tokens = 30 pages -> 10 requests per format
    e2e.main(["--model-path", str(tmp_path / "m"), "--load-format", "dummy", "--device", "cpu",
              "--input-len", "40", "--output-len", "8", "--max-total-tokens", "480",
              "--ttft-probes", "1", "--out", str(out)])
    data = json.loads((out / "e2e.json").read_text())
    res = {r["format"]: r for r in data["results"]}
    assert set(res) == {"fp8_e4m3", "nvfp4"}
    for r in res.values():
        assert r["capacity_requests"] == 10 and r["pool_tokens"] == 480
        run = r["runs"]["10"]
        assert set(run["modes"]) == {"iso-concurrency", "iso-capacity"}
        assert run["max_decode_batch"] == 10, "every request of the burst was admitted at once"
        assert run["decode_steps"] == 7           # 8 tokens: 1 from prefill + 7 decode steps
        assert 0 < run["ttft_mean_s"] <= run["wall_s"] and run["decode_tok_s"] > 0
        assert r["decode_path"] == "eager"
        assert len(r["ttft_probe_s"]) == 1 and r["ttft_cold_s"] > 0   # the cold probe apart
        ph = run["phases"]["unfused"]                 # CPU: the torch layer ops
        assert ph["steps"] == 7 and ph["decode_tok_s"] == run["decode_tok_s"]
        assert 0 < ph["floor_ms"] < ph["step_ms"] and 0 < ph["floor_share"] < 1
        assert "profile" not in ph                    # the profiler pass runs on CUDA only
    s = data["summary"]
    assert s["capacity_token_ratio"] == 1.0 and s["iso_concurrency"] == 10
    assert (out / "e2e.png").stat().st_size > 10_000


def test_capacity_as_scales_with_bytes(tmp_path):
    """Same bytes: NVFP4 pages hold 1.78x the tokens of FP8 pages."""
    from nibble.kernels import PageLayout
    from nibble.tiering import KVPool

    class Core:
        pool = KVPool(PageLayout("fp8_e4m3", 2, 2, 16, 16), 100)

    class Args:
        max_total_tokens, input_len, output_len = None, 40, 8

    fp8, nv = (PageLayout(f, 2, 2, 16, 16).page_nbytes for f in ("fp8_e4m3", "nvfp4"))
    assert e2e.capacity_as(Core, "fp8_e4m3", Args) == 33          # 100 pages // 3 per request
    assert e2e.capacity_as(Core, "nvfp4", Args) == (100 * fp8 // nv) // 3 == 59
