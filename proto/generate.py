"""Regenerate every Python stub from the ``.proto`` files under ``proto/``.

One command, run after editing any ``.proto``::

    python -m nibble.proto.generate

Stubs (``*_pb2.py`` and ``*_pb2_grpc.py``) are written beside their
``.proto`` files, so ``proto/nibble/v1/kv_transfer.proto`` becomes
``nibble.proto.nibble.v1.kv_transfer_pb2``. protoc writes imports rooted at
the proto tree (``from nibble.v1 import ...``); they are rewritten to the
installed package (``from nibble.proto.nibble.v1 import ...``). The stubs are
checked in; ``tests/proto`` fails when they are stale.
"""

from __future__ import annotations

import argparse
import importlib.resources
import pathlib
import re
import subprocess
import sys

PROTO_ROOT = pathlib.Path(__file__).resolve().parent
PACKAGE = "nibble.proto"

# Lines that differ only by the protoc/grpcio-tools version; tests normalise them.
VERSION_LINES = (
    re.compile(r"^# Protobuf Python Version: .*$", re.M),
    re.compile(r"^(_runtime_version\.ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain"
               r"\.PUBLIC,)[^']*", re.M),
    re.compile(r"^GRPC_GENERATED_VERSION = .*$", re.M),
)


def proto_files(root: pathlib.Path = PROTO_ROOT) -> list[pathlib.Path]:
    """Every ``.proto`` under ``root``, sorted, as paths relative to it."""
    return sorted(p.relative_to(root) for p in root.rglob("*.proto"))


def _fix_imports(text: str, top_dirs: set[str]) -> str:
    """Point protoc's tree-rooted imports (``from nibble.v1 import x_pb2``) at ``nibble.proto``."""
    def repl(m: re.Match) -> str:
        module = m.group(2)
        if module.split(".")[0] not in top_dirs:
            return m.group(0)  # google.protobuf and other installed packages
        return f"{m.group(1)}from {PACKAGE}.{module} import"
    return re.sub(r"^(\s*)from ([\w.]+) import", repl, text, flags=re.M)


def generate(out_dir: pathlib.Path | None = None, root: pathlib.Path = PROTO_ROOT
             ) -> list[pathlib.Path]:
    """Run protoc on every ``.proto`` in ``root``; stubs go under ``out_dir`` (default ``root``).

    Returns the stub paths written. Missing ``__init__.py`` files are created
    along the way so the stubs import as packages.
    """
    out = pathlib.Path(out_dir or root).resolve()
    files = proto_files(root)
    if not files:
        return []
    well_known = importlib.resources.files("grpc_tools") / "_proto"
    # A child process: grpc_tools' compiler carries its own protobuf/abseil, which can crash
    # a process that already loaded other native copies (NIXL's, for one).
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{root}", f"-I{well_known}",
           f"--python_out={out}", f"--grpc_python_out={out}", *(str(f) for f in files)]
    run = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if run.returncode != 0:
        raise RuntimeError(f"protoc failed ({run.returncode}): {run.stderr.strip()}")
    top_dirs = {f.parts[0] for f in files if len(f.parts) > 1}
    written = []
    for f in files:
        for suffix in ("_pb2.py", "_pb2_grpc.py"):
            stub = out / f.parent / (f.stem + suffix)
            if stub.exists():
                stub.write_text(_fix_imports(stub.read_text(), top_dirs))
                written.append(stub)
        pkg = out / f.parent
        while pkg != out and out in pkg.parents:
            (pkg / "__init__.py").touch(exist_ok=True)
            pkg = pkg.parent
    return written


def normalise(text: str) -> str:
    """A stub with its generator-version lines blanked, for staleness comparisons."""
    text = VERSION_LINES[0].sub("# Protobuf Python Version: <v>", text)
    text = VERSION_LINES[1].sub(r"\1 <v>", text)
    return VERSION_LINES[2].sub("GRPC_GENERATED_VERSION = <v>", text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=pathlib.Path, default=None,
                    help="write stubs here instead of beside the .proto files")
    args = ap.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
