"""Robustness of the request path under hostile input (hypothesis): malformed JSON, odd encodings, NUL
bytes, huge and deeply nested bodies, bad headers, odd content types and methods on every route of both
listeners. The router must never answer 5xx from its own code and never crash; a 5xx is acceptable only
when an engine produced it (the response names the endpoint), and the router keeps serving afterwards.

The router and a fake engine run on the test's event loop (conftest fixtures). Hypothesis drives a plain
(sync) test function, which runs each example's request to completion on that loop with
`run_until_complete`: the loop is idle between fixture set-up and the test body, so this is the one loop
everything lives on, with no thread. Examples are derandomised (the same inputs every run, so CI is
stable) and nothing is written to a `.hypothesis` database; set FLEETROUTE_FUZZ_EXAMPLES to explore more.
"""

from __future__ import annotations

import asyncio
import codecs
import gzip
import json
import logging
import os
import struct
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.model import EndpointState
from router.server.app import RunningRouter
from tests.conftest import MODEL
from tests.fake_engine import FakeEngine
from tests.redis_server import redis_url  # noqa: F401 - fixture

EXAMPLES = int(os.environ.get("FLEETROUTE_FUZZ_EXAMPLES", "200"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
MAX_BODY = 64 * 1024  # the fuzzed router's limit: big enough for every generated body
BIG_BODY = 512 * 1024  # the named cases' router: room for 100k-deep nesting (200 kB)
INFERENCE = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# 5xx the router may produce itself, and only for a valid request while an engine fails: none of them can
# happen here (the engine is up), so any router-made 5xx is a bug.
UPSTREAM_CODES = frozenset({"upstream_unreachable", "upstream_error", "upstream_timeout", "no_endpoint"})


@dataclass(repr=False)
class Target:
    router: RunningRouter
    engine: FakeEngine
    http: aiohttp.ClientSession
    loop: asyncio.AbstractEventLoop

    def __repr__(self) -> str:  # Hypothesis prints the arguments of a failing case: not the router's insides
        return f"Target(router at {self.router.ingress_url})"

    def run(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, 10))

    def still_serving(self) -> None:
        async def chat() -> int:
            async with self.http.post(self.router.ingress_url + "/v1/chat/completions",
                                      json={"model": MODEL, "messages": []}) as resp:
                await resp.read()
                return resp.status

        assert self.run(chat()) == 200


@pytest.fixture
async def target(make_engine, make_router, http) -> Target:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], limits={"maxBodyBytes": MAX_BODY})
    return Target(router, engine, http, asyncio.get_running_loop())


def _check(status: int, headers: dict[str, str], body: bytes, what: Any) -> None:
    """The contract: no router-made 5xx; a router-made error is in the OpenAI shape."""
    proxied = "x-fleetroute-endpoint" in headers
    if status >= 500:
        assert proxied, (status, body[:300], what)  # only an engine's own 5xx may pass through
    if not proxied and status >= 400 and body and headers.get("content-type", "").startswith("application/json"):
        error = orjson.loads(body)["error"]
        assert error["code"] and error["message"], what
        assert "Traceback" not in error["message"], what
        assert error["code"] not in UPSTREAM_CODES, what


def _no_router_errors_logged(caplog: pytest.LogCaptureFixture) -> None:
    errors = [r for r in caplog.records if r.name.startswith("fleetroute") and r.levelno >= logging.ERROR]
    assert not errors, [r.getMessage() for r in errors]


# ---- bodies ----------------------------------------------------------------------------------------------

