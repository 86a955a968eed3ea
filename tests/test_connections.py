"""Client connections (router/server/connections.py): header, body and keep-alive timeouts, connection caps per
listener and per client address, the admin listener's own budget (liveness survives a flood, also at a
256-descriptor limit, in a real router process), and clean answers for whatever is refused.

Real routers on 127.0.0.1, raw sockets for the clients that misbehave. Timeouts are set to 200 ms and every
wait is bounded by a generous `asyncio.timeout`: a test fails when a connection is *not* closed."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest
import yaml

from router.server.connections import MAX_AUTO_CONNECTIONS, client_key, connection_budget
from tests.conftest import MODEL
from tests.test_serve_process import free_port

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
FAST = {"headerTimeout": "200ms", "bodyTimeout": "200ms", "keepAliveTimeout": "200ms"}


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return await asyncio.open_connection(host, int(port))


def post_head(length: int, *, close: bool = False) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n" % length + (b"Connection: close\r\n" if close else b"") + b"\r\n")


async def closed_by_server(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (fails if it does not within 5 s)."""
    async with asyncio.timeout(5):
        return await reader.read()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    async with asyncio.timeout(5):
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
        body = await reader.readexactly(int(headers.get("content-length", "0")))
    return int(lines[0].split()[1]), headers, body


async def metrics(http, router) -> str:
    async with http.get(router.admin_url + "/metrics") as resp:
        return await resp.text()


def sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def until(condition, what: str) -> None:
    """Wait (bounded) for the router's side of a socket event the test caused: `what`."""
    try:
        async with asyncio.timeout(5):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"never happened: {what}") from None


# ---- timeouts --------------------------------------------------------------------------------------------


async def test_a_request_head_that_never_completes_is_closed_after_the_header_timeout(make_engine, make_router,
                                                                                      http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], limits=FAST)
    reader, writer = await connect(router.ingress_url)
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n")  # ...and the rest never comes
    assert await closed_by_server(reader) == b""
    silent, quiet = await connect(router.ingress_url)  # a connection that never says anything at all
    assert await closed_by_server(silent) == b""
    writer.close()
    quiet.close()
    text = await metrics(http, router)
    assert sample(text, 'fleetroute_client_timeouts_total{listener="ingress",phase="header"}') == 2
    assert engine.requests == []


async def test_a_stalled_request_body_gets_408_and_the_connection_is_closed(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], limits=FAST)
    reader, writer = await connect(router.ingress_url)
    writer.write(post_head(100) + b'{"model": ')  # 10 of 100 bytes, then silence
    status, headers, body = await read_response(reader)
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_timeout"
    assert await closed_by_server(reader) == b""
    writer.close()
    text = await metrics(http, router)
    assert sample(text, 'fleetroute_client_timeouts_total{listener="ingress",phase="body"}') == 1
    assert sample(text, 'fleetroute_rejected_requests_total{reason="request_timeout"}') == 1
    assert engine.requests == []


async def test_an_idle_keep_alive_connection_is_closed_after_the_keep_alive_timeout(make_engine, make_router,
                                                                                    http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], limits=FAST)
    reader, writer = await connect(router.ingress_url)
    body = orjson.dumps(CHAT)
    for _ in range(2):  # the connection is reused while it is busy...
        writer.write(post_head(len(body)) + body)
        status, _, _ = await read_response(reader)
        assert status == 200
    assert await closed_by_server(reader) == b""  # ...and closed once idle
    writer.close()
    text = await metrics(http, router)
    assert sample(text, 'fleetroute_client_timeouts_total{listener="ingress",phase="keepalive"}') == 1
    assert sample(text, 'fleetroute_client_timeouts_total{listener="ingress",phase="header"}') == 0


