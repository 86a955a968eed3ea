"""The router's shutdown drain (router/server/drain.py), in a real router process stopped with SIGTERM: the client
connections open at that moment are told to close (`Connection: close` on the answer to their next request),
nothing in flight is lost, connections that stay idle for the whole drain are closed at its end, and a request
still running when `shutdownGrace` ends is cut and counted.

Keep-alive clients are aiohttp sessions with one pooled connection each (the local port tells whether a request
went out on the same connection); the client that only idles is a raw socket, so its close is seen as it
happens. Every wait is bounded."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import yaml

from router.config.settings import ConfigError, parse_settings
from tests.conftest import MODEL
from tests.test_serve_process import free_port

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class RouterProcess:
    """`fleetroute router` with a config; its JSON log lines collected as they come."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str, admin: str) -> None:
        self.proc, self.url, self.admin = proc, url, admin
        self.lines: list[dict[str, Any]] = []
        self._new_line = asyncio.Event()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        while raw := await self.proc.stderr.readline():
            self.lines.append(json.loads(raw))
            self._new_line.set()

    async def logged(self, message: str, timeout: float = 10) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                found = next((line for line in self.lines if line.get("msg") == message), None)
                if found is not None:
                    return found
                self._new_line.clear()
                await self._new_line.wait()

    async def exited(self, timeout: float) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.wait_for(self._reader, 5)
        return code


@pytest.fixture
async def router_process(tmp_path: Path) -> AsyncIterator[Callable[..., Any]]:
    started: list[RouterProcess] = []

    async def start(engines: list[Any], **config: Any) -> RouterProcess:
        port, admin = free_port(), free_port()
        path = tmp_path / "router.yaml"
        path.write_text(yaml.safe_dump({
            "listen": {"host": "127.0.0.1", "port": port}, "admin": {"host": "127.0.0.1", "port": admin},
            "endpoints": [{"id": e.name, "url": e.url, "models": list(e.models)} for e in engines],
            "telemetry": {"enabled": False}, **config}))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "router", "router", "--config", str(path), stderr=asyncio.subprocess.PIPE,
            env={**os.environ, "PYTHONUNBUFFERED": "1"})
        router = RouterProcess(proc, f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin}")
        started.append(router)
        await router.logged("router listening", timeout=30)
        return router

    yield start
    for router in started:
        if router.proc.returncode is None:
            router.proc.kill()
            await router.proc.wait()
        router._reader.cancel()
        await asyncio.gather(router._reader, return_exceptions=True)


def keep_alive_client() -> tuple[aiohttp.ClientSession, list[object]]:
    """A client that keeps its one connection alive and never resends a failed request, and the list of the
    connections it opened."""
    opened: list[object] = []
    trace = aiohttp.TraceConfig()

    async def on_open(*_: Any) -> None:
        opened.append(None)

    trace.on_connection_create_end.append(on_open)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1),
                                    timeout=aiohttp.ClientTimeout(total=20), trace_configs=[trace])
    return session, opened


