"""The request path against hostile or broken peers: session keys of any length, bodies that do not decode,
`Expect: 100-continue`, header bytes that are not UTF-8, client input echoed back, engines that break the
protocol mid-stream, errors that must not reveal internals, and forwarding headers from untrusted clients.
Real routers (and Redis where pins are shared) with fake engines on 127.0.0.1."""

from __future__ import annotations

import asyncio
import gzip
import io
import ipaddress
import json
import logging
import uuid
import zlib
from types import SimpleNamespace

import orjson
import pytest
import redis.asyncio as aioredis
from multidict import CIMultiDict

from router.routing.sticky import session_digest
from router.server.access_log import AccessLog
from router.server.forwarding import Forwarding
from tests.conftest import MODEL
from tests.redis_server import redis_url  # noqa: F401 - fixture
from tests.test_auth import _post, _raw

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
URL = "/v1/chat/completions"


def access_lines(router) -> list[dict]:
    router.ctx.access_log.flush()
    return [orjson.loads(line) for line in router.ctx.access_log._stream.getvalue().splitlines()]  # noqa: SLF001


def capture_access_log(router) -> None:
    router.ctx.access_log = AccessLog(io.BytesIO())


async def first_head(url: str, data: bytes) -> bytes:
    """The head of the first response to `data` sent on a new connection."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        async with asyncio.timeout(5):
            return await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()


async def metrics(http, router) -> str:
    async with http.get(router.admin_url + "/metrics") as resp:
        return await resp.text()


def sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


# ---- session keys --------------------------------------------------------------------------------------


async def test_a_megabyte_session_key_is_pinned_under_a_short_digest_locally_and_in_redis(
        make_engine, make_router, http, redis_url) -> None:  # noqa: F811
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    policy = f"s{uuid.uuid4().hex[:8]}"  # its own Redis keys, whatever else shares the server
    common = {"policies": [{"name": policy, "strategy": "round-robin", "stickiness": {"ttl": "60s"}}],
              "redis": {"url": redis_url}}
    a = await make_router(engines, seed=1, **common)
    b = await make_router(engines, seed=2, **common)
    user = "u" * (1 << 20)  # the body's `user`, the fallback session key: 1 MiB

    async def endpoint(router, who: str) -> str:
        body = io.BytesIO(orjson.dumps({**CHAT, "user": who}))  # aiohttp wants big bodies as a stream
        async with http.post(router.ingress_url + URL, data=body, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == 200
            return resp.headers["x-fleetroute-endpoint"]

    pinned = await endpoint(a, user)
    assert {await endpoint(a, user) for _ in range(3)} == {pinned}  # still sticky
    await asyncio.gather(*a.ctx.sticky[policy]._tasks)  # noqa: SLF001 - the background Redis write has landed
    assert await endpoint(b, user) == pinned  # and the other replica agrees, through Redis
    assert [len(key) for key in a.ctx.sticky[policy]._local] == [32]  # noqa: SLF001 - a digest, not the key
    client = aioredis.from_url(redis_url, decode_responses=True)
    try:
        keys = await client.keys(f"fleetroute:v1:sticky:{policy}:*")
        assert keys == [f"fleetroute:v1:sticky:{policy}:{session_digest(user)}"]
        assert await client.get(keys[0]) == pinned
    finally:
        await client.aclose()


def test_session_digests_are_stable_short_and_tell_sessions_apart() -> None:
    assert session_digest("alice") == session_digest("alice")  # the same on every replica and restart
    assert session_digest("alice") != session_digest("alicf")
    assert len(session_digest("x" * 10_000_000)) == 32
    # Only the first 512 characters count, so hashing costs the same whatever the key's length.
    assert session_digest("k" * 512 + "a") == session_digest("k" * 512 + "b")


# ---- what is echoed --------------------------------------------------------------------------------------


async def test_client_input_echoed_in_errors_and_the_access_log_is_truncated(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    capture_access_log(router)
    model = "m" * 1_000_000
    async with http.post(router.ingress_url + URL, json={"model": model}) as resp:
        assert resp.status == 404
        body = await resp.read()
    assert len(body) < 1000
    assert json.loads(body)["error"]["message"].startswith("The model `" + "m" * 128 + "…` does not exist")
    async with http.post(router.ingress_url + "/v1/" + "p" * 5000, json=CHAT) as resp:
        assert resp.status == 404 and len(await resp.read()) < 1000
    (line,) = access_lines(router)
    assert line["model"] == "m" * 128 + "…"
    assert len(orjson.dumps(line)) < 1000


async def test_only_a_plausible_request_id_is_kept(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    kept = "req-7f3a_1:2/3+4=5@x"
    for given in (kept, "x" * 129, "two words", "a\"quote"):
        async with http.post(router.ingress_url + URL, json=CHAT, headers={"X-Request-Id": given}) as resp:
            returned = resp.headers["X-Request-Id"]
        seen = {k.lower(): v for k, v in engine.requests[-1]["headers"].items()}["x-request-id"]
        assert returned == seen
        if given == kept:
            assert seen == kept
        else:
            assert seen != given and len(seen) == 32  # replaced by a generated id


# ---- bodies ----------------------------------------------------------------------------------------------


async def test_compressed_bodies_decode_and_bad_ones_get_clean_4xx_without_tracebacks(
        make_engine, make_router, http, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    engine = await make_engine("gpu-0")
    router = await make_router([engine], limits={"maxBodyBytes": 4096})
    raw = json.dumps(CHAT).encode()
    raw_deflate = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    good = {
        "gzip": gzip.compress(raw),
        "deflate": zlib.compress(raw),  # RFC 9110's deflate: zlib-wrapped
        "Deflate": raw_deflate.compress(raw) + raw_deflate.flush(),  # what many clients send: raw deflate
        "gzip, gzip": gzip.compress(gzip.compress(raw)),  # applied twice, undone twice
        "identity": raw,
    }
    for coding, data in good.items():
        async with http.post(router.ingress_url + URL, data=data, headers={"Content-Encoding": coding}) as resp:
            assert resp.status == 200, coding
        assert engine.requests[-1]["body"] == CHAT
    bad = [
        ("gzip", b"\x1f\x8b\x08\x00garbage that is not deflate", 400, "invalid_body_encoding"),
        ("gzip", gzip.compress(raw)[:-12], 400, "invalid_body_encoding"),  # truncated
        ("deflate", b"not zlib at all", 400, "invalid_body_encoding"),
        ("br", b"\x0b\x02\x80{}\x03", 415, "unsupported_content_encoding"),
        ("x-custom", raw, 415, "unsupported_content_encoding"),
        ("gzip", gzip.compress(b" " * 10_000_000), 413, "body_too_large"),  # 10 kB that inflate to 10 MB
    ]
    for coding, data, status, code in bad:
        async with http.post(router.ingress_url + URL, data=data, headers={"Content-Encoding": coding}) as resp:
            assert resp.status == status, coding
            error = (await resp.json())["error"]
        assert error["code"] == code and error["type"] == "invalid_request_error"
        if status == 415:
            assert resp.headers["Accept-Encoding"] == "gzip, deflate"
    assert len(engine.requests) == len(good)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], \
        [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    async with http.post(router.ingress_url + URL, json=CHAT) as resp:
        assert resp.status == 200


async def test_100_continue_comes_only_after_the_checks_and_expect_is_not_forwarded(
        make_engine, make_router, tmp_path) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], limits={"maxBodyBytes": 4096})
    host, port = router.ingress_url.removeprefix("http://").rsplit(":", 1)
    body = orjson.dumps(CHAT)
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n" % len(body))
    async with asyncio.timeout(5):
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"  # the body is wanted
        writer.write(body)
        answer = await reader.read()
    writer.close()
    assert answer.startswith(b"HTTP/1.1 200")
    assert "expect" not in {k.lower() for k in engine.requests[0]["headers"]}  # the engine gets it all at once
    # Too large, or without the API key the ingress needs: the final status at once, never a 100 inviting the
    # upload (the body is never sent: only the answer's head is awaited).
    too_large = _post(URL, b"Expect: 100-continue\r\n").replace(b"Content-Length: 0", b"Content-Length: 10000000")
    assert (await first_head(router.ingress_url, too_large)).startswith(b"HTTP/1.1 413")
    (tmp_path / "keys").write_text("sk-test-key-0123456789")
    keyed = await make_router([engine], auth={"apiKeysFile": str(tmp_path / "keys")})
    no_key = _post(URL, b"Expect: 100-continue\r\n").replace(b"Content-Length: 0", b"Content-Length: 100")
    assert (await first_head(keyed.ingress_url, no_key)).startswith(b"HTTP/1.1 401")
    status, answer = await _raw(router.ingress_url, _post(URL, b"Expect: teapot\r\n", body))
    assert status == 417 and json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "expectation_failed"
    status, answer = await _raw(router.admin_url, b"GET /healthz HTTP/1.1\r\nHost: r\r\nExpect: teapot\r\n"
                                                  b"Connection: close\r\n\r\n")
    assert status == 417 and json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "expectation_failed"
    assert len(engine.requests) == 1


# ---- headers ---------------------------------------------------------------------------------------------


async def test_a_header_value_that_is_not_utf8_is_refused_not_silently_cut(make_engine, make_router) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    body = orjson.dumps(CHAT)
    status, answer = await _raw(router.ingress_url, _post(URL, b"X-Name: caf\xe9\r\n", body))
    assert status == 400
    error = json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]
    assert error["code"] == "invalid_header_value" and error["param"].lower() == "x-name"
    assert engine.requests == []  # rather than `caf` reaching the engine
    status, _ = await _raw(router.ingress_url, _post(URL, "X-Name: café\r\n".encode(), body))
    assert status == 200
    assert engine.requests[0]["headers"]["X-Name"] == "café"  # valid UTF-8 passes unchanged


# ---- broken engines --------------------------------------------------------------------------------------


async def test_a_malformed_chunk_from_the_engine_ends_the_stream_at_once_and_frees_its_slot(
        make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", malformed_chunk=asyncio.Event())
    router = await make_router([engine])  # the idle timeout is the default 60 s: the test must not wait for it
    capture_access_log(router)
    async with asyncio.timeout(10):
        async with http.post(router.ingress_url + URL, json={**CHAT, "stream": True}) as resp:
            assert resp.status == 200
            first = await resp.content.readuntil(b"\n\n")  # the stream is under way...
            engine.malformed_chunk.set()  # ...when the engine's bytes stop being HTTP
            events = [e for e in (first + await resp.read()).split(b"\n\n") if e]
        while router.ctx.loads.in_flight("gpu-0"):  # the handler's bookkeeping ends with the response
            await asyncio.sleep(0.01)
    assert json.loads(events[0][6:])["choices"][0]["delta"]["content"] == "tok0 "
    error = json.loads(events[-1][6:])["error"]
    assert error["code"] == "upstream_stream_interrupted" and "invalid response" in error["message"]
    (line,) = access_lines(router)
    assert line["upstream_error"] == "invalid_response"
    assert sample(await metrics(http, router),
                  'fleetroute_upstream_errors_total{endpoint="gpu-0",kind="invalid_response"}') == 1


async def test_errors_name_no_internal_address_nor_an_engines_header_bytes(make_engine, make_router, http,
                                                                           caplog) -> None:
    dead = await make_engine("gpu-0")
    await dead.stop()
    address = dead.url.removeprefix("http://")
    router = await make_router([dead])
    caplog.set_level(logging.INFO)
    async with http.post(router.ingress_url + URL, json=CHAT) as resp:
        assert resp.status == 502
        text = await resp.text()
    assert json.loads(text)["error"]["code"] == "upstream_unreachable"
    assert address not in text and "127.0.0.1" not in text and str(dead.port) not in text
    assert any(address in str(r.__dict__.get("error", "")) for r in caplog.records)  # the log has the detail
    cookie = "session=SECRET-c00k1e-" + "x" * 9000  # over aiohttp's 8190-byte header line limit
    leaky = await make_engine("gpu-1", response_headers={"Set-Cookie": cookie})
    router = await make_router([leaky])
    async with http.post(router.ingress_url + URL, json=CHAT) as resp:
        assert resp.status == 502
        text = await resp.text()
    assert json.loads(text)["error"]["code"] == "upstream_error" and "SECRET" not in text


async def test_no_response_names_the_software_versions(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    for method, url in (("POST", router.ingress_url + URL), ("GET", router.ingress_url + "/nope"),
                        ("GET", router.admin_url + "/healthz"), ("GET", router.admin_url + "/metrics")):
        async with http.request(method, url, json=CHAT) as resp:
            assert resp.headers["Server"] == "fleetroute", url  # a proxied answer too: not the engine's
    status, answer = await _raw(router.ingress_url, b"GARBAGE\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert status == 400 and b"Server: fleetroute\r\n" in head and b"aiohttp" not in answer
    assert json.loads(body)["error"]["code"] == "bad_request"  # OpenAI-shaped, not aiohttp's plain text


# ---- forwarding headers ----------------------------------------------------------------------------------

SPOOFED = {"X-Forwarded-For": "6.6.6.6", "X-Forwarded-Proto": "https", "X-Forwarded-Host": "evil.example",
           "X-Real-IP": "6.6.6.6", "Forwarded": "for=6.6.6.6;proto=https"}


async def test_forwarding_headers_from_an_untrusted_client_are_replaced(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    capture_access_log(router)
    async with http.post(router.ingress_url + URL, json=CHAT, headers=SPOOFED) as resp:
        assert resp.status == 200
    seen = {k.lower(): v for k, v in engine.requests[0]["headers"].items()}
    assert seen["x-forwarded-for"] == "127.0.0.1" and seen["x-forwarded-proto"] == "http"
    assert not {"x-forwarded-host", "x-real-ip", "forwarded"} & set(seen)
    assert access_lines(router)[0]["client"] == "127.0.0.1"


async def test_behind_trusted_proxies_the_chain_is_kept_and_the_client_is_the_nearest_untrusted_hop(
        make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], listen={"host": "127.0.0.1", "port": 0,
                                                 "trustedProxies": ["127.0.0.0/8", "10.0.0.0/8"]})
    capture_access_log(router)
    # The client claims 6.6.6.6; the ingress controller (10.1.2.3) saw 203.0.113.9 and forwarded to the router.
    headers = {"X-Forwarded-For": "6.6.6.6, 203.0.113.9, 10.1.2.3", "X-Forwarded-Proto": "https"}
    async with http.post(router.ingress_url + URL, json=CHAT, headers=headers) as resp:
        assert resp.status == 200
    seen = {k.lower(): v for k, v in engine.requests[0]["headers"].items()}
    assert seen["x-forwarded-for"] == "6.6.6.6, 203.0.113.9, 10.1.2.3, 127.0.0.1"
    assert seen["x-forwarded-proto"] == "https"  # the proxy terminated TLS
    assert access_lines(router)[0]["client"] == "203.0.113.9"


@pytest.mark.parametrize(
    "chain, client",
    [
        ("", "10.0.0.1"),  # no header: the trusted peer itself
        ("198.51.100.7", "198.51.100.7"),
        ("1.1.1.1, 198.51.100.7, 10.0.0.2", "198.51.100.7"),  # the right-most untrusted hop
        ("10.0.0.3, 10.0.0.2", "10.0.0.3"),  # every hop trusted: the left-most
        ("198.51.100.7, not-an-ip, 10.0.0.2", "10.0.0.2"),  # a malformed hop ends the walk
        ("[2001:db8::7]:4711, 10.0.0.2", "2001:db8::7"),
        ("198.51.100.7:8080", "198.51.100.7"),
    ],
)
def test_the_client_address_behind_trusted_proxies(chain: str, client: str) -> None:
    request = SimpleNamespace(remote="10.0.0.1", headers=CIMultiDict({"X-Forwarded-For": chain} if chain else {}))
    forwarding = Forwarding((ipaddress.ip_network("10.0.0.0/8"),))
    assert forwarding.client(request) == client  # type: ignore[arg-type]
    assert Forwarding().client(request) == "10.0.0.1"  # type: ignore[arg-type] # nobody trusted: the peer
