"""Reading a model directory's small JSON files (config, generation config, tokenizer config)."""

from __future__ import annotations

import json
import os

from ..errors import ModelLoadError


def read_json(path: str) -> dict:
    """The JSON object at ``path``; ``{}`` when the file does not exist; ModelLoadError when
    it cannot be read or parsed."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot parse {path}: {e}") from e