async def test_a_body_sent_after_its_answer_is_not_taken_for_a_slow_request_head(make_engine, make_router,
                                                                                   http) -> None:
    # A 404 answered before its body arrived: aiohttp drains the body afterwards. Those bytes must not start
    # the header timer (a false "too slow" for a client that then simply idles).
    engine = await make_engine("gpu-0")
    router = await make_router([engine], limits={**FAST, "keepAliveTimeout": "300ms"})
    reader, writer = await connect(router.ingress_url)
    writer.write(post_head(10).replace(b"/v1/chat/completions", b"/v1/nope"))
    status, _, _ = await read_response(reader)
    assert status == 404
    writer.write(b"0123456789")  # the body, late
    assert await closed_by_server(reader) == b""
    writer.close()
    text = await metrics(http, router)
    assert sample(text, 'fleetroute_client_timeouts_total{listener="ingress",phase="keepalive"}') == 1
    assert sample(text, 'fleetroute_client_timeouts_total{listener="ingress",phase="header"}') == 0


async def test_a_slow_stream_is_not_cut_by_the_client_timeouts(make_engine, make_router, http) -> None:
    # The client timers stop while a request is being handled: a stream held by the engine for longer than
    # every client timeout still completes.
    gate = asyncio.Event()
    engine = await make_engine("gpu-0", gate=gate)
    router = await make_router([engine], limits=FAST)
    async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        await resp.content.readuntil(b"\n\n")
        await asyncio.sleep(0.5)  # longer than every client timeout (the point of the test, not synchronisation)
        gate.set()
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")


# ---- caps ------------------------------------------------------------------------------------------------


async def test_over_the_listener_cap_a_connection_gets_503_and_the_admin_listener_still_answers(
        make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], listen={"host": "127.0.0.1", "port": 0, "maxConnections": 5})
    guard = router.connections["ingress"]
    held = [await connect(router.ingress_url) for _ in range(5)]
    await until(lambda: guard.open == 5, "five connections admitted")
    reader, writer = await connect(router.ingress_url)
    status, headers, body = await read_response(reader)
    assert status == 503 and headers["connection"] == "close" and headers["server"] == "fleetroute"
    assert json.loads(body)["error"]["code"] == "too_many_connections"
    assert await closed_by_server(reader) == b""
    writer.close()
    async with http.get(router.admin_url + "/healthz") as resp:  # liveness has its own budget
        assert resp.status == 200
    held.pop()[1].close()  # one client leaves: its place is free again
    await until(lambda: guard.open == 4, "a connection released")
    async with aiohttp.ClientSession() as fresh, fresh.post(router.ingress_url + "/v1/chat/completions",
                                                            json=CHAT) as resp:
        assert resp.status == 200
    for _, w in held:
        w.close()
    text = await metrics(http, router)
    assert sample(text, 'fleetroute_client_connections_rejected_total{listener="ingress",reason="total"}') == 1


async def test_a_client_over_its_per_address_cap_gets_429_unless_it_is_a_trusted_proxy(make_engine, make_router,
                                                                                       http) -> None:
    engine = await make_engine("gpu-0")
    capped = await make_router([engine], listen={"host": "127.0.0.1", "port": 0, "maxConnectionsPerClient": 2})
    held = [await connect(capped.ingress_url) for _ in range(2)]
    await until(lambda: capped.connections["ingress"].open == 2, "two connections admitted")
    reader, writer = await connect(capped.ingress_url)
    status, _, body = await read_response(reader)
    assert status == 429 and json.loads(body)["error"]["code"] == "too_many_connections"
    writer.close()
    text = await metrics(http, capped)
    assert sample(text, 'fleetroute_client_connections_rejected_total{listener="ingress",reason="per_client"}') == 1
    # An ingress controller carries many clients over its connections: listed as a trusted proxy, it is exempt.
    proxied = await make_router([engine], listen={"host": "127.0.0.1", "port": 0, "maxConnectionsPerClient": 2,
                                                  "trustedProxies": ["127.0.0.0/8"]})
    more = [await connect(proxied.ingress_url) for _ in range(4)]
    await until(lambda: proxied.connections["ingress"].open == 4, "four connections admitted")
    for _, w in held + more:
        w.close()


