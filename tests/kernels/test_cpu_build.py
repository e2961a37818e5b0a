"""The C kernels' build: every source compiles, ``$NIBBLE_CPU_MARCH``, and the AVX2 paths on an
AVX512 machine."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from nibble.kernels.cpu import available, build
from nibble.services.models.weight_quant import cpu_flags

ROOT = Path(__file__).resolve().parents[2]


def test_march_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv(build.MARCH_ENV, raising=False)
    assert build.cflags()[-1] == "-march=native"
    monkeypatch.setenv(build.MARCH_ENV, "x86-64-v3")
    assert build.cflags()[-1] == "-march=x86-64-v3"
    for bad in ("", "native -o /tmp/x", "v3;rm"):
        monkeypatch.setenv(build.MARCH_ENV, bad)
        with pytest.raises(ValueError, match="not an -march value"):
            build.cflags()


COMPILER = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(COMPILER is None, reason="no C compiler")
@pytest.mark.parametrize("march", ["native", "x86-64-v3", "x86-64"])
def test_every_source_compiles(tmp_path, monkeypatch, march):
    """Where a compiler exists, every csrc/*.c builds, for this CPU, for AVX2 and for plain
    x86-64. At run time a failed build falls back to the torch path, so the kernel tests
    would only skip: a compile error has to fail here, with the compiler's message."""
    if march != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("an x86 -march")
    monkeypatch.setenv(build.MARCH_ENV, march)
    for source in sorted(build.CSRC_DIR.glob("*.c")):
        try:
            build._compile(COMPILER, source, tmp_path / f"{source.stem}.so")
        except subprocess.CalledProcessError as exc:
            pytest.fail(f"{source.name} (-march={march}) does not compile:\n{exc.stderr[-3000:]}")
        assert (tmp_path / f"{source.stem}.so").stat().st_size > 0


@pytest.mark.skipif(not available(), reason="no C compiler")
@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the native build is the AVX2 one here")
def test_the_avx2_build_passes_the_kernel_tests(tmp_path):
    """On an AVX512 machine the native build never runs the kernels' AVX2 paths (the
    ``#ifdef __AVX512F__`` alternatives), which AVX2 CPUs run: build them for x86-64-v3 in a
    scratch cache and run the C kernels' tests against their torch references."""
    env = {**os.environ, build.MARCH_ENV: "x86-64-v3", "NIBBLE_CPU_KERNEL_DIR": str(tmp_path)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/kernels/test_cpu_decode.py", "tests/kernels/test_cpu_layer_ops.py"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1]
    libs = sorted(p.name for p in tmp_path.glob("*.so"))
    assert [n.split("_")[0] for n in libs] == ["layer", "nvfp4"], libs
    for lib in tmp_path.glob("*.so"):             # no 512-bit register in an AVX2 build
        dump = subprocess.run(["objdump", "-d", str(lib)], capture_output=True, text=True)
        if dump.returncode == 0:
            assert "zmm" not in dump.stdout, lib.name
