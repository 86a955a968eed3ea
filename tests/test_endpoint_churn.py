"""Endpoint churn frees everything: Kubernetes discovery rolls 200 pods through a real router, each pod taking
real traffic (sessions, prefix-aware least-prefill streams with cost estimates and admission caps, consistent
hashing, failures that eject and trip breakers, failing health checks, GPU telemetry), and once the pods are
gone the router holds exactly what it held before they came: the same /metrics series with an `endpoint` label,
and no structure anywhere that still names one of them (router/routing/departures.py).

"Anywhere" is checked generically, not against a list: `endpoint_holders` walks every object reachable from
the router's context (and the locals of its background loops), so a per-endpoint map someone adds later
without freeing it fails this test by its path. Every wait is on an event (discovery's progress, telemetry
and housekeeping rounds, the departures' progress); nothing sleeps.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import re
import time
import types
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis

from router.server.app import RunningRouter, health_round
from tests.fake_engine import FakeEngine
from tests.fake_kube import FakeKube, endpoint_slice, pod, slice_endpoint
from tests.redis_server import redis_url  # noqa: F401 - fixture
from worker.protocol import EngineSample, GpuSample, TelemetryRecord, telemetry_key
from worker.publisher import RedisPublisher

NS = "inference"
SERVICE = "vllm"
CHAT, KEYED, BASE, HELD = "chat-model", "keyed-model", "base-model", "held-model"
THERMAL = 0x20  # NVML SwThermalSlowdown: the GPU health input excludes the endpoint
# Pods per wave: two good, one throttled (its GPU telemetry says so), one failing every request, and one failing
# its health checks (whose agent, with Redis, writes records of a newer schema).
WAVE = 5
CHURNED = 200
MakeRouter = Callable[..., Awaitable[RunningRouter]]
MakeEngine = Callable[..., Awaitable[FakeEngine]]

HEALTH = {"health": {"interval": "1h", "unhealthyThreshold": 1},  # the test runs the rounds (health_round)
          "outlierDetection": {"consecutiveFailures": 1}, "circuitBreaker": {"minRequests": 1},
          "slowStart": {"window": "1h"}, "panicThreshold": 0,
          "retries": {"attempts": 3, "minRetriesPerSecond": 1000}}
POLICIES = [
    {"name": "chat", "models": [CHAT], "strategy": "prefix-aware",
     "prefixAware": {"selection": "least-prefill", "blockChars": 64},
     "stickiness": {"key": "header:x-session-id"}, "cost": {"enabled": True},
     "admission": {"maxConcurrentPerEndpoint": 4}, **HEALTH},
    {"name": "keyed", "models": [KEYED], "strategy": "consistent-hash",
     "consistentHash": {"key": "header:x-tenant-id", "maxLoadFactor": 1.25}, **HEALTH},
    {"name": "base", "models": [BASE, HELD], "strategy": "round-robin", "health": {"interval": "1h"}},
]


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    fake = await FakeKube().start()
    yield fake
    await fake.stop()


# ---- what the router holds per endpoint: found by walking it, not from a list ---------------------------


OWN_MODULES = ("router.", "worker.", "prometheus_client.", "uhashring.")
# What may name an endpoint that is gone without being state kept for it: a bounded history, as a log is (the
# recent routing decisions: at most explain.recent, router/server/explain.py), and the last message a loop received
# (an agent's "new record" announcement on the telemetry channel).
NOT_STATE = ("ctx.decisions._recent", "task[telemetry-pubsub]:listen.message")


def _attributes(obj: Any) -> Iterator[tuple[str, Any]]:
    names = list(getattr(obj, "__dict__", {}))
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else list(slots)
    for name in dict.fromkeys(names):
        if name != "__weakref__" and hasattr(obj, name):
            yield name, getattr(obj, name)


def _names_one(value: Any, ids: frozenset[str]) -> bool:
    if isinstance(value, str):
        return value in ids
    return isinstance(value, tuple) and any(_names_one(v, ids) for v in value)


def _walk(roots: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """(path, object) for every object reachable from the roots through builtin containers, objects of the
    router (and of the libraries it keeps state in: prometheus-client, uhashring) and their attributes. Other
    libraries' objects (sessions, clients, tasks, locks) are not entered; functions and methods neither.
    Breadth first, one root after the other: each object gets its shortest path from the first root."""
    seen: set[int] = set()
    for root_path, root in roots.items():
        queue = deque([(root_path, root)])
        while queue:
            path, obj = queue.popleft()
            if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None))):
                continue
            seen.add(id(obj))
            if isinstance(obj, dict):
                yield path, obj
                for key, value in obj.items():
                    queue.append((f"{path}[{key!r}]", value))
                    if not isinstance(key, (str, int, float, tuple)):
                        queue.append((f"{path}<key {type(key).__name__}>", key))
            elif isinstance(obj, (list, tuple, set, frozenset, deque)):
                yield path, obj
                ordered = isinstance(obj, (list, tuple, deque))
                for i, value in enumerate(obj):
                    queue.append((f"{path}[{i}]" if ordered else f"{path}{{}}", value))
            elif isinstance(obj, types.CoroutineType):  # a background loop: its locals live as long as it does
                frame = obj.cr_frame
                if frame is not None and frame.f_globals.get("__name__", "").startswith("router."):
                    for name, value in frame.f_locals.items():
                        if not isinstance(value, (str, tuple)):  # a loop's variables hold the item in hand
                            queue.append((f"{path}:{obj.cr_code.co_name}.{name}", value))
                    queue.append((f"{path}:{obj.cr_code.co_name}>", obj.cr_await))
            elif type(obj).__module__.startswith(OWN_MODULES):
                for name, value in _attributes(obj):
                    queue.append((f"{path}.{name}", value))


def _roots(router: RunningRouter) -> dict[str, Any]:
    """The context, and the router's background loops (Kubernetes discovery's watch is left out: its locals are
    the raw API objects of the event in hand)."""
    roots: dict[str, Any] = {"ctx": router.ctx}
    for task in sorted(asyncio.all_tasks(), key=lambda t: t.get_name()):
        if task is not asyncio.current_task() and not task.get_name().startswith("discovery-kubernetes"):
            roots[f"task[{task.get_name()}]"] = task.get_coro()
    return roots


def endpoint_holders(router: RunningRouter, ids: frozenset[str]) -> dict[str, int]:
    """Every container reachable from the router that names one of `ids` (as a key, an element, a value, or
    inside a tuple of them: a metric's label values), by path, with the number of its entries that do, those
    bounded by `NOT_STATE` left out."""
    found = {}
    for path, obj in _walk(_roots(router)):
        if path.startswith(NOT_STATE):
            continue
        entries: Any = obj.items() if isinstance(obj, dict) else obj
        n = sum(1 for entry in entries if _names_one(entry, ids))
        if n:
            found[path] = n
    return found


async def endpoint_series(http: aiohttp.ClientSession, router: RunningRouter) -> list[str]:
    """The /metrics samples with a non-empty `endpoint` label, as exposed."""
    async with http.get(router.admin_url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
        text = await resp.text()
    return [line for line in text.splitlines() if re.search(r'[{,]endpoint="[^"]', line)]


# ---- the fleet ---------------------------------------------------------------------------------------


async def start_router(make_router: MakeRouter, kube: FakeKube, tmp_path: Path, **config: Any) -> RunningRouter:
    """A router with the test's policies, its endpoints all from Kubernetes discovery."""
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    return await make_router([], policies=POLICIES, discovery={"kubernetes": {
        "service": SERVICE, "kubeconfig": str(kubeconfig), "initialBackoff": "10ms", "maxBackoff": "40ms"}},
        **config)


def add_pods(kube: FakeKube, pods: dict[str, FakeEngine], models: tuple[str, ...]) -> None:
    """Pods and the EndpointSlice listing each (one per pod; several pods may share one engine's port)."""
    for name, engine in pods.items():
        kube.create("pods", pod(name, annotations={"fleetroute.io/models": ",".join(models)}), namespace=NS)
        kube.create("endpointslices", endpoint_slice(
            f"{SERVICE}-{name}", service=SERVICE, port=engine.port,
            endpoints=[slice_endpoint(name, namespace=NS)]), namespace=NS)


def terminate(kube: FakeKube, name: str) -> None:
    obj = copy.deepcopy(kube.get("endpointslices", NS, f"{SERVICE}-{name}"))
    assert obj is not None
    obj["endpoints"] = [slice_endpoint(name, namespace=NS, ready=True, terminating=True)]
    kube.update("endpointslices", obj, namespace=NS)


def remove(kube: FakeKube, name: str) -> None:
    kube.delete("endpointslices", f"{SERVICE}-{name}", namespace=NS)
    kube.delete("pods", name, namespace=NS)


def members(router: RunningRouter) -> dict[str, str]:
    return {v.id: v.state.value for v in router.ctx.balancer.snapshot.views}


async def until_discovered(router: RunningRouter, predicate: Callable[[], bool]) -> None:
    assert router.ctx.discovery is not None
    async with asyncio.timeout(10):
        await router.ctx.discovery.wait_for(predicate)


async def until_telemetry(router: RunningRouter, ids: list[str]) -> None:
    """Telemetry rounds until every one of `ids` has a report in the snapshot."""
    async with asyncio.timeout(10):
        while not all(router.ctx.balancer.snapshot.by_id[i].telemetry is not None for i in ids):
            await router.ctx.telemetry_round.wait()


async def publish(client: aioredis.Redis | None, name: str, *, throttled: bool = False, schema: int = 1) -> None:
    """What each pod's agent writes to Redis (an engine and a GPU sample); `schema` 2: an agent newer than the
    router, whose records are ignored (and the endpoint's telemetry stays unknown)."""
    if client is None:
        return
    if schema != 1:
        await client.hset(telemetry_key(name), mapping={"schema": str(schema), "endpoint_id": name, "reported_at": "1"})
        await client.expire(telemetry_key(name), 3600)
        return
    await RedisPublisher(client, ttl=3600).publish(TelemetryRecord(
        endpoint_id=name, reported_at=time.time(), seq=1, interval=1.0, gpu_source="nvml",
        gpu=GpuSample(util=0.5, mem_used_bytes=40, mem_total_bytes=80, xid_errors=0, ecc_uncorrected=0,
                      throttle_reasons=THERMAL if throttled else 0),
        engine=EngineSample(up=True, kv_cache_usage=0.2, num_waiting=0, num_running=1, kv_capacity_tokens=65536),
    ))


async def send(http: aiohttp.ClientSession, router: RunningRouter, model: str, *, stream: bool = False,
               headers: dict[str, str] | None = None, prompt: str = "hi") -> int:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": stream}
    async with http.post(router.ingress_url + "/v1/chat/completions", json=body, headers=headers,
                         timeout=aiohttp.ClientTimeout(total=10)) as resp:
        await resp.read()
        return resp.status


async def exercise(http: aiohttp.ClientSession, router: RunningRouter, wave: int) -> None:
    """Traffic that gives the serving pods every kind of per-endpoint state: sessions pinned, prefixes indexed,
    prefill booked and timed (streams placed by least-prefill), costs in flight, a hash ring, health probes
    (one pod fails them), and failures (one pod answers 500: ejected, its breaker opens, retried elsewhere)."""
    async with asyncio.timeout(10):
        for policy in ("chat", "keyed"):
            await health_round(router.ctx, policy)
    for k in range(8):
        prompt = f"wave {wave} conversation {k % 3}: " + "the same long system prompt, " * 8
        await send(http, router, CHAT, stream=True, prompt=prompt, headers={"x-session-id": f"s-{wave}-{k % 4}"})
    for k in range(4):
        await send(http, router, KEYED, headers={"x-tenant-id": f"tenant-{wave}-{k}"})
    assert router.ctx.prefix_upkeep is not None
    async with asyncio.timeout(10):
        await router.ctx.prefix_upkeep.round()  # tuning windows, exported index sizes, sharing through Redis


# Per-endpoint structures the traffic above must populate (a check on the test: the walk finds them holding
# churned pods at some point). Each is a path, or a pattern for paths keyed by a policy or pool.
EXPECTED_HOLDERS = [
    "ctx.loads._counts", "ctx.loads._costs", "ctx.loads._children", "ctx.loads.prefill._work",
    "ctx.loads.prefill._seen", "ctx.balancer._endpoints", "ctx.balancer._telemetry", "ctx.balancer._expiry",
    "ctx.telemetry_feed._applied",
    "ctx.balancer.gpu_health._seen", "ctx.balancer.gpu_health._current",
    "ctx.balancer.health['chat'].active._tracks", "ctx.balancer.health['chat'].outlier._states",
    "ctx.balancer.health['chat']._breakers", "ctx.balancer.health['chat']._breaker_seen",
    "ctx.balancer.health['chat']._excluded", "ctx.balancer.health['chat'].slow_start._since",
    "ctx.balancer.health['keyed']._admitted", "ctx.balancer._decision_children",
    "ctx.balancer._pool_state[('chat', 'chat-model')].by_endpoint",
    "ctx.balancer._pool_state[('chat', 'chat-model')].tuning",
    "ctx.balancer._pool_state[('chat', 'chat-model')]._estimate",
    "ctx.balancer._pool_state[('keyed', 'keyed-model')].members",
    "ctx.sticky['chat']._local", "ctx.metrics._children", "ctx.prefix_upkeep._sized",
    "ctx.metrics.requests._metrics", "ctx.metrics.upstream_errors._metrics", "ctx.metrics.ejections._metrics",
    "ctx.metrics.health_checks._metrics", "ctx.metrics.excluded._metrics", "ctx.metrics.prefill_speed._metrics",
    "ctx.metrics.prefix_index_blocks._metrics", "ctx.metrics.breaker_transitions._metrics",
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("telemetry", ["redis", "embedded"])
async def test_rolling_200_pods_through_discovery_leaves_nothing_behind(
    telemetry: str, kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession,
    tmp_path: Path, request: pytest.FixtureRequest,
) -> None:
    run = uuid.uuid4().hex[:6]  # tests may share one Redis: telemetry keys and prefix streams never collide
    good = [await make_engine(f"good-{i}", models=(CHAT, KEYED)) for i in range(3)]
    failing = await make_engine("failing", models=(CHAT, KEYED), fail_status=500)
    sick = await make_engine("sick", models=(CHAT, KEYED), unhealthy=True)
    base_engine = await make_engine("base", models=(BASE,))
    redis = None
    # A scrape timeout far above the default 0.5 s: a base pod's scrape that a loaded machine makes late would count
    # a scrape error (a series of its own), and the comparison below is of what the churn leaves, not of the machine.
    config: dict[str, Any] = {"telemetry": {"enabled": True, "interval": "50ms", "staleAfter": "1h", "timeout": "10s"},
                              "explain": {"sampleRate": 0.2}}
    if telemetry == "redis":
        url = request.getfixturevalue("redis_url")
        redis = aioredis.from_url(url, decode_responses=True, socket_timeout=5)
        config["redis"] = {"url": url}
    base = {f"base-{run}-{i}": base_engine for i in range(3)}
    for name in base:
        await publish(redis, name)
    add_pods(kube, base, (BASE,))
    router = await start_router(make_router, kube, tmp_path, **config)
    try:
        await until_telemetry(router, list(base))
        for _ in range(3):
            assert await send(http, router, BASE) == 200
        await health_round(router.ctx, "base")
        async with asyncio.timeout(10):
            await router.ctx.housekeeping_round.wait()
        start_series = await endpoint_series(http, router)
        start = endpoint_holders(router, frozenset(base))
        assert start_series and start  # the base pods have state and series of their own: they must stay

        churned: list[str] = []
        peak_series = 0
        seen_holders: set[str] = set()
        previous: list[str] = []
        draining: list[str] = []
        for wave in range(CHURNED // WAVE):
            pods = {f"churn-{run}-{wave:02d}-{j}": engine
                    for j, engine in enumerate([good[0], good[1], good[2], failing, sick])}
            for j, name in enumerate(pods):
                await publish(redis, name, throttled=j == 2, schema=2 if j == 4 else 1)
            with kube.batch():  # a rolling update's step: new pods ready, the previous terminating, older gone
                add_pods(kube, pods, (CHAT, KEYED))
                for name in previous:
                    terminate(kube, name)
                for name in draining:
                    remove(kube, name)
            draining, previous = previous, list(pods)
            churned += pods
            wanted = {**dict.fromkeys(pods, "serving"), **dict.fromkeys(draining, "draining")}
            await until_discovered(router, lambda w=wanted: all(members(router).get(n) == s for n, s in w.items()))
            await until_telemetry(router, list(pods)[:4] if redis is not None else list(pods))
            await exercise(http, router, wave)
            peak_series = max(peak_series, len(await endpoint_series(http, router)))
            seen_holders |= set(endpoint_holders(router, frozenset(churned)))

        with kube.batch():  # the rollout ends: the last pods go too
            for name in previous + draining:
                remove(kube, name)
        await until_discovered(router, lambda: set(members(router)) == set(base))
        # Every background loop runs once more after the last departure, and must not bring anything back.
        async with asyncio.timeout(10):
            for _ in range(2):
                await router.ctx.telemetry_round.wait()
            await router.ctx.housekeeping_round.wait()
            assert router.ctx.prefix_upkeep is not None
            await router.ctx.prefix_upkeep.round()
            for policy in ("chat", "keyed", "base"):
                await health_round(router.ctx, policy)

        # The test gave the pods what it meant to give them.
        assert len(churned) == CHURNED
        missing = [p for p in EXPECTED_HOLDERS if p not in seen_holders]
        if telemetry == "redis" and "ctx.telemetry_feed._schema_warned" not in seen_holders:
            missing.append("ctx.telemetry_feed._schema_warned")
        if telemetry == "embedded":  # no GPU samples without an agent (gpuSource: none); the router scrapes
            missing = [p for p in missing if p != "ctx.balancer.gpu_health._current"]
            missing += [p for p in ("ctx.telemetry_collection._collectors", "ctx.telemetry_feed._store._records")
                        if p not in seen_holders]
        assert not missing, f"the traffic never populated {missing}"
        assert peak_series > len(start_series) + WAVE * 10

        # Nothing reachable from the router names a pod that left, and every structure holds as many entries per
        # endpoint as it did with the starting set...
        left = endpoint_holders(router, frozenset(churned))
        assert left == {}, f"state kept for endpoints that left, in {len(left)} places: " + ", ".join(
            f"{path} ({n})" for path, n in sorted(left.items(), key=lambda item: len(item[0]))[:12])
        assert endpoint_holders(router, frozenset(base) | frozenset(churned)) == start
        # ...and /metrics has the same series with an endpoint label as before the rollout.
        end_series = await endpoint_series(http, router)
        assert {s.split(" ")[0] for s in end_series} == {s.split(" ")[0] for s in start_series}
        assert router.ctx.metrics.registry.get_sample_value("fleetroute_endpoints_forgotten_total") == CHURNED
        assert router.ctx.balancer.departures.leaving == frozenset()
    finally:
        if redis is not None:
            await redis.aclose()


# ---- a pod that leaves with requests in flight, and one that comes back on a new address ------------------


async def open_stream(http: aiohttp.ClientSession, router: RunningRouter, model: str) -> aiohttp.ClientResponse:
    """A streamed answer whose first token has arrived (its engine then waits on its gate)."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "stream": True}
    resp = await http.post(router.ingress_url + "/v1/chat/completions", json=body)
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    return resp


async def test_a_pod_deleted_mid_stream_keeps_its_count_until_the_stream_ends_then_is_freed(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fleetroute.departures")
    held = await make_engine("held", models=(HELD,))
    held.gate = asyncio.Event()
    add_pods(kube, {"held-0": held}, (HELD,))
    add_pods(kube, {"base-0": await make_engine("base", models=(BASE,))}, (BASE,))
    router = await start_router(make_router, kube, tmp_path)
    departures, loads = router.ctx.balancer.departures, router.ctx.loads
    stream = await open_stream(http, router, HELD)
    assert stream.headers["x-fleetroute-endpoint"] == "held-0" and loads.in_flight("held-0") == 1

    remove(kube, "held-0")  # force-deleted: it leaves its EndpointSlice while it streams
    await until_discovered(router, lambda: "held-0" not in members(router))
    # Its routing state is gone at once; its in-flight count and series stay exact while the stream runs.
    assert departures.leaving == {"held-0"} and loads.in_flight("held-0") == 1
    series = await endpoint_series(http, router)
    assert 'fleetroute_endpoint_in_flight_requests{endpoint="held-0"} 1.0' in series
    assert router.ctx.metrics.registry.get_sample_value("fleetroute_endpoints_leaving") == 1.0
    assert "endpoint left with requests in flight; its load state and series are kept until they end" in [
        r.getMessage() for r in caplog.records if r.name == "fleetroute.departures"]

    held.gate.set()
    assert (await stream.read()).decode().rstrip().endswith("data: [DONE]")  # the stream finished normally
    stream.release()
    async with asyncio.timeout(5):
        await departures.progress.wait_for(lambda: not departures.leaving)
    # Freed after the request was recorded: no series of it came back, nothing names it, no count went negative.
    assert not [s for s in await endpoint_series(http, router) if 'endpoint="held-0"' in s]
    assert endpoint_holders(router, frozenset({"held-0"})) == {}
    assert loads.in_flight("held-0") == 0 and loads.total() == 0
    assert router.ctx.metrics.registry.get_sample_value("fleetroute_endpoints_leaving") == 0.0
    assert router.ctx.metrics.registry.get_sample_value("fleetroute_endpoints_forgotten_total") == 1.0


async def test_a_pod_recreated_on_a_new_address_is_a_new_endpoint_that_keeps_its_in_flight_requests(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    old, new = await make_engine("old", models=(CHAT, KEYED)), await make_engine("new", models=(CHAT, KEYED))
    old.gate = asyncio.Event()
    add_pods(kube, {"sts-0": old, "sts-1": old}, (CHAT, KEYED))  # a StatefulSet's pods
    router = await start_router(make_router, kube, tmp_path)
    balancer, loads = router.ctx.balancer, router.ctx.loads
    stream = await open_stream(http, router, KEYED)
    pod_name = stream.headers["x-fleetroute-endpoint"]
    assert balancer.health_report(pod_name)["keyed"]["slow_start_weight"] == 1.0  # there from the start

    # The pod is recreated under its name on another address (here: another port) while its old self streams.
    obj = copy.deepcopy(kube.get("endpointslices", NS, f"{SERVICE}-{pod_name}"))
    assert obj is not None
    obj["ports"][0]["port"] = new.port
    kube.update("endpointslices", obj, namespace=NS)
    await until_discovered(router, lambda: balancer.snapshot.by_id[pod_name].endpoint.url == new.url)
    # A new incarnation: its health starts over (it ramps up like any new pod)...
    assert balancer.health_report(pod_name)["keyed"]["slow_start_weight"] < 1.0
    # ...while the old incarnation's request still counts under the same id, and nothing is freed.
    assert loads.in_flight(pod_name) == 1 and balancer.departures.leaving == frozenset()
    assert f'fleetroute_endpoint_in_flight_requests{{endpoint="{pod_name}"}} 1.0' in await endpoint_series(http, router)
    old.gate.set()
    await stream.read()
    stream.release()
    async with asyncio.timeout(5):
        while loads.in_flight(pod_name):  # the router's side of the stream ends just after the client's
            await router.ctx.housekeeping_round.wait()
    assert f'fleetroute_endpoint_in_flight_requests{{endpoint="{pod_name}"}} 0.0' in await endpoint_series(http, router)
    assert router.ctx.metrics.registry.get_sample_value("fleetroute_endpoints_forgotten_total") == 0.0
