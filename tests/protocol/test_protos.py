"""The checked-in generated code is exactly what protos/ produces, and it imports."""
from __future__ import annotations


from services.protocol.protogen import ROOT, generate


def test_generated_code_matches_protos(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "no .proto files found"
    for path in fresh:
        rel = path.relative_to(tmp_path)
        checked_in = ROOT / rel
        assert checked_in.exists(), f"{rel} is not checked in: run python -m services.protocol.protogen"
        assert checked_in.read_bytes() == path.read_bytes(), (
            f"{rel} is stale: run python -m services.protocol.protogen")


def test_generated_modules_import_package_qualified():
    from services.protocol.pb.kvfleet.v1 import kvfleet_pb2, kvfleet_pb2_grpc

    chunk = kvfleet_pb2.TokenChunk(request_id="r1", token_ids=[1, 2], finished=True)
    assert kvfleet_pb2.TokenChunk.FromString(chunk.SerializeToString()) == chunk
    assert hasattr(kvfleet_pb2_grpc, "WorkerServicer") and hasattr(kvfleet_pb2_grpc, "GatewayStub")
