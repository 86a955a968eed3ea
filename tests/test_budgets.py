"""Tenant budgets (router/traffic/budgets.py) on a real Redis: the sliding window exact at its edge, tokens charged at
admission and from the answer, refunds, two router replicas sharing one budget, Redis Cluster hash tags, and
what happens while Redis is down (fail-open, fail-closed).

Time: the budgets take a wall clock (`budget_clock`) that these tests move by hand, shared by both replicas,
so window edges are tested to the millisecond without sleeping. (In production the Redis server's TIME is
the one clock.) Each test uses a tenant name of its own: the shared Redis may hold other tests' keys.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis.asyncio as aioredis

from router.config.settings import parse_settings
from router.runtime.metrics import RouterMetrics
from router.runtime.redis_client import RedisSettings, connect
from router.runtime.redis_input import Rejected
from router.server.app import RunningRouter, build_context, start_router
from router.traffic.budgets import Budgets, budget_keys, check_reply, openai_duration
from router.traffic.tenants import TenancySettings, Tenant
from tests.conftest import MODEL, router_config
from tests.redis_server import PASSWORD, own_redis, redis_cluster, redis_url  # noqa: F401 - fixtures

KEY = "sk-budgeted-0123456789abcdef"
# A prompt of 160 characters: 40 tokens at 4 characters per token, plus 4 for the chat message: 44 tokens.
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 160}]}
PROMPT_TOKENS = 44
T0 = 1_700_000_000.0


class WallClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def unique_tenant() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


# ---- pure parts ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("seconds", "text"), [(0, "0ms"), (0.0201, "21ms"), (1, "1s"), (1.5, "1.5s"),
                                               (59.9986, "59.999s"), (59.9994, "1m0s"), (60, "1m0s"), (90.25, "1m30.25s")])
def test_reset_times_are_written_as_openai_writes_them(seconds: float, text: str) -> None:
    assert openai_duration(seconds) == text


@pytest.mark.parametrize("raw", [None, [1, 2, 3], [1, 0, 0, 0, 0, 0, 1], [0, 5, 0, 1000, 0, 0, 0],
                                 [1, -1, 0, 0, 0, 0, 0], [0, 1, 0, 61_000, 0, 0, 1], [True, 0, 0, 0, 0, 0, 0],
                                 [0, 0, 0, 0, 0, 0, 9]])
def test_a_reply_that_is_no_verdict_is_rejected(raw: Any) -> None:
    with pytest.raises(Rejected):
        check_reply(raw, 60.0)


def test_budget_keys_share_one_cluster_slot() -> None:
    from redis.crc import key_slot

    keys = budget_keys("acme")
    assert keys == ("fleetroute:v1:budget:{acme}:requests", "fleetroute:v1:budget:{acme}:tokens",
                    "fleetroute:v1:budget:{acme}:tokens-sum")
    assert len({key_slot(k.encode()) for k in keys}) == 1


# ---- the script, on a real Redis ---------------------------------------------------------------------------


@pytest.fixture
async def make_budgets(redis_url: str) -> AsyncIterator[Callable[..., Awaitable[tuple[Budgets, WallClock]]]]:  # noqa: F811
    clients: list[Any] = []

    async def make(*tenants: Tenant, url: str = redis_url, cluster: bool = False, password: str | None = None,
                   clock: WallClock | None = None, fail_mode: str = "open") -> tuple[Budgets, WallClock]:
        client = connect(RedisSettings(url=url, cluster=cluster, password=password), timeout=2.0)
        clients.append(client)
        clock = clock or WallClock()
        tenancy = TenancySettings(tenants=(Tenant("default"), *tenants), budget_fail_mode=fail_mode,
                                  budget_timeout=2.0)
        return Budgets(redis=client, tenancy=tenancy, metrics=RouterMetrics(), clock=clock), clock

    yield make
    for client in clients:
        await client.aclose()


async def test_the_request_window_is_exact_at_its_edge(make_budgets) -> None:
    tenant = Tenant(unique_tenant(), requests_per_minute=3)
    budgets, clock = await make_budgets(tenant)
    verdicts = []
    for _ in range(3):
        verdicts.append(await budgets.check(tenant, 10, MODEL))
        clock.now += 1.0  # at T0, T0 + 1, T0 + 2
    assert [v.response for v in verdicts] == [None] * 3
    assert [v.headers["x-ratelimit-remaining-requests"] for v in verdicts] == ["2", "1", "0"]
    assert verdicts[0].headers == {"x-ratelimit-limit-requests": "3", "x-ratelimit-remaining-requests": "2",
                                   "x-ratelimit-reset-requests": "1m0s"}
    clock.now = T0 + 59.999  # one millisecond before the first request leaves the window
    refused = await budgets.check(tenant, 10, MODEL)
    assert refused.response is not None and refused.response.status == 429 and refused.reason == "requests"
    assert refused.response.headers["Retry-After"] == "1"  # 1 ms, rounded up to whole seconds
    assert refused.headers["x-ratelimit-reset-requests"] == "2.001s"  # until the newest (T0 + 2) has left
    error = orjson.loads(refused.response.body)["error"]
    assert error == {"message": f"Rate limit reached for tenant `{tenant.name}` on requests per minute (RPM): "
                                "limit 3, used 3. Please try again in 1ms.",
                     "type": "requests", "param": None, "code": "rate_limit_exceeded"}
    clock.now = T0 + 60.0  # the first request has left: exactly one more fits
    assert (await budgets.check(tenant, 10, MODEL)).response is None
    assert (await budgets.check(tenant, 10, MODEL)).response is not None  # the second leaves at T0 + 61
    clock.now = T0 + 61.0
    assert (await budgets.check(tenant, 10, MODEL)).response is None


async def test_tokens_count_prompts_at_admission_and_completions_afterwards(make_budgets) -> None:
    tenant = Tenant(unique_tenant(), tokens_per_minute=100)
    budgets, clock = await make_budgets(tenant)
    first = await budgets.check(tenant, 40, MODEL)
    assert first.response is None and first.headers["x-ratelimit-remaining-tokens"] == "60"
    budgets.charge(tenant, 30)  # the first answer's completion tokens
    await budgets.flush()
    clock.now += 10
    second = await budgets.check(tenant, 30, MODEL)  # 70 used + 30 = 100: fits exactly
    assert second.response is None and second.headers["x-ratelimit-remaining-tokens"] == "0"
    clock.now += 10
    third = await budgets.check(tenant, 1, MODEL)
    assert third.reason == "tokens" and third.response.status == 429
    # Enough leaves the window when the first prompt (40 tokens, charged at T0) does: 60 s after it.
    assert third.response.headers["Retry-After"] == "40"
    assert orjson.loads(third.response.body)["error"]["type"] == "tokens"
    too_large = await budgets.check(tenant, 101, MODEL)
    assert too_large.reason == "too_large" and "Retry-After" not in too_large.response.headers
    assert "Request too large" in orjson.loads(too_large.response.body)["error"]["message"]
    clock.now = T0 + 60.0
    fourth = await budgets.check(tenant, 40, MODEL)  # the first prompt left; its completion (charged at T0) too
    assert fourth.response is None and fourth.headers["x-ratelimit-remaining-tokens"] == "30"


async def test_a_refund_gives_back_what_the_check_charged(make_budgets) -> None:
    tenant = Tenant(unique_tenant(), requests_per_minute=1, tokens_per_minute=100)
    budgets, _ = await make_budgets(tenant)
    verdict = await budgets.check(tenant, 60, MODEL)
    assert verdict.response is None
    assert (await budgets.check(tenant, 1, MODEL)).reason == "requests"
    budgets.refund(tenant, verdict)  # e.g. the admission queue shed it
    await budgets.flush()
    again = await budgets.check(tenant, 100, MODEL)
    assert again.response is None and again.headers["x-ratelimit-remaining-tokens"] == "0"


async def test_hostile_values_under_the_keys_cost_a_budget_at_most_a_window(make_budgets, redis_url) -> None:  # noqa: F811
    tenant = Tenant(unique_tenant(), tokens_per_minute=100)
    budgets, clock = await make_budgets(tenant)
    _, tokens, total = budget_keys(tenant.name)
    async with aioredis.Redis.from_url(redis_url) as raw:
        await raw.set(total, "not a number")
        await raw.zadd(tokens, {"garbage": clock.now * 1000 - 61_000, "x:abc": clock.now * 1000 - 1})
    verdict = await budgets.check(tenant, 50, MODEL)  # the sum is rebuilt; members that are not ours count 0
    assert verdict.response is None and verdict.headers["x-ratelimit-remaining-tokens"] == "50"
    async with aioredis.Redis.from_url(redis_url) as raw:
        await raw.delete(total)
        await raw.lpush(total, "a list where a number belongs")
    broken = await budgets.check(tenant, 1, MODEL)  # the script fails: Redis "unavailable", fail-open
    assert broken.response is None and broken.headers == {}
    assert budgets._metrics.registry.get_sample_value("fleetroute_tenant_budget_errors_total",
                                                      {"outcome": "allowed"}) == 1


async def test_the_script_runs_on_a_redis_cluster(make_budgets, redis_cluster) -> None:  # noqa: F811
    tenants = [Tenant(unique_tenant(), requests_per_minute=2, tokens_per_minute=1000) for _ in range(4)]
    budgets, clock = await make_budgets(*tenants, url=redis_cluster.url, cluster=True, password=PASSWORD)
    for tenant in tenants:  # spread over the masters' slots
        first = await budgets.check(tenant, 10, MODEL)
        assert first.response is None
        assert (await budgets.check(tenant, 10, MODEL)).response is None
        assert (await budgets.check(tenant, 10, MODEL)).reason == "requests"
        budgets.charge(tenant, 5)
        budgets.refund(tenant, first)
    await budgets.flush()
    assert budgets._metrics.registry.get_sample_value("fleetroute_tenant_budget_errors_total",
                                                      {"outcome": "charge_lost"}) is None
    for tenant in tenants:
        again = await budgets.check(tenant, 10, MODEL)
        assert again.response is None and again.headers["x-ratelimit-remaining-tokens"] == str(1000 - 10 - 5 - 10)


# ---- through routers ---------------------------------------------------------------------------------------


@pytest.fixture
async def replicas(make_engine, tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[list[RunningRouter]]]]:
    started: list[RunningRouter] = []

    async def make(n: int, url: str, tenant: Tenant, clock: WallClock, *, engine: Any = None,
                   policies: list[dict[str, Any]] | None = None, **tenancy: Any) -> list[RunningRouter]:
        engine = engine or await make_engine(f"gpu-{len(started)}")
        (tmp_path / "keys").write_text(f"{KEY} tenant={tenant.name}\n")
        config = router_config([engine], redis={"url": url}, auth={"apiKeysFile": str(tmp_path / "keys")},
                               tenancy={"tenants": [{"name": tenant.name, "requestsPerMinute": tenant.requests_per_minute,
                                                     "tokensPerMinute": tenant.tokens_per_minute}], **tenancy})
        if policies is not None:
            config["policies"] = policies
        for _ in range(n):
            ctx = build_context(parse_settings(config), rng=random.Random(1), budget_clock=clock)
            started.append(await start_router(ctx))
        return started[-n:]

    yield make
    for running in started:
        await running.close()


def _chat(router: RunningRouter, http: Any, body: dict[str, Any] = CHAT) -> Any:
    return http.post(router.ingress_url + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {KEY}"})


async def test_two_replicas_share_one_budget_exactly(replicas, http, redis_url) -> None:  # noqa: F811
    clock = WallClock()
    tenant = Tenant(unique_tenant(), requests_per_minute=4)
    a, b = await replicas(2, redis_url, tenant, clock)
    remaining = []
    for i in range(4):  # alternating replicas, 100 ms apart
        async with _chat((a, b)[i % 2], http) as resp:
            assert resp.status == 200
            remaining.append(resp.headers["x-ratelimit-remaining-requests"])
            assert resp.headers["x-ratelimit-limit-requests"] == "4"
        clock.now += 0.1
    assert remaining == ["3", "2", "1", "0"]
    clock.now = T0 + 59.999
    for router in (a, b):  # the fifth is refused by either replica, until the first request's minute is over
        async with _chat(router, http) as resp:
            assert resp.status == 429 and resp.headers["Retry-After"] == "1"
            assert resp.headers["x-ratelimit-remaining-requests"] == "0"
            assert (await resp.json())["error"]["code"] == "rate_limit_exceeded"
    clock.now = T0 + 60.0
    async with _chat(b, http) as resp:
        assert resp.status == 200 and resp.headers["x-ratelimit-remaining-requests"] == "0"
    async with _chat(a, http) as resp:
        assert resp.status == 429  # the second request (T0 + 0.1) is still in the window
    for router, shed in ((a, 2.0), (b, 1.0)):
        async with http.get(router.admin_url + "/metrics") as resp:
            text = await resp.text()
        assert f'fleetroute_tenant_shed_total{{model="{MODEL}",reason="requests",tenant="{tenant.name}"}} {shed}' in text
        assert f'fleetroute_tenant_budget_limit{{kind="requests",tenant="{tenant.name}"}} 4.0' in text
        assert f'fleetroute_tenant_budget_remaining{{kind="requests",tenant="{tenant.name}"}} 0.0' in text


async def test_completion_tokens_from_the_stream_spend_the_budget(replicas, http, redis_url) -> None:  # noqa: F811
    clock = WallClock()
    tenant = Tenant(unique_tenant(), tokens_per_minute=2 * PROMPT_TOKENS + 2 * 4)
    a, b = await replicas(2, redis_url, tenant, clock)
    for router in (a, b):  # each: 44 prompt tokens, then 4 completion tokens counted from the stream
        async with _chat(router, http, {**CHAT, "stream": True}) as resp:
            assert resp.status == 200
            await resp.read()
        await router.ctx.budgets.flush()
    async with _chat(a, http) as resp:
        assert resp.status == 429 and (await resp.json())["error"]["type"] == "tokens"
        assert resp.headers["x-ratelimit-remaining-tokens"] == "0"
    async with http.get(a.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert f'fleetroute_tenant_tokens_total{{kind="completion",tenant="{tenant.name}"}} 4.0' in text
    assert f'fleetroute_tenant_tokens_total{{kind="prompt",tenant="{tenant.name}"}} 44.0' in text


async def test_a_request_the_queue_sheds_is_refunded(replicas, http, redis_url, make_engine) -> None:  # noqa: F811
    clock = WallClock()
    tenant = Tenant(unique_tenant(), requests_per_minute=2)
    engine = await make_engine("gated", gate=asyncio.Event())
    (router,) = await replicas(1, redis_url, tenant, clock, engine=engine, policies=[{
        "name": "default", "admission": {"maxConcurrentPerEndpoint": 1, "maxQueue": 0}}])  # no queue at all
    async with _chat(router, http, {**CHAT, "stream": True}) as holder:  # holds the only slot
        await holder.content.readuntil(b"\n\n")
        async with _chat(router, http) as resp:  # passes its budget (1 left), then the full pool sheds it
            assert resp.status == 429 and (await resp.json())["error"]["code"] == "queue_full"
            assert resp.headers["x-ratelimit-remaining-requests"] == "0"
        await router.ctx.budgets.flush()
        engine.gate.set()
        await holder.read()
    async with _chat(router, http) as resp:  # the shed request's charge was given back
        assert resp.status == 200 and resp.headers["x-ratelimit-remaining-requests"] == "0"


@pytest.mark.parametrize("fail_mode", ["open", "closed"])
async def test_while_redis_is_down_the_fail_mode_decides(replicas, http, own_redis, fail_mode: str) -> None:  # noqa: F811
    clock = WallClock()
    tenant = Tenant(unique_tenant(), requests_per_minute=100)
    (router,) = await replicas(1, own_redis.url, tenant, clock, budgetFailMode=fail_mode)
    async with _chat(router, http) as resp:
        assert resp.status == 200 and resp.headers["x-ratelimit-remaining-requests"] == "99"
    own_redis.kill()
    for _ in range(3):
        async with _chat(router, http) as resp:
            if fail_mode == "open":  # through, uncharged, without budget headers
                assert resp.status == 200 and "x-ratelimit-remaining-requests" not in resp.headers
            else:
                assert resp.status == 503 and resp.headers["Retry-After"] == "1"
                assert (await resp.json())["error"]["code"] == "budget_unavailable"
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    outcome = "allowed" if fail_mode == "open" else "refused"
    assert f'fleetroute_tenant_budget_errors_total{{outcome="{outcome}"}} 3.0' in text
    if fail_mode == "closed":
        assert f'reason="budget_unavailable",tenant="{tenant.name}"}} 3.0' in text
    own_redis.start()  # back (empty: the server keeps nothing): budgets count again
    async with _chat(router, http) as resp:
        assert resp.status == 200 and resp.headers["x-ratelimit-remaining-requests"] == "99"
