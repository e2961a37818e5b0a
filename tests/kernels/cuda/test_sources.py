"""The CUDA C++ of ``nibble.kernels.cuda`` as files in ``csrc/`` (CPU; nothing is compiled).

Checks what the loader hands ``torch.utils.cpp_extension.load`` (files, include path, flags,
name), that the files ship in the package, and that the C++ agrees with the Python side
where they share numbers: the ``-D`` constants, the kernel variants, the exported functions
and their argument counts.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import nibble.kernels.cuda as kcuda
from nibble.kernels.cuda import _sources, decode

ROOT = Path(__file__).resolve().parents[3]
PKG_DIR = Path(kcuda.__file__).resolve().parent
CSRC = PKG_DIR / "csrc"


def _kwargs() -> dict:
    return _sources.load_kwargs(decode.KERNEL_CONSTANTS)


def _text(name: str) -> str:
    return (CSRC / name).read_text()


def test_loader_names_files_of_the_package():
    kw = _kwargs()
    assert _sources.CSRC_DIR == CSRC
    assert kw["sources"] == [str(CSRC / s) for s in ("binding.cpp", "decode.cu", "store.cu")]
    assert all(Path(s).is_file() for s in kw["sources"])
    assert kw["extra_include_paths"] == [str(CSRC)]
    assert all((CSRC / h).is_file() for h in _sources.HEADERS)
    listed = set(_sources.SOURCES) | set(_sources.HEADERS)
    assert {p.name for p in CSRC.iterdir()} == listed, "csrc/ holds a file the loader does not list"


def test_every_quoted_include_is_a_listed_header():
    for name in (*_sources.SOURCES, *_sources.HEADERS):
        for inc in re.findall(r'^#include "([^"]+)"', _text(name), re.M):
            assert inc in _sources.HEADERS, f"{name} includes {inc}"
    # only the binding sees torch: the device code builds fast and alone (nvcc -cubin)
    torch_users = [n for n in (*_sources.SOURCES, *_sources.HEADERS) if "<torch/" in _text(n)]
    assert torch_users == ["binding.cpp"]


def test_no_cuda_source_left_in_python_strings():
    assert not list(PKG_DIR.glob("_src_*.py"))
    for path in PKG_DIR.glob("*.py"):
        text = path.read_text()
        assert "__global__" not in text and "#include <" not in text, path.name


def test_compile_flags_and_defines():
    kw = _kwargs()
    assert kw["extra_cflags"] == ["-O2"]
    assert kw["extra_cuda_cflags"] == [
        "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
        f"-DNIBBLE_COUNTER_STRIDE={decode.COUNTER_STRIDE}",
        f"-DNIBBLE_FUSED_CAPACITY={decode.FUSED_CAPACITY}",
        f"-DNIBBLE_HEAD_DIM={decode.HEAD_DIM}", f"-DNIBBLE_MAX_GROUP={decode.MAX_GROUP}",
        f"-DNIBBLE_WARPS_PER_CTA={decode.WARPS_PER_CTA}"]
    assert kw["name"].startswith("nibble_nvfp4_decode_")


def test_kernel_constants_match_python():
    m = re.search(r"constexpr int kD = (\d+), kWarps = (\d+), kMaxGroup = (\d+);",
                  _text("tile.cuh"))
    assert m, "tile.cuh no longer states kD, kWarps, kMaxGroup on one line"
    assert tuple(map(int, m.groups())) == (decode.HEAD_DIM, decode.WARPS_PER_CTA,
                                           decode.MAX_GROUP)
    m = re.search(r"constexpr int kSplitGroup = (\d+), kMaxSplitGroups = (\d+), "
                  r"kCtrStride = 1 \+ kMaxSplitGroups;", _text("tile.cuh"))
    assert m, "tile.cuh no longer states the split combine's group sizes on one line"
    assert tuple(map(int, m.groups())) == (decode.SPLIT_GROUP, decode.MAX_SPLIT_GROUPS)
    guard = re.search(r"static_assert\(([^;]*)\);", _text("tile.cuh")).group(1)
    for macro in decode.KERNEL_CONSTANTS:
        assert macro in guard, f"tile.cuh does not check {macro}"


def test_compiled_variants_are_the_python_variants():
    body = re.search(r"#define NIBBLE_VARIANTS\(X\)(.*?)\n\n", _text("decode.cu"), re.S).group(1)
    fields = [tuple(map(int, t.split(","))) for t in re.findall(r"X\(([\d, ]+)\)", body)]
    # X(MINB, DQ, PIPE, MODE, PAIR, FMT), as decode.cu's kernel_of composes the code
    codes = sorted(100000 * f + 10000 * r + 1000 * d + 100 * p + 10 * q + m
                   for m, q, p, d, r, f in fields)
    assert codes == sorted(decode.VARIANTS + decode.FP8_VARIANTS + decode.DIAG_VARIANTS)


def _cpp_params(src: str, fn: str) -> int:
    sig = re.search(rf"^\w[\w:]* {fn}\(([^)]*)\)", src, re.M).group(1)
    return len(sig.split(","))


def _python_args(path: Path, fn: str) -> int:
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == fn and isinstance(node.func.value, ast.Call)
                and getattr(node.func.value.func, "id", None) == "_module"):
            return len(node.args)
    raise AssertionError(f"no _module().{fn}(...) call in {path.name}")


def test_binding_exports_what_the_wrappers_call():
    src = _text("binding.cpp")
    exported = re.findall(r'm\.def\("(\w+)", torch::wrap_pybind_function\((\w+)\)', src)
    assert [a for a, b in exported if a == b] == list(_sources.FUNCTIONS)
    assert _cpp_params(src, "decode") == _python_args(PKG_DIR / "decode.py", "decode")
    assert _cpp_params(src, "store") == _python_args(PKG_DIR / "store.py", "store")
    assert _cpp_params(src, "occupancy") == _python_args(PKG_DIR / "decode.py", "occupancy")


def test_name_changes_with_any_file_or_flag(tmp_path, monkeypatch):
    base = _kwargs()["name"]
    assert _kwargs()["name"] == base
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    monkeypatch.setattr(_sources, "CSRC_DIR", copy)
    assert _kwargs()["name"] == base
    with open(copy / "pipe.cuh", "a") as f:          # a header only, not a listed source
        f.write("\n")
    changed = _kwargs()["name"]
    assert changed != base
    assert _sources.load_kwargs({**decode.KERNEL_CONSTANTS, "NIBBLE_MAX_GROUP": 4})["name"] \
        not in (base, changed)


def test_module_is_built_with_load(monkeypatch):
    import torch.utils.cpp_extension as cpp_extension
    calls = []
    monkeypatch.setattr(cpp_extension, "load", lambda **kw: calls.append(kw) or "ext")
    monkeypatch.delenv("NIBBLE_CUDA_VERBOSE", raising=False)
    decode._module.cache_clear()
    try:
        assert decode._module() == "ext" and decode._module() == "ext"
        assert kcuda.is_built()
    finally:
        decode._module.cache_clear()
    assert calls == [_kwargs()]


def _package_data() -> dict:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "package_data":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no package_data")


def test_package_data_covers_csrc():
    patterns = _package_data()["nibble.kernels.cuda"]
    for path in CSRC.iterdir():
        rel = f"csrc/{path.name}"
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), f"{rel} would not ship"


@pytest.mark.slow
def test_wheel_ships_csrc(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("nibble-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    want = {f"nibble/kernels/cuda/csrc/{n}" for n in (*_sources.SOURCES, *_sources.HEADERS)}
    assert want <= names, f"missing from the wheel: {sorted(want - names)}"
