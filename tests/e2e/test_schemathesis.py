"""Schemathesis against a real ``nibble serve``: no 5xx, and every answer as /openapi.json says.

The server runs a tiny random-weight model on CPU (tiny_model.py: starts in
seconds, has a chat template and a byte-level tokenizer), with a 64-token
context so generations stay short. Schemathesis (pinned in the test extra)
generates valid and invalid requests for every operation from the server's own
schema and runs all its checks: no server error; status codes, content types,
headers and bodies as documented; schema-invalid input refused; schema-valid
input accepted. The last one is schemathesis_hooks.py's variant, which allows the
one 400 no schema can rule out (prompt + max_tokens over the context).

Bounded: MAX_EXAMPLES per operation and a fixed seed (about 30 s on 2 cores).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import running_server
from .tiny_model import tiny_server_args

pytest.importorskip("schemathesis")
pytestmark = pytest.mark.slow

HOOKS = Path(__file__).resolve().with_name("schemathesis_hooks.py")
MAX_EXAMPLES = 40
SEED = 14
RUN_TIMEOUT_S = 300


def schemathesis_cmd(url: str) -> list[str]:
    return [sys.executable, "-m", "schemathesis.cli", "run", f"{url}/openapi.json",
            "--checks", "all", "--exclude-checks", "positive_data_acceptance",
            "--max-examples", str(MAX_EXAMPLES), "--seed", str(SEED),
            "--generation-database", "none", "--continue-on-failure",
            "--request-timeout", "30", "--no-color", "--output-sanitize", "false"]


def test_schemathesis_finds_no_server_error_and_no_mismatch(tmp_path_factory):
    model = tmp_path_factory.mktemp("tiny-model")
    args = [*tiny_server_args(model), "--context-length", "64"]
    with running_server(tmp_path_factory, "schemathesis", args) as srv:
        env = {**os.environ, "SCHEMATHESIS_HOOKS": str(HOOKS)}
        # Its working directory gets schemathesis' cache: a scratch one, not the checkout.
        run = subprocess.run(schemathesis_cmd(srv.url), cwd=tmp_path_factory.mktemp("st"),
                             env=env, text=True, capture_output=True, timeout=RUN_TIMEOUT_S)
        log = srv.log_tail(4000)
    report = run.stdout[-12000:] + run.stderr[-3000:]
    assert run.returncode == 0, f"{report}\n--- server log ---\n{log}"
    assert "No issues found" in run.stdout, report