_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20)
_json_values = st.recursive(
    _scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_models = st.sampled_from([MODEL, MODEL + "\x00", "", "gpt-4", MODEL.upper()]) | _json_values


@st.composite
def _payloads(draw: st.DrawFn) -> dict[str, Any]:
    payload = draw(st.dictionaries(st.text(max_size=10), _json_values, max_size=4))
    if draw(st.booleans()):
        payload["model"] = draw(_models)
    if draw(st.booleans()):
        payload["stream"] = draw(st.sampled_from([True, False, "yes", None]))
    return payload


def _encode(text: str, encoding: str) -> bytes:
    return text.encode(encoding, "surrogatepass") if "utf" in encoding else text.encode(encoding, "replace")


@st.composite
def _bodies(draw: st.DrawFn) -> bytes:
    kinds = ["json", "encoded", "mutated", "bytes", "nested", "nul", "bad-utf8", "json-nan", "not-an-object"]
    kind = draw(st.sampled_from(kinds))
    if kind == "bytes":
        return draw(st.binary(max_size=512))
    if kind == "not-an-object":  # valid JSON, but a list, a string, a number, null...
        return json.dumps(draw(_json_values)).encode()
    if kind == "json-nan":  # Python's json writes NaN and Infinity, which are not JSON
        return json.dumps(draw(_payloads()), allow_nan=True).encode()
    text = json.dumps(draw(_payloads()), ensure_ascii=draw(st.booleans()))
    if kind == "json":
        return text.encode("utf-8", "surrogatepass")
    if kind == "encoded":  # JSON must be UTF-8 (RFC 8259): BOMs and other encodings are 400s
        encoding = draw(st.sampled_from(["utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-8-sig", "latin-1"]))
        return _encode(text, encoding)
    if kind == "nested":
        depth = draw(st.integers(min_value=1, max_value=3000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        return f'{{"model": "{MODEL}", "x": {opener * depth}1{closer * depth}}}'.encode()
    data = bytearray(text.encode("utf-8", "surrogatepass"))
    position = draw(st.integers(min_value=0, max_value=len(data)))
    if kind == "nul":
        data[position:position] = b"\x00" * draw(st.integers(min_value=1, max_value=3))
    elif kind == "bad-utf8":
        data[position:position] = draw(st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
    else:  # mutated: truncated, or a byte flipped
        if draw(st.booleans()):
            del data[position:]
        elif data:
            index = min(position, len(data) - 1)
            data[index] = draw(st.integers(min_value=0, max_value=255))
    return bytes(data)


_content_types = st.sampled_from([
    "application/json", "application/json; charset=utf-16", "text/plain", "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x", "application/octet-stream", "", ";;;", "application/json; charset=nope",
])


@FUZZ
@given(path=st.sampled_from(INFERENCE), body=_bodies(), content_type=_content_types)
def test_fuzzed_bodies_never_get_a_router_5xx(target: Target, caplog, path: str, body: bytes, content_type: str) -> None:
    async def send() -> tuple[int, dict[str, str], bytes]:
        async with target.http.post(target.router.ingress_url + path, data=body,
                                    headers={"Content-Type": content_type}) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, await resp.read()

    status, headers, answer = target.run(send())
    _check(status, headers, answer, body[:200])
    _no_router_errors_logged(caplog)


# ---- methods, paths and headers, raw on the wire ---------------------------------------------------------

_ROUTES = [
    *INFERENCE, "/v1/models", "/metrics", "/healthz", "/readyz", "/admin/endpoints",
    "/admin/endpoints/gpu-0/drain", "/admin/endpoints/gpu-0/resume", "/admin/endpoints/nope/drain",
]
_paths = st.sampled_from(_ROUTES) | st.builds(
    lambda route, suffix: route + suffix, st.sampled_from(_ROUTES),
    st.sampled_from(["/", "?", "?a=1&a=2", "/..", "%00", "%2e%2e/", "//", "?x=" + "y" * 3000, "#frag", ";p"]),
) | st.sampled_from(["/", "*", "//v1/models", "/v1/", "/%ff", "/v1/chat/completions/../models", "/" + "a" * 5000])
_methods = st.sampled_from(
    ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS", "TRACE", "FOO", "post", "M-SEARCH", "PRI"]
)
_header_names = st.text(alphabet="!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
                        min_size=1, max_size=20)
_header_values = st.binary(max_size=64).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
_special_headers = st.sampled_from([
    (b"Content-Type", b"application/json"), (b"Content-Type", b"\xff\xfe"), (b"Content-Encoding", b"gzip"),
    (b"Content-Encoding", b"deflate"), (b"Content-Encoding", b"br"), (b"Content-Encoding", b"zstd"),
    (b"Content-Encoding", b"bogus"), (b"Expect", b"100-continue"), (b"Expect", b"nothing"),
    (b"X-Request-Id", b"\xff\xfe"), (b"X-Request-Id", b"a" * 2000), (b"X-Session-Id", b"\x01\x02"),
    (b"x-priority", b"\xc3\xa9"), (b"x-request-deadline-ms", b"-5"), (b"Authorization", b"Bearer \x80"),
    (b"Connection", b"upgrade, x-foo"), (b"Upgrade", b"websocket"), (b"Transfer-Encoding", b"gzip"),
    (b"Host", b""), (b"Host", b"evil.example:1"), (b"Content-Length", b"abc"), (b"Content-Length", b"-1"),
])


@st.composite
def _raw_requests(draw: st.DrawFn) -> bytes:
    method = draw(_methods)
    path = draw(_paths)
    body_kind = draw(st.sampled_from(["none", "json", "bytes", "gzip-garbage", "gzip-json"]))
    body = {
        "none": b"",
        "json": orjson.dumps({"model": MODEL, "prompt": "x"}),
        "bytes": draw(st.binary(max_size=256)),
        "gzip-garbage": b"\x1f\x8b\x08\x00garbage",
        "gzip-json": gzip.compress(orjson.dumps({"model": MODEL, "prompt": "x"})),
    }[body_kind]
    headers = [(b"Host", b"router")]
    headers += draw(st.lists(st.tuples(_header_names.map(str.encode), _header_values), max_size=4))
    headers += draw(st.lists(_special_headers, max_size=3, unique=True))
    names = {name.lower() for name, _ in headers}
    chunked = draw(st.booleans()) and b"content-length" not in names and b"transfer-encoding" not in names
    if chunked:
        headers.append((b"Transfer-Encoding", b"chunked"))
        framed = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    else:
        if b"content-length" not in names and b"transfer-encoding" not in names:
            headers.append((b"Content-Length", b"%d" % len(body)))
        framed = body
    headers.append((b"Connection", b"close"))
    head = b"%s %s HTTP/1.1\r\n" % (method.encode(), path.encode()) + b"".join(n + b": " + v + b"\r\n" for n, v in headers)
    return head + b"\r\n" + framed


async def _exchange(url: str, data: bytes) -> bytes:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        try:
            # Enough for the status line and headers; a bad framing may leave the server waiting for more
            # body, in which case it must still not have answered 5xx (nothing is read = nothing answered).
            return await asyncio.wait_for(reader.read(65536), 2)
        except TimeoutError:
            return b""
    finally:
        writer.close()


def _parse(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0].startswith(b"HTTP/1."), answer[:200]
    status = int(lines[0].split(b" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return status, headers, body


@FUZZ
@given(request=_raw_requests(), admin=st.booleans())
def test_fuzzed_methods_paths_and_headers_never_get_a_router_5xx(
    target: Target, caplog, request: bytes, admin: bool
) -> None:
    url = target.router.admin_url if admin else target.router.ingress_url
    answer = target.run(_exchange(url, request))
    if answer:
        status, headers, body = _parse(answer)
        _check(status, headers, body if "content-length" in headers else b"", request[:300])
    _no_router_errors_logged(caplog)
    # An admin drain from the fuzzer must not leave the next examples without an endpoint.
    target.router.ctx.balancer.set_state("gpu-0", EndpointState.SERVING)


# ---- named cases: the worst inputs, each once --------------------------------------------------------------


def _nested(depth: int) -> bytes:
    return b'{"model": "' + MODEL.encode() + b'", "messages": ' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        (_nested(100_000), 400, "invalid_json"),  # orjson's depth limit (1024): a 400, not a RecursionError
        (b"{" * 100_000, 400, "invalid_json"),
        (codecs.BOM_UTF16_LE + '{"model": "llama-3-8b"}'.encode("utf-16-le"), 400, "invalid_json"),
        (codecs.BOM_UTF8 + b'{"model": "llama-3-8b"}', 400, "invalid_json"),
        (b'{"model": "llama-3-8b", "x": "\xff\xfe"}', 400, "invalid_json"),
        (b'{"model": "llama-3-8b", "x": "\\ud800"}', 400, "invalid_json"),  # a lone surrogate escape
        (b'{"model": "llama-3-8b\\u0000"}', 404, "model_not_found"),
        (b'\x00{"model": "llama-3-8b"}', 400, "invalid_json"),
        (b'{"model": "llama-3-8b", "n": 1e999}', 400, "invalid_json"),
        (b'{"model": "llama-3-8b", "pad": "' + b"a" * BIG_BODY + b'"}', 413, "body_too_large"),
        (b"", 400, "invalid_json"),
    ],
    ids=["nested-100k", "open-braces-100k", "utf16-bom", "utf8-bom", "invalid-utf8", "lone-surrogate",
         "nul-in-model", "leading-nul", "huge-number", "over-limit", "empty"],
)
async def test_the_worst_bodies_get_clean_4xx(target_async, body: bytes, status: int, code: str) -> None:
    router, engine, http = target_async
    async with http.post(router.ingress_url + "/v1/chat/completions", data=body,
                         headers={"Content-Type": "application/json"}) as resp:
        assert resp.status == status
        error = (await resp.json())["error"]
    assert error["code"] == code
    assert engine.requests == []
    async with http.post(router.ingress_url + "/v1/chat/completions", json={"model": MODEL, "messages": []}) as resp:
        assert resp.status == 200


async def test_a_valid_body_at_the_size_limit_is_served(target_async) -> None:
    router, engine, http = target_async
    prefix = b'{"model": "' + MODEL.encode() + b'", "messages": [], "pad": "'
    body = prefix + b"a" * (BIG_BODY - len(prefix) - 2) + b'"}'
    assert len(body) == BIG_BODY
    async with http.post(router.ingress_url + "/v1/chat/completions", data=body) as resp:
        assert resp.status == 200
    assert len(engine.requests) == 1


@pytest.fixture
async def target_async(make_engine, make_router, http) -> tuple[RunningRouter, FakeEngine, aiohttp.ClientSession]:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], limits={"maxBodyBytes": BIG_BODY})
    return router, engine, http


# ---- hostile data arriving from Redis -------------------------------------------------------------------
#
# Whoever can write the router's Redis can put anything under its keys (docs/telemetry.md, "Trust"). For
# every key the router reads (telemetry hashes, session pins, the replica set and in-flight count hashes,
# the prefix-index stream, the updates channel), Hypothesis writes values of any type, content and size
# into a real Redis, then the router runs its own reading code (a telemetry refresh, a load exchange, a
# prefix upkeep round, and requests that look pins up). None of it may raise, every request is served, and
# what reaches routing stays within the ranges real agents and routers produce.

REDIS_PREFIX_MODEL = "prefix-model"
REDIS_POLICIES = [
    {"name": "sticky", "models": [MODEL], "strategy": "adaptive", "stickiness": {"enabled": True}},
    {"name": "prefix", "models": [REDIS_PREFIX_MODEL], "strategy": "prefix-aware"},
]
REDIS_FUZZ = settings(FUZZ, max_examples=max(10, EXAMPLES // 2))


@dataclass(repr=False)
class RedisTarget(Target):
    redis: Any  # a plain client the fuzzer writes with
    feed: Any  # the router's telemetry feed (router.telemetry.feed.TelemetryFeed over a RedisStore)
    session: int = 0

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # Hypothesis prints failing examples this way
        printer.text(f"RedisTarget(router at {self.router.ingress_url})")

    def request(self, model: str, session: str | None = None) -> int:
        async def send() -> int:
            headers = {"x-session-id": session} if session is not None else {}
            body = {"model": model, "messages": [{"role": "user", "content": "the same long prompt " * 40}]}
            async with self.http.post(self.router.ingress_url + "/v1/chat/completions", json=body,
                                      headers=headers) as resp:
                await resp.read()
                return resp.status

        return self.run(send())

    def next_session(self) -> str:
        self.session += 1
        return f"fuzz-{self.session}"


@pytest.fixture
async def redis_target(make_engine, make_router, http, redis_url) -> Any:  # noqa: F811
    from router.runtime.redis_client import connect
    from router.telemetry.feed import RedisStore, TelemetryFeed

    engines = [await make_engine(f"gpu-{i}", models=(MODEL, REDIS_PREFIX_MODEL)) for i in range(2)]
    router = await make_router(engines, policies=REDIS_POLICIES, telemetry={"enabled": False},
                               redis={"url": redis_url})
    store = RedisStore(connect(router.ctx.settings.redis, timeout=2.0))
    client = aioredis.from_url(redis_url)
    target = RedisTarget(router, engines[0], http, asyncio.get_running_loop(), redis=client,
                         feed=TelemetryFeed(store=store, balancer=router.ctx.balancer, metrics=router.ctx.metrics))
    yield target
    await client.aclose()
    await store.close()


_REDIS_TYPES = ("hash", "string", "list", "set", "zset", "stream")


class _Big(bytes):
    """Bytes that Hypothesis reports by size, not by content, when an example fails."""

    def __repr__(self) -> str:
        return f"<{len(self)} bytes {bytes(self[:12])!r}...>"

_counts_text = st.one_of(
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "-inf", "1e309", "\u0663", "1_000", " 7", "0x10", "", "9" * 4000, "7" * 5000,
                     "-0", "1e-320", "2", "0.5"]),
)
_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(min_value=-2.0, max_value=3.0).map(repr),  # around the ratios' range
    st.integers(min_value=-(10**30), max_value=10**30).map(str),
).map(str.encode)
_redis_values = st.one_of(
    _counts_text.map(str.encode),
    st.binary(max_size=64),
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.integers(min_value=300, max_value=300_000).map(lambda n: _Big(b"7" * n)),  # oversize, up to 300 kB
    st.sampled_from([b"gpu-0", b"gpu-1", b"\xff\xfe", b"gpu-0\x00", b"\x1b[2J"]),
)


async def _plant(client: Any, key: str, kind: str, items: list[tuple[bytes, bytes]]) -> None:
    """`key` as a Redis `kind` holding `items` (field/member, value) - whatever the router expects there."""
    await client.delete(key)
    if not items:
        items = [(b"x", b"y")]
    if kind == "hash":
        await client.hset(key, mapping=dict(items))
    elif kind == "string":
        await client.set(key, items[0][1])
    elif kind == "list":
        await client.rpush(key, *[v for _, v in items])
    elif kind == "set":
        await client.sadd(key, *[v for _, v in items])
    elif kind == "zset":
        await client.zadd(key, {v: 1.0 for _, v in items})
    else:
        await client.xadd(key, dict(items))


def _within_schema(router: RunningRouter) -> None:
    """What reached routing: every number finite, ratios in [0, 1], counts non-negative and bounded."""
    from router.routing.shared_loads import MAX_IN_FLIGHT, MAX_REPLICAS

    for view in router.ctx.balancer.snapshot.views:
        t = view.telemetry
        if t is None:
            continue
        for ratio in (t.gpu_util, t.gpu_mem_util, t.kv_cache_usage, t.prefix_cache_hit_rate):
            assert ratio is None or 0.0 <= ratio <= 1.0, t
        for count in (t.num_waiting, t.num_running, t.prefix_cache_queries, t.prefix_cache_hits):
            assert count is None or 0.0 <= count <= 2.0**53, t
    for endpoint, count in router.ctx.loads.others.items():
        assert endpoint in {"gpu-0", "gpu-1"} and 0 <= count <= MAX_IN_FLIGHT * MAX_REPLICAS


def _no_errors_but_schema(caplog: pytest.LogCaptureFixture) -> None:
    errors = [r.getMessage() for r in caplog.records if r.name.startswith("fleetroute") and r.levelno >= logging.ERROR
              and "unknown schema version" not in r.getMessage()]  # a rollout to do: logged as an error by design
    assert not errors, errors


@st.composite
def _telemetry_hashes(draw: st.DrawFn) -> tuple[str, list[tuple[bytes, bytes]]]:
    """A valid record with some fields replaced by hostile values, some dropped, some added; or garbage."""
    import time

    from worker.protocol import FIELD_NAMES, EngineSample, GpuSample, TelemetryRecord, encode

    fields = {k.encode(): v.encode() for k, v in encode(TelemetryRecord(
        endpoint_id="gpu-0", reported_at=time.time(), seq=1, interval=1.0, gpu_source="nvml",
        gpu=GpuSample(util=0.4, mem_used_bytes=10, mem_total_bytes=80, temperature_c=60.0, xid_errors=0),
        engine=EngineSample(up=True, kv_cache_usage=0.3, num_waiting=1.0, num_running=2.0,
                            prefix_cache_queries=10.0, prefix_cache_hits=5.0, kv_capacity_tokens=4096),
        prefix_cache_hit_rate=0.5)).items()}
    names = st.sampled_from([n.encode() for n in FIELD_NAMES])
    values = st.one_of(_numbers, _numbers, _redis_values)  # mostly numbers, where the range checks matter
    for name, value in draw(st.lists(st.tuples(names, values), min_size=1, max_size=4)):
        fields[name] = value
    for name, value in draw(st.lists(st.tuples(st.binary(max_size=12), _redis_values), max_size=2)):
        fields[name] = value  # fields no schema has: ignored, but bounded in size and number
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3)):
        fields.pop(name, None)
    return draw(st.sampled_from(["hash"] * 5 + list(_REDIS_TYPES))), list(fields.items())


