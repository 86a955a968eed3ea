"""The prefix index shared between router replicas through a real Redis: a prefix routed through router A is
found by router B, entries expire with the TTL (server-side trimming and the readers' filter), the stream
stays within its bounds, and a Redis outage leaves routing local until Redis is back."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import redis.asyncio as aioredis

from router.routing.policies.prefix_aware import block_hashes
from router.routing.prefix.sharing import ENDPOINT_FIELD, ROUTER_FIELD, pack, stream_key
from router.server.app import RunningRouter
from tests.conftest import MODEL
from tests.redis_server import own_redis, redis_url  # noqa: F401 - fixtures
from tests.test_prefix_aware import text

BLOCK = 256


def policy(name: str, **params: Any) -> list[dict[str, Any]]:
    return [{"name": name, "models": ["*"], "strategy": "prefix-aware", "prefixAware": params}]


def unique() -> str:
    return f"p-{uuid.uuid4().hex[:8]}"  # tests may share one Redis: streams never collide


def conversation(conv: int, turns: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": text(7000 + conv, 3 * BLOCK)}]
    for t in range(turns):
        messages.append({"role": "user", "content": text(8000 + conv * 10 + t, 200)})
    return {"model": MODEL, "messages": messages, "max_tokens": 2}


async def served_by(http, router: RunningRouter, body: dict[str, Any]) -> str:
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    async with http.post(router.ingress_url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-fleetroute-endpoint"]


def sample(router: RunningRouter, name: str, **labels: str) -> float:
    return router.ctx.metrics.registry.get_sample_value(name, labels) or 0.0


async def until(router: RunningRouter, condition, rounds: int = 100) -> None:
    """Wait for the router's own upkeep rounds (events, not sleeps) until `condition()` holds."""
    upkeep = router.ctx.prefix_upkeep
    assert upkeep is not None
    async with asyncio.timeout(30):
        for _ in range(rounds):
            if condition():
                return
            await upkeep.round_done.wait()
    assert condition()


async def test_a_prefix_routed_through_one_router_is_found_by_another(make_engine, make_router, http,
                                                                      redis_url) -> None:  # noqa: F811
    engines = [await make_engine(f"gpu-{i}") for i in range(4)]
    name = unique()
    common = {"policies": policy(name), "redis": {"url": redis_url}, "telemetry": {"enabled": False}}
    a = await make_router(engines, seed=1, **common)
    b = await make_router(engines, seed=2, **common)
    document = text(9600, 5 * BLOCK)
    first = {conv: await served_by(http, a, conversation(conv, 1)) for conv in range(6)}
    first["doc"] = await served_by(http, a, {"model": MODEL, "prompt": document + " Q1?", "max_tokens": 2})
    assert a.ctx.prefix_upkeep is not None and b.ctx.prefix_upkeep is not None
    await a.ctx.prefix_upkeep.round()  # A publishes what it routed...
    await b.ctx.prefix_upkeep.round()  # ...and B applies it
    # B has never seen these conversations: without sharing their second turns would go by load (a 1 in 4
    # chance each of meeting the right engine); with it, each goes where A sent the first turn.
    second = {conv: await served_by(http, b, conversation(conv, 2)) for conv in range(6)}
    second["doc"] = await served_by(http, b, {"model": MODEL, "prompt": document + " Q2?", "max_tokens": 2})
    assert second == first
    assert sample(b, "fleetroute_policy_events_total", policy=name, event="prefix_hit") == 7
    assert sample(b, "fleetroute_policy_events_total", policy=name, event="prefix_miss") == 0
    assert sample(a, "fleetroute_prefix_shared_blocks_total", outcome="published") > 0
    assert sample(b, "fleetroute_prefix_shared_blocks_total", outcome="received") > 0
    assert sample(a, "fleetroute_prefix_shared_blocks_total", outcome="received") == 0  # its own entries skipped
    assert sample(b, "fleetroute_prefix_sharing_up") == 1
    # B's inverted index holds every distinct block it learnt from A and routed itself, and its gauge says so.
    index_b = b.ctx.balancer._pool_state[(name, MODEL)]
    held = {h for blocks in index_b.by_endpoint.values() for h in blocks}
    await b.ctx.prefix_upkeep.round()
    assert sample(b, "fleetroute_prefix_index_distinct_blocks", policy=name, model=MODEL) == len(held) > 0


