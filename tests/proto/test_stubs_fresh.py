"""The checked-in protobuf stubs match what ``python -m nibble.proto.generate`` writes now."""

from __future__ import annotations

import pathlib

from nibble.proto import generate


def _stubs(root: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(root)): generate.normalise(p.read_text())
            for p in sorted(root.rglob("*_pb2*.py"))}


def test_checked_in_stubs_are_fresh(tmp_path):
    assert generate.proto_files(), "no .proto files found under proto/"
    written = generate.generate(tmp_path)
    assert written, "protoc wrote nothing"
    fresh, checked_in = _stubs(tmp_path), _stubs(generate.PROTO_ROOT)
    assert sorted(checked_in) == sorted(fresh), (
        "stub files differ from the .proto files; run: python -m nibble.proto.generate")
    stale = [name for name in fresh if fresh[name] != checked_in[name]]
    assert not stale, f"stale stubs {stale}; run: python -m nibble.proto.generate"


def test_normalise_hides_only_generator_versions():
    a = ("# Protobuf Python Version: 7.35.1\n_runtime_version.ValidateProtobufRuntimeVersion(\n"
         "    _runtime_version.Domain.PUBLIC,\n    7,\n    35,\n    1,\n    '',\n    'x.proto'\n)\n"
         "GRPC_GENERATED_VERSION = '1.85.1'\nfield = 1\n")
    b = a.replace("7.35.1", "7.40.0").replace("35,", "40,").replace("1.85.1", "1.90.0")
    assert generate.normalise(a) == generate.normalise(b)
    assert generate.normalise(a) != generate.normalise(a.replace("field = 1", "field = 2"))


def test_generated_stubs_import_as_nibble_proto():
    from nibble.proto.nibble.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

    assert kv_transfer_pb2.DESCRIPTOR.services_by_name["KVTransfer"]
    assert hasattr(kv_transfer_pb2_grpc, "KVTransferStub")