@REDIS_FUZZ
@given(planted=_telemetry_hashes(), announce=st.binary(max_size=64))
def test_hostile_telemetry_in_redis_is_refused_without_failing_a_round_or_a_request(
        redis_target: RedisTarget, caplog, planted: tuple[str, list[tuple[bytes, bytes]]], announce: bytes) -> None:
    from worker.protocol import UPDATES_CHANNEL, telemetry_key

    kind, items = planted
    t = redis_target
    t.run(_plant(t.redis, telemetry_key("gpu-0"), kind, items))
    t.run(t.redis.publish(UPDATES_CHANNEL, announce))  # only ever wakes the reader up
    t.run(t.feed.refresh())
    _within_schema(t.router)
    assert t.request(MODEL) == 200
    _no_errors_but_schema(caplog)


@REDIS_FUZZ
@given(kind=st.sampled_from(["string"] * 6 + list(_REDIS_TYPES)), value=_redis_values)
def test_hostile_session_pins_in_redis_never_fail_a_request(redis_target: RedisTarget, caplog, kind: str,
                                                            value: bytes) -> None:
    from router.routing.sticky import KEY_PREFIX, session_digest

    t = redis_target
    session = t.next_session()
    t.run(_plant(t.redis, f"{KEY_PREFIX}sticky:{session_digest(session)}", kind, [(b"f", value)]))
    assert t.request(MODEL, session) == 200
    assert t.request(MODEL, session) == 200  # the pin the router wrote (or read) is honoured
    _no_router_errors_logged(caplog)


