"""The part of Envoy's API (v3) that the endpoint picker speaks: the `envoy.service.ext_proc.v3.ExternalProcessor`
gRPC service and every message its requests and responses reach (HttpHeaders, HeaderMutation, ImmediateResponse,
the `envoy.config.core.v3` header and metadata types, `envoy.type.v3.HttpStatus`, the processing mode).

Why our own copy: Envoy's protos with Python stubs come as `xds-protos`, which also installs an old copy of
OpenTelemetry's protos over `opentelemetry-proto`'s files and breaks the OTLP trace exporter in the same
environment (grpc/grpc#42926). The .proto files here are derived from Envoy's API (Apache-2.0) by
scripts/envoy-ext-proc-protos.py: same packages, message names, field names, numbers and types (the wire
interface, so Envoy's messages decode and ours are Envoy's), without options and validation annotations, and
without the files' other messages. The tests through real Envoy (tests/test_epp.py) are the proof.

The stubs are generated and committed (installing fleetroute needs only the protobuf and grpcio runtimes).
Regenerate them from the repository root after changing a .proto or the pinned grpcio-tools:

    python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. $(find router/gateway/envoy_api -name '*.proto')
    python -m grpc_tools.protoc -I . --grpc_python_out=. \\
        router/gateway/envoy_api/envoy/service/ext_proc/v3/external_processor.proto

tests/test_envoy_api.py fails when the committed stubs differ from what those commands write.

Not importable beside xds-protos' own `envoy.*` stubs in one process: both define the same protobuf symbols.
"""
