"""Host -> device copies of the step path (services/host_copy.py)."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from nibble.services.host_copy import copy_to, floats_to_device, ints_to_device, to_device

CPU = torch.device("cpu")
ROOT = pathlib.Path(__file__).resolve().parents[2]
# The modules that plan, enqueue and sample an engine step: every host -> device copy in
# them goes through host_copy (a blocking copy is a stream sync in torch).
STEP_PATH = ["services/engine/model_runner.py", "services/engine/overlap.py",
             "services/engine/sampling.py", "services/engine/logits_process.py",
             "services/engine/cuda_graph.py", "services/engine/step_inputs.py",
             "services/attention/triton_backend.py", "services/attention/ragged_plan.py",
             "services/models/llama.py", "services/models/gemma3.py"]
# Copies that run once, or when the calibrated parameters or global scales change.
ALLOWED = {("services/attention/triton_backend.py", "_refresh_scales")}


def test_on_the_cpu_nothing_is_copied():
    t = torch.arange(5)
    assert to_device(t, CPU) is t
    assert ints_to_device([3, 1], CPU).tolist() == [3, 1]
    assert ints_to_device([3, 1], CPU, torch.int32).dtype == torch.int32
    assert floats_to_device([0.5], CPU, torch.bfloat16).dtype == torch.bfloat16
    dst = torch.zeros(3, dtype=torch.int64)
    assert copy_to(dst, torch.tensor([1, 2, 3])) is dst and dst.tolist() == [1, 2, 3]


def test_refuses_a_tensor_that_is_not_on_the_host():
    with pytest.raises(ValueError, match="host tensors"):
        to_device(torch.empty(2, device="meta"), torch.device("cuda"))


def _blocking_copies(path: str, root: pathlib.Path = ROOT) -> list[str]:
    """``torch.tensor(..., device=...)`` and ``x.to(<device>)`` without ``non_blocking`` in
    ``path``, as "function:line" (device-ish: a name or attribute that mentions dev)."""
    tree = ast.parse((root / path).read_text())
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or \
                (path, fn.name) in ALLOWED:
            continue
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            kw = {k.arg for k in node.keywords}
            if node.func.attr in ("tensor", "as_tensor") and "device" in kw:
                found.append(f"{fn.name}:{node.lineno}")
            elif node.func.attr == "to" and "non_blocking" not in kw and node.args and \
                    "dev" in ast.unparse(node.args[0]).lower():
                found.append(f"{fn.name}:{node.lineno}")
    return found


@pytest.mark.parametrize("path", STEP_PATH)
def test_the_step_path_copies_to_the_device_only_through_host_copy(path):
    assert _blocking_copies(path) == []


def test_the_check_sees_a_blocking_copy(tmp_path):
    (tmp_path / "bad.py").write_text(
        "def f(x, dev):\n    a = torch.tensor([1], device=dev)\n"
        "    return x.to(dev), x.to(dev, non_blocking=True), x.to(torch.int32)\n")
    assert _blocking_copies("bad.py", tmp_path) == ["f:2", "f:3"]


@pytest.mark.gpu
def test_a_copy_to_the_gpu_does_not_wait_for_it():
    """Under torch's sync debug mode a blocking copy raises; these must not."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev = torch.device("cuda")
    busy = torch.randn(4096, 4096, device=dev)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            busy = busy @ busy / 64            # keep the stream busy
        got = ints_to_device(list(range(100_000)), dev)
        dst = torch.empty(100_000, dtype=torch.int64, device=dev)
        copy_to(dst, torch.arange(100_000))
        with pytest.raises(RuntimeError):
            torch.tensor([1, 2], device=dev)   # the blocking form does raise
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), torch.arange(100_000)) and torch.equal(dst.cpu(), got.cpu())