async def test_one_client_cannot_fill_the_admin_listener_and_fail_the_probes(make_engine, make_router, http) -> None:
    # The admin listener's defaults: 64 connections, 16 per client address. A client at 127.0.0.2 opens all 64;
    # without the per-client cap it held them all and the kubelet's /healthz (from 127.0.0.1) got 503.
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    guard = router.connections["admin"]
    flood = [await asyncio.open_connection("127.0.0.1", int(router.admin_url.rsplit(":", 1)[1]),
                                           local_addr=("127.0.0.2", 0)) for _ in range(64)]
    rejected = router.ctx.metrics.client_connections_rejected.labels("admin", "per_client")
    try:
        await until(lambda: guard.open + rejected._value.get() == 64, "every flood connection admitted or refused")
        for _ in range(3):
            async with http.get(router.admin_url + "/healthz") as resp:
                assert resp.status == 200
        assert (guard.open - 1, rejected._value.get()) == (16, 48)  # the flood's 16, and the probes' one
        # The refused ones were told why (the admitted ones stay silent, waiting for a request).
        answers = [asyncio.ensure_future(reader.read()) for reader, _ in flood]
        async with asyncio.timeout(5):
            refusals = [await answer for _, answer in zip(range(48), asyncio.as_completed(answers), strict=False)]
        assert all(a.startswith(b"HTTP/1.1 429 Too Many Requests") for a in refusals)
        for answer in answers:
            answer.cancel()
    finally:
        for _, writer in flood:
            writer.close()


def test_the_admin_per_client_cap_is_configurable() -> None:
    from router.config.settings import parse_settings

    assert parse_settings({}).admin.max_connections_per_client == 16
    assert parse_settings({"admin": {"maxConnectionsPerClient": 0}}).admin.max_connections_per_client == 0
    assert parse_settings({}).listen.max_connections_per_client == 0  # the ingress: clients behind one NAT


def test_the_default_cap_leaves_descriptors_for_the_admin_listener_and_the_engines() -> None:
    # 256 descriptors: 64 for the admin listener, 64 reserved, half the rest (each request may hold a second
    # descriptor, to its engine) for client connections.
    assert connection_budget(256, 64) == 64
    assert connection_budget(1024, 64) == 448
    assert connection_budget(None, 64) == MAX_AUTO_CONNECTIONS == connection_budget(1 << 20, 64)
    assert connection_budget(100, 64) == 1


def test_ipv6_clients_are_capped_per_64_and_ipv4_per_address() -> None:
    assert client_key("2001:db8:1:2::1") == client_key("2001:db8:1:2:ffff::9") == "2001:db8:1:2::/64"
    assert client_key("::ffff:192.0.2.7") == "192.0.2.7"
    assert client_key("192.0.2.7") != client_key("192.0.2.8")


@pytest.mark.parametrize(
    "listen, message",
    [
        ({"maxConnections": "lots"}, "listen.maxConnections: must be auto or an integer, got 'lots'"),
        ({"maxConnections": 0}, "listen.maxConnections: must be between 1 and 1000000, got 0"),
        ({"maxConnectionsPerClient": -1}, "listen.maxConnectionsPerClient: must be between 0 and 1000000"),
        ({"trustedProxies": ["10.0.0.5/8"]}, "did you mean 10.0.0.0/8?"),
        ({"trustedProxies": "10.0.0.0/8"}, "listen.trustedProxies: must be a list"),
    ],
)
def test_bad_connection_settings_are_named(listen, message) -> None:
    from router.config.settings import ConfigError, parse_settings

    with pytest.raises(ConfigError) as info:
        parse_settings({"listen": listen})
    assert message in str(info.value)


