"""Telemetry through a real Redis server: the agent publishes, routers read; expiry, schema versions, Redis
outages and two router replicas sharing one Redis."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import uuid
from collections import Counter

import aiohttp
import pytest
import redis.asyncio as aioredis

from router.runtime.redis_client import RedisSettings, connect
from router.telemetry.feed import RedisStore, TelemetryFeed
from tests.conftest import MODEL
from tests.fake_engine import EngineLoad
from tests.redis_server import own_redis, redis_url  # noqa: F401 - fixtures
from worker.agent import Agent, AgentSettings
from worker.protocol import UPDATES_CHANNEL, EngineSample, GpuSample, TelemetryRecord, decode, telemetry_key
from worker.publisher import RedisPublisher


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"  # tests may share one Redis: keys never collide


async def publish(url: str, endpoint_id: str, *, gpu_util: float | None = None, kv: float | None = None,
                  waiting: float | None = None, ttl: float = 30.0, reported_at: float | None = None) -> None:
    import time

    client = aioredis.from_url(url, decode_responses=True)
    try:
        await RedisPublisher(client, ttl=ttl).publish(TelemetryRecord(
            endpoint_id=endpoint_id, reported_at=reported_at if reported_at is not None else time.time(), seq=1,
            interval=1.0, gpu_source="nvml", gpu=GpuSample(util=gpu_util, mem_used_bytes=72, mem_total_bytes=80),
            engine=EngineSample(up=True, kv_cache_usage=kv, num_waiting=waiting, num_running=1.0),
        ))
    finally:
        await client.aclose()


async def test_agent_publishes_engine_telemetry_that_round_trips(make_engine, redis_url) -> None:  # noqa: F811
    engine = await make_engine("e", load=EngineLoad(waiting=4, running=9, kv_usage=0.5))
    endpoint_id = unique("gpu")
    settings = AgentSettings(engine_url=engine.url, redis=RedisSettings(url=redis_url), endpoint_id=endpoint_id, gpu_source="none",
                             interval=2.0)
    client = aioredis.from_url(redis_url, decode_responses=True)
    async with aiohttp.ClientSession() as session:
        agent = Agent(settings, session, client)
        await agent.tick()
        await agent.tick()
    raw = await client.hgetall(telemetry_key(endpoint_id))
    ttl_ms = await client.pttl(telemetry_key(endpoint_id))
    await client.aclose()
    record = decode(raw)
    assert record.endpoint_id == endpoint_id and record.seq == 2 and record.gpu_source == "none"
    assert (record.engine.num_waiting, record.engine.num_running, record.engine.kv_cache_usage) == (4, 9, 0.5)
    assert record.gpu.util is None  # no GPU source: engine-only telemetry, GPU fields absent
    assert 0 < ttl_ms <= 6000  # three intervals: a dead agent's record disappears by itself


async def test_router_with_redis_routes_away_from_the_loaded_endpoint(make_engine, make_router, http, redis_url) -> None:  # noqa: F811
    engines = [await make_engine(unique("gpu")) for _ in range(3)]
    busy, *idle = engines
    await publish(redis_url, busy.name, gpu_util=0.99, kv=0.95, waiting=30)
    for e in idle:
        await publish(redis_url, e.name, gpu_util=0.2, kv=0.1, waiting=0)
    router = await make_router(engines, policies=[{"name": "default", "strategy": "adaptive"}],
                               telemetry={"enabled": True, "interval": "1s"}, redis={"url": redis_url})
    await asyncio.wait_for(router.ctx.telemetry_round.wait(), 5)
    served: Counter[str] = Counter()
    for _ in range(30):
        async with http.post(router.ingress_url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as resp:
            served[resp.headers["x-fleetroute-endpoint"]] += 1
    assert served[busy.name] == 0 and all(served[e.name] > 5 for e in idle)
    view = router.ctx.balancer.snapshot.by_id[busy.name]
    assert view.telemetry.gpu_util == 0.99 and view.telemetry.gpu_mem_util == pytest.approx(0.9)


async def test_missing_or_stale_records_are_unknown(make_engine, make_router, redis_url) -> None:  # noqa: F811
    import time

    engine = await make_engine(unique("gpu"))
    router = await make_router([engine], telemetry={"enabled": False, "staleAfter": "5s"}, redis={"url": redis_url})
    store = RedisStore(connect(RedisSettings(url=redis_url), timeout=1.0))
    feed = TelemetryFeed(store=store, balancer=router.ctx.balancer, metrics=router.ctx.metrics)
    try:
        await feed.refresh()
        assert router.ctx.balancer.snapshot.by_id[engine.name].telemetry is None  # nothing published yet
        await publish(redis_url, engine.name, gpu_util=0.5, reported_at=time.time() - 60)  # an old sample
        await feed.refresh()
        assert router.ctx.balancer.snapshot.by_id[engine.name].telemetry is None  # too old: unknown
        await publish(redis_url, engine.name, gpu_util=0.5)
        await feed.refresh()
        assert router.ctx.balancer.snapshot.by_id[engine.name].telemetry.gpu_util == 0.5
    finally:
        await store.close()


async def test_another_schema_version_is_ignored_with_a_clear_log(make_engine, make_router, redis_url, caplog) -> None:  # noqa: F811
    engine = await make_engine(unique("gpu"))
    router = await make_router([engine], telemetry={"enabled": False}, redis={"url": redis_url})
    client = aioredis.from_url(redis_url, decode_responses=True)
    await client.hset(telemetry_key(engine.name), mapping={"schema": "2", "endpoint_id": engine.name,
                                                           "reported_at": "1", "gpu_util": "0.1"})
    await client.aclose()
    store = RedisStore(connect(RedisSettings(url=redis_url), timeout=1.0))
    feed = TelemetryFeed(store=store, balancer=router.ctx.balancer, metrics=router.ctx.metrics)
    with caplog.at_level(logging.ERROR, logger="fleetroute.telemetry"):
        await feed.refresh()
        await feed.refresh()
    await store.close()
    assert router.ctx.balancer.snapshot.by_id[engine.name].telemetry is None
    errors = [r for r in caplog.records if "unknown schema version" in r.getMessage()]
    assert len(errors) == 1 and "'2'" in errors[0].error  # once per endpoint, naming the version
    async with aiohttp.ClientSession() as http, http.get(router.admin_url + "/metrics") as resp:
        assert 'fleetroute_telemetry_rejected_records_total{reason="schema"} 2.0' in await resp.text()


async def test_redis_outage_degrades_gracefully_and_recovers(make_engine, make_router, http, own_redis) -> None:  # noqa: F811
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    for e in engines:
        await publish(own_redis.url, e.name, gpu_util=0.3, kv=0.2, waiting=0)
    router = await make_router(engines, policies=[{"name": "default", "strategy": "adaptive"}],
                               telemetry={"enabled": True, "interval": "100ms", "timeout": "200ms"},
                               redis={"url": own_redis.url})
    await asyncio.wait_for(router.ctx.telemetry_round.wait(), 5)
    assert all(v.telemetry is not None for v in router.ctx.balancer.snapshot.views)

    own_redis.kill()
    await asyncio.wait_for(router.ctx.telemetry_round.wait(), 5)  # a refresh that found Redis gone
    for _ in range(20):  # no request fails because Redis is down
        async with http.post(router.ingress_url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as resp:
            assert resp.status == 200
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert "fleetroute_telemetry_store_up 0.0" in text
    assert "fleetroute_telemetry_store_errors_total" in text

    own_redis.start()  # same port, empty: agents publish again
    for e in engines:
        await publish(own_redis.url, e.name, gpu_util=0.7, kv=0.2, waiting=0)
    async with asyncio.timeout(10):
        while router.ctx.balancer.snapshot.by_id["gpu-0"].telemetry is None or \
                router.ctx.balancer.snapshot.by_id["gpu-0"].telemetry.gpu_util != 0.7:
            await router.ctx.telemetry_round.wait()
    async with http.get(router.admin_url + "/metrics") as resp:
        assert "fleetroute_telemetry_store_up 1.0" in await resp.text()


async def test_two_router_replicas_sharing_redis_do_not_herd(make_engine, make_router, http, redis_url) -> None:  # noqa: F811
    # Four engines: three nearly idle with slightly different GPU load (a, b, c) and one loaded (d). Both
    # router replicas read the same numbers. Argmax would send 100% of both replicas' traffic to a. Power of
    # two choices draws one of the 6 pairs uniformly and the better one wins: a 3/6, b 2/6, c 1/6, d 0.
    # Bounds: a well below 1 (no herding), d nearly nothing, b and c clearly used; +-8% covers the
    # binomial noise of 2 x 150 requests (sigma < 3%) and the small in-flight correction.
    names = {k: unique(k) for k in "abcd"}
    engines = {k: await make_engine(v) for k, v in names.items()}
    for key, util in (("a", 0.10), ("b", 0.12), ("c", 0.14)):
        await publish(redis_url, names[key], gpu_util=util, kv=0.1, waiting=0)
    await publish(redis_url, names["d"], gpu_util=0.95, kv=0.9, waiting=20)
    routers = [
        await make_router(list(engines.values()), seed=seed, policies=[{"name": "default", "strategy": "adaptive"}],
                          telemetry={"enabled": True, "interval": "1s"}, redis={"url": redis_url})
        for seed in (1, 2)
    ]
    for r in routers:
        await asyncio.wait_for(r.ctx.telemetry_round.wait(), 5)
    served: Counter[str] = Counter()

    async def send(router) -> None:
        for _ in range(150):
            async with http.post(router.ingress_url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
                served[r.headers["x-fleetroute-endpoint"]] += 1

    await asyncio.gather(*(send(r) for r in routers))
    share = {k: served[v] / 300 for k, v in names.items()}
    assert share["a"] == pytest.approx(3 / 6, abs=0.08)
    assert share["b"] == pytest.approx(2 / 6, abs=0.08)
    assert share["c"] == pytest.approx(1 / 6, abs=0.08)
    assert share["d"] <= 0.02


async def test_agent_command_without_a_gpu_driver_publishes_engine_only_telemetry(make_engine, redis_url, tmp_path) -> None:  # noqa: F811
    engine = await make_engine("e", load=EngineLoad(waiting=2))
    endpoint_id = unique("gpu")
    env_path = tmp_path / "no-driver"  # an empty library path: libnvidia-ml.so.1 cannot be found
    env_path.mkdir()
    import os

    # The engine URL carries credentials (aiohttp sends them as Basic auth): the agent's log never shows them.
    engine_url = engine.url.replace("http://", "http://metrics:hunter2@")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "agent", "--engine-url", engine_url, "--redis", redis_url,
        "--endpoint-id", endpoint_id, "--gpu-source", "nvml", "--interval", "200ms",
        stderr=asyncio.subprocess.PIPE, env={**os.environ, "LD_LIBRARY_PATH": str(env_path)},
    )
    client = aioredis.from_url(redis_url, decode_responses=True)
    pubsub = client.pubsub()
    await pubsub.subscribe(UPDATES_CHANNEL)  # the agent announces each record: an event to wait for
    try:
        lines = []
        async with asyncio.timeout(20):
            while not any("agent started" in line for line in lines):
                line = (await proc.stderr.readline()).decode()
                assert line, f"agent exited: {lines}"
                lines.append(line)
        assert any("no GPU telemetry" in line for line in lines)  # one clear line, not a crash loop
        assert '"engine":"http://***@127.0.0.1:' in lines[-1] and not any("hunter2" in line for line in lines)
        async with asyncio.timeout(10):
            async for message in pubsub.listen():
                if message["type"] == "message" and message["data"] == endpoint_id:
                    break
        record = decode(await client.hgetall(telemetry_key(endpoint_id)))
        assert record.gpu_source == "none" and record.engine.num_waiting == 2
    finally:
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        await pubsub.aclose()
        await client.aclose()


@pytest.mark.parametrize(("url", "message"), [
    ("127.0.0.1:8000", "must be an http:// or https:// URL with a host, got '127.0.0.1:8000'"),
    ("ftp://engine:8000", "must be an http:// or https:// URL with a host"),
    ("http://:8000", "must be an http:// or https:// URL with a host"),
    ("http://engine:99999", "has an invalid port (want 1 to 65535), got 'http://engine:99999'"),
    ("http://engine:0", "has an invalid port (want 1 to 65535)"),
    ("http://engine:http", "has an invalid port (want 1 to 65535)"),
    ("http://ops:hunter2@engine:x", "has an invalid port (want 1 to 65535), got 'http://***@engine:x'"),
], ids=["no-scheme", "not-http", "no-host", "port-too-high", "port-0", "port-not-a-number", "credentials-hidden"])
def test_a_bad_engine_url_is_an_argparse_error(url: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from router.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["agent", "--engine-url", url, "--endpoint-id", "e"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and f"fleetroute agent: error: argument --engine-url: {message}" in err
    assert "hunter2" not in err


def test_a_good_engine_url_is_kept_without_its_trailing_slash() -> None:
    from router.cli import build_parser

    args = build_parser().parse_args(["agent", "--engine-url", "https://[::1]:8443/v/", "--endpoint-id", "e"])
    assert args.engine_url == "https://[::1]:8443/v"


class MonoClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_a_round_reads_only_the_records_agents_announced_and_a_full_read_catches_a_lost_one(
        redis_url) -> None:  # noqa: F811
    import random as _random

    from router.config.settings import PolicySpec
    from router.model import Endpoint
    from router.routing.balancer import Balancer
    from router.routing.loads import LoadTracker
    from router.routing.policies.registry import PolicyRegistry
    from router.runtime.metrics import RouterMetrics

    ids = [unique("gpu") for _ in range(3)]
    for endpoint_id in ids:
        await publish(redis_url, endpoint_id, gpu_util=0.5)
    registry, metrics = PolicyRegistry(), RouterMetrics()
    adaptive = registry.get("adaptive")
    assert adaptive is not None
    mono = MonoClock()  # the feed's and the balancer's clock: reports' ages are judged on it
    balancer = Balancer(policies=[PolicySpec(name="p", models=(MODEL,), strategy="adaptive", params=adaptive.parse({}))],
                        registry=registry, metrics=metrics, loads=LoadTracker(metrics), stale_after=3600,
                        rng=_random.Random(1), clock=mono)
    balancer.set_endpoints([Endpoint(i, f"http://{i}", (MODEL,)) for i in ids])
    store = RedisStore(await connect(RedisSettings(url=redis_url), timeout=5))
    feed = TelemetryFeed(store=store, balancer=balancer, metrics=metrics, mono_clock=mono, full_read_every=60)
    wake = asyncio.Event()
    listener = asyncio.create_task(store.listen(wake, 0.05, metrics))

    def read(kind: str | None = None) -> float:
        if kind is None:
            return metrics.registry.get_sample_value("fleetroute_telemetry_records_read_total") or 0.0
        return metrics.registry.get_sample_value("fleetroute_telemetry_reads_total", {"kind": kind}) or 0.0

    def util(endpoint_id: str) -> float | None:
        t = balancer.snapshot.by_id[endpoint_id].telemetry
        return None if t is None else t.gpu_util

    try:
        # Until the subscription is confirmed, every round reads every record (messages may be missed).
        async with asyncio.timeout(10):
            while True:
                await feed.refresh()
                if read("changed"):
                    break
                await asyncio.sleep(0.01)
        assert all(util(i) == 0.5 for i in ids)
        before, fulls = read(), read("full")
        # An agent writes and announces: the next round reads that one record, and nothing else.
        wake.clear()
        await publish(redis_url, ids[0], gpu_util=0.9)
        await asyncio.wait_for(wake.wait(), 5)
        await feed.refresh()
        assert util(ids[0]) == 0.9
        assert read() - before == 1 and read("full") == fulls
        # A record written without its announcement (a lost message) is not read by changed-only rounds...
        client = aioredis.from_url(redis_url)
        try:
            await client.hset(telemetry_key(ids[1]), "gpu_util", "0.1")
        finally:
            await client.aclose()
        await feed.refresh()
        assert util(ids[1]) == 0.5
        # ...until the next full read, `full_read_every` after the last.
        mono.now += 60
        await feed.refresh()
        assert util(ids[1]) == 0.1 and read("full") == fulls + 1
        # A new endpoint is read in the first round it is a member, announced or not.
        newcomer = unique("gpu")
        await publish(redis_url, newcomer, gpu_util=0.3)
        balancer.set_endpoints([Endpoint(i, f"http://{i}", (MODEL,)) for i in [*ids, newcomer]])
        await feed.refresh()
        assert util(newcomer) == 0.3
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await store.close()


class FreezingProxy:
    """TCP to Redis through 127.0.0.1; `freeze()` stops forwarding on the connections open now without closing
    them, as a dead node or a partition does (no error, no FIN): new connections pass."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.frozen: list[asyncio.Event] = []
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        frozen = asyncio.Event()
        self.frozen.append(frozen)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                if frozen.is_set():
                    await asyncio.Event().wait()  # hold the bytes: nothing more flows, nothing closes
                dst.write(data)
                await dst.drain()

        try:
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()

    def freeze(self) -> None:
        for event in self.frozen:
            event.set()

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()


