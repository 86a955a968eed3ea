"""Fair sharing between tenants inside an admission class (router/traffic/fair_queue.py, router/traffic/admission.py).

The simulation drives a saturated pool's admission queue directly, with a fake clock and seeded arrivals: a
heavy tenant sends five times its share against a light tenant that asks for half of its own, and the light
tenant's share of service and its P99 queue wait are checked with fairness on, and shown to collapse with it
off. The table-driven tests pin the order (weights, tokens not requests, no credit for idling), and that
ageing, deadlines and eviction still work with tenants; one end-to-end test goes through a real router.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest

from router.config.settings import parse_settings
from router.model import RequestInfo
from router.server.app import build_context
from router.server.context import RouterContext
from router.traffic.admission import Pool
from tests.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _config(admission: dict[str, Any], tenants: list[dict[str, Any]], *, fairness: bool = True,
            endpoints: int = 1) -> dict[str, Any]:
    return {
        "endpoints": [{"id": f"gpu-{i}", "url": f"http://127.0.0.1:{9 + i}", "models": [MODEL]}
                      for i in range(endpoints)],
        "policies": [{"name": "default", "strategy": "least-connections", "admission": admission}],
        "telemetry": {"enabled": False},
        "redis": {"url": None},
        "tenancy": {"fairness": fairness, "tenants": tenants},
    }


class Harness:
    """A router context without sockets: requests are `pool.admit` calls; a held slot is `loads.track()`."""

    def __init__(self, admission: dict[str, Any], tenants: list[dict[str, Any]], *, fairness: bool = True,
                 endpoints: int = 1) -> None:
        self.clock = FakeClock()
        self.ctx: RouterContext = build_context(parse_settings(_config(admission, tenants, fairness=fairness,
                                                                       endpoints=endpoints)), clock=self.clock)
        pool = self.ctx.admission.pool(self.ctx.balancer.policy_for(MODEL), MODEL)
        assert pool is not None
        self.pool: Pool = pool
        self.admitted: list[str] = []
        self.shed: dict[str, Any] = {}
        self.slots: dict[str, contextlib.ExitStack] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}

    def hold(self, label: str, endpoint: str = "gpu-0") -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.ctx.loads.track(endpoint))
        self.slots[label] = stack

    def release(self, label: str) -> None:
        self.slots.pop(label).close()

    async def _request(self, rid: str, tenant: str, cost: float, headers: dict[str, str]) -> None:
        shed = await self.pool.admit(rid, headers, cost, tenant)
        if shed is not None:
            self.shed[rid] = shed
            return
        self.admitted.append(rid)
        view = self.ctx.balancer.pick(RequestInfo(model=MODEL, request_id=rid, headers={}, body={}),
                                      self.pool.exclude(frozenset()))
        assert view is not None
        self.hold(rid, view.id)

    async def send(self, rid: str, tenant: str, cost: float = 100.0, **headers: str) -> None:
        self.tasks[rid] = asyncio.create_task(self._request(rid, tenant, cost, {k.replace("_", "-"): v
                                                                                for k, v in headers.items()}))
        await _until(lambda: rid in self.admitted or rid in self.shed or rid in self.queued_ids())

    def queued_ids(self) -> set[str]:
        return {w.request_id for queue in self.pool._queues.values() for w in queue}

    async def drain(self, n: int) -> None:
        """Release the slot (held by "busy", then by the latest admitted request), `n` times, each time waiting
        for the next request to take it."""
        start = len(self.admitted)
        for i in range(1, n + 1):
            self.release(self.admitted[-1] if self.admitted else "busy")
            await _until(lambda i=i: len(self.admitted) == start + i)

    def sample(self, name: str, **labels: str) -> float | None:
        return self.ctx.metrics.registry.get_sample_value(name, labels)


async def _until(condition: Any) -> None:
    """Yield to the event loop until `condition()` holds (bounded; never a timed sleep)."""
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)


TWO = [{"name": "a"}, {"name": "b"}]
CAP1 = {"maxConcurrentPerEndpoint": 1, "maxQueue": 1000}


# ---- the order within a class ----------------------------------------------------------------------------


async def test_one_tenant_keeps_the_order_admission_had_without_tenants() -> None:
    # Fairness on, but every request is `default`'s: one flow per class, so classes first, FIFO within each.
    h = Harness({**CAP1, "agingSeconds": None}, [])
    h.hold("busy")
    for rid, priority in [("low-1", "low"), ("normal-1", "normal"), ("low-2", "low"), ("high-1", "high"),
                          ("normal-2", "normal"), ("high-2", "high")]:
        await h.send(rid, "default", x_priority=priority)
    await h.drain(6)
    assert h.admitted == ["high-1", "high-2", "normal-1", "normal-2", "low-1", "low-2"]


@pytest.mark.parametrize(
    ("weights", "expected"),
    [
        # Equal weights, equal costs: the flows alternate, although all of a's requests arrived first.
        ((1, 1), "ababab" + "aa"),
        # a weighs 2: two of a's requests per one of b's while both wait. Start tags a 0, 50, 100, 150, 200 and
        # b 0, 100, 200; the lowest goes first, and a tie goes to the older request (a's arrived first).
        ((2, 1), "abaabaab"),
    ],
    ids=["equal", "two-to-one"],
)
async def test_tenants_of_one_class_are_served_in_proportion_to_their_weights(weights, expected) -> None:
    h = Harness(CAP1, [{"name": "a", "weight": weights[0]}, {"name": "b", "weight": weights[1]}])
    h.hold("busy")
    for i in range(5):
        await h.send(f"a{i}", "a")
    for i in range(3):
        await h.send(f"b{i}", "b")
    await h.drain(8)
    assert "".join(rid[0] for rid in h.admitted) == expected


async def test_fair_shares_are_counted_in_tokens_not_requests() -> None:
    # a's requests are 10 times b's: with equal weights b gets about ten requests per one of a's.
    h = Harness(CAP1, TWO)
    h.hold("busy")
    for i in range(3):
        await h.send(f"a{i}", "a", cost=1000)
    for i in range(25):
        await h.send(f"b{i:02d}", "b", cost=100)
    await h.drain(24)
    order = "".join(rid[0] for rid in h.admitted)
    assert order == "a" + "b" * 10 + "a" + "b" * 10 + "a" + "b"


async def test_an_idle_tenant_earns_no_credit() -> None:
    # a is served alone for a while; when b arrives it gets its turn at once, but no catch-up burst: from then
    # on the two alternate.
    h = Harness(CAP1, TWO)
    h.hold("busy")
    for i in range(10):
        await h.send(f"a{i}", "a")
    await h.drain(4)
    for i in range(4):
        await h.send(f"b{i}", "b")
    await h.drain(6)
    assert "".join(rid[0] for rid in h.admitted) == "aaaa" + "bababa"


async def test_with_shortest_expected_first_each_tenants_flow_keeps_that_order() -> None:
    # Within a's flow the cheapest goes first; between a and b, tokens alternate (each pays its own cost).
    h = Harness({**CAP1, "order": "shortest-expected-first"}, TWO)
    h.hold("busy")
    for rid, cost in (("a-300", 300), ("a-100", 100), ("a-200", 200)):
        await h.send(rid, "a", cost=cost)
    for rid, cost in (("b-250", 250), ("b-50", 50)):
        await h.send(rid, "b", cost=cost)
    await h.drain(5)
    # Start tags: a-100 and b-50 tie at 0 (b-50's key is lower: cheaper), then a-100 (a 0 < b 50), b-250 (b 50 <
    # a 100), a-200 (a 100 < b 300), a-300.
    assert h.admitted == ["b-50", "a-100", "b-250", "a-200", "a-300"]


async def test_classes_still_come_first_and_ageing_still_lifts_a_class() -> None:
    h = Harness({**CAP1, "agingSeconds": 10}, TWO)
    h.hold("busy")
    await h.send("low-a", "a", x_priority="low")
    h.clock.now += 25  # 2.5 classes of ageing: ahead of a fresh high request
    await h.send("high-b", "b", x_priority="high")
    await h.send("normal-b", "b", x_priority="normal")
    await h.drain(3)
    assert h.admitted == ["low-a", "high-b", "normal-b"]


async def test_deadlines_still_shed_and_are_counted_per_tenant() -> None:
    h = Harness(CAP1, TWO)
    h.hold("busy")
    await h.send("a0", "a", x_request_deadline_ms="1000")
    await h.send("b0", "b")
    h.clock.now += 1.5
    h.pool.sweep()
    await _until(lambda: "a0" in h.shed)
    assert orjson.loads(h.shed["a0"].body)["error"]["code"] == "queue_deadline_exceeded"
    assert h.sample("fleetroute_tenant_shed_total", tenant="a", model=MODEL, reason="deadline") == 1
    assert h.sample("fleetroute_tenant_queue_depth", tenant="b", model=MODEL) == 1
    await h.drain(1)
    assert h.admitted == ["b0"]
    assert h.sample("fleetroute_tenant_queue_wait_seconds_count", tenant="b", model=MODEL) == 1


async def test_a_full_queue_drops_the_flooding_tenants_newest_not_the_newcomer() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1, "maxQueue": 4}, TWO)
    h.hold("busy")
    for i in range(4):
        await h.send(f"a{i}", "a")
    await h.send("a4", "a")  # a's own flood: the newcomer is the one shed
    assert orjson.loads(h.shed["a4"].body)["error"]["code"] == "queue_full"
    await h.send("b0", "b")  # b has nothing waiting: a gives up its newest
    await _until(lambda: "a3" in h.shed)
    error = orjson.loads(h.shed["a3"].body)["error"]
    assert error["code"] == "queue_evicted" and "tenant had the most waiting" in error["message"]
    await h.send("b1", "b")  # a (3 waiting) still holds more than b would with b1 (2): a gives up a2
    await _until(lambda: "a2" in h.shed)
    await h.send("b2", "b")  # a 2, b would hold 3: b2 is shed
    assert orjson.loads(h.shed["b2"].body)["error"]["code"] == "queue_full"
    assert h.sample("fleetroute_tenant_shed_total", tenant="a", model=MODEL, reason="evicted") == 2
    await h.drain(4)
    assert sorted(h.admitted) == ["a0", "a1", "b0", "b1"]


async def test_without_fairness_the_class_is_first_come_first_served() -> None:
    h = Harness(CAP1, TWO, fairness=False)
    h.hold("busy")
    for rid, tenant in [("a0", "a"), ("a1", "a"), ("a2", "a"), ("b0", "b")]:
        await h.send(rid, tenant)
    await h.drain(4)
    assert h.admitted == ["a0", "a1", "a2", "b0"]
    assert h.sample("fleetroute_tenant_queue_wait_seconds_count", tenant="b", model=MODEL) == 1  # metrics still


# ---- the simulation ----------------------------------------------------------------------------------------

SLOTS = 4  # one endpoint, four requests at a time
SPEED = 1000.0  # tokens per second per slot: a request of cost C holds its slot C / SPEED seconds
COSTS = (100.0, 300.0)  # uniform: mean 200 tokens, so the pool serves 4 x 1000 / 200 = 20 requests/s
CAPACITY = SLOTS * SPEED  # 4000 tokens/s; with equal weights each tenant's share is 2000 tokens/s
HEAVY_RATE = 50.0  # requests/s x 200 tokens = 10,000 tokens/s: five times its share
LIGHT_RATE = 5.0  # 1000 tokens/s: half its share, a quarter of the pool
DURATION = 40.0  # seconds of simulated time
WARMUP = 5.0  # the queue fills in about 2 s; statistics count requests arriving after this


@dataclass
class TenantStats:
    sent_tokens: float = 0.0
    served_tokens: float = 0.0
    waits: list[float] = field(default_factory=list)
    shed: int = 0

    def p99_wait(self) -> float:
        ordered = sorted(self.waits)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))] if ordered else float("inf")


async def simulate(*, fairness: bool, seed: int = 11) -> dict[str, TenantStats]:
    """A discrete-event run of a saturated pool: Poisson arrivals for both tenants, each admitted request holding
    a slot for its cost / SPEED seconds of fake time. Deterministic (seeded, no real time); bounded (about
    2,200 requests)."""
    clock = FakeClock()
    start = clock.now
    settings = parse_settings(_config({"maxConcurrentPerEndpoint": SLOTS, "maxQueue": 64,
                                       "classes": {"normal": {"priority": 1, "deadline": "10m"}}},
                                      [{"name": "heavy"}, {"name": "light"}], fairness=fairness))
    ctx = build_context(settings, clock=clock)
    pool = ctx.admission.pool(ctx.balancer.policy_for(MODEL), MODEL)
    assert pool is not None
    rng = random.Random(seed)
    events: list[tuple[float, int, str, Any]] = []
    seq = itertools.count()
    for tenant, rate in (("heavy", HEAVY_RATE), ("light", LIGHT_RATE)):
        t = 0.0
        while (t := t + rng.expovariate(rate)) < DURATION:
            heapq.heappush(events, (start + t, next(seq), "arrive", (tenant, rng.uniform(*COSTS))))
    stats = {"heavy": TenantStats(), "light": TenantStats()}
    unstarted: set[str] = set()

    async def request(rid: str, tenant: str, cost: float, arrived: float) -> None:
        unstarted.discard(rid)
        counted = arrived - start >= WARMUP
        shed = await pool.admit(rid, {}, cost, tenant)
        if shed is not None:
            stats[tenant].shed += counted
            return
        view = ctx.balancer.pick(RequestInfo(model=MODEL, request_id=rid, headers={}, body={}),
                                 pool.exclude(frozenset()))
        assert view is not None
        slot = contextlib.ExitStack()
        slot.enter_context(ctx.loads.track(view.id))
        heapq.heappush(events, (clock.now + cost / SPEED, next(seq), "done", slot))
        if counted:
            stats[tenant].waits.append(clock.now - arrived)
            stats[tenant].served_tokens += cost

    tasks = []
    while events:
        clock.now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            tenant, cost = payload
            if clock.now - start >= WARMUP:
                stats[tenant].sent_tokens += cost
            rid = f"r{len(tasks)}"
            unstarted.add(rid)
            tasks.append(asyncio.create_task(request(rid, tenant, cost, clock.now)))
        else:
            payload.close()  # the request ends: admission hands its slot to the queue
        # Settle: every new request has run up to its queue or its slot, and every woken one has taken its slot.
        for _ in range(1000):
            if not unstarted and not pool.pending:
                break
            await asyncio.sleep(0)
        else:
            raise AssertionError("the event loop did not settle")
    for task in tasks:
        if not task.done():  # still queued when the arrivals ended
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    return stats


async def test_a_light_tenant_keeps_its_service_and_a_short_wait_against_a_flood() -> None:
    fair = await simulate(fairness=True)
    unfair = await simulate(fairness=False)
    results = {}
    for name, stats in (("fair", fair), ("unfair", unfair)):
        served = stats["heavy"].served_tokens + stats["light"].served_tokens
        results[name] = (stats["light"].served_tokens / served, stats["light"].p99_wait(), stats["light"].shed)
    print("light tenant (share of service, P99 queue wait s, shed):", results)  # the report quotes these
    light_share, light_p99, light_shed = results["fair"]
    # The light tenant asks for a quarter of the pool (1000 of 4000 tokens/s), half its weighted share: with
    # fairness it is served all it asks, so its share of service is its quarter (within 5 points: Poisson
    # arrivals over 35 s), and nothing of it is shed although the heavy tenant keeps the queue full.
    offered = fair["light"].sent_tokens / (CAPACITY * (DURATION - WARMUP))  # its demand, as a share of the pool
    assert light_shed == 0
    assert fair["light"].served_tokens >= 0.97 * fair["light"].sent_tokens  # the rest is still queued at the end
    assert abs(light_share - offered) < 0.05 and light_share > 0.2
    # Its requests wait only for the next slot to free (one every 50 ms on average, none held over 0.3 s), plus
    # a turn per light request ahead of it when its arrivals bunch up: P99 under 0.5 s (measured 0.32-0.39 s
    # over seeds 11-13; the median is 55-65 ms).
    assert light_p99 < 0.5
    # Without fairness the heavy tenant's flood fills the 64-place queue: the light tenant's requests are mostly
    # shed, and those that get in wait behind the whole queue (64 / 20 requests/s = 3.2 s). Measured over seeds
    # 11-13: a share of 7.5-9.2% (against 22-27% with fairness), P99 3.4-3.5 s, 60-66% of its requests shed.
    unfair_share, unfair_p99, unfair_shed = results["unfair"]
    assert unfair_share < 0.5 * light_share
    assert unfair_p99 > 2.5 and unfair_p99 > 5 * light_p99
    assert unfair_shed > 0.4 * (len(unfair["light"].waits) + unfair_shed)
    # The heavy tenant still gets everything the light one leaves: the pool stays busy.
    assert fair["heavy"].served_tokens + fair["light"].served_tokens > 0.97 * CAPACITY * (DURATION - WARMUP)


async def test_two_flooding_tenants_split_the_pool_by_weight() -> None:
    # Both send more than the pool can serve; weights 3 and 1: 75% and 25% of the tokens, within 2 points.
    h = Harness({"maxConcurrentPerEndpoint": 1, "maxQueue": 1000}, [{"name": "a", "weight": 3}, {"name": "b"}])
    rng = random.Random(3)
    h.hold("busy")
    costs: dict[str, float] = {}
    for i in range(300):
        for tenant in "ab":
            rid = f"{tenant}{i}"
            costs[rid] = rng.uniform(50, 500)
            await h.send(rid, tenant, cost=costs[rid])
    await h.drain(300)
    served = {t: sum(costs[r] for r in h.admitted if r[0] == t) for t in "ab"}
    assert served["a"] / (served["a"] + served["b"]) == pytest.approx(0.75, abs=0.02)


# ---- end to end ------------------------------------------------------------------------------------------


async def test_end_to_end_a_light_tenant_is_served_before_a_flooding_one(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await make_router([engine], policies=[{
        "name": "default", "strategy": "least-connections", "admission": {"maxConcurrentPerEndpoint": 1}}],
        tenancy={"tenants": [{"name": "flood"}, {"name": "light"}]})
    url = router.ingress_url + "/v1/chat/completions"
    holder = await http.post(url, json={**CHAT, "stream": True}, headers={"x-tenant-id": "flood"})
    await holder.content.readuntil(b"\n\n")
    queued = []
    for i in range(4):
        queued.append(asyncio.create_task(http.post(url, json={**CHAT, "messages": [
            {"role": "user", "content": f"flood {i}"}]}, headers={"x-tenant-id": "flood"})))
        await _until(lambda i=i: router.ctx.admission.queued(MODEL) == i + 1)
    queued.append(asyncio.create_task(http.post(url, json={**CHAT, "messages": [{"role": "user", "content": "light"}]},
                                                headers={"x-tenant-id": "light"})))
    await _until(lambda: router.ctx.admission.queued(MODEL) == 5)
    engine.gate.set()
    await holder.read()
    for task in queued:
        resp = await asyncio.wait_for(task, 10)
        assert resp.status == 200
        await resp.read()
    served = [r["body"]["messages"][0]["content"] for r in engine.requests[1:]]
    # The flood's first queued request and the light one have the same start tag (nobody has been served
    # yet): arrival order decides. Then the light tenant goes before the flood's other three.
    assert served == ["flood 0", "light", "flood 1", "flood 2", "flood 3"]
