"""Redis with a password, behind Sentinel, and as a Cluster (issue #16, item 6), against real servers
(tests/redis_server.py): the `redis:` settings, the password reaching every client (router and agent),
every Redis operation of the router and the agents on a three-master cluster (keys on different nodes,
MULTI on hash-tagged keys, pub/sub, streams), and a Sentinel failover during which telemetry, session pins
and in-flight sharing recover."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from redis.crc import key_slot

from loadtest.redis_server import RedisServer
from router.config.settings import ConfigError, parse_settings
from router.routing.sticky import session_digest
from router.runtime.metrics import RouterMetrics
from router.runtime.redis_client import RedisSettings, SentinelSettings, connect
from router.server.app import RunningRouter
from router.telemetry.feed import RedisStore
from tests.conftest import MODEL
from tests.fake_engine import EngineLoad
from tests.redis_server import (  # noqa: F401 - fixtures
    MASTER_NAME,
    PASSWORD,
    SENTINEL_PASSWORD,
    ClusterServers,
    SentinelServers,
    redis_cluster,
    redis_sentinel,
)
from worker.agent import Agent, AgentSettings
from worker.protocol import UPDATES_CHANNEL, telemetry_key

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
STICKY = [{"name": "chat", "models": ["*"], "strategy": "adaptive", "stickiness": {"enabled": True}}]


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def sample(router: RunningRouter, name: str, **labels: str) -> float:
    return router.ctx.metrics.registry.get_sample_value(name, labels) or 0.0


async def chat(http: aiohttp.ClientSession, router: RunningRouter, session: str, *, model: str = MODEL) -> str:
    async with http.post(router.ingress_url + "/v1/chat/completions", headers={"x-session-id": session},
                         json={**CHAT, "model": model}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-fleetroute-endpoint"]


async def pins_landed(router: RunningRouter) -> None:
    await asyncio.gather(*router.ctx.sticky["chat"]._tasks)


async def telemetry_round(router: RunningRouter) -> None:
    await asyncio.wait_for(router.ctx.telemetry_round.wait(), 10)


# ---- configuration -------------------------------------------------------------------------------------


@pytest.fixture
def secrets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TEST_REDIS_PASSWORD", PASSWORD)
    monkeypatch.setenv("TEST_SENTINEL_PASSWORD", SENTINEL_PASSWORD)
    monkeypatch.delenv("REDIS_URL", raising=False)
    path = tmp_path / "password"
    path.write_text(PASSWORD + "\n")  # as `echo` or a Secret written by hand leaves it
    return path


@pytest.mark.parametrize("block, expected", [
    ({"url": "redis://r:6379/0", "passwordEnv": "TEST_REDIS_PASSWORD"},
     RedisSettings(url="redis://r:6379/0", password=PASSWORD, password_source="$TEST_REDIS_PASSWORD")),
    ({"url": "rediss://r:6380", "cluster": True, "username": "fleetroute", "passwordFile": "{file}"},
     RedisSettings(url="rediss://r:6380", cluster=True, username="fleetroute", password=PASSWORD,
                   password_source="file {file}")),
    ({"sentinel": {"masterName": "m", "addresses": ["s-0:26379", "[::1]:26380"], "db": 2, "tls": True,
                   "passwordEnv": "TEST_SENTINEL_PASSWORD"}, "passwordEnv": "TEST_REDIS_PASSWORD"},
     RedisSettings(sentinel=SentinelSettings(master_name="m", addresses=(("s-0", 26379), ("::1", 26380)), db=2,
                                             tls=True, password=SENTINEL_PASSWORD),
                   password=PASSWORD, password_source="$TEST_REDIS_PASSWORD")),
    ({"url": None}, RedisSettings()),
], ids=["password-from-env", "cluster-user-password-from-file", "sentinel-both-passwords", "off"])
def test_redis_settings_are_read_with_their_secrets(secrets: Path, block: dict[str, Any],
                                                    expected: RedisSettings) -> None:
    import json

    block = json.loads(json.dumps(block).replace("{file}", str(secrets)))
    expected_source = expected.password_source.replace("{file}", str(secrets)) if expected.password_source else None
    settings = parse_settings({"redis": block}).redis
    assert settings == RedisSettings(**{**expected.__dict__, "password_source": expected_source})
    assert PASSWORD not in repr(settings) and SENTINEL_PASSWORD not in repr(settings)  # never printed


@pytest.mark.parametrize("block, message", [
    ({"url": "redis://r/0", "sentinel": {"masterName": "m", "addresses": ["s:1"]}},
     "redis.url: must be left out with redis.sentinel"),
    ({"sentinel": {"masterName": "m", "addresses": []}}, "redis.sentinel.addresses: must list at least one"),
    ({"sentinel": {"masterName": "m", "addresses": ["s-0"]}}, "redis.sentinel.addresses[0]: must be host:port"),
    ({"sentinel": {"addresses": ["s:1"]}}, "redis.sentinel.masterName: is required"),
    ({"sentinel": {"masterName": "m", "addresses": ["s:1"]}, "cluster": True},
     "redis.cluster: cannot be combined with redis.sentinel"),
    ({"url": "unix:///run/redis.sock", "cluster": True}, "must be redis:// or rediss:// with database 0"),
    ({"url": "redis://r/3", "cluster": True}, "must be redis:// or rediss:// with database 0"),
    ({"url": "redis://:inline@r/0", "passwordEnv": "TEST_REDIS_PASSWORD"}, "redis.url: carries a password"),
    ({"url": "redis://r/0", "passwordEnv": "TEST_REDIS_PASSWORD", "passwordFile": "/x"},
     "redis.passwordFile: give passwordEnv or passwordFile, not both"),
    ({"url": "redis://r/0", "passwordEnv": "NOT_SET_ANYWHERE"},
     "redis.passwordEnv: the environment variable it names is not set or empty"),
    ({"url": "redis://r/0", "passwordEnv": "not a name"}, "redis.passwordEnv: must be an environment variable"),
    ({"url": "redis://r/0", "passwordFile": "/nonexistent/password"}, "redis.passwordFile: cannot read"),
    ({"url": None, "passwordEnv": "TEST_REDIS_PASSWORD"}, "redis: has connection options but no url"),
    ({"url": "http://r:6379"}, "redis.url: must be a redis://, rediss:// or unix:// URL"),
    ({"url": "redis://r/0", "password": "inline"}, "redis.password: unknown field"),
    # A bad port or database: redis-py would raise a traceback making the client, fail the first command
    # (SELECT -1), or take `/x` silently as database 0.
    ({"url": "redis://r:99999"}, "redis.url: has an invalid port (want 1 to 65535)"),
    ({"url": "redis://r:abc/0"}, "redis.url: has an invalid port (want 1 to 65535)"),
    ({"url": "redis://r:0"}, "redis.url: has an invalid port (want 1 to 65535)"),
    ({"url": "redis://r/x"}, "redis.url: the database (the URL's path) must be an integer from 0 to 1023, got 'x'"),
    ({"url": "redis://r/-1"}, "redis.url: the database (the URL's path) must be an integer from 0 to 1023, got '-1'"),
    ({"url": "unix:///run/redis.sock?db=two"}, "redis.url: the db query parameter must be an integer from 0 to 1023"),
    ({"url": "redis://r?socket_timeout=soon"}, "redis.url: has an invalid query option: Invalid value for "
                                              "'socket_timeout'"),
    ({"url": "redis://[::1"}, "redis.url: must be a redis://, rediss:// or unix:// URL"),
], ids=["url-and-sentinel", "no-sentinels", "sentinel-without-port", "no-master-name", "cluster-and-sentinel",
        "cluster-over-unix", "cluster-db-3", "two-passwords", "env-and-file", "unset-variable", "bad-variable-name",
        "unreadable-file", "options-without-redis", "not-a-redis-url", "a-password-in-the-file", "port-too-high",
        "port-not-a-number", "port-0", "db-not-a-number", "db-negative", "db-query-not-a-number",
        "bad-query-option", "unclosed-ipv6-bracket"])
def test_bad_redis_settings_are_named(secrets: Path, block: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings({"redis": block})
    assert message in str(info.value)


@pytest.mark.parametrize("url", ["redis://r:6379/15", "rediss://r:6380", "redis://r:", "redis://[::1]:6379/1",
                                 "unix:///run/redis.sock?db=2", "redis://r?db=3&socket_timeout=0.5"])
def test_good_redis_urls_are_kept_as_written(secrets: Path, url: str) -> None:
    assert parse_settings({"redis": {"url": url}}).redis.url == url


def test_a_bad_redis_url_from_the_environment_is_named_too(secrets: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", "redis://r:65536")
    with pytest.raises(ConfigError, match=r"^\$REDIS_URL: has an invalid port"):
        parse_settings({})


def fleetroute(*args: str) -> subprocess.CompletedProcess[str]:
    """The command in its own process (bounded: a command that does not refuse its arguments would run on)."""
    return subprocess.run([sys.executable, "-m", "router", *args], capture_output=True, text=True, timeout=30)


def test_the_router_exits_2_on_a_bad_redis_url(secrets: Path, tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("redis: {url: 'redis://r/x'}\n")
    result = fleetroute("router", "--config", str(path))
    assert result.returncode == 2 and result.stderr == (
        "fleetroute router: config error: redis.url: the database (the URL's path) must be an integer from 0 to "
        "1023, got 'x'\n")


# ---- a password -----------------------------------------------------------------------------------------


@pytest.fixture
def password_redis(tmp_path: Path):
    server = RedisServer(tmp_path / "redis", args=("--requirepass", PASSWORD)).start()
    try:
        yield server
    finally:
        server.kill()


async def test_the_password_from_a_file_or_a_variable_reaches_redis(make_engine, make_router, http, secrets,
                                                                    password_redis) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    common = {"policies": STICKY, "telemetry": {"enabled": False}}
    a = await make_router(engines, redis={"url": password_redis.url, "passwordFile": str(secrets)}, **common)
    b = await make_router(engines, redis={"url": password_redis.url, "passwordEnv": "TEST_REDIS_PASSWORD"},
                          **common)
    pinned = await chat(http, a, "sam")
    await pins_landed(a)
    assert await chat(http, b, "sam") == pinned  # b found a's pin in Redis
    assert sample(a, "fleetroute_sticky_store_errors_total") == sample(b, "fleetroute_sticky_store_errors_total") == 0
    # Without the password Redis refuses the router, which routes on its own (counted, not failed).
    c = await make_router(engines, redis={"url": password_redis.url}, **common)
    await chat(http, c, "sam")
    assert sample(c, "fleetroute_sticky_store_errors_total") >= 1


async def test_the_agent_takes_its_redis_password_from_a_file(make_engine, secrets, password_redis) -> None:
    engine = await make_engine("e", load=EngineLoad(waiting=3))
    endpoint_id = unique("gpu")
    client = connect(RedisSettings(url=password_redis.url, password=PASSWORD), timeout=5)
    pubsub = client.pubsub()
    await pubsub.subscribe(UPDATES_CHANNEL)  # each record is announced: an event to wait for
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "router", "agent", "--engine-url", engine.url, "--redis", password_redis.url,
        "--redis-password-file", str(secrets), "--endpoint-id", endpoint_id, "--gpu-source", "none",
        "--interval", "200ms", stderr=asyncio.subprocess.DEVNULL)
    try:
        async with asyncio.timeout(20):
            async for message in pubsub.listen():
                if message["type"] == "message" and message["data"] == endpoint_id.encode():
                    break
        assert await client.hget(telemetry_key(endpoint_id), "num_waiting") == b"3.0"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            await pubsub.aclose()
            await client.aclose()


def agent_redis(*flags: str) -> RedisSettings:
    import argparse

    from worker.agent import add_parser, redis_settings

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return redis_settings(parser.parse_args(["agent", "--engine-url", "http://e:8000", "--endpoint-id", "e",
                                             *flags]))


def test_the_agents_redis_flags_mean_what_the_routers_redis_block_means(secrets) -> None:
    assert agent_redis("--redis", "redis://r:6379", "--redis-cluster", "--redis-password-env",
                       "TEST_REDIS_PASSWORD") == RedisSettings(url="redis://r:6379", cluster=True, password=PASSWORD,
                                                               password_source="$TEST_REDIS_PASSWORD")
    assert agent_redis("--redis-sentinel", "s-0:26379, s-1:26379", "--redis-sentinel-master", "m",
                       "--redis-sentinel-password-env", "TEST_SENTINEL_PASSWORD",
                       "--redis-password-file", str(secrets)).sentinel == SentinelSettings(
        master_name="m", addresses=(("s-0", 26379), ("s-1", 26379)), password=SENTINEL_PASSWORD)


@pytest.mark.parametrize("flags, message", [
    (("--redis-sentinel", "s-0", "--redis-sentinel-master", "m"), "--redis-sentinel: must be host:port, got 's-0'"),
    (("--redis-sentinel", "s-0:1"), "--redis-sentinel-master: is required"),
    (("--redis", "http://r"), "--redis: must be a redis://, rediss:// or unix:// URL"),
    (("--redis", "redis://r", "--redis-password-env", "UNSET_HERE"), "--redis-password-env: the environment variable"),
    ((), "--redis: is required (or set REDIS_URL, or give --redis-sentinel)"),
    (("--redis", "redis://r:99999"), "--redis: has an invalid port (want 1 to 65535)"),
    (("--redis", "redis://r/x"), "--redis: the database (the URL's path) must be an integer from 0 to 1023"),
], ids=["sentinel-without-port", "no-master-name", "not-redis", "unset-password-variable", "nothing", "bad-port",
        "bad-db"])
def test_bad_agent_redis_flags_are_named(secrets, flags: tuple[str, ...], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        agent_redis(*flags)
    assert message in str(info.value)


@pytest.mark.parametrize("command", ["agent", "node-agent"])
def test_the_agents_exit_2_on_a_bad_redis_url(secrets, command: str) -> None:
    args = ["--engine-url", "http://e:8000", "--endpoint-id", "e"] if command == "agent" else ["--source", "dcgm"]
    result = fleetroute(command, *args, "--redis", "redis://r:abc")
    assert result.returncode == 2 and result.stderr == (
        f"fleetroute {command}: error: --redis: has an invalid port (want 1 to 65535): 'redis://r:abc'\n")


# ---- Redis Cluster --------------------------------------------------------------------------------------


def cluster_settings(cluster: ClusterServers) -> dict[str, Any]:
    return {"url": cluster.url, "cluster": True, "passwordEnv": "TEST_REDIS_PASSWORD"}


def spread_ids(key: Any, count: int, prefix: str) -> list[str]:
    """`count` ids whose keys fall in different thirds of the slot space: each on another master."""
    ids: dict[int, str] = {}
    n = 0
    while len(ids) < count:
        candidate = f"{prefix}-{uuid.uuid4().hex[:4]}"
        third = min(key_slot(key(candidate).encode()) * 3 // 16384, 2)
        ids.setdefault(third, candidate)
        n += 1
        assert n < 1000
    return list(ids.values())


async def test_telemetry_through_a_redis_cluster(make_engine, make_router, secrets, redis_cluster) -> None:  # noqa: F811
    ids = spread_ids(telemetry_key, 3, "gpu")  # one record on each master: the pipeline spans nodes
    engines = [await make_engine(i, load=EngineLoad(waiting=n + 1)) for n, i in enumerate(ids)]
    redis = RedisSettings(url=redis_cluster.url, cluster=True, password=PASSWORD)
    client = connect(redis, timeout=5)
    wake = asyncio.Event()
    listener = asyncio.create_task(RedisStore(client).listen(wake, retry_after=0.1, metrics=RouterMetrics()))
    try:
        async with aiohttp.ClientSession() as session:
            agents = [Agent(AgentSettings(engine_url=e.url, redis=redis, endpoint_id=e.name, gpu_source="none"),
                            session, client) for e in engines]
            for agent in agents:
                await agent.tick()  # MULTI on the record's key, then PUBLISH
            assert all(agent.published == 1 for agent in agents)
            async with asyncio.timeout(10):  # the router's subscriber hears the cluster-wide PUBLISH
                while not wake.is_set():  # (once it has subscribed: until then, announcements are lost)
                    await agents[0].tick()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(wake.wait(), 0.2)
        router = await make_router(engines, policies=[{"name": "default", "strategy": "adaptive"}],
                                   telemetry={"enabled": True, "interval": "100ms"},
                                   redis=cluster_settings(redis_cluster))
        await telemetry_round(router)
        seen = {i: router.ctx.balancer.snapshot.by_id[i].telemetry for i in ids}
        assert {i: t.num_waiting for i, t in seen.items() if t is not None} == {i: n + 1 for n, i in enumerate(ids)}
        assert sample(router, "fleetroute_telemetry_store_up") == 1
    finally:
        listener.cancel()
        await asyncio.gather(listener, return_exceptions=True)
        await client.delete(*[telemetry_key(i) for i in ids])
        await client.aclose()


async def test_pins_and_in_flight_counts_through_a_redis_cluster(make_engine, make_router, http, secrets,
                                                                 redis_cluster) -> None:  # noqa: F811
    gate = asyncio.Event()
    engines = [await make_engine(f"gpu-{i}", gate=gate) for i in range(2)]  # streams wait for the gate
    common = {"policies": STICKY, "redis": cluster_settings(redis_cluster), "telemetry": {"enabled": False}}
    a = await make_router(engines, seed=1, **common)
    b = await make_router(engines, seed=2, **common)
    # Pins are stored under the session's digest (router/routing/sticky.py): spread the digests' keys over the masters.
    sessions = spread_ids(lambda s: f"fleetroute:v1:sticky:chat:{session_digest(s)}", 3, "sess")
    pinned = {s: await chat(http, a, s) for s in sessions}
    await pins_landed(a)
    assert {s: await chat(http, b, s) for s in sessions} == pinned  # b agrees, whichever node holds the pin
    held = []
    try:
        for _ in range(3):
            resp = await http.post(a.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                                   headers={"x-session-id": "held"})
            await resp.content.readuntil(b"\n\n")
            held.append(resp)
        held_on = held[0].headers["x-fleetroute-endpoint"]
        assert a.ctx.shared_loads is not None and b.ctx.shared_loads is not None
        await a.ctx.shared_loads.exchange()  # one MULTI over the {loads}-tagged keys
        await b.ctx.shared_loads.exchange()
        assert b.ctx.loads.cluster_in_flight(held_on) >= 3 and b.ctx.loads.in_flight(held_on) == 0
        assert sample(b, "fleetroute_shared_loads_errors_total") == 0
    finally:
        gate.set()
        for resp in held:
            await resp.read()
            resp.close()


async def test_the_prefix_index_is_shared_through_a_redis_cluster(make_engine, make_router, http, secrets,
                                                                  redis_cluster) -> None:  # noqa: F811
    from router.routing.prefix.sharing import stream_key
    from tests.test_prefix_sharing import conversation

    name = unique("p")
    models = spread_ids(lambda m: stream_key(name, m, 256), 2, "model")  # two pools, streams on two masters
    engines = [await make_engine(f"gpu-{i}", models=tuple(models)) for i in range(4)]
    common = {"policies": [{"name": name, "models": ["*"], "strategy": "prefix-aware"}],
              "redis": cluster_settings(redis_cluster), "telemetry": {"enabled": False}}
    a = await make_router(engines, seed=1, **common)
    b = await make_router(engines, seed=2, **common)
    bodies = {m: {**conversation(n, 1), "model": m} for n, m in enumerate(models)}
    first = {}
    for m, body in bodies.items():
        async with http.post(a.ingress_url + "/v1/chat/completions", json=body) as resp:
            first[m] = resp.headers["x-fleetroute-endpoint"]
    assert a.ctx.prefix_upkeep is not None and b.ctx.prefix_upkeep is not None
    await a.ctx.prefix_upkeep.round()  # XADD to both streams, one pipeline split by node
    await b.ctx.prefix_upkeep.round()  # one XREAD per stream
    for m, body in bodies.items():
        async with http.post(b.ingress_url + "/v1/chat/completions", json=body) as resp:
            assert resp.headers["x-fleetroute-endpoint"] == first[m]  # b found what a routed
    assert sample(b, "fleetroute_prefix_sharing_up") == 1
    assert sample(b, "fleetroute_prefix_shared_blocks_total", outcome="received") > 0


# ---- Sentinel and a failover ----------------------------------------------------------------------------


def sentinel_settings(servers: SentinelServers) -> dict[str, Any]:
    return {"sentinel": {"masterName": MASTER_NAME, "addresses": [servers.address],
                         "passwordEnv": "TEST_SENTINEL_PASSWORD"},
            "passwordEnv": "TEST_REDIS_PASSWORD"}


async def test_through_a_sentinel_failover_telemetry_pins_and_in_flight_counts_recover(
        make_engine, make_router, http, secrets, redis_sentinel) -> None:  # noqa: F811
    gate = asyncio.Event()
    engines = [await make_engine(f"gpu-{i}", gate=gate, load=EngineLoad(waiting=1)) for i in range(2)]
    redis = parse_settings({"redis": sentinel_settings(redis_sentinel)}).redis
    client = connect(redis, timeout=2)
    session = aiohttp.ClientSession()
    agents = [Agent(AgentSettings(engine_url=e.url, redis=redis, endpoint_id=e.name, gpu_source="none"),
                    session, client) for e in engines]
    common = {"policies": STICKY, "redis": sentinel_settings(redis_sentinel),
              "telemetry": {"enabled": True, "interval": "100ms"}}
    held: list[aiohttp.ClientResponse] = []
    try:
        for agent in agents:
            await agent.tick()
        a = await make_router(engines, seed=1, **common)
        b = await make_router(engines, seed=2, **common)
        await telemetry_round(a)
        assert a.ctx.balancer.snapshot.by_id["gpu-1"].telemetry.num_waiting == 1
        before = await chat(http, a, "before")
        await pins_landed(a)
        redis_sentinel.replicated()  # what the old master had, the replica has

        promoted = redis_sentinel.failover()

        # Telemetry: the agents' next writes reach the new master, the routers read them there.
        engines[1].load = EngineLoad(waiting=7)
        async with asyncio.timeout(20):
            while agents[1].published < 2:  # a write in flight during the failover may fail once
                await agents[1].tick()
            while a.ctx.balancer.snapshot.by_id["gpu-1"].telemetry.num_waiting != 7:
                await telemetry_round(a)
        # Pins: the one written before the failover is on the new master; new ones are shared again.
        restarted = await make_router(engines, seed=3, **common)
        assert await chat(http, restarted, "before") == before
        after = await chat(http, a, "after")
        await pins_landed(a)
        assert await chat(http, b, "after") == after
        # In-flight sharing: a's held streams count in b's load bounds.
        for _ in range(2):
            resp = await http.post(a.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                                   headers={"x-session-id": "held"})
            await resp.content.readuntil(b"\n\n")
            held.append(resp)
        held_on = held[0].headers["x-fleetroute-endpoint"]
        assert a.ctx.shared_loads is not None and b.ctx.shared_loads is not None
        async with asyncio.timeout(20):
            while b.ctx.loads.cluster_in_flight(held_on) < 2:  # an exchange may meet the failover once
                await a.ctx.shared_loads.exchange()
                await b.ctx.shared_loads.exchange()
        with redis_sentinel.data_client(promoted) as new_master:
            # written after the failover, on the new master
            assert new_master.get(f"fleetroute:v1:sticky:chat:{session_digest('after')}") == after.encode()
    finally:
        gate.set()
        for resp in held:
            await resp.read()
            resp.close()
        await session.close()
        await client.aclose()
