"""Fault tolerance against failing engines on real sockets: retries before the first byte, passive ejection
with slow-start recovery, circuit breaking, the retry budget, panic mode, active health checks and GPU
health. Time-driven behaviour runs on a fake clock injected into the router (no sleeping)."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from router.model import Telemetry
from router.server.app import health_round
from tests.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy(strategy: str = "round-robin", **blocks) -> list[dict]:
    base = {"name": "p", "strategy": strategy, "health": {"enabled": False}}
    base.update(blocks)
    return [base]


async def send(http, router, n: int, **extra) -> Counter[tuple[int, str]]:
    seen: Counter[tuple[int, str]] = Counter()
    for _ in range(n):
        async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, **extra}) as resp:
            await resp.read()
            seen[(resp.status, resp.headers.get("x-fleetroute-endpoint", ""))] += 1
    return seen


async def metric(http, router, series: str) -> float:
    async with http.get(router.admin_url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_killed_backend_costs_no_client_errors_is_ejected_and_ramps_back(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    clock = Clock()
    router = await make_router(engines, clock=clock, policies=policy(
        outlierDetection={"consecutiveFailures": 3, "baseEjectionTime": "30s"},
        slowStart={"window": "60s", "minWeight": 0.1}))
    await engines[0].stop()  # killed: connections refused from now on
    seen = await send(http, router, 30)
    assert {status for status, _ in seen} == {200}  # every request retried before any byte was sent
    # Ejected after exactly 3 consecutive refusals; after that nothing is sent to it.
    assert await metric(http, router, 'fleetroute_outlier_ejections_total{endpoint="gpu-0",policy="p",reason="connect"}') == 1
    assert await metric(http, router, 'fleetroute_upstream_errors_total{endpoint="gpu-0",kind="connect"}') == 3
    assert await metric(http, router, 'fleetroute_endpoint_excluded{endpoint="gpu-0",policy="p",reason="ejected"}') == 1

    await engines[0].start()  # it comes back (same port) ...
    clock.now += 31  # ... and its ejection ends: it rejoins through slow start
    weights = []
    for _ in range(3):
        router.ctx.balancer.tick()
        weights.append(await metric(http, router, 'fleetroute_slow_start_weight{endpoint="gpu-0",policy="p"}'))
        clock.now += 30
    assert weights == [pytest.approx(0.1), pytest.approx(0.5), pytest.approx(1.0)]  # linear ramp over 60 s


async def test_slow_start_shares_traffic_in_proportion_to_the_ramp(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    clock = Clock()
    router = await make_router(engines, clock=clock, policies=policy(
        outlierDetection={"consecutiveFailures": 1, "baseEjectionTime": "10s"}, slowStart={"window": "100s"}))
    await engines[1].stop()
    await send(http, router, 4)  # gpu-1 refuses once and is ejected
    await engines[1].start()
    clock.now += 10  # the ejection is over: the ramp starts at the next tick
    router.ctx.balancer.tick()
    clock.now += 25  # a quarter into the ramp: weight 0.25
    router.ctx.balancer.tick()
    seen = await send(http, router, 400)
    share = seen[(200, "gpu-1")] / 400
    # Round-robin offers gpu-1 every other turn and takes it with probability 0.25: its share is
    # 0.25 / 1.25 = 0.2 of requests (the declined turn goes to gpu-0); +-0.07 is > 3 sigma at n = 400.
    assert share == pytest.approx(0.2, abs=0.07)


async def test_hung_backend_times_out_before_first_byte_and_the_request_is_retried(make_engine, make_router, http) -> None:
    hung = await make_engine("gpu-0", hang=asyncio.Event())
    ok = await make_engine("gpu-1")
    router = await make_router([hung, ok], policies=policy(timeouts={"firstByte": "300ms"}))
    seen = await send(http, router, 4)
    assert seen == {(200, "gpu-1"): 4}
    assert await metric(http, router, 'fleetroute_upstream_errors_total{endpoint="gpu-0",kind="timeout"}') >= 1
    hung.hang.set()


async def test_5xx_answers_are_retried_and_trip_the_breaker_which_probes_and_closes(make_engine, make_router, http) -> None:
    bad = await make_engine("gpu-0", fail_status=500)
    good = await make_engine("gpu-1")
    clock = Clock()
    router = await make_router([bad, good], clock=clock, policies=policy(
        outlierDetection={"enabled": False},
        circuitBreaker={"minRequests": 4, "failureRatio": 0.5, "openDuration": "20s", "halfOpenRequests": 2}))
    seen = await send(http, router, 12)
    assert seen == {(200, "gpu-1"): 12}  # the 500s never reached a client: retried on gpu-1
    assert await metric(http, router, 'fleetroute_breaker_state{endpoint="gpu-0",policy="p"}') == 2  # open
    tried_while_open = len(bad.requests)
    await send(http, router, 6)
    assert len(bad.requests) == tried_while_open  # an open breaker gets nothing

    bad.fail_status = None  # the engine recovers
    clock.now += 21  # open duration over: half-open
    router.ctx.balancer.tick()
    assert await metric(http, router, 'fleetroute_breaker_state{endpoint="gpu-0",policy="p"}') == 1
    await send(http, router, 8)  # two probes succeed: closed again
    assert await metric(http, router, 'fleetroute_breaker_state{endpoint="gpu-0",policy="p"}') == 0
    for state in ("open", "half_open", "closed"):
        assert await metric(http, router,
                            f'fleetroute_breaker_transitions_total{{endpoint="gpu-0",policy="p",state="{state}"}}') == 1


async def test_a_5xx_is_passed_through_when_no_other_endpoint_could_take_a_retry(make_engine, make_router, http) -> None:
    only = await make_engine("gpu-0", fail_status=503)
    router = await make_router([only], policies=policy())
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 503
        assert (await resp.json())["error"]["message"] == "gpu-0 failing"  # the engine's own answer


async def test_the_retry_budget_caps_retries_in_a_fleet_wide_outage(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}", fail_status=500) for i in range(3)]
    router = await make_router(engines, policies=policy(
        outlierDetection={"enabled": False}, circuitBreaker={"enabled": False},
        retries={"attempts": 3, "budgetPercent": 10, "minRetriesPerSecond": 0}))
    statuses = Counter(status for (status, _), n in (await send(http, router, 40)).items() for _ in range(n))
    assert set(statuses) <= {500, 502}  # the outage is visible, nothing hangs
    retries = await metric(http, router, 'fleetroute_retries_total{model="llama-3-8b"}')
    denied = await metric(http, router, 'fleetroute_retry_budget_exhausted_total{model="llama-3-8b"}')
    # Without a budget, 40 failing requests with 3 attempts would make 80 retries. With 10% of the requests
    # started in the window, the 10th, 20th, 30th and 40th request each get one retry (4 in all); every
    # other wanted retry is refused and the failure answered at once: 36 first retries + those 4 requests'
    # second retries = 40 refusals.
    assert retries == 4
    assert denied == 40


async def test_a_short_burst_of_failures_is_retried_in_full(make_engine, make_router, http) -> None:
    bad = await make_engine("gpu-0", fail_status=500)
    good = await make_engine("gpu-1")
    router = await make_router([bad, good], policies=policy(outlierDetection={"enabled": False},
                                                            circuitBreaker={"enabled": False}))
    seen = await send(http, router, 20)  # half of them meet gpu-0 first: the 10/s floor covers them all
    assert seen == {(200, "gpu-1"): 20}


async def test_panic_mode_routes_to_all_when_too_few_are_healthy(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    router = await make_router(engines, policies=policy(
        outlierDetection={"consecutiveFailures": 1, "maxEjectionPercent": 100}, panicThreshold=50))
    for e in engines[:2]:
        await e.stop()
    await send(http, router, 6)  # gpu-0 and gpu-1 refuse and are ejected: 1 of 3 healthy < 50%
    assert await metric(http, router, 'fleetroute_panic_mode{model="llama-3-8b",policy="p"}') == 1
    for e in engines[:2]:
        await e.start()
    seen = await send(http, router, 9)  # in panic, the ejected endpoints get traffic again
    assert {ep for _, ep in seen} == {"gpu-0", "gpu-1", "gpu-2"}


async def test_max_ejection_percent_keeps_most_of_the_pool(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(4)]
    router = await make_router(engines, policies=policy(
        outlierDetection={"consecutiveFailures": 1, "maxEjectionPercent": 25}))
    for e in engines[:2]:
        await e.stop()
    await send(http, router, 12)
    ejected = sum([await metric(http, router, f'fleetroute_outlier_ejections_total{{endpoint="gpu-{i}",policy="p",reason="connect"}}')
                   for i in range(2)])
    assert ejected == 1  # 25% of 4: only one of the two dead endpoints may be ejected


async def test_active_health_checks_isolate_and_restore_an_endpoint(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    router = await make_router(engines, policies=[{
        "name": "p", "strategy": "round-robin",
        "health": {"interval": "1h", "unhealthyThreshold": 2, "healthyThreshold": 2}}])  # rounds run by hand
    engines[0].unhealthy = True
    await health_round(router.ctx, "p")
    assert {ep for _, ep in await send(http, router, 4)} == {"gpu-0", "gpu-1"}  # one failed probe: not yet
    await health_round(router.ctx, "p")
    assert await send(http, router, 4) == {(200, "gpu-1"): 4}  # two in a row: isolated
    assert await metric(http, router, 'fleetroute_endpoint_excluded{endpoint="gpu-0",policy="p",reason="health_check"}') == 1
    engines[0].unhealthy = False
    await health_round(router.ctx, "p")
    await health_round(router.ctx, "p")
    assert "gpu-0" in {ep for _, ep in await send(http, router, 6)}  # back, through slow start


async def test_a_wedged_engine_is_caught_by_the_probe_request(make_engine, make_router, http) -> None:
    wedged = await make_engine("gpu-0", fail_status=500)  # /health says 200, but completions fail
    ok = await make_engine("gpu-1")
    router = await make_router([wedged, ok], policies=[{
        "name": "p", "strategy": "round-robin", "outlierDetection": {"enabled": False},
        "health": {"interval": "1h", "unhealthyThreshold": 1, "probeRequest": True}}])
    await health_round(router.ctx, "p")
    assert await metric(http, router, 'fleetroute_endpoint_excluded{endpoint="gpu-0",policy="p",reason="health_check"}') == 1


@pytest.mark.parametrize("telemetry, reason", [
    (Telemetry(reported_at=0.0, gpu_lost=True), "gpu_lost"),
    (Telemetry(reported_at=0.0, gpu_throttle_reasons=0x40), "thermal_throttling"),
])
async def test_a_gpu_reported_faulty_is_isolated_before_a_request_fails_on_it(make_engine, make_router, http,
                                                                             telemetry, reason) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    clock = Clock()
    router = await make_router(engines, clock=clock, policies=policy())
    balancer = router.ctx.balancer
    balancer.report_telemetry("gpu-0", _at(telemetry, clock.now))
    balancer.rebuild()
    assert await send(http, router, 4) == {(200, "gpu-1"): 4}
    assert engines[0].requests == []  # not a single request was risked on it
    assert await metric(http, router, f'fleetroute_endpoint_excluded{{endpoint="gpu-0",policy="p",reason="{reason}"}}') == 1


async def test_new_xid_errors_isolate_an_endpoint_for_a_while(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    clock = Clock()
    router = await make_router(engines, clock=clock, policies=policy())
    balancer = router.ctx.balancer
    balancer.report_telemetry("gpu-0", Telemetry(reported_at=clock.now, gpu_xid_errors=2))
    balancer.rebuild()
    assert "gpu-0" in {ep for _, ep in await send(http, router, 4)}  # old errors: no news
    balancer.report_telemetry("gpu-0", Telemetry(reported_at=clock.now, gpu_xid_errors=3))  # a new XID
    balancer.rebuild()
    assert await send(http, router, 4) == {(200, "gpu-1"): 4}
    clock.now += 61  # held out for a minute, then back
    balancer.report_telemetry("gpu-0", Telemetry(reported_at=clock.now, gpu_xid_errors=3))
    balancer.rebuild()
    assert "gpu-0" in {ep for _, ep in await send(http, router, 8)}


def _at(t: Telemetry, now: float) -> Telemetry:
    from dataclasses import replace

    return replace(t, reported_at=now)


@pytest.mark.parametrize(
    "block, message",
    [
        ({"outlierDetection": {"consecutiveFailures": 0}}, "outlierDetection.consecutiveFailures: must be between 1"),
        ({"outlierDetection": {"baseEjectionTime": "60s", "maxEjectionTime": "30s"}}, "maxEjectionTime: must be >= baseEjectionTime"),
        ({"circuitBreaker": {"failureRatio": 0}}, "circuitBreaker.failureRatio: must be > 0"),
        ({"slowStart": {"minWeight": 2}}, "slowStart.minWeight: must be > 0 and <= 1"),
        ({"health": {"path": "health"}}, "health.path: must start with '/'"),
        ({"panicThreshold": 101}, "panicThreshold: must be between 0 and 100"),
        ({"retries": {"budgetPercent": -1}}, "retries.budgetPercent: must be >= 0"),
        ({"retries": {"minRetriesPerSecond": "many"}}, "retries.minRetriesPerSecond: must be a number"),
        ({"timeouts": {"total": "soon"}}, "timeouts.total: must be a positive duration"),
    ],
)
def test_bad_resilience_config_is_named(block, message) -> None:
    from router.config.settings import ConfigError, parse_settings

    with pytest.raises(ConfigError) as info:
        parse_settings({"policies": [{"name": "p", "strategy": "round-robin", **block}]})
    assert message in str(info.value)
