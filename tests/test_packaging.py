"""The wheel ships every subpackage under ``nibble.*`` and imports point one way."""

import ast
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CODE_FOLDERS = ("kernels", "tiering", "services", "proto", "bench")
# Which of our packages each may import: kernels <- tiering <- services; proto holds
# generated stubs only (a leaf), which tiering's gRPC transport uses.
ALLOWED = {"kernels": {"kernels"}, "proto": {"proto"},
           "tiering": {"kernels", "tiering", "proto"}}


def source_packages():
    for folder in CODE_FOLDERS:
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            rel = init.parent.relative_to(ROOT)
            yield "nibble/" + "/".join(rel.parts)


@pytest.mark.slow
def test_wheel_contains_every_subpackage(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("nibble-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [p for p in source_packages() if f"{p}/__init__.py" not in names]
    assert not missing, f"subpackages missing from the wheel: {missing}"
    assert any(n.endswith(".py") and n.startswith("nibble/kernels/") for n in names)


def _our_imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_import_direction(folder):
    bad = []
    for path in (ROOT / folder).rglob("*.py"):
        for mod in _our_imports(path):
            parts = mod.split(".")
            if parts[0] == "nibble" and len(parts) > 1 and parts[1] not in ALLOWED[folder]:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    assert not bad, bad
