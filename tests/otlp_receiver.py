"""A local OTLP/HTTP traces endpoint for tests: an aiohttp server on 127.0.0.1 that decodes each protobuf
`ExportTraceServiceRequest` it is sent (what the router's exporter, and vLLM's, send to a collector)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass
class Receiver:
    url: str = ""
    requests: list[ExportTraceServiceRequest] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    got: asyncio.Event = field(default_factory=asyncio.Event)  # set by every export; cleared by `wait_for`

    def spans(self) -> list[tuple[Any, Any]]:
        """(span, its resource) of every span received."""
        return [(span, resource.resource) for message in self.requests for resource in message.resource_spans
                for scope in resource.scope_spans for span in scope.spans]

    async def wait_for(self, name: str, timeout: float) -> Any:
        """The first span called `name`, waiting for exports to bring it (bounded by `timeout`)."""
        async with asyncio.timeout(timeout):
            while True:
                for span, _ in self.spans():
                    if span.name == name:
                        return span
                self.got.clear()
                await self.got.wait()

    async def _receive(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf", request.content_type
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        self.requests.append(message)
        self.headers.append(dict(request.headers))
        self.got.set()
        return web.Response(body=b"", content_type="application/x-protobuf")


@contextlib.asynccontextmanager
async def otlp_receiver() -> AsyncIterator[Receiver]:
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", receiver._receive)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    receiver.url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/traces"
    try:
        yield receiver
    finally:
        await runner.cleanup()