async def test_sigterm_tells_each_open_connection_to_close_and_loses_nothing(make_engine, router_process) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await router_process([engine], shutdownGrace="20s", drainConnections="4s")
    (streaming, streaming_opened), (busy, busy_opened) = keep_alive_client(), keep_alive_client()
    try:
        # Before SIGTERM: a stream in flight (its answer promised keep-alive), a client between two requests,
        # and a connection that will idle through the whole drain.
        stream = await streaming.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True})
        assert stream.status == 200 and "Connection" not in stream.headers
        await stream.content.readuntil(b"\n\n")
        async with busy.post(router.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200 and "Connection" not in resp.headers
            await resp.read()  # a response released unread closes its connection
        host, port = router.url.removeprefix("http://").split(":")
        idle_reader, idle_writer = await asyncio.open_connection(host, int(port))
        body = orjson.dumps(CHAT)
        idle_writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
        head = await asyncio.wait_for(idle_reader.readuntil(b"\r\n\r\n"), 5)
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
        await asyncio.wait_for(idle_reader.readexactly(length), 5)

        router.proc.send_signal(signal.SIGTERM)
        draining = await router.logged("draining client connections")
        assert draining["open"] == 3
        # Readiness fails; the listener takes no new connection.
        async with aiohttp.ClientSession() as probe:
            async with probe.get(router.admin + "/readyz") as resp:
                assert resp.status == 503
        with pytest.raises(OSError):
            await asyncio.open_connection(host, int(port))

        # The client idle at SIGTERM sends again on its connection: answered, and told to close.
        async with busy.post(router.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200 and resp.headers.get("Connection") == "close"
        assert len(busy_opened) == 1  # the same connection, still open after SIGTERM
        # The stream in flight finishes whole; its connection stays for one more request, told to close.
        engine.gate.set()
        assert (await stream.content.read()).endswith(b"data: [DONE]\n\n")
        stream.release()
        async with streaming.post(router.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200 and resp.headers.get("Connection") == "close"
        assert len(streaming_opened) == 1
        async with aiohttp.ClientSession() as scrape:
            async with scrape.get(router.admin + "/metrics") as resp:
                text = await resp.text()
        assert 'fleetroute_client_connections_drained_total{how="connection_close",listener="ingress"} 2.0' in text

        # The connection that never spoke again is closed when the drain period ends (not at SIGTERM: it was
        # open through all of the above), and the process exits.
        assert await asyncio.wait_for(idle_reader.read(), 10) == b""
        drained = await router.logged("client connections drained")
        assert drained["closed"] == {"connection_close": 2, "idle": 1}, drained
        assert await router.exited(10) == 0
        idle_writer.close()
    finally:
        await streaming.close()
        await busy.close()


async def test_busy_clients_end_the_drain_early(make_engine, router_process) -> None:
    """Every open connection answered with Connection: close and closed: the process exits without waiting
    for the rest of drainConnections."""
    engine = await make_engine("gpu-0")
    router = await router_process([engine], shutdownGrace="60s", drainConnections="60s")
    client, _ = keep_alive_client()
    async with client:
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            await resp.read()  # a response released unread closes its connection
        router.proc.send_signal(signal.SIGTERM)
        await router.logged("draining client connections")
        async with client.post(router.url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200 and resp.headers.get("Connection") == "close"
        assert await router.exited(20) == 0  # well before the 60 s drain period
    drained = await router.logged("client connections drained")
    assert drained["closed"] == {"connection_close": 1}, drained


async def test_a_request_still_running_when_shutdown_grace_ends_is_cut_and_counted(make_engine,
                                                                                  router_process) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())  # never opened: the stream never ends
    router = await router_process([engine], shutdownGrace="1500ms", drainConnections="500ms")
    client, _ = keep_alive_client()
    async with client:
        async with client.post(router.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            await resp.content.readuntil(b"\n\n")
            router.proc.send_signal(signal.SIGTERM)
            with pytest.raises(aiohttp.ClientPayloadError):
                await resp.content.read()  # cut: no [DONE]
    assert await router.exited(10) == 0
    drained = await router.logged("client connections drained")
    assert drained["closed"] == {"cut": 1} and drained["level"] == "warning", drained


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        pytest.param({}, 15.0, id="default 15s"),
        pytest.param({"shutdownGrace": "5s"}, 5.0, id="default within a shorter shutdownGrace"),
        pytest.param({"drainConnections": "0s"}, 0.0, id="0 closes idle connections at once"),
        pytest.param({"drainConnections": 20}, 20.0, id="seconds as a number"),
    ],
)
def test_drain_connections_setting(config: dict[str, Any], expected: float) -> None:
    assert parse_settings(config).drain_connections == expected


@pytest.mark.parametrize(
    ("config", "message"),
    [
        pytest.param({"drainConnections": "40s"}, "must not exceed shutdownGrace (30s)", id="above shutdownGrace"),
        pytest.param({"drainConnections": "-1s"}, "must be a duration", id="negative"),
        pytest.param({"drainConnections": "soon"}, "must be a duration", id="not a duration"),
    ],
)
def test_bad_drain_connections_are_named(config: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match="drainConnections") as info:
        parse_settings(config)
    assert message in str(info.value)