async def test_entries_older_than_the_ttl_are_not_applied_and_are_trimmed(make_engine, make_router, http,
                                                                          redis_url) -> None:  # noqa: F811
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    name = unique()
    key = stream_key(name, MODEL, BLOCK)
    old_blocks = block_hashes(conversation(1, 1), BLOCK, 64)
    fresh_blocks = block_hashes(conversation(2, 1), BLOCK, 64)
    client = aioredis.from_url(redis_url, decode_responses=False)
    try:
        seconds, micros = await client.time()
        now_ms = seconds * 1000 + micros // 1000
        # Another replica's entries: one written two TTLs (120 s) ago, one now, and one for an endpoint this
        # router does not know. Ids are explicit only here, to place an entry in the past.
        await client.xadd(key, {ROUTER_FIELD: b"elsewhere", ENDPOINT_FIELD + b"gpu-0": pack(old_blocks)},
                          id=f"{now_ms - 120_000}-0")
        await client.xadd(key, {ROUTER_FIELD: b"elsewhere", ENDPOINT_FIELD + b"gpu-1": pack(fresh_blocks),
                                ENDPOINT_FIELD + b"ghost": pack([1, 2, 3])})
        router = await make_router(engines, policies=policy(name, sharing={"ttl": "60s"}),
                                   redis={"url": redis_url}, telemetry={"enabled": False})
        assert router.ctx.prefix_upkeep is not None
        await router.ctx.prefix_upkeep.round()
        index = router.ctx.balancer.pool_states()[0][2]
        # The warm-up reads from server time - TTL: the old entry is not even read.
        assert index.matched("gpu-0", old_blocks) == 0
        assert index.matched("gpu-1", fresh_blocks) == len(fresh_blocks)
        assert sample(router, "fleetroute_prefix_shared_blocks_total", outcome="received") == len(fresh_blocks)
        assert sample(router, "fleetroute_prefix_shared_blocks_total", outcome="ignored") == 3
        # Its first write trims the stream by server time: the old entry is gone, the fresh one stays, and
        # the stream itself expires a TTL after the last write.
        await served_by(http, router, conversation(3, 1))
        await router.ctx.prefix_upkeep.round()
        ids = [int(entry_id.split(b"-")[0]) for entry_id, _ in await client.xrange(key)]
        assert ids and min(ids) >= now_ms - 60_000
        assert len(ids) == 2  # the fresh entry and the router's own
        assert 0 < await client.pttl(key) <= 60_000
    finally:
        await client.delete(key)
        await client.aclose()


async def test_the_stream_stays_within_max_stream_entries(make_engine, make_router, http,
                                                          redis_url) -> None:  # noqa: F811
    engines = [await make_engine("gpu-0")]
    name = unique()
    router = await make_router(engines, policies=policy(name, sharing={"maxStreamEntries": 16}),
                               redis={"url": redis_url}, telemetry={"enabled": False})
    assert router.ctx.prefix_upkeep is not None
    client = aioredis.from_url(redis_url, decode_responses=False)
    key = stream_key(name, MODEL, BLOCK)
    try:
        for i in range(40):  # 40 rounds with new blocks: 40 entries written, at most 16 kept
            await served_by(http, router, {"model": MODEL, "prompt": text(20_000 + i, 2 * BLOCK), "max_tokens": 2})
            await router.ctx.prefix_upkeep.round()
            assert await client.xlen(key) <= 16
        assert await client.xlen(key) == 16
    finally:
        await client.delete(key)
        await client.aclose()


