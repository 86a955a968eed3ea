"""The Gateway API Inference Extension's endpoint-picker protocol, as Envoy's ext_proc messages.

GIE `docs/proposals/004-endpoint-picker-protocol` (v1.0.0):
- subset hint, gateway -> picker: `metadata_context.filter_metadata["envoy.lb.subset_hint"]
  ["x-gateway-destination-endpoint-subset"]`, a list of "ip:port"; when present the picker chooses only
  among them, and answers 503 when none of them can serve;
- destination, picker -> gateway: the header `x-gateway-destination-endpoint` AND the dynamic metadata
  `envoy.lb` / `x-gateway-destination-endpoint`, the same value in both: "ip:port", or an ordered fallback
  list "ip:port,ip:port" that the gateway walks on retries;
- refusals: an ImmediateResponse, 503 when no endpoint can serve, 429 when the request is shed;
- served, gateway -> picker: `metadata_context.filter_metadata["envoy.lb"]
  ["x-gateway-destination-endpoint-served"]` on the response, the endpoint that really answered.

Plain Envoy does not write the served key itself; a picker behind it can ask for the `upstream.address`
attribute on the response headers (`response_attributes`), which this module reads as the second source.
"""

from __future__ import annotations

import functools
from urllib.parse import urlsplit

from aiohttp import web
from google.protobuf import struct_pb2

from router.gateway.envoy_api.envoy.config.core.v3 import base_pb2
from router.gateway.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from router.gateway.envoy_api.envoy.type.v3 import http_status_pb2

DESTINATION = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET = "x-gateway-destination-endpoint-subset"
SERVED = "x-gateway-destination-endpoint-served"
ATTRIBUTES_NAMESPACE = "envoy.filters.http.ext_proc"  # where Envoy puts the attributes it was asked for
UPSTREAM_ADDRESS = "upstream.address"
SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"  # the gRPC health service name of the picker
# The GIE conformance suite's test hooks (`--conformance-test-hooks`; off by default: any client could steer).
TEST_SELECTION = "test-epp-endpoint-selection"  # request: "ip" or "ip:port", comma-separated: the candidates
TEST_SERVED = "x-conformance-test-served-endpoint"  # response: the gateway's served-endpoint metadata, echoed


@functools.lru_cache(maxsize=65536)  # a few endpoints' URLs, asked on every request with a subset hint
def address(url: str) -> str:
    """An endpoint's "host:port" as a gateway names it (pod IPs under Kubernetes discovery)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = parts.hostname or ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def headers_of(message: ext_proc.HttpHeaders) -> dict[str, str]:
    """Lower-cased names to values (Envoy sends `raw_value` bytes; older ones `value`); the last wins."""
    out = {}
    for header in message.headers.headers:
        value = header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
        out[header.key.lower()] = value
    return out


def status_of(message: ext_proc.HttpHeaders) -> int:
    """The response's `:status` (0 when missing or not a number), without decoding the other headers."""
    for header in message.headers.headers:
        if header.key == ":status":
            try:
                return int(header.raw_value or header.value)
            except ValueError:
                return 0
    return 0


def subset_hint(request: ext_proc.ProcessingRequest) -> tuple[str, ...] | None:
    """The gateway's subset of "ip:port" to choose from, or None when it sent none (choose from the pool)."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET not in namespace.fields:
        return None
    value = namespace.fields[SUBSET]
    if value.HasField("list_value"):
        return tuple(v.string_value.strip() for v in value.list_value.values if v.HasField("string_value"))
    if value.HasField("string_value"):  # tolerated: one comma-separated string
        return tuple(s.strip() for s in value.string_value.split(",") if s.strip())
    return ()


def reported_served(request: ext_proc.ProcessingRequest) -> str | None:
    """The gateway's own served-endpoint metadata (GIE), as it sent it; None when it sent none."""
    lb = request.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if lb is not None and SERVED in lb.fields and lb.fields[SERVED].HasField("string_value"):
        return lb.fields[SERVED].string_value
    return None


def selected(value: str, url: str) -> bool:
    """Does a test-selection entry ("ip" or "ip:port") name the endpoint at `url`?"""
    where = address(url)
    return value == where or value == where.rsplit(":", 1)[0]


def served_address(request: ext_proc.ProcessingRequest) -> str | None:
    """The endpoint that answered, as the gateway reports it: the GIE metadata key, else the upstream address
    attribute; the first of a list."""
    lb = request.metadata_context.filter_metadata.get(DESTINATION_NAMESPACE)
    if lb is not None and SERVED in lb.fields and lb.fields[SERVED].HasField("string_value"):
        return lb.fields[SERVED].string_value.split(",")[0].strip() or None
    for namespace in (ATTRIBUTES_NAMESPACE, *request.attributes):  # the filter's name, or a configured one
        attributes = request.attributes.get(namespace)
        if attributes is not None and UPSTREAM_ADDRESS in attributes.fields:
            value = attributes.fields[UPSTREAM_ADDRESS]
            if value.HasField("string_value") and value.string_value:
                return value.string_value
    return None


def _set(headers: dict[str, str]) -> ext_proc.HeaderMutation:
    """Set (replace, or add) each header: a client's own `x-gateway-destination-endpoint` never survives."""
    return ext_proc.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()),
                                   append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD)
        for k, v in headers.items()])


def destination(addresses: list[str], extra: dict[str, str] | None = None, *,
                body: bytes | None = None) -> ext_proc.CommonResponse:
    """The request goes on, with the destination header set (the metadata goes on the ProcessingResponse), and
    with `body` instead of the client's when given (a model alias rewritten), its content-length with it."""
    headers = {DESTINATION: ",".join(addresses), **(extra or {})}
    if body is None:
        return ext_proc.CommonResponse(header_mutation=_set(headers))
    return ext_proc.CommonResponse(header_mutation=_set({**headers, "content-length": str(len(body))}),
                                   body_mutation=ext_proc.BodyMutation(body=body))


def destination_metadata(addresses: list[str]) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()  # set field by field: Struct.update walks Python dicts, 3x slower
    metadata.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION].string_value = ",".join(addresses)
    return metadata


def response_headers(extra: dict[str, str]) -> ext_proc.ProcessingResponse:
    """Let the response on, with `extra` headers added."""
    return ext_proc.ProcessingResponse(
        response_headers=ext_proc.HeadersResponse(response=ext_proc.CommonResponse(header_mutation=_set(extra))))


def immediate(response: web.Response) -> ext_proc.ProcessingResponse:
    """The router's own OpenAI-shaped answer (a refusal) as an ImmediateResponse: same status, headers, body."""
    body = response.body if isinstance(response.body, bytes) else b""
    headers = [base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type",
                                                                      raw_value=b"application/json"))]
    for name, value in response.headers.items():
        if name.lower() not in ("content-type", "content-length"):
            headers.append(base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=name.lower(),
                                                                                  raw_value=value.encode())))
    return ext_proc.ProcessingResponse(immediate_response=ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=response.status),  # type: ignore[arg-type]
        headers=ext_proc.HeaderMutation(set_headers=headers), body=body, details="fleetroute"))
