"""The scale benchmark (loadtest/scale) at tiny sizes: every registered strategy is measured on the inputs it
claims (fresh telemetry, varied in-flight loads, a warm prefix index), picks stay in the pool, a burst of
reports collapses into one rebuild, the simulated agents write what the router reads, and the report
renders. No timing is asserted: the numbers belong to docs/benchmarks.md, not to a test."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from loadtest.scale.agents import drive
from loadtest.scale.inputs import MODEL, build_fleet, endpoint_ids
from loadtest.scale.micro import MicroSettings, run_micro, strategies
from loadtest.scale.report import render_markdown, render_micro, write_plots
from router.model import Endpoint, EndpointView, RequestInfo
from router.routing.policies.base import EventSink, LoadView
from router.routing.policies.registry import BUILTIN, PolicyRegistry
from router.runtime.redis_client import RedisSettings, connect
from router.telemetry.feed import RedisStore, TelemetryFeed
from tests.redis_server import own_redis  # noqa: F401 - fixture
from worker.protocol import UPDATES_CHANNEL, decode, telemetry_key

SIZES = (3, 8)
TINY = MicroSettings(sizes=SIZES, rounds=2, target_s=0.001, max_sessions=8)


class FirstServing:
    """A strategy registered by a test: the benchmark must measure it without being told about it."""

    name = "first-serving"
    config_key = "firstServing"

    def parse(self, params: Mapping[str, Any]) -> None:
        return None

    def new_state(self) -> None:
        return None

    def build(self, views: tuple[EndpointView, ...], config: None, state: None, rng: random.Random,
              events: EventSink) -> FirstServing:
        self._views = views
        return self

    def pick(self, req: RequestInfo, loads: LoadView, exclude: frozenset[str]) -> EndpointView | None:
        return next((v for v in self._views if v.id not in exclude), None)


@pytest.fixture(scope="module")
def micro() -> dict[str, Any]:
    registry = PolicyRegistry([*BUILTIN, FirstServing()])
    return run_micro(TINY, say=lambda _msg: None, registry=registry)


def test_every_registered_strategy_and_variant_is_measured_at_every_size(micro) -> None:
    expected = set(strategies(PolicyRegistry([*BUILTIN, FirstServing()])))
    assert {"round-robin", "least-connections", "consistent-hash", "adaptive", "prefix-aware",
            "first-serving", "consistent-hash (maxLoadFactor 1.25)"} <= expected
    assert set(micro["strategies"]) == expected
    for entry in micro["strategies"].values():
        assert set(entry["sizes"]) == {str(n) for n in SIZES}


def test_picks_return_endpoints_of_the_pool_and_every_cost_is_positive(micro) -> None:
    for label, entry in micro["strategies"].items():
        for n, r in entry["sizes"].items():
            checks = r["checks"]
            assert checks["picks"] > 0 and checks["none"] == 0 and checks["outside_pool"] == 0, (label, n, checks)
            for key in ("pick", "balancer_pick", "retry_pick", "rebuild", "refresh"):
                m = r[key]
                assert 0 < m["min_us"] <= m["median_us"] <= m["max_us"], (label, n, key, m)
                assert m["rounds"] == TINY.rounds and m["iterations"] >= 1
            assert r["refresh"]["unknown_after"] == 0  # every record the refresh read was applied, none stale


def test_the_prefix_aware_picks_are_measured_on_a_warm_index(micro) -> None:
    # The measured turns extend conversations whose earlier turns warmed the index: they must hit it.
    for n, r in micro["strategies"]["prefix-aware"]["sizes"].items():
        assert r["events"].get("prefix_hit", 0) > 0, (n, r["events"])
        assert r["prefix_hashing"]["median_us"] > 0
        assert r["prompt_bytes"]["median"] > 1024  # a system prompt of ~1.5 KiB and at least one turn


def test_a_burst_of_n_reports_collapses_into_one_rebuild(micro) -> None:
    assert set(micro["burst"]) == {str(n) for n in SIZES}
    for n, burst in micro["burst"].items():
        assert burst["reports"] == int(n)
        assert burst["rebuilds_per_burst"] == [1.0] * TINY.rounds


def test_the_fleet_has_fresh_telemetry_varied_loads_and_health_state() -> None:
    fleet = build_fleet(200, "adaptive", sessions=4)
    try:
        views = fleet.balancer.snapshot.views
        assert len(views) == 200 and all(v.telemetry is not None for v in views)
        loads = [fleet.loads.in_flight(i) for i in fleet.ids]
        assert min(loads) >= 1 and len(set(loads)) > 3
        candidates = {v.id: v for v in fleet.balancer.candidates(MODEL)}
        assert fleet.ejected and not set(fleet.ejected) & set(candidates)  # ejected: out of the pool
        assert fleet.ramping and all(candidates[i].weight_factor < 1.0 for i in fleet.ramping)  # slow start
    finally:
        fleet.close()
    assert fleet.loads.total() == 0  # closing the fleet ends the requests it held in flight


async def test_simulated_agents_write_records_the_router_reads_with_a_ttl_and_a_publish(own_redis) -> None:  # noqa: F811
    ids = endpoint_ids(5)
    client = aioredis.from_url(own_redis.url, decode_responses=True)
    pubsub = client.pubsub()
    await pubsub.subscribe(UPDATES_CHANNEL)
    await pubsub.get_message(timeout=1)  # the subscription's confirmation
    stop = asyncio.Event()
    ready = asyncio.Event()
    # One round: agent i publishes at i/5 of the first 0.5 s interval; records live 3 intervals (1.5 s).
    stats = await drive(own_redis.url, ids, interval=0.5, duration=0.5, seed=1, stop=stop, on_ready=ready.set,
                        concurrency=2)
    assert ready.is_set() and stats["errors"] == 0 and stats["published"] == len(ids)
    for endpoint_id in ids:
        assert 0 < await client.pttl(telemetry_key(endpoint_id)) <= 1500  # 3 intervals, as worker.agent sets it
        assert decode(await client.hgetall(telemetry_key(endpoint_id))).endpoint_id == endpoint_id
    # The router's own reader applies them: every endpoint gets fresh telemetry.
    fleet = build_fleet(5, "adaptive", sessions=2)
    fleet.balancer.set_endpoints([Endpoint(i, f"http://127.0.0.1:9/{i}", (MODEL,)) for i in ids])
    store = RedisStore(connect(RedisSettings(url=own_redis.url), timeout=2))
    try:
        feed = TelemetryFeed(store=store, balancer=fleet.balancer, metrics=fleet.metrics,
                             mono_clock=fleet.clock)
        await feed.refresh()
        assert all(v.telemetry is not None for v in fleet.balancer.snapshot.views)
        assert fleet.metrics.registry.get_sample_value("fleetroute_telemetry_unknown_endpoints") == 0
    finally:
        await store.close()
        fleet.close()
    announced = set()  # and each write was announced on the updates channel
    while len(announced) < len(ids) and (message := await pubsub.get_message(timeout=2)) is not None:
        announced.add(message["data"])
    assert announced == set(ids)
    await pubsub.aclose()
    await client.aclose()


def _fleet_result() -> dict[str, Any]:
    def case(n: int, telemetry: str, rates: list[float]) -> dict[str, Any]:
        runs = [{"rate": r, "achieved_rate": r, "router_cpu_util": r / 4000 + n / 2000, "router_cpu_ms_per_req": 0.3,
                 "net_cpu_ms_per_req": 0.25, "p50_ms": 0.8, "p99_ms": 2.0, "errors": 0, "foreign_cpu_util": 0.01}
                for r in rates]
        return {"endpoints": n, "strategy": "adaptive", "telemetry": telemetry, "idle_cpu_util": n / 2000,
                "runs": runs}

    return {
        "settings": {"rate_endpoints": 10, "seconds": 5, "size_rate": 400},
        "rate_sweep": [case(10, "embedded", [100, 400, 1600])],
        "size_sweep": [case(n, t, [400]) for t in ("off", "embedded") for n in (10, 100, 1000)],
        "scrape_cost": [{"endpoints": 1000, "off_idle_cpu_util": 0.01, "embedded_idle_cpu_util": 0.5,
                         "embedded_over_off": 0.49}],
    }


def test_the_report_renders_a_table_row_per_strategy_and_both_plots(micro, tmp_path: Path) -> None:
    result = {"command": "python -m loadtest.scale --quick", "started_utc": "2026-01-01T00:00:00Z",
              "elapsed_s": 1.0, "quick": True, "machine": {"nproc": 2, "cpu_model": "test"},
              "micro": micro, "fleet": _fleet_result()}
    text = render_markdown(result)
    assert "python -m loadtest.scale --quick" in text
    tables = "\n".join(render_micro(micro))
    for label in micro["strategies"]:
        assert tables.count(f"| {label} |") == 5  # pick, Balancer.pick, retry, rebuild, refresh tables
    assert "| embedded | 1,000 | adaptive |" in text and "Router CPU against request rate" in text
    written = write_plots(result, tmp_path)
    assert [p.name for p in written] == ["router-cpu-vs-rate.png", "router-cpu-vs-fleet-size.png"]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