async def test_a_subscription_that_hangs_is_noticed_and_made_again(redis_url) -> None:  # noqa: F811
    from router.runtime.metrics import RouterMetrics

    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    proxy = FreezingProxy(port)
    proxy_url = f"redis://127.0.0.1:{await proxy.start()}/0"
    metrics = RouterMetrics()
    store = RedisStore(await connect(RedisSettings(url=proxy_url), timeout=5))
    wake = asyncio.Event()
    listener = asyncio.create_task(store.listen(wake, 0.2, metrics))
    announcer = aioredis.from_url(redis_url)

    async def announced(endpoint_id: str) -> None:
        """Publish until the store has noted `endpoint_id` (the subscription may still be on its way)."""
        async with asyncio.timeout(10):
            while True:
                await announcer.publish(UPDATES_CHANNEL, endpoint_id)
                await asyncio.sleep(0.05)
                changes = store.take_changes()
                if changes is not None and endpoint_id in changes:
                    return

    try:
        await announced(unique("before"))
        proxy.freeze()  # the subscription's connection hangs: announcements stop arriving, no error is raised
        async with asyncio.timeout(10):
            while not metrics.registry.get_sample_value("fleetroute_telemetry_subscription_restarts_total",
                                                        {"reason": "silent"}):
                await asyncio.sleep(0.05)
        assert store.take_changes() is None  # the round after a restart reads every record
        await announced(unique("after"))  # the new subscription (a new connection) hears agents again
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await store.close()
        await announcer.aclose()
        await proxy.close()