def test_client_timeouts_are_configured_under_limits_and_default_near_nginx() -> None:
    from router.config.settings import ConfigError, parse_settings

    default = parse_settings({}).client_timeouts
    assert (default.header, default.body, default.keep_alive, default.write) == (30.0, 60.0, 75.0, 60.0)
    assert parse_settings({"limits": {"keepAliveTimeout": "5m"}}).client_timeouts.keep_alive == 300.0
    with pytest.raises(ConfigError, match="limits.headerTimeout: must be a positive duration"):
        parse_settings({"limits": {"headerTimeout": 0}})
    with pytest.raises(ConfigError, match="admin.trustedProxies: unknown field"):
        parse_settings({"admin": {"trustedProxies": []}})


# ---- a flood, at a real descriptor limit -------------------------------------------------------------------


def _descriptors(limit: int):
    def apply() -> None:  # in the router process, before exec: soft and hard, so it cannot raise them back
        resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    return apply


async def test_an_idle_connection_flood_past_the_descriptor_limit_leaves_healthz_answering(tmp_path: Path,
                                                                                           make_engine) -> None:
    # The audit's case: a router allowed 256 descriptors, one client opening 300 idle connections. Before the
    # caps, accept() failed with EMFILE on both listeners and the kubelet would have restarted the router.
    engine = await make_engine("gpu-0")
    port, admin = free_port(), free_port()
    config = {"listen": {"host": "127.0.0.1", "port": port}, "admin": {"host": "127.0.0.1", "port": admin},
              "endpoints": [{"id": engine.name, "url": engine.url, "models": list(engine.models)}],
              "telemetry": {"enabled": False}, "redis": {"url": None}, "shutdownGrace": "1s"}
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "router", "--config", str(path), stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=_descriptors(256))
    flood: list[asyncio.StreamWriter] = []
    try:
        async with asyncio.timeout(30):
            while True:
                line = await proc.stderr.readline()
                assert line, "router exited during start-up"
                record = json.loads(line)
                if record.get("msg") == "router listening":
                    break
        assert record["max_connections"] == {"ingress": 64, "admin": 64}
        readers = []
        for _ in range(300):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            readers.append(reader)
            flood.append(writer)
        async with aiohttp.ClientSession() as http:
            for _ in range(3):
                async with http.get(f"http://127.0.0.1:{admin}/healthz") as resp:
                    assert resp.status == 200
            async with asyncio.timeout(5):
                answers = await asyncio.gather(*(r.read() for r in readers[64:]))
            assert all(a.startswith(b"HTTP/1.1 503") for a in answers)
            for writer in flood:
                writer.close()
            flood.clear()
            async with asyncio.timeout(10):  # the flood gone, the ingress serves again
                while True:
                    try:
                        async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=CHAT) as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.05)
    finally:
        for writer in flood:
            writer.close()
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 20)


# ---- what the listeners report --------------------------------------------------------------------------------


async def test_the_router_reports_the_addresses_its_listeners_are_bound_to(make_engine, make_router, http) -> None:
    # Port 0 resolved to the port the OS chose; a host name resolved to its addresses (localhost: 127.0.0.1,
    # and ::1 where IPv6 is up, on a port of its own).
    router = await make_router([await make_engine("gpu-0")], admin={"host": "localhost", "port": 0})
    assert ("127.0.0.1", 0) not in router.bound["admin"]
    assert {host for host, _ in router.bound["admin"]} <= {"127.0.0.1", "::1"}
    async with http.get(router.admin_url + "/healthz") as resp:
        assert resp.status == 200


def test_a_wildcard_address_is_reported_as_bound_and_reached_over_loopback() -> None:
    from router.server.app import _local_url, show_address

    assert show_address("0.0.0.0", 9090) == "0.0.0.0:9090" and show_address("::", 9090) == "[::]:9090"
    assert _local_url((("0.0.0.0", 9090),)) == "http://127.0.0.1:9090"
    assert _local_url((("::", 9090),)) == "http://[::1]:9090"
    assert _local_url((("::1", 9091), ("127.0.0.1", 9092))) == "http://[::1]:9091"
