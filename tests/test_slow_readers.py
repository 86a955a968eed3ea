"""A client that stops reading a stream (router/server/proxy.py, `limits.writeTimeout`): the router stops reading
from the engine (TCP back-pressure), so its memory stays bounded however much the engine has to say; and
after `writeTimeout` the client is cut, the engine's request cancelled, and the cut counted.

A real router on 127.0.0.1 in front of a "flood" engine that streams 16 KiB SSE events as fast as its socket
takes them (256 MiB in all) and counts what it managed to send; the client is a raw socket with a small
receive buffer that reads the response head and then nothing."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

from tests.conftest import MODEL
from tests.test_connections import metrics, sample

EVENT = b"data: " + b"x" * (16 * 1024 - 8) + b"\n\n"
TOTAL = 256 * 1024 * 1024  # what the engine would send to a client that reads it all


@dataclass
class FloodEngine:
    name: str = "flood"
    models: tuple[str, ...] = (MODEL,)
    url: str = ""
    sent: int = 0
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while self.sent < TOTAL:
                await response.write(EVENT)  # waits while the router reads nothing (TCP flow control)
                self.sent += len(EVENT)
            await response.write_eof()
        except (ConnectionResetError, asyncio.CancelledError):
            self.cancelled.set()  # the router closed its connection: the generation is aborted
            raise
        return response


@pytest.fixture
async def flood() -> AsyncIterator[FloodEngine]:
    engine = FloodEngine()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", engine.chat)
    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    engine.url = f"http://127.0.0.1:{port}"
    yield engine
    await runner.cleanup()


async def stop_reading(url: str) -> tuple[socket.socket, asyncio.StreamWriter]:
    """A streaming request from a client that reads the response head, then nothing more."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it advertises
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock)
    body = b'{"model": "%s", "stream": true, "messages": [{"role": "user", "content": "hi"}]}' % MODEL.encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    async with asyncio.timeout(5):
        await reader.readuntil(b"\r\n\r\n")
    writer.transport.pause_reading()  # from here the client reads nothing: its receive buffer fills
    return sock, writer


async def plateau(engine: FloodEngine) -> int:
    """What the engine has sent once it has stopped being able to send more (bounded: fails after 20 s)."""
    last, steady = -1, 0
    async with asyncio.timeout(20):
        while steady < 10:  # unchanged over 10 polls 50 ms apart: the socket buffers on the way are full
            await asyncio.sleep(0.05)
            steady = steady + 1 if engine.sent == last else 0
            last = engine.sent
    return last


async def test_a_client_that_stops_reading_leaves_the_router_memory_bounded(flood, make_router) -> None:
    router = await make_router([flood])  # writeTimeout: its default 60 s, longer than this test
    sock, writer = await stop_reading(router.ingress_url)
    try:
        sent = await plateau(flood)
        # The engine could send only what the socket buffers between it and the client hold (loopback's TCP
        # autotuning allows a few MiB per socket), not the 256 MiB of its answer: the router stopped reading.
        assert sent < 32 * 1024 * 1024, sent
        # What the router itself holds for the client, in user space: the transport's write buffer stays near
        # its 64 KiB high-water mark (plus one chunk), whatever the engine has left to say.
        buffered = [c.transport.get_write_buffer_size() for c in router.connections["ingress"]._connections
                    if c.transport is not None]
        assert buffered and max(buffered) <= 256 * 1024, buffered
        assert not flood.cancelled.is_set()  # a slow reader is not cut before writeTimeout
    finally:
        writer.close()
        sock.close()


async def test_a_stalled_reader_is_cut_after_the_write_timeout_and_its_request_cancelled(flood, make_router,
                                                                                          http) -> None:
    router = await make_router([flood], limits={"writeTimeout": "300ms"})
    sock, writer = await stop_reading(router.ingress_url)
    try:
        async with asyncio.timeout(10):
            await flood.cancelled.wait()  # the router closed the engine's connection: vLLM aborts the request
        async with asyncio.timeout(5):
            while router.connections["ingress"].open:  # the client's connection is gone too
                await asyncio.sleep(0.01)
        assert flood.sent < 32 * 1024 * 1024
        text = await metrics(http, router)
        assert sample(text, 'fleetroute_client_timeouts_total{listener="ingress",phase="write"}') == 1
        assert sample(text, 'fleetroute_upstream_errors_total{endpoint="flood",kind="client_disconnect"}') == 1
    finally:
        writer.close()
        sock.close()
