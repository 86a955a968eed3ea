"""The endpoint picker's copy of Envoy's ext_proc API (router/gateway/envoy_api): the committed stubs are what the
pinned compiler writes from the committed .proto files, they never reach into xds-protos, and a message round-trips
with the field numbers Envoy's API gives it. Wire compatibility with Envoy itself: tests/test_epp.py (real Envoy)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from google.protobuf import struct_pb2

from router.gateway.envoy_api.envoy.config.core.v3 import base_pb2
from router.gateway.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from router.gateway.envoy_api.envoy.type.v3 import http_status_pb2

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path("router/gateway/envoy_api")
SERVICE = PACKAGE / "envoy/service/ext_proc/v3/external_processor.proto"


def test_committed_stubs_are_what_the_pinned_compiler_generates(tmp_path: Path) -> None:
    # The commands of router/gateway/envoy_api/__init__.py, into a scratch tree.
    protos = sorted(p.relative_to(ROOT) for p in (ROOT / PACKAGE).rglob("*.proto"))
    assert len(protos) == 4
    for proto in protos:
        (tmp_path / proto.parent).mkdir(parents=True, exist_ok=True)
        (tmp_path / proto).write_bytes((ROOT / proto).read_bytes())
    compiler = [sys.executable, "-m", "grpc_tools.protoc", "-I", "."]
    subprocess.run([*compiler, "--python_out=.", "--pyi_out=.", *map(str, protos)], cwd=tmp_path, check=True,
                   capture_output=True, text=True)
    subprocess.run([*compiler, "--grpc_python_out=.", str(SERVICE)], cwd=tmp_path, check=True, capture_output=True,
                   text=True)
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.py*"))
    assert fresh == sorted(p.relative_to(ROOT) for p in (ROOT / PACKAGE).rglob("*_pb2*.py*"))
    for stub in fresh:
        assert (ROOT / stub).read_text() == (tmp_path / stub).read_text(), (
            f"{stub} is out of date: regenerate the stubs (see router/gateway/envoy_api/__init__.py)")
    for stub in fresh:
        assert "from envoy." not in (ROOT / stub).read_text()  # never the xds-protos package's modules


def test_the_service_and_messages_carry_envoys_names_and_numbers() -> None:
    service = ext_proc.DESCRIPTOR.services_by_name["ExternalProcessor"]
    assert service.full_name == "envoy.service.ext_proc.v3.ExternalProcessor"  # the gRPC path Envoy calls
    numbers = {f.name: f.number for f in ext_proc.ProcessingResponse.DESCRIPTOR.fields}
    assert numbers["request_headers"] == 1 and numbers["immediate_response"] == 7
    assert numbers["dynamic_metadata"] == 8
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct("envoy.lb")["x-gateway-destination-endpoint"] = "10.0.0.1:8000"
    answer = ext_proc.ProcessingResponse(
        request_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(
            header_mutation=ext_proc.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key="x-gateway-destination-endpoint", raw_value=b"10.0.0.1:8000"),
                append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)]))),
        dynamic_metadata=metadata)
    wire = answer.SerializeToString()
    # Field 1 (request_headers, length-delimited) first, and field 8 (dynamic_metadata) present on the wire.
    assert wire[0] == (1 << 3) | 2 and bytes([(8 << 3) | 2]) in wire
    again = ext_proc.ProcessingResponse.FromString(wire)
    assert again == answer
    refusal = ext_proc.ImmediateResponse(status=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable))
    assert ext_proc.ImmediateResponse.FromString(refusal.SerializeToString()).status.code == 503
