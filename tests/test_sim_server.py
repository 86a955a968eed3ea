"""`fleetroute sim` over HTTP: the OpenAI surface (via the official SDK, directly and through the router),
vLLM's /metrics, GPU telemetry, client disconnects and fault injection."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import openai
import pytest

from router.config.settings import parse_settings
from router.server.app import build_context, start_router
from tests.sim_server import MODEL
from worker.sim.tokenizer import render_chat, tokenize
from worker.vllm_metrics import parse_vllm_metrics


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def test_openai_sdk_streams_from_the_sim_directly_and_through_the_router(make_sim) -> None:
    sims = [await make_sim(), await make_sim(gpu="a100-80g")]
    settings = parse_settings({
        "listen": {"host": "127.0.0.1", "port": 0}, "admin": {"host": "127.0.0.1", "port": 0},
        "endpoints": [{"id": f"sim-{i}", "url": s.url, "models": [MODEL]} for i, s in enumerate(sims)],
        "telemetry": {"enabled": False}, "redis": {"url": None},
    })
    router = await start_router(build_context(settings, rng=random.Random(1)))
    try:
        for base in (sims[0].url, router.ingress_url):
            async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0) as client:
                stream = await client.chat.completions.create(
                    model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=6, stream=True,
                    stream_options={"include_usage": True})
                pieces, usage = [], None
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces.append(chunk.choices[0].delta.content)
                    if chunk.usage:
                        usage = chunk.usage
                assert len(pieces) == 6  # one SSE event per generated token
                assert usage is not None and usage.completion_tokens == 6 and usage.prompt_tokens > 0
                reply = await client.completions.create(model=MODEL, prompt="once upon a time", max_tokens=4)
                assert reply.usage.completion_tokens == 4 and reply.choices[0].finish_reason == "length"
    finally:
        await router.close()


async def test_metrics_use_vllm_names_and_the_router_reads_them(make_sim, http) -> None:
    sim = await make_sim()
    async with http.post(sim.url + "/v1/completions", json={"model": MODEL, "prompt": "a b c " * 50, "max_tokens": 3}):
        pass
    async with http.get(sim.url + "/metrics") as resp:
        text = await resp.text()
    for name in ("vllm:num_requests_running{", "vllm:num_requests_waiting{", "vllm:kv_cache_usage_perc{",
                 "vllm:prefix_cache_queries_total{", "vllm:prefix_cache_hits_total{", "vllm:num_preemptions_total{",
                 "vllm:time_to_first_token_seconds_bucket{", "vllm:inter_token_latency_seconds_bucket{",
                 "vllm:e2e_request_latency_seconds_bucket{", "vllm:cache_config_info{", 'model_name="sim-model"'):
        assert name in text, name
    engine = parse_vllm_metrics(text)
    assert (engine.num_waiting, engine.num_running, engine.kv_cache_usage) == (0.0, 0.0, 0.0)
    assert engine.prefix_cache_queries is not None and engine.preemptions_total == 0.0


async def test_gpu_telemetry_reflects_engine_activity(make_sim, http) -> None:
    sim = await make_sim()
    async with http.get(sim.url + "/sim/gpu") as resp:
        idle = await resp.json()
    async with http.post(sim.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 40}):
        pass
    async with http.get(sim.url + "/sim/gpu") as resp:
        busy = await resp.json()
    assert busy["busy_seconds_total"] > idle["busy_seconds_total"]
    assert busy["memory"]["used"] == pytest.approx(0.9 * busy["memory"]["total"], rel=0.01)  # vLLM pre-allocates
    assert busy["power"]["usage"] > idle["power"]["usage"]


async def test_client_disconnect_aborts_the_request_in_the_engine(make_sim, http) -> None:
    sim = await make_sim(time_scale=1.0)
    resp = await http.post(sim.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2000,
                                                             "stream": True})
    await resp.content.readuntil(b"\n\n")
    assert sim.server.engine.num_running == 1
    resp.close()
    async with asyncio.timeout(5):
        while sim.server.engine.num_running:  # the handler's cancellation aborts the request
            await asyncio.sleep(0)
    assert sim.server.engine.kv_usage == 0.0  # its KV blocks are free again


@pytest.mark.parametrize(
    "body, status, fragment",
    [
        ({"model": "other", "prompt": "x"}, 404, "does not exist"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 5000}, 400, "maximum context length is 2048"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens must be a positive integer"),
        ({"model": MODEL, "prompt": {"a": 1}}, 400, "prompt must be"),
        ({"model": MODEL, "prompt": ""}, 400, "the prompt is empty"),
        ({"model": MODEL, "prompt": "word " * 3000}, 400, "your prompt has"),
    ],
)
async def test_bad_requests_get_vllm_style_errors(make_sim, http, body, status, fragment) -> None:
    sim = await make_sim()
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        assert resp.status == status
        assert fragment in (await resp.json())["message"]


async def test_tokenize_gives_the_prompt_tokens_the_engine_processes(make_sim, http) -> None:
    # vllm-router's cache_aware builds its prefix tree from these ids (on a vLLM without render endpoints):
    # they must be the ones the completion endpoints feed the engine, chat template included.
    sim = await make_sim()
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]
    for tokenize_body, completion_path, completion_body in (
        ({"model": MODEL, "prompt": "once upon a time"}, "/v1/completions", {"prompt": "once upon a time"}),
        ({"model": MODEL, "messages": messages}, "/v1/chat/completions", {"messages": messages}),
    ):
        async with http.post(sim.url + "/tokenize", json={**tokenize_body, "return_token_strs": True}) as resp:
            assert resp.status == 200
            tok = await resp.json()
        async with http.post(sim.url + completion_path, json={"model": MODEL, "max_tokens": 1, **completion_body}) as resp:
            usage = (await resp.json())["usage"]
        assert tok["count"] == len(tok["tokens"]) == usage["prompt_tokens"]
        assert tok["max_model_len"] == 2048
        text = render_chat(messages) if "messages" in tokenize_body else "once upon a time"
        assert tok["tokens"] == tokenize(text) and "".join(tok["token_strs"]) == text


async def test_tokenize_takes_vllms_chat_options_and_rejects_what_vllm_rejects(make_sim, http) -> None:
    sim = await make_sim()
    messages = [{"role": "user", "content": "hi"}]

    async def tokens(**body: Any) -> list[int]:
        async with http.post(sim.url + "/tokenize", json=body) as resp:
            assert resp.status == 200
            return (await resp.json())["tokens"]

    with_prompt = await tokens(messages=messages)  # no model: vLLM allows it
    assert await tokens(messages=messages, add_generation_prompt=False) == tokenize(
        render_chat(messages, add_generation_prompt=False))
    assert len(await tokens(messages=messages, add_generation_prompt=False)) < len(with_prompt)
    for body, status, fragment in (
        ({"messages": messages, "add_generation_prompt": True, "continue_final_message": True}, 400, "Cannot set both"),
        ({"model": "other", "prompt": "x"}, 404, "does not exist"),
        ({"model": MODEL}, 400, "`prompt` (a string) or `messages`"),
        ({"model": MODEL, "messages": []}, 400, "non-empty list"),
    ):
        async with http.post(sim.url + "/tokenize", json=body) as resp:
            assert (resp.status, fragment in (await resp.json())["message"]) == (status, True), body


@pytest.mark.parametrize("path", ["/v1/completions/render", "/v1/chat/completions/render"])
async def test_render_endpoints_answer_like_vllm_without_scale_out(make_sim, http, path) -> None:
    sim = await make_sim()
    async with http.post(sim.url + path, json={"model": MODEL, "prompt": "x"}) as resp:
        assert resp.status == 403
        body = await resp.json()
    assert body["type"] == "PermissionDeniedError" and "--enable-scale-out" in body["message"]


async def test_fault_injection_errors_unhealthy_hang_and_reset(make_sim, http) -> None:
    sim = await make_sim()
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    async with http.post(sim.url + "/sim/faults", json={"error_rate": 1.0, "error_status": 503, "unhealthy": True}) as r:
        assert r.status == 200
    async with http.post(sim.url + "/v1/completions", json=body) as resp:
        assert resp.status == 503
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 503
    async with http.delete(sim.url + "/sim/faults") as resp:
        assert (await resp.json())["error_rate"] == 0.0
    async with http.get(sim.url + "/health") as resp:
        assert resp.status == 200
    # hang: no answer at all until the fault is lifted, then the request completes normally.
    async with http.post(sim.url + "/sim/faults", json={"hang": True}):
        pass
    pending = asyncio.create_task(http.post(sim.url + "/v1/completions", json=body))
    done, _ = await asyncio.wait({pending}, timeout=0.3)
    assert not done
    async with http.post(sim.url + "/sim/faults", json={"hang": False}):
        pass
    resp = await asyncio.wait_for(pending, 5)
    assert resp.status == 200
    resp.release()


async def test_stalled_stream_holds_after_n_tokens(make_sim, http) -> None:
    sim = await make_sim()
    async with http.post(sim.url + "/sim/faults", json={"stall_after_tokens": 2}):
        pass
    resp = await http.post(sim.url + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 5, "stream": True})
    events = [await resp.content.readuntil(b"\n\n") for _ in range(2)]
    assert all(e.startswith(b"data: {") for e in events)
    third = asyncio.create_task(resp.content.readuntil(b"\n\n"))
    done, _ = await asyncio.wait({third}, timeout=0.3)
    assert not done  # stalled, connection still open
    async with http.delete(sim.url + "/sim/faults"):
        pass
    assert (await asyncio.wait_for(third, 5)).startswith(b"data: {")
    rest = await resp.content.read()
    assert rest.endswith(b"data: [DONE]\n\n")
    resp.close()


async def test_a_chat_streams_first_byte_comes_with_its_first_token_not_at_arrival(make_sim, http) -> None:
    # vLLM writes the role-only opening event in the same output-loop iteration as the first token, so a
    # router timing the first body byte times the prefill (least-prefill's speed). Stalled before token 0,
    # the stream must have sent headers and nothing else, though the engine has computed the token.
    sim = await make_sim()
    async with http.post(sim.url + "/sim/faults", json={"stall_after_tokens": 0}):
        pass
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    resp = await http.post(sim.url + "/v1/chat/completions", json=body)
    assert resp.status == 200 and resp.content_type == "text/event-stream"  # headers at once, as Starlette's
    first = asyncio.create_task(resp.content.readuntil(b"\n\n"))
    done, _ = await asyncio.wait({first}, timeout=0.3)
    assert not done  # the engine has produced its tokens by now; the stall holds them back, role event too
    async with http.delete(sim.url + "/sim/faults"):
        pass
    assert b'"role":"assistant"' in await asyncio.wait_for(first, 5)
    assert b'"content":"' in await resp.content.readuntil(b"\n\n")  # then the first token
    resp.close()


@pytest.mark.parametrize("faults, fragment", [({"slowdown": 0}, "slowdown"), ({"nope": 1}, "unknown fault"),
                                              ({"error_rate": 2}, "error_rate")])
async def test_bad_faults_are_rejected(make_sim, http, faults, fragment) -> None:
    sim = await make_sim()
    async with http.post(sim.url + "/sim/faults", json=faults) as resp:
        assert resp.status == 400 and fragment in (await resp.json())["message"]


async def test_fault_endpoint_absent_without_the_flag(make_sim, http) -> None:
    sim = await make_sim(fault_injection=False)
    async with http.post(sim.url + "/sim/faults", json={"hang": True}) as resp:
        assert resp.status == 404
