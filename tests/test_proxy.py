"""The proxy end to end: real aiohttp router, real sockets on 127.0.0.1, fake vLLM-like engines."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp

from tests.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


async def test_chat_completion_is_proxied_and_names_its_endpoint(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        body = await resp.json()
        assert resp.status == 200
        assert resp.headers["x-fleetroute-endpoint"] == "gpu-0"
        assert resp.headers["x-served-by"] == "gpu-0"  # engine headers pass through
    assert body["choices"][0]["message"]["content"] == "tok0 tok1 tok2 tok3 "
    assert engine.requests[0]["body"] == CHAT  # the body reaches the engine unchanged


async def test_completions_and_embeddings_are_proxied(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    async with http.post(router.ingress_url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}) as resp:
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["text"] == "tok0 tok1 "
    async with http.post(router.ingress_url + "/v1/embeddings", json={"model": MODEL, "input": "x"}) as resp:
        assert resp.status == 200
        assert (await resp.json())["data"][0]["embedding"] == [0.1, 0.2, 0.3]
    assert [r["path"] for r in engine.requests] == ["/v1/completions", "/v1/embeddings"]


async def test_streaming_chunks_pass_through_without_buffering(make_engine, make_router, http) -> None:
    # The engine sends its first token, then waits for `gate`. The test opens the gate only after the
    # first token has arrived *through the router*: a router that buffered the stream would deadlock here
    # (and the test would time out).
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await make_router([engine])
    body = {**CHAT, "stream": True, "max_tokens": 5}
    async with http.post(router.ingress_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        first = await resp.content.readuntil(b"\n\n")
        assert json.loads(first[len(b"data: "):])["choices"][0]["delta"]["content"] == "tok0 "
        engine.gate.set()
        rest = (await resp.content.read()).decode()
    events = [e for e in rest.split("\n\n") if e]
    contents = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in events[:-1]]
    assert contents == ["tok1 ", "tok2 ", "tok3 ", "tok4 ", None]  # in order, final chunk has no content
    assert events[-1] == "data: [DONE]"


async def test_openai_errors_use_the_openai_shape(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], limits={"maxBodyBytes": 4096})
    url = router.ingress_url
    cases = [
        ("POST", "/v1/chat/completions", b"{not json", 400, "invalid_json"),
        ("POST", "/v1/chat/completions", b"[1, 2]", 400, "invalid_json"),
        ("POST", "/v1/chat/completions", b'{"messages": []}', 400, "missing_model"),
        ("POST", "/v1/chat/completions", b'{"model": 7}', 400, "missing_model"),
        ("POST", "/v1/chat/completions", b'{"model": "gpt-17"}', 404, "model_not_found"),
        ("POST", "/v1/chat/completions", b'{"model": "x", "pad": "' + b"a" * 5000 + b'"}', 413, "body_too_large"),
        ("GET", "/v1/chat/completions", b"", 405, "method_not_allowed"),
        ("POST", "/v1/images/generations", b"{}", 404, "not_found"),
    ]
    for method, path, data, status, code in cases:
        async with http.request(method, url + path, data=data, headers={"Content-Type": "application/json"}) as resp:
            assert resp.status == status, (path, data[:30])
            error = (await resp.json())["error"]
            assert error["code"] == code
            assert error["message"] and error["type"] == "invalid_request_error"
            assert "Traceback" not in error["message"]
    assert engine.requests == []  # nothing bad reached the engine
    # The router is still serving after all that.
    async with http.post(url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200


async def test_unknown_model_lists_the_available_models(make_engine, make_router, http) -> None:
    a = await make_engine("gpu-0", models=("llama-3-8b",))
    b = await make_engine("gpu-1", models=("qwen-2-7b",))
    router = await make_router([a, b])
    async with http.post(router.ingress_url + "/v1/completions", json={"model": "gpt-4", "prompt": "x"}) as resp:
        error = (await resp.json())["error"]
    assert resp.status == 404 and error["param"] == "model"
    assert "llama-3-8b" in error["message"] and "qwen-2-7b" in error["message"]


async def test_body_over_limit_without_content_length_is_413(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], limits={"maxBodyBytes": 4096})

    async def chunks():
        for _ in range(10):
            yield b"x" * 1000

    async with http.post(router.ingress_url + "/v1/completions", data=chunks()) as resp:  # chunked upload
        assert resp.status == 413
        assert (await resp.json())["error"]["code"] == "body_too_large"


async def test_model_routing_sends_each_model_to_its_endpoints(make_engine, make_router, http) -> None:
    llama = [await make_engine(f"llama-{i}", models=("llama-3-8b",)) for i in range(2)]
    qwen = await make_engine("qwen-0", models=("qwen-2-7b",))
    router = await make_router([*llama, qwen], policies=[{"name": "rr", "strategy": "round-robin"}])
    served: Counter[tuple[str, str]] = Counter()
    for model in ["llama-3-8b", "qwen-2-7b"] * 10:
        async with http.post(router.ingress_url + "/v1/completions", json={"model": model, "prompt": "x"}) as resp:
            assert resp.status == 200
            served[(model, resp.headers["x-fleetroute-endpoint"])] += 1
    assert served == {("llama-3-8b", "llama-0"): 5, ("llama-3-8b", "llama-1"): 5, ("qwen-2-7b", "qwen-0"): 10}


async def test_models_endpoint_lists_the_union_of_served_models(make_engine, make_router, http) -> None:
    a = await make_engine("gpu-0", models=("llama-3-8b", "llama-3-8b-lora"))
    b = await make_engine("gpu-1", models=("qwen-2-7b",))
    router = await make_router([a, b])
    async with http.get(router.ingress_url + "/v1/models") as resp:
        body = await resp.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["llama-3-8b", "llama-3-8b-lora", "qwen-2-7b"]


async def test_policies_are_chosen_by_model_pattern(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}", models=("llama-3-8b", "qwen-2-7b")) for i in range(3)]
    router = await make_router(engines, policies=[
        {"name": "sticky", "models": ["llama-*"], "strategy": "consistent-hash"},
        {"name": "spread", "models": ["*"], "strategy": "round-robin"},
    ])
    async def endpoint(model: str) -> str:
        async with http.post(router.ingress_url + "/v1/completions", json={"model": model, "prompt": "x"},
                             headers={"x-session-id": "alice"}) as resp:
            return resp.headers["x-fleetroute-endpoint"]
    assert len({await endpoint("llama-3-8b") for _ in range(6)}) == 1  # hashed: one endpoint per session
    assert len({await endpoint("qwen-2-7b") for _ in range(6)}) == 3  # round-robin: all of them


async def test_hop_by_hop_headers_are_not_forwarded(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    headers = {"Connection": "keep-alive, X-Secret-Hop", "X-Secret-Hop": "1", "Proxy-Authorization": "Basic x",
               "Authorization": "Bearer user-key", "X-Session-Id": "s1", "TE": "trailers"}
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT, headers=headers) as resp:
        assert resp.status == 200
    seen = {k.lower(): v for k, v in engine.requests[0]["headers"].items()}
    assert "x-secret-hop" not in seen and "proxy-authorization" not in seen and "te" not in seen
    assert seen["authorization"] == "Bearer user-key"  # end-to-end headers are kept
    assert seen["x-session-id"] == "s1"
    assert seen["x-forwarded-for"] == "127.0.0.1"
    assert seen["x-request-id"]
    assert seen["host"] == engine.url.removeprefix("http://")


async def test_request_id_is_propagated(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "abc-123"}):
        pass
    seen = {k.lower(): v for k, v in engine.requests[0]["headers"].items()}
    assert seen["x-request-id"] == "abc-123"


async def test_client_disconnect_mid_stream_cancels_the_upstream_request(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await make_router([engine])
    resp = await http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True, "max_tokens": 50})
    await resp.content.readuntil(b"\n\n")
    assert router.ctx.loads.in_flight("gpu-0") == 1
    resp.close()  # the client goes away mid-stream
    await asyncio.wait_for(engine.stream_aborted.wait(), 5)  # the engine sees its request cancelled
    engine.gate.set()
    async with asyncio.timeout(5):
        while router.ctx.loads.in_flight("gpu-0"):  # the router's bookkeeping ends with the request
            await asyncio.sleep(0)
    metrics = await _metrics(http, router)
    assert 'fleetroute_upstream_errors_total{endpoint="gpu-0",kind="client_disconnect"} 1.0' in metrics
    # Counted as nginx's 499 "client closed request", against the endpoint that was streaming.
    assert 'fleetroute_requests_total{endpoint="gpu-0",model="llama-3-8b",status="499"} 1.0' in metrics


async def test_in_flight_ends_when_the_body_ends_not_at_headers(make_engine, make_router, http) -> None:
    # least-connections must see a streaming request as load until its last token: while gpu-0 holds an
    # open stream, every new request goes to gpu-1.
    busy = await make_engine("gpu-0", gate=asyncio.Event())
    idle = await make_engine("gpu-1")
    router = await make_router([busy, idle], seed=3)
    # Send streams until one lands on gpu-0 and holds there (the others finish immediately on gpu-1).
    held = None
    for _ in range(10):
        resp = await http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True})
        if resp.headers["x-fleetroute-endpoint"] == "gpu-0":
            held = resp
            await resp.content.readuntil(b"\n\n")  # headers and first token received; body still open
            break
        await resp.read()
    assert held is not None
    for _ in range(5):
        async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.headers["x-fleetroute-endpoint"] == "gpu-1"
    busy.gate.set()
    await held.read()
    held.close()
    assert router.ctx.loads.in_flight("gpu-0") == 0


async def test_upstream_5xx_is_passed_through(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", fail_status=500)
    router = await make_router([engine])
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 500
        assert (await resp.json())["error"]["message"] == "gpu-0 failing"
        assert resp.headers["x-fleetroute-endpoint"] == "gpu-0"


async def test_connection_refused_is_retried_on_another_endpoint(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-1")
    dead = await make_engine("gpu-0")
    await dead.stop()  # nothing listens there any more: connection refused
    router = await make_router([dead, engine], policies=[{"name": "rr", "strategy": "round-robin"}])
    for _ in range(4):
        async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            assert resp.headers["x-fleetroute-endpoint"] == "gpu-1"
    metrics = await _metrics(http, router)
    retries = _sample(metrics, 'fleetroute_retries_total{model="llama-3-8b"}')
    # Round-robin keeps offering gpu-0; each time the refusal is counted and the request retried.
    assert retries >= 2
    assert _sample(metrics, 'fleetroute_upstream_errors_total{endpoint="gpu-0",kind="connect"}') == retries


async def test_all_endpoints_unreachable_is_502(make_engine, make_router, http) -> None:
    dead = [await make_engine(f"gpu-{i}") for i in range(2)]
    for engine in dead:
        await engine.stop()
    router = await make_router(dead)
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 502
        error = (await resp.json())["error"]
    assert error["code"] == "upstream_unreachable" and error["type"] == "server_error"


async def test_upstream_timeout_before_first_byte_is_504(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", hang=asyncio.Event())
    router = await make_router([engine], policies=[
        {"name": "default", "strategy": "round-robin", "timeouts": {"firstByte": "200ms"}}])
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 504
        assert (await resp.json())["error"]["code"] == "upstream_timeout"
    engine.hang.set()


async def test_stalled_stream_is_cut_after_the_idle_timeout(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await make_router([engine], policies=[
        {"name": "default", "strategy": "round-robin", "timeouts": {"idle": "200ms"}}])
    async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
        assert resp.status == 200
        events = [e for e in (await resp.read()).split(b"\n\n") if e]
    # The stream ends cleanly with an OpenAI-shaped error event, so SDKs raise instead of hanging or
    # silently returning half an answer; it is never retried (the client already has part of it).
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_stream_interrupted"
    assert b"[DONE]" not in events[-1]
    engine.gate.set()
    assert 'kind="idle_timeout"} 1.0' in await _metrics(http, router)


async def test_draining_every_endpoint_gives_503_with_retry_after(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    async with http.post(router.admin_url + "/admin/endpoints/gpu-0/drain") as resp:
        assert resp.status == 200
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        error = (await resp.json())["error"]
    assert error["code"] == "no_endpoint" and error["type"] == "server_error"
    async with http.post(router.admin_url + "/admin/endpoints/gpu-0/resume") as resp:
        assert resp.status == 200
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    async with http.post(router.admin_url + "/admin/endpoints/nope/drain") as resp:
        assert resp.status == 404


async def test_concurrent_requests_are_spread_and_all_succeed(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    router = await make_router(engines, policies=[{"name": "rr", "strategy": "round-robin"}])

    async def one(i: int) -> str:
        async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": i % 2 == 0}) as resp:
            assert resp.status == 200
            await resp.read()
            return resp.headers["x-fleetroute-endpoint"]

    served = Counter(await asyncio.gather(*(one(i) for i in range(60))))
    assert served == {"gpu-0": 20, "gpu-1": 20, "gpu-2": 20}


async def _metrics(http: aiohttp.ClientSession, router) -> str:
    async with http.get(router.admin_url + "/metrics") as resp:
        return await resp.text()


def _sample(metrics: str, series: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not in metrics")


async def test_a_gzip_request_body_reaches_the_engine_decoded_and_unlabelled(make_engine, make_router, http) -> None:
    import gzip

    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    body = gzip.compress(json.dumps(CHAT).encode())
    async with http.post(router.ingress_url + "/v1/chat/completions", data=body,
                         headers={"Content-Encoding": "gzip", "Content-Type": "application/json"}) as resp:
        assert resp.status == 200
    assert engine.requests[0]["body"] == CHAT
    assert "content-encoding" not in {k.lower() for k in engine.requests[0]["headers"]}


class DyingEngine:
    """An engine killed with the request in it: it reads the request, then closes without answering (or, with
    `head`, after sending a stream's response head, as vLLM does at once)."""

    def __init__(self, name: str, *, head: bool = False) -> None:
        self.name, self.models, self.head, self.url, self.requests = name, (MODEL,), head, "", 0
        self.server: asyncio.Server | None = None

    async def start(self) -> DyingEngine:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            await reader.readexactly(length)
            self.requests += 1
            if self.head:
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
                await writer.drain()
            writer.close()

        self.server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def stop(self) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()


async def test_an_engine_that_dies_with_the_request_in_it_before_answering_is_retried_elsewhere(
        make_engine, make_router, http) -> None:
    # A killed engine closes its connections: nothing reached the client, so the request goes to another
    # endpoint, as after a 5xx (a non-streamed request, and a stream whose head alone had come).
    for stream, head in ((False, False), (True, True)):
        dying = await DyingEngine("gpu-dead", head=head).start()
        healthy = await make_engine("gpu-ok")
        try:
            router = await make_router([dying, healthy], policies=[
                {"name": "default", "models": ["*"], "strategy": "round-robin", "retries": {"attempts": 2}}])
            for _ in range(4):  # round-robin: both endpoints get first tries
                async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-fleetroute-endpoint"] == "gpu-ok"
                    await resp.read()
            assert dying.requests >= 1
            metrics = await (await http.get(router.admin_url + "/metrics")).text()
            assert 'fleetroute_upstream_errors_total{endpoint="gpu-dead",kind="disconnect"}' in metrics
        finally:
            await dying.stop()