async def test_routing_goes_on_locally_while_redis_is_down_and_sharing_recovers(make_engine, make_router, http,
                                                                                own_redis) -> None:  # noqa: F811
    engines = [await make_engine(f"gpu-{i}") for i in range(4)]
    name = unique()
    common = {"policies": policy(name), "redis": {"url": own_redis.url}, "telemetry": {"enabled": False}}
    a = await make_router(engines, seed=1, **common)
    b = await make_router(engines, seed=2, **common)
    assert a.ctx.prefix_upkeep is not None and b.ctx.prefix_upkeep is not None
    own_redis.kill()
    first = {conv: await served_by(http, a, conversation(conv, 1)) for conv in range(6)}
    second = {conv: await served_by(http, a, conversation(conv, 2)) for conv in range(6)}
    assert second == first  # no request failed, and A's own index keeps affinity without Redis
    await a.ctx.prefix_upkeep.round()
    sharing = a.ctx.prefix_upkeep.sharing
    assert sharing is not None and sharing.up is False
    assert sample(a, "fleetroute_prefix_sharing_up") == 0
    assert sample(a, "fleetroute_prefix_sharing_errors_total") >= 1
    own_redis.start()
    # A retries with backoff, then publishes what it queued during the outage; B, warming up, learns it.
    await until(a, lambda: sharing.up is True)
    await until(b, lambda: sample(b, "fleetroute_prefix_shared_blocks_total", outcome="received") > 0)
    third = {conv: await served_by(http, b, conversation(conv, 3)) for conv in range(6)}
    assert third == first
    assert sample(b, "fleetroute_policy_events_total", policy=name, event="prefix_hit") == 6


async def test_entries_that_aged_past_the_ttl_before_a_lagging_reader_got_to_them_are_skipped(
        redis_url) -> None:  # noqa: F811
    # The background class itself against real Redis: a reader whose cursor is older than the TTL (it was
    # cut off from Redis, or far behind) skips what expired meanwhile and counts it.
    from router.routing.prefix.index import PrefixIndex
    from router.routing.prefix.sharing import PrefixSharing, SharedPool
    from router.runtime.metrics import RouterMetrics

    key = stream_key(unique(), MODEL, BLOCK)
    client = aioredis.from_url(redis_url, decode_responses=False)
    metrics = RouterMetrics()
    reader = PrefixSharing(redis=client, router_id="reader", metrics=metrics)
    index = PrefixIndex()
    pool = SharedPool(key=key, index=index, ttl=60.0, max_entries=100, endpoints=frozenset({"gpu-0"}))
    try:
        await reader.exchange([pool])  # warm-up on an empty stream: the cursor is at server time - 60 s
        seconds, micros = await client.time()
        start_ms = seconds * 1000 + micros // 1000
        # An entry just after the cursor, i.e. 60 s old already, then a fresh one.
        await client.xadd(key, {ROUTER_FIELD: b"writer", ENDPOINT_FIELD + b"gpu-0": pack([1, 2])},
                          id=f"{start_ms - 60_000 + 1}-0")
        await client.xadd(key, {ROUTER_FIELD: b"writer", ENDPOINT_FIELD + b"gpu-0": pack([3])})
        async with asyncio.timeout(5):
            while True:  # the server clock must pass the old entry's id + TTL (a few ms)
                seconds, micros = await client.time()
                if seconds * 1000 + micros // 1000 > start_ms + 2:
                    break
        await reader.exchange([pool])
        assert (index.matched("gpu-0", [1]), index.matched("gpu-0", [3])) == (0, 1)
        assert metrics.registry.get_sample_value("fleetroute_prefix_shared_blocks_total", {"outcome": "expired"}) == 2
    finally:
        await client.delete(key)
        await client.aclose()
