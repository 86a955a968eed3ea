"""Session stickiness within a time window, shared through Redis, and in-flight counts shared between
router replicas (the load bounds of bounded-load hashing and of stickiness hold fleet-wide)."""

from __future__ import annotations

import asyncio

import pytest

from tests.conftest import MODEL
from tests.redis_server import own_redis, redis_url  # noqa: F401 - fixtures

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
STICKY_RR = [{"name": "chat", "strategy": "round-robin", "stickiness": {"ttl": "60s"}}]


async def endpoint_for(http, router, session: str | None = None, **extra) -> str:
    headers = {"x-session-id": session} if session else {}
    async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, **extra}, headers=headers) as r:
        assert r.status == 200
        await r.read()
        return r.headers["x-fleetroute-endpoint"]


def sample(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def metrics(http, router) -> str:
    async with http.get(router.admin_url + "/metrics") as resp:
        return await resp.text()


async def test_a_session_keeps_its_endpoint_within_the_ttl_and_is_released_after(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    now = [0.0]
    router = await make_router(engines, policies=STICKY_RR, clock=lambda: now[0])
    first = await endpoint_for(http, router, "alice")
    for _ in range(5):  # round-robin would rotate; the pin holds
        now[0] += 50  # each use renews the window: 50 s apart stays within a 60 s TTL
        assert await endpoint_for(http, router, "alice") == first
    now[0] += 61  # silence longer than the TTL: the pin is gone, the policy chooses again
    await endpoint_for(http, router, "alice")
    text = await metrics(http, router)
    assert sample(text, 'fleetroute_sticky_decisions_total{outcome="hit",policy="chat"}') == 5
    assert sample(text, 'fleetroute_sticky_decisions_total{outcome="new",policy="chat"}') == 2
    # Requests without a session key are not pinned and keep rotating.
    assert len({await endpoint_for(http, router) for _ in range(3)}) == 3


async def test_body_user_is_the_fallback_session_key(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    router = await make_router(engines, policies=STICKY_RR)
    assert len({await endpoint_for(http, router, user="bob") for _ in range(4)}) == 1


async def test_a_session_moves_off_a_draining_endpoint(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    router = await make_router(engines, policies=STICKY_RR)
    first = await endpoint_for(http, router, "carol")
    async with http.post(f"{router.admin_url}/admin/endpoints/{first}/drain"):
        pass
    moved = await endpoint_for(http, router, "carol")
    assert moved != first
    assert await endpoint_for(http, router, "carol") == moved  # re-pinned to its new endpoint
    assert sample(await metrics(http, router), 'fleetroute_sticky_decisions_total{outcome="gone",policy="chat"}') == 1


async def test_a_session_moves_off_an_overloaded_endpoint(make_engine, make_router, http) -> None:
    gate = asyncio.Event()
    engines = [await make_engine(f"gpu-{i}", gate=gate) for i in range(2)]
    router = await make_router(engines, policies=[
        {"name": "chat", "strategy": "round-robin", "stickiness": {"ttl": "60s", "maxLoadFactor": 1.5}}])
    pinned = await endpoint_for(http, router, "dave")
    # Hold 3 streams of this session on its endpoint: 3 of 3 in flight is over ceil(1.5 * 4 / 2) = 3.
    held = []
    for _ in range(3):
        resp = await http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                               headers={"x-session-id": "dave"})
        assert resp.headers["x-fleetroute-endpoint"] == pinned
        await resp.content.readuntil(b"\n\n")
        held.append(resp)
    moved = await endpoint_for(http, router, "dave")
    assert moved != pinned
    gate.set()
    for resp in held:
        await resp.read()
        resp.close()
    assert sample(await metrics(http, router),
                  'fleetroute_sticky_decisions_total{outcome="overloaded",policy="chat"}') == 1


async def test_replicas_agree_and_a_restarted_router_keeps_sessions_through_redis(make_engine, make_router, http,
                                                                                  redis_url) -> None:  # noqa: F811
    import uuid

    engines = [await make_engine(f"gpu-{i}") for i in range(4)]
    session = f"erin-{uuid.uuid4().hex[:6]}"
    common = {"policies": STICKY_RR, "redis": {"url": redis_url}, "telemetry": {"enabled": False}}
    a = await make_router(engines, seed=1, **common)
    b = await make_router(engines, seed=2, **common)
    pinned = await endpoint_for(http, a, session)
    await asyncio.gather(*a.ctx.sticky["chat"]._tasks)  # the background write has landed
    assert await endpoint_for(http, b, session) == pinned  # the other replica agrees
    await a.close()
    restarted = await make_router(engines, seed=3, **common)  # a fresh table: only Redis remembers
    assert await endpoint_for(http, restarted, session) == pinned
    assert sample(await metrics(http, restarted), 'fleetroute_sticky_decisions_total{outcome="hit",policy="chat"}') == 1


async def test_stickiness_keeps_working_when_redis_is_down(make_engine, make_router, http, own_redis) -> None:  # noqa: F811
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    router = await make_router(engines, policies=STICKY_RR, redis={"url": own_redis.url}, telemetry={"enabled": False})
    own_redis.kill()
    first = await endpoint_for(http, router, "frank")  # no request fails because Redis is down
    assert all([await endpoint_for(http, router, "frank") == first for _ in range(3)])  # local pins hold
    assert sample(await metrics(http, router), "fleetroute_sticky_store_errors_total") >= 1


async def test_replicas_share_in_flight_counts_through_redis(make_engine, make_router, http, redis_url) -> None:  # noqa: F811
    gate = asyncio.Event()
    engine = await make_engine("gpu-0", gate=gate)
    common = {"redis": {"url": redis_url}, "telemetry": {"enabled": False}}
    a = await make_router([engine], seed=1, **common)
    b = await make_router([engine], seed=2, **common)
    held = []
    for _ in range(3):
        resp = await http.post(a.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True})
        await resp.content.readuntil(b"\n\n")
        held.append(resp)
    await a.ctx.shared_loads.exchange()
    await b.ctx.shared_loads.exchange()
    assert b.ctx.loads.in_flight("gpu-0") == 0
    assert b.ctx.loads.cluster_in_flight("gpu-0") >= 3  # a's three streams (plus any other live replica's)
    gate.set()
    for resp in held:
        await resp.read()
        resp.close()
    await a.ctx.shared_loads.exchange()
    await b.ctx.shared_loads.exchange()
    assert b.ctx.loads.cluster_in_flight("gpu-0") == 0


@pytest.mark.parametrize(
    "block, message",
    [
        ({"ttl": "forever"}, "policies[0].stickiness.ttl: must be a positive duration"),
        ({"key": "cookie:sid"}, "policies[0].stickiness.key: must look like 'header:<name>'"),
        ({"maxLoadFactor": 1}, "policies[0].stickiness.maxLoadFactor: must be a number > 1"),
        ({"sticky": True}, "policies[0].stickiness.sticky: unknown field"),
    ],
)
def test_bad_stickiness_config_is_named(block, message) -> None:
    from router.config.settings import ConfigError, parse_settings

    with pytest.raises(ConfigError) as info:
        parse_settings({"policies": [{"name": "p", "strategy": "round-robin", "stickiness": block}]})
    assert message in str(info.value)
