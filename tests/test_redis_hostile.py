"""Values read from Redis are untrusted (issue #24, item 4): whoever can write the router's Redis must not be
able to fail a request, stop a background round, stall the event loop, or move routing with values no real
agent or router writes. Each finding of the issue is reproduced here through a real router and a real Redis:
the bad value is written with a plain client, then the router reads it in its normal round. Each test
failed on the code before the fix (noted per test) and passes after; tests/test_fuzz.py then throws
generated hostile data at every key the router reads."""

from __future__ import annotations

import asyncio
import logging
import math
import struct
import time
import uuid
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis

from router.routing.prefix.sharing import ENDPOINT_FIELD, ROUTER_FIELD, stream_key
from router.routing.shared_loads import LOADS_PREFIX, REPLICAS_KEY
from router.routing.sticky import KEY_PREFIX as STICKY_PREFIX
from router.routing.sticky import session_digest
from router.server.app import RunningRouter
from tests.conftest import MODEL
from tests.redis_server import redis_url  # noqa: F401 - fixture
from tests.test_prefix_sharing import BLOCK, conversation, policy
from worker.protocol import EngineSample, GpuSample, TelemetryRecord, encode, telemetry_key

STICKY = [{"name": "chat", "models": ["*"], "strategy": "round-robin", "stickiness": {"enabled": True}}]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def sample(router: RunningRouter, name: str, **labels: str) -> float:
    return router.ctx.metrics.registry.get_sample_value(name, labels) or 0.0


def rejected(router: RunningRouter, data: str, reason: str) -> float:
    return sample(router, "fleetroute_redis_rejected_values_total", data=data, reason=reason)


async def chat(http, router: RunningRouter, session: str) -> tuple[int, str | None]:
    async with http.post(router.ingress_url + "/v1/chat/completions", headers={"x-session-id": session},
                         json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}) as resp:
        await resp.read()
        return resp.status, resp.headers.get("x-fleetroute-endpoint")


async def plant_replica(client: aioredis.Redis, replica: str, counts: dict[str, Any]) -> None:
    """Another 'router replica' in the shared in-flight counts, with whatever counts it claims."""
    await client.zadd(REPLICAS_KEY, {replica: time.time()})
    await client.hset(LOADS_PREFIX + replica, mapping=counts)
    await client.pexpire(LOADS_PREFIX + replica, 30_000)


# --- In-flight counts shared between replicas ------------------------------------------------------------


async def test_a_4000_digit_in_flight_count_does_not_fail_sticky_requests(make_engine, make_router, http,
                                                                         redis_url) -> None:  # noqa: F811
    # Before: the count was summed into LoadTracker.others, and the sticky load bound's float arithmetic
    # raised OverflowError on the request path: every sticky request answered 500.
    engines = [await make_engine(unique("gpu")) for _ in range(2)]
    router = await make_router(engines, policies=STICKY, redis={"url": redis_url}, telemetry={"enabled": False})
    client = aioredis.from_url(redis_url)
    replica = unique("evil")
    try:
        await plant_replica(client, replica, {e.name: "9" * 4000 for e in engines})
        assert router.ctx.shared_loads is not None
        await router.ctx.shared_loads.exchange()
        for _ in range(3):  # the first pins the session; the others check the pinned endpoint's load bound
            status, _ = await chat(http, router, "erin")
            assert status == 200
        assert all(router.ctx.loads.cluster_in_flight(e.name) == 0 for e in engines)  # the count was dropped
        assert rejected(router, "in_flight", "out_of_range") == 2
    finally:
        await client.zrem(REPLICAS_KEY, replica)
        await client.aclose()


async def test_a_5000_digit_count_does_not_stop_housekeeping_and_honest_counts_still_add_up(
        make_engine, make_router, redis_url) -> None:  # noqa: F811
    # Before: int() of a 5,000-digit string raises ValueError (Python's digit limit), so every exchange
    # failed, and the honest replicas' counts were never read.
    engine = await make_engine(unique("gpu"))
    router = await make_router([engine], redis={"url": redis_url}, telemetry={"enabled": False})
    client = aioredis.from_url(redis_url)
    evil, honest = unique("evil"), unique("honest")
    try:
        await plant_replica(client, evil, {engine.name: "7" * 5000})
        await plant_replica(client, honest, {engine.name: "3"})
        assert router.ctx.shared_loads is not None
        await router.ctx.shared_loads.exchange()  # does not raise
        assert router.ctx.loads.others.get(engine.name) == 3
    finally:
        await client.zrem(REPLICAS_KEY, evil, honest)
        await client.aclose()


