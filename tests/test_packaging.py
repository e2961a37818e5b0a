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
# Folders shipped under another package name (setup.py's RENAMED): the SDK is nibble.client,
# standalone (it talks to a server over gRPC and imports only the stubs).
RENAMED = {"services/client": "client"}
ALLOWED_RENAMED = {"client": {"client", "proto"}}


def _package_of(rel: pathlib.Path) -> str:
    path = "/".join(rel.parts)
    for folder, name in RENAMED.items():
        if path == folder or path.startswith(folder + "/"):
            path = name + path[len(folder):]
    return "nibble/" + path


def source_packages():
    for folder in CODE_FOLDERS:
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            yield _package_of(init.parent.relative_to(ROOT))


def test_every_code_folder_is_a_package():
    """A folder of .py files without __init__.py is left out of a non-editable install
    (find_packages skips it), though an editable one still imports it."""
    bare = [str(d.relative_to(ROOT)) for folder in CODE_FOLDERS
            for d in [ROOT / folder, *(ROOT / folder).rglob("*")]
            if d.is_dir() and "__pycache__" not in d.parts and any(d.glob("*.py"))
            and not (d / "__init__.py").exists()]
    assert not bare, f"folders with modules but no __init__.py: {bare}"


@pytest.mark.slow
def test_wheel_contains_every_subpackage(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path), str(ROOT)], check=True)
    (wheel,) = tmp_path.glob("nibble-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [p for p in source_packages() if f"{p}/__init__.py" not in names]
    assert not missing, f"subpackages missing from the wheel: {missing}"
    doubled = [folder for folder in RENAMED
               if any(n.startswith(f"nibble/{folder}/") for n in names)]
    assert not doubled, f"shipped twice (also under their folder's name): {doubled}"
    assert any(n.endswith(".py") and n.startswith("nibble/kernels/") for n in names)


def _our_imports(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def _bad_imports(folder: str, allowed: set[str]) -> list[str]:
    bad = []
    for path in (ROOT / folder).rglob("*.py"):
        for mod in _our_imports(path):
            parts = mod.split(".")
            if parts[0] == "nibble" and len(parts) > 1 and parts[1] not in allowed:
                bad.append(f"{path.relative_to(ROOT)} imports {mod}")
    return bad


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_import_direction(folder):
    bad = _bad_imports(folder, ALLOWED[folder])
    assert not bad, bad


@pytest.mark.parametrize("folder", sorted(RENAMED))
def test_renamed_packages_import_only_what_they_may(folder):
    bad = _bad_imports(folder, ALLOWED_RENAMED[RENAMED[folder]])
    assert not bad, bad


# The KV cache's parts, which only KVCacheManager may drive (``tiering.kv_cache_manager``).
CACHE_PARTS = {"nibble.tiering", "nibble.tiering.allocator", "nibble.tiering.kv_pool",
               "nibble.tiering.radix_cache", "nibble.tiering.tier_manager",
               "nibble.tiering.tier_worker", "nibble.tiering.host_pool"}
MANAGER_ONLY = ["services/engine/scheduler.py", "services/engine/kv_connector.py",
                *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "services/disagg").glob("*.py"))]


@pytest.mark.parametrize("path", MANAGER_ONLY)
def test_the_scheduler_and_disaggregation_see_only_the_cache_manager(path):
    bad = [mod for mod in _our_imports(ROOT / path) if mod in CACHE_PARTS]
    assert not bad, f"{path} imports {bad}; use nibble.tiering.kv_cache_manager"


def _resolved_imports(path: pathlib.Path):
    """Every module ``path`` imports, relative imports resolved to ``nibble.<...>`` names."""
    package = _package_of(path.parent.relative_to(ROOT)).replace("/", ".").split(".")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            mod = ".".join([*base, *(node.module.split(".") if node.module else [])])
            yield mod
            yield from (f"{mod}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


# Frontend layering: the gRPC API and the shared frontend never reach into the HTTP gateway.
NO_GATEWAY = ("services/grpc_api", "services/frontend")


@pytest.mark.parametrize("folder", NO_GATEWAY)
def test_frontends_do_not_import_the_http_gateway(folder):
    bad = sorted({f"{p.relative_to(ROOT)} imports {mod}"
                  for p in (ROOT / folder).rglob("*.py") for mod in _resolved_imports(p)
                  if mod == "nibble.services.gateway" or mod.startswith("nibble.services.gateway.")})
    assert not bad, bad


def test_the_import_check_sees_relative_imports():
    mods = set(_resolved_imports(ROOT / "services/gateway/app.py"))
    assert "nibble.services.frontend.tracking" in mods and "nibble.services.gateway.auth" in mods


def _constructs(path: pathlib.Path, name: str) -> list[int]:
    """Lines of ``path`` that call ``name(...)`` (a bare or dotted name)."""
    tree = ast.parse(path.read_text(), str(path))
    return [node.lineno for node in ast.walk(tree) if isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Name) and node.func.id == name)
        or (isinstance(node.func, ast.Attribute) and node.func.attr == name))]


def test_one_builder_constructs_the_engine_core():
    """The server, the workers, the tests and the benchmarks all get their EngineCore from
    ``build_engine_core``: no hand-wired copy of the pool/backend/tiers/runner wiring."""
    allowed = ROOT / "services/engine/builder.py"
    found = [f"{p.relative_to(ROOT)}:{line}"
             for folder in (*CODE_FOLDERS, "tests")
             for p in sorted((ROOT / folder).rglob("*.py")) if p != allowed
             for line in _constructs(p, "EngineCore")]
    assert not found, found
    assert _constructs(allowed, "EngineCore")       # the check sees the one that exists
