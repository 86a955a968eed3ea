"""Checking the prefix index against the engine's own prefix-cache hit rate and tuning its bound: the
controller step by step on hand-built telemetry, then a real router over a simulated vLLM whose small KV
cache evicts what the index still claims (estimated and engine hit rates exported, the bound shrinking, and
growing back once the traffic fits)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from router.config.settings import parse_settings
from router.model import Telemetry
from router.routing.prefix.index import MIN_BLOCKS, PrefixIndex
from router.routing.prefix.tuning import GROW, MIN_FACTOR, MIN_REQUESTS, SHRINK, TuningConfig, decide, tune
from router.server.app import RunningRouter, build_context, start_router
from tests.test_prefix_aware import text
from worker.sim.engine import EngineConfig, EngineCore
from worker.sim.profiles import profile
from worker.sim.server import SimServer, SimSettings

CONFIG = TuningConfig(window=10.0, tolerance=0.1)


@pytest.mark.parametrize(
    "factor, estimated, engine, expected, reason",
    [
        pytest.param(1.0, 0.9, 0.2, SHRINK, "shrink", id="the index claims far more than the engine delivers"),
        pytest.param(1.0, 0.31, 0.2, SHRINK, "shrink", id="just over the tolerance shrinks"),
        pytest.param(1.0, 0.29, 0.2, 1.0, None, id="inside the dead band (tolerance/2, tolerance] holds"),
        pytest.param(0.5, 0.25, 0.2, 0.5 * GROW, "grow", id="agreement within tolerance/2 grows back"),
        pytest.param(0.5, 0.1, 0.6, 0.5 * GROW, "grow", id="an index that claims less than the engine grows"),
        pytest.param(0.9, 0.5, 0.5, 1.0, "grow", id="growth stops at the base bound"),
        pytest.param(1.0, 0.5, 0.5, 1.0, None, id="at the base bound agreement changes nothing"),
        pytest.param(MIN_FACTOR, 1.0, 0.0, MIN_FACTOR, None, id="the floor holds however far off"),
    ],
)
def test_the_controller_step(factor: float, estimated: float, engine: float, expected: float,
                             reason: str | None) -> None:
    new, why = decide(factor, estimated, engine, 0.1)
    assert new == pytest.approx(expected) and why == reason


def telemetry(hits: float, queries: float) -> Telemetry:
    return Telemetry(reported_at=0.0, prefix_cache_hits=hits, prefix_cache_queries=queries)


def route(index: PrefixIndex, endpoint: str, requests: int, matched: float) -> None:
    for _ in range(requests):
        index.observe(endpoint, int(1000 * matched), 1000)


def test_an_index_that_overclaims_shrinks_each_window_down_to_the_floor() -> None:
    index = PrefixIndex()
    index.set_base("a", 10_000, "config")
    engine_hits, engine_queries = 0.0, 0.0
    assert tune(index, {"a": telemetry(0, 0)}, 0.0, CONFIG) == []  # the first call opens the window
    factors = []
    for window in range(1, 14):
        route(index, "a", 30, matched=0.9)  # the index said 90% of each prompt was cached...
        engine_hits += 3000 * 0.1  # ...the engine found 10%
        engine_queries += 3000
        (result,) = tune(index, {"a": telemetry(engine_hits, engine_queries)}, window * 10.0, CONFIG)
        assert result.estimated == pytest.approx(0.9) and result.engine == pytest.approx(0.1)
        assert result.requests == 30
        factors.append(result.factor)
    assert factors[:3] == pytest.approx([SHRINK, SHRINK ** 2, SHRINK ** 3])
    assert factors[-1] == MIN_FACTOR  # 0.7^12 < 1/64: clamped
    assert index.bound("a") == int(10_000 * MIN_FACTOR)  # 156 blocks, above the floor of MIN_BLOCKS
    assert [c.reason for c in index.changes][-3:] == ["shrink"] * 3


def test_agreement_grows_the_bound_back_to_its_base() -> None:
    index = PrefixIndex()
    index.set_base("a", 1000, "config")
    index.set_factor("a", 0.25, "shrink")
    assert index.bound("a") == 250
    tune(index, {"a": telemetry(0, 0)}, 0.0, CONFIG)
    hits = queries = 0.0
    bounds = []
    for window in range(1, 9):
        route(index, "a", 25, matched=0.5)
        hits, queries = hits + 1300, queries + 2500  # engine 52%, index 50%: they agree
        tune(index, {"a": telemetry(hits, queries)}, window * 10.0, CONFIG)
        bounds.append(index.bound("a"))
    # x1.25 per window: 312, 390, 488, 610, 762, 953, then capped at the base of 1000.
    assert bounds == [312, 390, 488, 610, 762, 953, 1000, 1000]


def test_a_window_closes_only_with_enough_requests_and_skips_a_counter_reset() -> None:
    index = PrefixIndex()
    index.set_base("a", 1000, "config")
    tune(index, {"a": telemetry(500, 1000)}, 0.0, CONFIG)
    route(index, "a", MIN_REQUESTS - 1, matched=1.0)
    assert tune(index, {"a": telemetry(500, 2000)}, 60.0, CONFIG) == []  # 19 requests: the window stays open
    route(index, "a", 1, matched=1.0)
    (result,) = tune(index, {"a": telemetry(500, 3000)}, 61.0, CONFIG)
    assert (result.requests, result.estimated, result.engine) == (MIN_REQUESTS, 1.0, 0.0)  # the whole window
    route(index, "a", 30, matched=1.0)
    (result,) = tune(index, {"a": telemetry(10, 20)}, 80.0, CONFIG)  # the engine restarted: counters went down
    assert result.engine is None and result.reason is None and result.factor == SHRINK  # judged on nothing
    route(index, "a", 5, matched=1.0)
    assert tune(index, {"a": telemetry(10, 30)}, 80.0 + 10 * CONFIG.window, CONFIG) == []  # 5 requests in 10 windows
    route(index, "a", MIN_REQUESTS, matched=0.5)
    (result,) = tune(index, {"a": telemetry(20, 50)}, 80.0 + 11 * CONFIG.window, CONFIG)
    assert (result.requests, result.estimated, result.engine) == (MIN_REQUESTS, 0.5, 0.5)  # the stale 5 dropped


def test_with_tuning_disabled_both_rates_are_reported_and_the_bound_never_moves() -> None:
    index = PrefixIndex()
    index.set_base("a", 1000, "config")
    off = dataclasses.replace(CONFIG, enabled=False)
    tune(index, {"a": telemetry(0, 0)}, 0.0, off)
    route(index, "a", 40, matched=1.0)
    (result,) = tune(index, {"a": telemetry(0, 4000)}, 20.0, off)
    assert (result.estimated, result.engine, result.reason) == (1.0, 0.0, None)
    assert index.bound("a") == 1000


def test_an_endpoint_without_engine_counters_is_reported_estimated_only() -> None:
    index = PrefixIndex()
    tune(index, {"a": None}, 0.0, CONFIG)
    route(index, "a", 30, matched=0.4)
    (result,) = tune(index, {"a": None}, 15.0, CONFIG)
    assert (result.estimated, result.engine, result.factor) == (pytest.approx(0.4), None, 1.0)


# ---- end to end: a real router over a simulated vLLM with a small KV cache -------------------------------

MODEL = "sim-model"
KV_TOKENS = 2048  # 128 blocks of 16 tokens: room for ~7 of the 280-token prompts below


@pytest.fixture
async def make_sim() -> AsyncIterator[Callable[[int], Awaitable[str]]]:
    runners: list[web.AppRunner] = []

    async def make(kv_tokens: int) -> str:
        gpu = dataclasses.replace(profile("h100"), kv_pool_tokens=kv_tokens)
        config = EngineConfig()
        server = SimServer(SimSettings(model=MODEL, profile=gpu, engine=config, time_scale=0.02,
                                       max_model_len=min(kv_tokens, 8192)),
                           EngineCore(gpu, config, random.Random(0)))
        runner = web.AppRunner(server.build_app(), handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]

    yield make
    for runner in runners:
        await runner.cleanup()


async def start(sim_url: str, params: dict[str, Any]) -> RunningRouter:
    settings = parse_settings({
        "listen": {"host": "127.0.0.1", "port": 0}, "admin": {"host": "127.0.0.1", "port": 0},
        "endpoints": [{"id": "sim-0", "url": sim_url, "models": [MODEL]}],
        "policies": [{"name": "cache", "models": ["*"], "strategy": "prefix-aware", "prefixAware": params}],
        "telemetry": {"interval": "100ms"}, "redis": {"url": None},  # embedded: the router scrapes the sim
    })
    return await start_router(build_context(settings, rng=random.Random(1)))


async def test_auto_sizes_the_index_from_the_capacity_the_engine_reports(make_sim, caplog) -> None:
    caplog.set_level(logging.INFO, logger="fleetroute.prefix")
    router = await start(await make_sim(436_000), {})  # the h100 profile: 27250 blocks x 16 tokens
    try:
        upkeep = router.ctx.prefix_upkeep
        assert upkeep is not None
        async with asyncio.timeout(10):
            await router.ctx.telemetry_round.wait()  # the sim's /metrics has been scraped and applied
            await upkeep.round()
        labels = {"policy": "cache", "model": MODEL, "endpoint": "sim-0"}
        # 436000 tokens / (256 chars / 4 chars per token) = 6812 blocks.
        assert router.ctx.metrics.registry.get_sample_value("fleetroute_prefix_index_bound_blocks", labels) == 6812
    finally:
        await router.close()
    sized = [r for r in caplog.records if r.getMessage() == "prefix index bound changed"]
    assert [(r.reason, r.old_bound, r.new_bound) for r in sized] == [("kv_capacity", 32768, 6812)]  # type: ignore[attr-defined]


async def test_the_router_reports_both_hit_rates_and_tunes_the_bound_against_a_real_engine(
        make_sim, caplog: pytest.LogCaptureFixture) -> None:
    # An explicit bound far above what the engine holds: the index will overclaim.
    router = await start(await make_sim(KV_TOKENS), {"maxBlocksPerEndpoint": 100_000,
                                                     "tuning": {"window": "100ms", "tolerance": 0.2}})
    ctx = router.ctx
    upkeep = ctx.prefix_upkeep
    assert upkeep is not None
    metrics = ctx.metrics.registry

    def gauge(name: str, **labels: str) -> float | None:
        return metrics.get_sample_value(name, {"policy": "cache", "model": MODEL, "endpoint": "sim-0", **labels})

    async def batch(documents: list[str], session: aiohttp.ClientSession) -> None:
        for i, document in enumerate(documents):
            body = {"model": MODEL, "messages": [{"role": "user", "content": document + f" question {i}?"}],
                    "max_tokens": 1}
            async with session.post(router.ingress_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
        await ctx.telemetry_round.wait()  # a scrape after the batch: the engine's counters include it
        await ctx.telemetry_round.wait()
        await upkeep.round()

    caplog.set_level(logging.INFO, logger="fleetroute.prefix")
    many = [text(40_000 + d, 1100) for d in range(24)]  # ~280 tokens each: 24 need ~3x the engine's cache
    few = many[:2]
    try:
        async with aiohttp.ClientSession() as session:
            async with asyncio.timeout(50):
                # Cycling through 24 documents on an engine that holds ~7: the engine has evicted each one
                # before it comes round again (LRU), while the index (bound 100000) still lists them all.
                for _ in range(20):
                    await batch(many, session)
                    if (gauge("fleetroute_prefix_index_bound_blocks") or 100_000) < 100_000:
                        break
                estimated = gauge("fleetroute_prefix_cache_hit_rate", source="estimated")
                engine = gauge("fleetroute_prefix_cache_hit_rate", source="engine")
                assert estimated is not None and engine is not None
                assert estimated > 0.7 and engine < 0.3, (estimated, engine)
                shrunk = gauge("fleetroute_prefix_index_bound_blocks")
                assert shrunk is not None and shrunk < 100_000
                assert metrics.get_sample_value("fleetroute_prefix_index_bound_changes_total",
                                                {"policy": "cache", "reason": "shrink"}) >= 1
                # Two documents fit in the engine's cache: it hits as often as the index claims, and the
                # bound grows back.
                for _ in range(30):
                    await batch(few * 12, session)
                    bound = gauge("fleetroute_prefix_index_bound_blocks")
                    if bound is not None and bound > shrunk:
                        break
                assert gauge("fleetroute_prefix_index_bound_blocks") > shrunk
                assert gauge("fleetroute_prefix_cache_hit_rate", source="engine") > 0.7
    finally:
        await router.close()
    changes = [r for r in caplog.records if r.getMessage() == "prefix index bound changed"]
    assert {"shrink", "grow"} <= {r.reason for r in changes}  # type: ignore[attr-defined]
    shrink = next(r for r in changes if r.reason == "shrink")  # type: ignore[attr-defined]
    assert shrink.old_bound > shrink.new_bound and shrink.estimated_hit_rate > shrink.engine_hit_rate  # type: ignore[attr-defined]
    assert MIN_BLOCKS <= shrink.new_bound  # type: ignore[attr-defined]