async def test_a_replica_set_of_another_type_is_replaced_and_sharing_goes_on(make_engine, make_router,
                                                                             redis_url) -> None:  # noqa: F811
    # A string where the replica set belongs made every exchange fail (WRONGTYPE in the MULTI) for good.
    engine = await make_engine(unique("gpu"))
    router = await make_router([engine], redis={"url": redis_url}, telemetry={"enabled": False})
    client = aioredis.from_url(redis_url)
    honest = unique("honest")
    try:
        await client.set(REPLICAS_KEY, b"garbage")
        shared = router.ctx.shared_loads
        assert shared is not None
        await shared.exchange()
        assert rejected(router, "replica", "wrong_type") >= 1
        await plant_replica(client, honest, {engine.name: "4"})
        await shared.exchange()
        assert router.ctx.loads.others.get(engine.name) == 4
        assert sample(router, "fleetroute_shared_loads_errors_total") == 0
    finally:
        await client.delete(REPLICAS_KEY)
        await client.aclose()


# --- Session pins ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("plant, reason", [
    (lambda c, k: c.set(k, b"x" * (8 * 1024 * 1024)), "oversize"),
    (lambda c, k: c.set(k, b"\xff\xfe-not-utf8"), "malformed"),
    (lambda c, k: c.set(k, b"gpu-0\n\x1b[31m"), "malformed"),
    (lambda c, k: c.hset(k, mapping={"a": "b"}), "wrong_type"),
], ids=["8MiB", "not-utf8", "control-characters", "a-hash"])
async def test_a_bad_pin_is_dropped_and_the_session_pinned_afresh(make_engine, make_router, http, redis_url,  # noqa: F811
                                                                   plant, reason) -> None:
    # Before: an 8 MiB pin was read whole on the request path, undecodable bytes failed the lookup, and a
    # key of another type (WRONGTYPE) counted as a Redis outage, turning Redis pins off for 5 s.
    engines = [await make_engine(unique("gpu")) for _ in range(2)]
    router = await make_router(engines, policies=STICKY, redis={"url": redis_url}, telemetry={"enabled": False})
    client = aioredis.from_url(redis_url)
    session = unique("sess")
    key = f"{STICKY_PREFIX}chat:{session_digest(session)}"  # pins are stored under the session's digest
    try:
        await plant(client, key)
        status, endpoint = await chat(http, router, session)
        assert status == 200 and endpoint in {e.name for e in engines}
        assert rejected(router, "sticky_pin", reason) == 1
        assert sample(router, "fleetroute_sticky_store_errors_total") == 0  # not mistaken for an outage
        await router.ctx.sticky["chat"].close()  # the fresh pin's background write has landed
        assert await client.get(key) == endpoint.encode()  # and replaced the garbage
    finally:
        await client.delete(key)
        await client.aclose()


# --- The shared prefix index ----------------------------------------------------------------------------


async def test_an_8_mib_prefix_stream_entry_is_dropped_unread(make_engine, make_router, http,
                                                             redis_url) -> None:  # noqa: F811
    # Before: the merge budget was checked only between entries, so one entry of a million hashes was
    # unpacked and merged whole in one round (the worst request latency went from 8 ms to 532 ms). Now an
    # entry larger than any router writes is dropped without being unpacked, and the next entry applies.
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    name = unique("p")
    key = stream_key(name, MODEL, BLOCK)
    client = aioredis.from_url(redis_url)
    huge = struct.pack("<1048576Q", *range(1, 1048577))  # 8 MiB: a million block hashes
    try:
        await client.xadd(key, {ROUTER_FIELD: b"evil", ENDPOINT_FIELD + b"gpu-0": huge})
        await client.xadd(key, {ROUTER_FIELD: b"other", ENDPOINT_FIELD + b"gpu-1": struct.pack("<2Q", 7, 8)})
        router = await make_router(engines, policies=policy(name), redis={"url": redis_url},
                                   telemetry={"enabled": False})
        assert router.ctx.prefix_upkeep is not None
        await router.ctx.prefix_upkeep.round()
        index = router.ctx.balancer.pool_states()[0][2]
        assert index.matched("gpu-0", [1048576]) == 0  # nothing of the huge entry was merged
        assert index.matched("gpu-1", [7, 8]) == 2
        assert rejected(router, "prefix_entry", "oversize") == 1
        assert sample(router, "fleetroute_prefix_shared_blocks_total", outcome="received") == 2
    finally:
        await client.delete(key)
        await client.aclose()


