"""Behaviour under the awkward cases: reserved names, probe slots of clients that leave, bounded memory,
client-controlled label values, malformed telemetry, deadlines that run out, and background loops that meet
an unexpected error."""

from __future__ import annotations

import asyncio

import pytest

from router.config.settings import ConfigError, parse_settings
from router.traffic.retry_budget import RetryBudget
from tests.conftest import MODEL
from worker.protocol import EngineSample, GpuSample, TelemetryRecord, decode, encode

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def metrics_text(http, router) -> str:
    async with http.get(router.admin_url + "/metrics") as resp:
        return await resp.text()


def test_the_builtin_fallback_name_is_reserved() -> None:
    with pytest.raises(ConfigError, match="reserved for the built-in policy"):
        parse_settings({"policies": [{"name": "builtin-fallback"}]})


async def test_a_policy_named_default_keeps_its_own_health_settings(make_engine, make_router) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], policies=[{"name": "default", "strategy": "round-robin",
                                                    "health": {"enabled": False}, "panicThreshold": 0}])
    pool = router.ctx.balancer.health["default"]
    assert pool.settings.active.enabled is False and pool.settings.panic_threshold == 0


async def test_a_half_open_probe_whose_client_leaves_frees_its_slot(make_engine, make_router, http) -> None:
    gate = asyncio.Event()
    engine = await make_engine("gpu-0", fail_status=500)
    clock = Clock()
    router = await make_router([engine], clock=clock, policies=[{
        "name": "p", "strategy": "round-robin", "health": {"enabled": False}, "outlierDetection": {"enabled": False},
        "circuitBreaker": {"minRequests": 2, "openDuration": "10s", "halfOpenRequests": 1}}])
    for _ in range(2):
        async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 500
    engine.fail_status = None
    engine.gate = gate
    clock.now += 11  # half-open: one probe slot
    router.ctx.balancer.tick()
    resp = await http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True})
    await resp.content.readuntil(b"\n\n")
    resp.close()  # the probe's client goes away: no verdict, but the slot must come back
    await asyncio.wait_for(engine.stream_aborted.wait(), 5)
    async with asyncio.timeout(5):
        while router.ctx.loads.in_flight("gpu-0"):
            await asyncio.sleep(0)
    gate.set()
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200  # a new probe could be made, and it closed the breaker
    assert router.ctx.balancer.health["p"].breaker("gpu-0").state.value == "closed"


def test_the_retry_budget_keeps_only_one_window_of_history() -> None:
    clock = Clock()
    budget = RetryBudget(clock, window=10.0)
    for _ in range(100_000):
        budget.request_started()
        clock.now += 0.001  # 1000 requests per second, never a retry
    assert len(budget._requests) <= 10_001


async def test_unknown_model_names_never_become_metric_labels(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    for i in range(20):
        async with http.post(router.ingress_url + "/v1/chat/completions", json={"model": f"junk-{i}"}) as resp:
            assert resp.status == 404
    text = await metrics_text(http, router)
    assert "junk-" not in text
    assert 'fleetroute_rejected_requests_total{reason="model_not_found"} 20.0' in text


@pytest.mark.parametrize("field", ["gpu_util", "kv_cache_usage", "reported_at", "interval"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf"])
def test_non_finite_telemetry_values_are_refused_and_never_written(field: str, value: str) -> None:
    # No agent writes them (below), so a record holding one is not trusted at all: the router counts it as
    # malformed (router.telemetry.feed.admit_record; tests/test_redis_hostile.py).
    raw = {"schema": "1", "endpoint_id": "e", "reported_at": "1", "num_waiting": "3", field: value}
    with pytest.raises(ValueError, match=f"{field} is not a finite number"):
        decode(raw)
    record = TelemetryRecord(endpoint_id="e", reported_at=1.0, seq=1, interval=1.0, gpu_source="none",
                             gpu=GpuSample(util=float(value)), engine=EngineSample(kv_cache_usage=float(value)))
    assert {"gpu_util", "kv_cache_usage"}.isdisjoint(encode(record))  # an unreadable gauge is left out


async def test_no_retry_starts_after_the_total_deadline_and_no_innocent_endpoint_is_blamed(make_engine, make_router,
                                                                                            http) -> None:
    hung = await make_engine("gpu-0", hang=asyncio.Event())
    other = await make_engine("gpu-1", hang=asyncio.Event())
    router = await make_router([hung, other], policies=[{
        "name": "p", "strategy": "round-robin", "health": {"enabled": False},
        "timeouts": {"firstByte": "10s", "total": "300ms"}, "retries": {"attempts": 3}}])
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 504
        assert "-" not in (await resp.json())["error"]["message"].split("within")[-1]  # no negative waits
    text = await metrics_text(http, router)
    blamed = [line for line in text.splitlines()
              if line.startswith("fleetroute_upstream_errors_total{") and 'kind="timeout"' in line]
    assert len(blamed) == 1  # only the endpoint that actually had the request
    hung.hang.set()
    other.hang.set()


async def test_a_background_step_that_fails_is_logged_counted_and_the_loop_goes_on(make_engine, make_router, http,
                                                                                   monkeypatch) -> None:
    from router.telemetry.feed import TelemetryFeed

    calls = {"n": 0}
    original = TelemetryFeed.refresh

    async def flaky(self) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        await original(self)

    monkeypatch.setattr(TelemetryFeed, "refresh", flaky)
    engine = await make_engine("gpu-0")
    router = await make_router([engine], telemetry={"enabled": True, "interval": "50ms"})
    await asyncio.wait_for(router.ctx.telemetry_round.wait(), 5)  # a later round completed
    assert calls["n"] >= 2
    assert 'fleetroute_background_errors_total{task="telemetry"} 1.0' in await metrics_text(http, router)