_scores = st.floats(min_value=-1e12, max_value=1e12) | st.sampled_from([float("inf"), float("-inf"), 0.0])


@REDIS_FUZZ
@given(
    replicas=st.lists(st.tuples(_redis_values, _scores), max_size=4),
    counts=st.lists(st.tuples(st.sampled_from([b"gpu-0", b"gpu-1"]) | st.binary(max_size=8), _redis_values),
                    max_size=4),
    kind=st.sampled_from(["hash"] * 6 + list(_REDIS_TYPES)),
    replica_set_kind=st.sampled_from(["zset"] * 8 + list(_REDIS_TYPES)),
)
def test_hostile_in_flight_counts_in_redis_never_fail_a_round_or_a_request(
        redis_target: RedisTarget, caplog, replicas: list[tuple[bytes, float]], counts: list[tuple[bytes, bytes]],
        kind: str, replica_set_kind: str) -> None:
    import time

    from router.routing.shared_loads import LOADS_PREFIX, REPLICAS_KEY

    t = redis_target
    shared = t.router.ctx.shared_loads
    assert shared is not None

    async def plant() -> None:
        members = [(m, time.time() if s == 0.0 else s) for m, s in replicas] + [(b"fuzzed-replica", time.time())]
        if replica_set_kind == "zset":
            await t.redis.delete(REPLICAS_KEY)
            await t.redis.zadd(REPLICAS_KEY, dict(members))
        else:
            await _plant(t.redis, REPLICAS_KEY, replica_set_kind, [(b"m", m) for m, _ in members])
        for member, _ in members:
            await _plant(t.redis, LOADS_PREFIX + member.decode("utf-8", "replace"), kind, counts)

    t.run(plant())
    t.run(shared.exchange())
    _within_schema(t.router)
    assert t.request(MODEL, t.next_session()) == 200
    t.run(shared.exchange())  # a second round: nothing the first one left behind breaks it
    _within_schema(t.router)
    t.run(t.redis.delete(REPLICAS_KEY))
    _no_router_errors_logged(caplog)