async def test_a_future_dated_prefix_entry_poisons_its_stream_which_is_started_afresh(
        make_engine, make_router, http, redis_url) -> None:  # noqa: F811
    # An entry id far in the future makes Redis date every later entry after it, so nothing in the stream
    # would ever expire. The reader drops the stream; the next writes start a clean one.
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    name = unique("p")
    key = stream_key(name, MODEL, BLOCK)
    client = aioredis.from_url(redis_url)
    try:
        await client.xadd(key, {ROUTER_FIELD: b"evil", ENDPOINT_FIELD + b"gpu-0": struct.pack("<Q", 5)},
                          id="9999999999999-0")
        router = await make_router(engines, policies=policy(name), redis={"url": redis_url},
                                   telemetry={"enabled": False})
        assert router.ctx.prefix_upkeep is not None
        await router.ctx.prefix_upkeep.round()
        index = router.ctx.balancer.pool_states()[0][2]
        assert index.matched("gpu-0", [5]) == 0
        assert rejected(router, "prefix_entry", "future") == 1
        assert not await client.exists(key)
        body = conversation(1, 1)
        async with http.post(router.ingress_url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
        await router.ctx.prefix_upkeep.round()
        ids = [int(entry_id.split(b"-")[0]) for entry_id, _ in await client.xrange(key)]
        assert len(ids) == 1 and ids[0] < 9999999999999  # the router's own entry, dated by the server
    finally:
        await client.delete(key)
        await client.aclose()


async def test_a_key_of_another_type_where_a_prefix_stream_belongs_is_replaced(make_engine, make_router, http,
                                                                              redis_url) -> None:  # noqa: F811
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    name = unique("p")
    key = stream_key(name, MODEL, BLOCK)
    client = aioredis.from_url(redis_url)
    try:
        await client.hset(key, mapping={"not": "a stream"})
        router = await make_router(engines, policies=policy(name), redis={"url": redis_url},
                                   telemetry={"enabled": False})
        assert router.ctx.prefix_upkeep is not None
        async with http.post(router.ingress_url + "/v1/chat/completions", json=conversation(1, 1)) as resp:
            assert resp.status == 200
        await router.ctx.prefix_upkeep.round()  # XADD and XREAD answer WRONGTYPE: counted, the key dropped
        assert rejected(router, "prefix_entry", "wrong_type") >= 1
        await router.ctx.prefix_upkeep.round()  # the queued blocks go to a fresh stream
        assert await client.type(key) == b"stream" and await client.xlen(key) >= 1
        assert sample(router, "fleetroute_prefix_sharing_up") == 1
    finally:
        await client.delete(key)
        await client.aclose()


# --- Telemetry ------------------------------------------------------------------------------------------


def record_fields(endpoint_id: str, **overrides: str) -> dict[str, str]:
    fields = encode(TelemetryRecord(
        endpoint_id=endpoint_id, reported_at=time.time(), seq=1, interval=1.0, gpu_source="nvml",
        gpu=GpuSample(util=0.5, mem_used_bytes=40, mem_total_bytes=80),
        engine=EngineSample(up=True, kv_cache_usage=0.5, num_waiting=2.0, num_running=4.0),
    ))
    fields.update(overrides)
    return fields


async def write_record(url: str, endpoint_id: str, **overrides: str) -> None:
    client = aioredis.from_url(url)
    try:
        await client.delete(telemetry_key(endpoint_id))
        await client.hset(telemetry_key(endpoint_id), mapping=record_fields(endpoint_id, **overrides))
        await client.pexpire(telemetry_key(endpoint_id), 30_000)
    finally:
        await client.aclose()


async def telemetry_router(make_router, engines, url: str, **overrides: Any) -> RunningRouter:
    """A router reading telemetry from `url` every 100 ms (records are written before it starts)."""
    return await make_router(engines, telemetry={"enabled": True, "interval": "100ms", "staleAfter": "5s"},
                             redis={"url": url}, **overrides)


async def rounds(router: RunningRouter, n: int) -> None:
    """Wait for `n` of the router's own telemetry refreshes (events, not sleeps)."""
    for _ in range(n):
        await asyncio.wait_for(router.ctx.telemetry_round.wait(), 5)


@pytest.mark.parametrize("overrides, reason", [
    ({"gpu_util": "-50"}, "out_of_range"),
    ({"kv_cache_usage": "1.5"}, "out_of_range"),
    ({"num_waiting": "1e12"}, "out_of_range"),
    ({"gpu_mem_used_bytes": "100"}, "out_of_range"),  # more used than the GPU has (80)
    ({"num_running": "nan"}, "malformed"),
    ({"gpu_util": "inf"}, "malformed"),
    ({"gpu_temperature_c": "1" * 5000}, "oversize"),
    ({"seq": "9" * 4000}, "oversize"),
    ({"gpu_source": "\x1b[2J"}, "malformed"),
    ({"reported_at": str(time.time() + 3600)}, "future"),
], ids=["negative-util", "kv-over-1", "absurd-queue", "mem-over-total", "nan", "inf", "5000-digits",
        "4000-digit-seq", "control-characters", "an-hour-ahead"])
async def test_impossible_telemetry_is_refused_counted_and_logged(make_engine, make_router, redis_url, caplog,  # noqa: F811
                                                                  overrides, reason) -> None:
    # Before: negative, huge and future-dated values were accepted (a future reported_at never goes stale).
    engine = await make_engine(unique("gpu"))
    await write_record(redis_url, engine.name, **overrides)
    with caplog.at_level(logging.WARNING, logger="fleetroute.telemetry"):
        router = await telemetry_router(make_router, [engine], redis_url)
        await rounds(router, 3)
    assert router.ctx.balancer.snapshot.by_id[engine.name].telemetry is None
    assert sample(router, "fleetroute_telemetry_rejected_records_total", reason=reason) >= 2
    lines = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(lines) == 1 and lines[0].reason == reason and lines[0].endpoint == engine.name  # rate-limited


async def test_a_record_slightly_ahead_of_the_routers_clock_is_still_fresh(make_engine, make_router,
                                                                          redis_url) -> None:  # noqa: F811
    engine = await make_engine(unique("gpu"))
    await write_record(redis_url, engine.name, reported_at=repr(time.time() + 0.5))  # NTP-sized skew
    router = await telemetry_router(make_router, [engine], redis_url)
    await rounds(router, 1)
    assert router.ctx.balancer.snapshot.by_id[engine.name].telemetry.gpu_util == 0.5


async def test_forged_impossible_telemetry_does_not_move_the_adaptive_split(make_engine, make_router, http,
                                                                           redis_url) -> None:  # noqa: F811
    # Two identical endpoints. Before: a record claiming gpu_util -5 and a negative queue was taken at its
    # word (its score clamped to the best possible), and least-load sent it every sequential request. Now
    # the record is refused: the endpoint is "unknown", gets the mean score, and the split stays even.
    honest, forged = await make_engine(unique("gpu")), await make_engine(unique("gpu"))
    await write_record(redis_url, honest.name)
    await write_record(redis_url, forged.name, gpu_util="-5", kv_cache_usage="-3", num_waiting="-40")
    router = await telemetry_router(make_router, [honest, forged], redis_url,
                                    policies=[{"name": "default", "strategy": "adaptive"}])
    await rounds(router, 1)
    served: Counter[str] = Counter()
    for _ in range(200):
        async with http.post(router.ingress_url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as resp:
            assert resp.status == 200
            served[resp.headers["x-fleetroute-endpoint"]] += 1
    # Ties between equal scores are broken at random: 200 draws of a fair coin stay within +-0.15 of 50/50
    # (4 sigma); a forged record that was believed takes all 200.
    assert math.isclose(served[forged.name] / 200, 0.5, abs_tol=0.15)
    assert sample(router, "fleetroute_telemetry_rejected_records_total", reason="out_of_range") >= 1
