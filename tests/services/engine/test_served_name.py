"""The served model name: what ``/v1/models`` reports and what requests must name."""

from __future__ import annotations

from nibble.services.engine.builder import served_name


def test_the_flag_wins():
    assert served_name("my-model", "gemma3-270m", "gemma-3-270m") == "my-model"


def test_a_packaged_model_is_served_under_the_name_typed():
    assert served_name(None, "gemma3-270m", "gemma-3-270m") == "gemma3-270m"


def test_the_default_model_and_paths_take_the_checkpoint_name(tmp_path, monkeypatch):
    assert served_name(None, None, "SmolLM2-135M-Instruct") == "SmolLM2-135M-Instruct"
    assert served_name(None, str(tmp_path / "qwen3"), "qwen3") == "qwen3"
    # a directory of that name is a path, not the package: its name would probe the disk
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gemma3-270m").mkdir()
    assert served_name(None, "gemma3-270m", "gemma-3-270m") == "gemma-3-270m"