_stream_fields = st.lists(st.tuples(
    st.sampled_from([b"e:gpu-0", b"e:gpu-1", b"e:gpu-0", b"e:gpu-1", b"router", b"e:", b"e:\xff", b"other"]),
    st.one_of(
        st.sampled_from([40_000, 1024, 1025, 1]).map(lambda n: _Big(struct.pack(f"<{n}Q", *range(n)))),  # hashes
        st.sampled_from([3, 8 * 1024 + 1]).map(lambda n: _Big(bytes(n))),  # not whole 8-byte hashes
        _redis_values,
    ),
), min_size=1, max_size=5)
_stream_ids = st.sampled_from([None] * 6 + ["0-1", "9999999999999-0"])


@REDIS_FUZZ
@given(entries=st.lists(st.tuples(_stream_fields, _stream_ids), max_size=4),
       kind=st.sampled_from(["stream"] * 8 + list(_REDIS_TYPES)))
def test_hostile_prefix_stream_entries_never_fail_a_round_or_a_request(
        redis_target: RedisTarget, caplog, entries: list[tuple[list[tuple[bytes, bytes]], str | None]],
        kind: str) -> None:
    from redis.exceptions import ResponseError

    from router.routing.prefix.sharing import ENTRY_HASHES, MERGE_BUDGET, stream_key

    t = redis_target
    upkeep = t.router.ctx.prefix_upkeep
    assert upkeep is not None
    key = stream_key("prefix", REDIS_PREFIX_MODEL, 256)

    async def plant() -> None:
        await t.redis.delete(key)
        if kind != "stream":
            await _plant(t.redis, key, kind, entries[0][0] if entries else [])
            return
        for fields, entry_id in entries:
            try:
                await t.redis.xadd(key, dict(fields), id=entry_id or "*")
            except ResponseError:
                pass  # an explicit id not after the last one: Redis refuses it, as it would anyone's

    def looked_at() -> float:
        return sum(t.router.ctx.metrics.registry.get_sample_value("fleetroute_prefix_shared_blocks_total",
                                                                    {"outcome": outcome}) or 0.0
                   for outcome in ("received", "expired", "ignored"))

    assert t.request(REDIS_PREFIX_MODEL) == 200  # something to publish this round
    t.run(plant())
    for _ in range(2):
        before = looked_at()
        t.run(upkeep.round())
        # The work of one round is bounded whatever the stream holds: the byte budget, plus one entry.
        assert looked_at() - before <= MERGE_BUDGET // 8 + ENTRY_HASHES
    assert t.request(REDIS_PREFIX_MODEL) == 200
    t.run(t.redis.delete(key))
    _no_router_errors_logged(caplog)
