"""Admission control: a saturated pool queues by priority with ageing, sheds on deadline and when full
(lowest class first), wakes on released slots and resumed endpoints, and costs nothing when caps are off.

Most tests drive `Pool.admit` directly on a real context (real balancer and load tracker, no sockets) with a
fake clock: a held `loads.track()` is a request in flight, releasing it is the event admission reacts to,
and deadlines pass by moving the clock and calling `sweep()` (what the pool's timer does). The end-to-end
tests at the bottom go through real aiohttp, a router and a fake engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

import orjson
import pytest

from router.config.settings import ConfigError, parse_settings
from router.model import EndpointState, RequestInfo
from router.runtime.logs import JsonFormatter
from router.server.app import build_context
from router.server.context import RouterContext
from router.traffic.admission import AdmissionSettings, Pool, PriorityClass
from tests.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _config(admission: dict[str, Any] | None, endpoints: int = 1) -> dict[str, Any]:
    policy: dict[str, Any] = {"name": "default", "strategy": "least-connections"}
    if admission is not None:
        policy["admission"] = admission
    return {
        "endpoints": [
            {"id": f"gpu-{i}", "url": f"http://127.0.0.1:{9 + i}", "models": [MODEL]} for i in range(endpoints)
        ],
        "policies": [policy],
        "telemetry": {"enabled": False},
        "redis": {"url": None},
    }


class Harness:
    """A router context without sockets, plus helpers to hold slots and run admission requests."""

    def __init__(self, admission: dict[str, Any] | None, *, endpoints: int = 1) -> None:
        self.clock = FakeClock()
        self.ctx: RouterContext = build_context(parse_settings(_config(admission, endpoints)), clock=self.clock)
        spec = self.ctx.balancer.policy_for(MODEL)
        pool = self.ctx.admission.pool(spec, MODEL)
        assert pool is not None
        self.pool: Pool = pool
        self.admitted: list[str] = []  # request ids, in the order they were let through
        self.shed: dict[str, Any] = {}  # request id -> the shed response
        self.slots: dict[str, contextlib.ExitStack] = {}  # request id (or a label) -> its held slot
        self.tasks: dict[str, asyncio.Task[None]] = {}
        self.costs: dict[str, float] = {}  # request id -> predicted cost in tokens (shortest-expected-first)

    def hold(self, label: str, endpoint: str = "gpu-0") -> None:
        stack = contextlib.ExitStack()
        stack.enter_context(self.ctx.loads.track(endpoint))
        self.slots[label] = stack

    def release(self, label: str) -> None:
        self.slots.pop(label).close()

    async def _request(self, rid: str, headers: dict[str, str]) -> None:
        shed = await self.pool.admit(rid, headers, self.costs.get(rid, 0.0))
        if shed is not None:
            self.shed[rid] = shed
            return
        self.admitted.append(rid)
        # What the handler does next, with no await in between: pick an endpoint under its cap, go in flight.
        view = self.ctx.balancer.pick(_info(rid), self.pool.exclude(frozenset()))
        assert view is not None
        self.hold(rid, view.id)

    async def send(self, rid: str, priority: str | None = None, **headers: str) -> None:
        """Start a request and return once it is queued, admitted or shed."""
        if priority is not None:
            headers["x-priority"] = priority
        self.tasks[rid] = asyncio.create_task(self._request(rid, {k.replace("_", "-"): v for k, v in headers.items()}))
        await _until(lambda: rid in self.admitted or rid in self.shed or rid in self.queued_ids()
                     or self.tasks[rid].done())

    def queued_ids(self) -> set[str]:
        return {w.request_id for queue in self.pool._queues.values() for w in queue}

    def sample(self, name: str, **labels: str) -> float | None:
        return self.ctx.metrics.registry.get_sample_value(name, labels)


def _info(rid: str) -> RequestInfo:
    return RequestInfo(model=MODEL, request_id=rid, headers={}, body={})


async def _until(condition: Any) -> None:
    """Yield to the event loop until `condition()` holds (event-driven; bounded, never a timed sleep)."""
    async with asyncio.timeout(5):
        while not condition():
            await asyncio.sleep(0)


def _error(response: Any) -> dict[str, Any]:
    return orjson.loads(response.body)["error"]


# ---- configuration ---------------------------------------------------------------------------------------


def test_admission_is_off_without_a_cap_and_defaults_are_documented() -> None:
    settings = parse_settings(_config({}))
    (spec,) = settings.policies
    assert spec.admission == AdmissionSettings()
    assert spec.admission.max_concurrent_per_endpoint is None  # off by default
    assert [(c.name, c.deadline) for c in spec.admission.classes] == [("high", 30.0), ("normal", 60.0), ("low", 120.0)]
    assert spec.admission.max_queue == 256 and spec.admission.aging == 10.0 and spec.admission.shed_status == 429
    ctx = build_context(settings)
    assert ctx.admission.pool(spec, MODEL) is None
    assert ctx.admission.pool(ctx.balancer.policy_for("other-model"), "other-model") is None  # built-in default


def test_a_full_admission_block_is_parsed() -> None:
    (spec,) = parse_settings(_config({
        "maxQueue": 10, "maxConcurrentPerEndpoint": 4, "priorityHeader": "X-Tier",
        "classes": {"gold": {"deadline": "5s"}, "bronze": {"deadline": "500ms"}},
        "defaultClass": "bronze", "agingSeconds": None, "shedStatus": 503, "retryAfter": "3s",
    })).policies
    a = spec.admission
    assert a.max_queue == 10 and a.max_concurrent_per_endpoint == 4 and a.priority_header == "x-tier"
    assert a.classes == (PriorityClass("gold", 0, 5.0), PriorityClass("bronze", 1, 0.5))
    assert a.aging is None and a.shed_status == 503 and a.retry_after == 3.0
    assert a.classify("GOLD ") == a.classes[0]
    assert a.classify("platinum") == a.classify(None) == a.classes[1]  # unknown or absent: the default class


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"maxQueu": 3}, "policies[0].admission.maxQueu: unknown field (expected one of: "),
        ({"maxQueue": -1}, "policies[0].admission.maxQueue: must be between 0 and 1000000, got -1"),
        ({"maxConcurrentPerEndpoint": 0}, "policies[0].admission.maxConcurrentPerEndpoint: must be between 1 and"),
        ({"maxConcurrentPerEndpoint": "4"}, "policies[0].admission.maxConcurrentPerEndpoint: must be an integer, got '4'"),
        ({"shedStatus": 500}, "policies[0].admission.shedStatus: must be 429 or 503, got 500"),
        ({"defaultClass": "urgent"}, "policies[0].admission.defaultClass: must be one of the classes (high, normal, low); got 'urgent'"),
        ({"classes": {"gold": {"deadline": "1s"}}}, "policies[0].admission.defaultClass: must be one of the classes (gold); got 'normal'"),
        ({"classes": {}}, "policies[0].admission.classes: must be a non-empty mapping"),
        ({"classes": {"high": {"deadline": "-1s"}}}, "policies[0].admission.classes.high.deadline: must be a positive duration"),
        ({"classes": {"high": {"timeout": "1s"}}}, "policies[0].admission.classes.high.timeout: unknown field (expected one of: deadline, priority)"),
        ({"classes": {"High Prio": {}}}, "policies[0].admission.classes.High Prio: class names must be lower-case"),
        ({"priorityHeader": "x priority"}, "policies[0].admission.priorityHeader: must be an HTTP header name"),
        ({"agingSeconds": 0}, "policies[0].admission.agingSeconds: must be a positive duration"),
        ({"retryAfter": "soon"}, "policies[0].admission.retryAfter: must be a positive duration"),
        ("yes", "policies[0].admission: must be a mapping, got 'yes'"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_admission_fields_are_named(block: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(_config(block))
    assert message in str(info.value)


# ---- the queue -------------------------------------------------------------------------------------------


async def test_a_pool_with_free_slots_admits_at_once_without_queueing() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 2})
    h.hold("busy")
    await h.send("a")
    assert h.admitted == ["a"] and h.pool.queued == 0
    assert h.sample("fleetroute_admission_admitted_total", model=MODEL, priority="normal") == 1
    assert h.sample("fleetroute_admission_queue_wait_seconds_count", model=MODEL, priority="normal") == 0


async def test_a_saturated_pool_queues_until_a_slot_frees() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1})
    h.hold("busy")
    await h.send("a")
    assert h.admitted == [] and h.pool.queued == 1
    assert h.sample("fleetroute_admission_queue_depth", model=MODEL, priority="normal") == 1
    h.clock.now += 2.5
    h.release("busy")  # the in-flight request ends: its slot goes to the queue
    await _until(lambda: h.admitted == ["a"])
    assert h.pool.queued == 0 and h.ctx.loads.in_flight("gpu-0") == 1  # "a" now holds the slot
    assert h.sample("fleetroute_admission_queue_depth", model=MODEL, priority="normal") == 0
    assert h.sample("fleetroute_admission_queue_wait_seconds_sum", model=MODEL, priority="normal") == 2.5


async def test_higher_classes_are_admitted_first_and_fifo_within_a_class() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1, "agingSeconds": None})
    h.hold("busy")
    for rid, priority in [("low-1", "low"), ("normal-1", "normal"), ("low-2", "low"), ("high-1", "high"),
                          ("normal-2", None), ("high-2", "HIGH"), ("junk", "urgent!")]:
        await h.send(rid, priority)
    assert h.pool.queued == 7
    previous = "busy"
    for n in range(1, 8):
        h.release(previous)
        await _until(lambda n=n: len(h.admitted) == n)
        previous = h.admitted[-1]
    # Absent and unknown priorities count as the default class (normal), in arrival order.
    assert h.admitted == ["high-1", "high-2", "normal-1", "normal-2", "junk", "low-1", "low-2"]


@pytest.mark.parametrize(
    ("low_waited", "first"),
    [
        # Ageing raises a request one class per agingSeconds (10 s) waited: a low request (rank 2) that has
        # waited 15 s counts as rank 0.5 and still yields to a fresh high one (rank 0) ...
        (15.0, "high"),
        # ... but after 25 s it counts as rank -0.5 and goes before a high request that just arrived.
        (25.0, "low"),
        # After 12 s it is rank 0.8: ahead of a fresh normal request (rank 1).
        (12.0, "low-vs-normal"),
    ],
)
async def test_ageing_lets_a_long_waiting_low_request_overtake(low_waited: float, first: str) -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1, "agingSeconds": 10})
    h.hold("busy")
    await h.send("low", "low")
    h.clock.now += low_waited
    newcomer = "normal" if first == "low-vs-normal" else "high"
    await h.send(newcomer, newcomer)
    h.release("busy")
    await _until(lambda: len(h.admitted) == 1)
    assert h.admitted == (["high"] if first == "high" else ["low"])


async def test_without_ageing_priority_is_strict() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1, "agingSeconds": None, "classes": {
        "high": {"deadline": "1h"}, "normal": {"deadline": "1h"}, "low": {"deadline": "1h"}}})
    h.hold("busy")
    await h.send("low", "low")
    h.clock.now += 1800  # half an hour
    await h.send("high", "high")
    h.release("busy")
    await _until(lambda: len(h.admitted) == 1)
    assert h.admitted == ["high"]


async def test_a_request_whose_deadline_passes_in_the_queue_is_shed_with_429(caplog) -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1, "retryAfter": "2s"})
    h.hold("busy")
    await h.send("slow", "high")  # class deadline 30 s
    await h.send("patient", "low")  # class deadline 120 s
    h.clock.now += 29.9
    h.pool.sweep()
    assert not h.shed
    h.clock.now += 0.2
    with caplog.at_level(logging.WARNING, logger="fleetroute.admission"):
        h.pool.sweep()  # what the pool's timer does when the earliest deadline comes
    await _until(lambda: "slow" in h.shed)
    response = h.shed["slow"]
    assert response.status == 429 and response.headers["Retry-After"] == "2"
    error = _error(response)
    assert error["code"] == "queue_deadline_exceeded" and "retry later" in error["message"]
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert h.pool.queued == 1 and "patient" not in h.shed
    assert h.sample("fleetroute_admission_shed_total", model=MODEL, priority="high", reason="deadline") == 1
    (record,) = [r for r in caplog.records if r.name == "fleetroute.admission"]
    entry = orjson.loads(JsonFormatter().format(record))
    assert entry["msg"] == "request shed" and entry["request_id"] == "slow" and entry["reason"] == "deadline"
    assert entry["priority"] == "high" and entry["model"] == MODEL and entry["status"] == 429
    assert entry["waited_ms"] == pytest.approx(30100, abs=1)
    h.release("busy")
    await _until(lambda: h.admitted == ["patient"])  # the shed request left no hole in the queue


async def test_the_deadline_header_can_shorten_the_wait_but_not_extend_it() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1})
    h.hold("busy")
    await h.send("short", "low", x_request_deadline_ms="1500")
    await h.send("greedy", "high", x_request_deadline_ms="3600000")  # asks for an hour; high allows 30 s
    await h.send("garbage", "high", x_request_deadline_ms="soon")  # malformed: the class's deadline
    h.clock.now += 1.6
    h.pool.sweep()
    await _until(lambda: set(h.shed) == {"short"})
    h.clock.now += 28.5  # 30.1 s in all
    h.pool.sweep()
    await _until(lambda: set(h.shed) == {"short", "greedy", "garbage"})


async def test_a_zero_deadline_means_do_not_queue_at_all() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1})
    await h.send("first", x_request_deadline_ms="0")  # a free slot: admitted, deadline irrelevant
    await h.send("second", x_request_deadline_ms="0")  # saturated: shed at once, never queued
    assert h.admitted == ["first"] and _error(h.shed["second"])["code"] == "queue_deadline_exceeded"
    assert h.pool.queued == 0


async def test_a_full_queue_sheds_the_lowest_class_first() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1, "maxQueue": 2})
    h.hold("busy")
    await h.send("low-1", "low")
    await h.send("low-2", "low")
    await h.send("low-3", "low")  # full of its own class: the newcomer is shed, the queue keeps its order
    assert _error(h.shed["low-3"])["code"] == "queue_full"
    await h.send("high-1", "high")  # evicts the newest request of the lowest class present
    await _until(lambda: "low-2" in h.shed)
    assert _error(h.shed["low-2"])["code"] == "queue_evicted" and h.shed["low-2"].status == 429
    await h.send("normal-1", "normal")  # evicts low-1, the last low one
    await _until(lambda: "low-1" in h.shed)
    await h.send("normal-2", "normal")  # only normal and high queued now: shed
    await h.send("high-2", "high")  # evicts the newest normal request
    await _until(lambda: "normal-1" in h.shed)
    assert set(h.shed) == {"low-3", "low-2", "low-1", "normal-2", "normal-1"}
    assert h.sample("fleetroute_admission_shed_total", model=MODEL, priority="low", reason="queue_full") == 1
    assert h.sample("fleetroute_admission_shed_total", model=MODEL, priority="low", reason="evicted") == 2
    assert h.sample("fleetroute_admission_shed_total", model=MODEL, priority="normal", reason="queue_full") == 1
    assert h.sample("fleetroute_admission_shed_total", model=MODEL, priority="normal", reason="evicted") == 1
    h.release("busy")
    await _until(lambda: h.admitted == ["high-1"])
    h.release("high-1")
    await _until(lambda: h.admitted == ["high-1", "high-2"])


async def test_max_queue_zero_fails_fast_with_the_configured_503() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1, "maxQueue": 0, "shedStatus": 503})
    h.hold("busy")
    await h.send("a", "high")
    response = h.shed["a"]
    assert response.status == 503 and response.headers["Retry-After"] == "1"
    assert _error(response)["type"] == "server_error" and _error(response)["code"] == "queue_full"


async def test_a_client_that_leaves_the_queue_gives_up_its_place() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1})
    h.hold("busy")
    await h.send("gone", "high")
    await h.send("stays", "low")
    h.tasks["gone"].cancel()  # what aiohttp does when the client disconnects
    await _until(lambda: h.pool.queued == 1)
    assert h.sample("fleetroute_admission_queue_depth", model=MODEL, priority="high") == 0
    h.release("busy")
    await _until(lambda: h.admitted == ["stays"])


async def test_a_woken_request_that_leaves_hands_its_slot_to_the_next() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1})
    h.hold("busy")
    await h.send("first", "high")
    await h.send("second", "low")
    h.release("busy")  # wakes "first" (its slot is promised) ...
    h.tasks["first"].cancel()  # ... but its client leaves before it runs
    await _until(lambda: h.admitted == ["second"])
    assert h.pool.pending == 0


async def test_a_newcomer_does_not_take_a_slot_promised_to_a_queued_request() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1})
    h.hold("busy")
    await h.send("queued", "low")
    # The newcomer's handler is scheduled before the woken request resumes, so it asks first.
    h.tasks["newcomer"] = asyncio.create_task(h._request("newcomer", {"x-priority": "high"}))
    h.release("busy")  # the slot is promised to "queued", which has not run yet
    assert h.pool.pending == 1 and h.ctx.loads.in_flight("gpu-0") == 0
    await _until(lambda: h.admitted == ["queued"])
    assert h.queued_ids() == {"newcomer"}  # a free slot was visible to it, but promised


async def test_endpoints_at_their_cap_are_excluded_from_the_pick() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 2}, endpoints=3)
    h.hold("a", "gpu-0")
    h.hold("b", "gpu-0")
    h.hold("c", "gpu-1")
    assert h.pool.exclude(frozenset({"gpu-2"})) == {"gpu-0", "gpu-2"}
    await h.send("d")  # gpu-1 and gpu-2 have room
    assert h.admitted == ["d"] and h.slots["d"] is not None
    assert h.ctx.loads.in_flight("gpu-0") == 2  # never above the cap


async def test_the_pool_waits_only_when_every_endpoint_is_at_its_cap() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1}, endpoints=2)
    await h.send("a")
    await h.send("b")
    await h.send("c")
    assert h.admitted == ["a", "b"] and h.pool.queued == 1
    assert {h.ctx.loads.in_flight("gpu-0"), h.ctx.loads.in_flight("gpu-1")} == {1}
    h.release("a")
    await _until(lambda: h.admitted == ["a", "b", "c"])


async def test_resuming_a_drained_endpoint_admits_queued_requests() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1}, endpoints=2)
    h.ctx.balancer.set_state("gpu-1", EndpointState.DRAINING)
    h.hold("busy", "gpu-0")
    await h.send("a")
    assert h.pool.queued == 1
    h.ctx.balancer.set_state("gpu-1", EndpointState.SERVING)  # a rebuild: new slots, no request ended
    await _until(lambda: h.admitted == ["a"])
    assert h.ctx.loads.in_flight("gpu-1") == 1


async def test_with_every_endpoint_drained_requests_are_not_held_in_the_queue() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1})
    h.hold("busy")
    await h.send("queued")
    h.ctx.balancer.set_state("gpu-0", EndpointState.DRAINING)
    # Nothing left to wait for: let it through at once, and the picker answers 503 no_endpoint.
    await _until(lambda: h.tasks["queued"].done())
    with pytest.raises(AssertionError):  # our stand-in handler found nothing to pick
        h.tasks["queued"].result()
    assert h.admitted == ["queued"] and h.pool.queued == 0


async def test_requests_that_passed_through_the_queue_leave_no_deadline_bookkeeping_behind() -> None:
    # Under steady load with long deadlines, every queued-then-admitted request leaves a stale deadline
    # entry; they must not accumulate (memory would grow with the request rate times the deadline).
    h = Harness({"maxConcurrentPerEndpoint": 1})
    h.hold("busy")
    previous = "busy"
    for i in range(500):
        await h.send(f"r{i}")
        h.release(previous)
        await _until(lambda i=i: h.admitted[-1:] == [f"r{i}"])
        previous = f"r{i}"
    assert len(h.pool._deadlines) <= 64


async def test_deadlines_fire_on_their_own_with_the_real_clock() -> None:
    # The pool's loop timer, not a test calling sweep(): a 30 ms deadline sheds within the test's timeout.
    ctx = build_context(parse_settings(_config({"maxConcurrentPerEndpoint": 1})))
    pool = ctx.admission.pool(ctx.balancer.policy_for(MODEL), MODEL)
    assert pool is not None
    with ctx.loads.track("gpu-0"):
        response = await asyncio.wait_for(pool.admit("r", {"x-request-deadline-ms": "30"}), 5)
    assert response is not None and _error(response)["code"] == "queue_deadline_exceeded"


# ---- shortest-expected-first ------------------------------------------------------------------------------

SEF = {"maxConcurrentPerEndpoint": 1, "order": "shortest-expected-first", "agingTokensPerSecond": 1000}


async def _drain(h: Harness, n: int) -> None:
    """Release the busy slot, then each admitted request's, until `n` requests were admitted."""
    previous = "busy"
    for i in range(1, n + 1):
        h.release(previous)
        await _until(lambda i=i: len(h.admitted) == i)
        previous = h.admitted[-1]


async def test_shortest_expected_first_serves_short_requests_before_long_ones_of_their_class() -> None:
    h = Harness(SEF)
    h.hold("busy")
    h.costs.update({"long": 5000, "medium": 500, "short": 50, "no-estimate": 0})
    for rid in ("long", "medium", "short", "no-estimate"):
        await h.send(rid)
    await _drain(h, 4)
    assert h.admitted == ["no-estimate", "short", "medium", "long"]


async def test_shortest_expected_first_across_classes_is_one_virtual_time() -> None:
    # With ageing a class is worth agingSeconds (10 s) of waiting and a cost C is worth C / 1000 s, all fixed
    # on entry: keys rank * 10 + C / 1000 are normal-5000 -> 15, high-20000 -> 20, low-1000 -> 21.
    h = Harness(SEF)
    h.hold("busy")
    h.costs.update({"high-20000": 20_000, "normal-5000": 5000, "low-1000": 1000})
    await h.send("low-1000", "low")
    await h.send("high-20000", "high")
    await h.send("normal-5000", "normal")
    await _drain(h, 3)
    assert h.admitted == ["normal-5000", "high-20000", "low-1000"]


@pytest.mark.parametrize(
    ("short_arrives_after", "first"),
    [
        # A 5,000-token request waits at most 5,000 / 1000 = 5 s longer than FIFO would make it: a cheaper
        # request of its class that arrives within those 5 s goes first ...
        (4.9, "short"),
        # ... one that arrives later does not: the long one is not starved by a stream of short ones.
        (5.1, "long"),
    ],
)
async def test_shortest_expected_first_ages_long_requests_within_the_bound(short_arrives_after: float, first: str) -> None:
    h = Harness({**SEF, "classes": {"normal": {"deadline": "1m"}}, "defaultClass": "normal"})
    h.hold("busy")
    h.costs.update({"long": 5000, "short": 0})
    await h.send("long")
    h.clock.now += short_arrives_after
    await h.send("short")
    await _drain(h, 2)
    assert h.admitted[0] == first


async def test_under_a_stream_of_short_requests_a_long_one_is_served_within_its_bound() -> None:
    # The pool serves one request per second; a short request arrives every 0.5 s, forever (here: 40 s).
    # The long one (cost 10,000: 10 s at 1000 tokens/s) arrives at t = 0 behind a queue of shorts and is
    # served once the shorts that arrived before t = 10 s have been: at about t = 20 s, not never.
    h = Harness({**SEF, "maxQueue": 1000, "classes": {"normal": {"deadline": "10m"}}, "defaultClass": "normal"})
    h.hold("busy")
    h.costs["long"] = 10_000
    start = h.clock.now
    await h.send("long")
    served_at: dict[str, float] = {}
    previous = "busy"
    for tick in range(80):  # 0.5 s per tick
        await h.send(f"short-{tick}")
        h.clock.now += 0.5
        if tick % 2:
            h.release(previous)
            wanted = len(served_at) + 1
            await _until(lambda wanted=wanted: len(h.admitted) == wanted)
            previous = h.admitted[-1]
            served_at[previous] = h.clock.now - start
    assert "long" in served_at and served_at["long"] <= 21.0, served_at.get("long")
    later = [rid for rid in h.admitted[h.admitted.index("long") + 1:]]
    assert later and all(int(rid.split("-")[1]) >= 20 for rid in later)  # only shorts from after t = 10 s


async def test_fifo_stays_the_default_whatever_the_cost() -> None:
    h = Harness({"maxConcurrentPerEndpoint": 1})
    h.hold("busy")
    h.costs.update({"long": 50_000, "short": 1})
    await h.send("long")
    await h.send("short")
    await _drain(h, 2)
    assert h.admitted == ["long", "short"]


async def test_shortest_expected_first_evicts_the_last_in_order_of_the_lowest_class() -> None:
    h = Harness({**SEF, "maxQueue": 2})
    h.hold("busy")
    h.costs.update({"low-long": 9000, "low-short": 10})
    await h.send("low-long", "low")
    await h.send("low-short", "low")  # newer, but ahead of low-long in the class's order
    await h.send("high", "high")
    await _until(lambda: "low-long" in h.shed)
    assert _error(h.shed["low-long"])["code"] == "queue_evicted"
    await _drain(h, 2)
    assert h.admitted == ["high", "low-short"]


async def test_shortest_expected_first_a_client_that_leaves_gives_up_its_place() -> None:
    h = Harness(SEF)
    h.hold("busy")
    h.costs.update({"a": 300, "b": 100, "c": 200})
    for rid in ("a", "b", "c"):
        await h.send(rid)
    h.tasks["c"].cancel()  # in the middle of the class's heap
    await _until(lambda: h.pool.queued == 2)
    await _drain(h, 2)
    assert h.admitted == ["b", "a"]


async def test_end_to_end_shortest_expected_first_uses_the_requests_predicted_cost(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await make_router([engine], policies=[{
        "name": "default", "strategy": "least-connections",
        "admission": {"maxConcurrentPerEndpoint": 1, "order": "shortest-expected-first"}}])
    url = router.ingress_url + "/v1/chat/completions"
    holder = await http.post(url, json={**CHAT, "stream": True})
    await holder.content.readuntil(b"\n\n")
    # Same class, the long one first: a 40k-character prompt and max_tokens 2000 against a short question.
    long = asyncio.create_task(http.post(url, json={**CHAT, "max_tokens": 2000,
                                                    "messages": [{"role": "user", "content": "x" * 40_000}]}))
    await _until(lambda: router.ctx.admission.queued(MODEL) == 1)
    short = asyncio.create_task(http.post(url, json={**CHAT, "max_tokens": 10}))
    await _until(lambda: router.ctx.admission.queued(MODEL) == 2)
    engine.gate.set()
    await holder.read()
    for task in (long, short):
        resp = await asyncio.wait_for(task, 5)
        assert resp.status == 200
        await resp.read()
    assert [len(r["body"]["messages"][0]["content"]) for r in engine.requests[1:]] == [2, 40_000]  # "hi" first


# ---- end to end ------------------------------------------------------------------------------------------


async def _metrics(http, router) -> str:
    async with http.get(router.admin_url + "/metrics") as resp:
        return await resp.text()


async def test_end_to_end_saturation_queues_evicts_sheds_and_recovers(make_engine, make_router, http, caplog) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    clock = FakeClock()
    router = await make_router([engine], clock=clock, policies=[{
        "name": "default", "strategy": "least-connections",
        "admission": {"maxConcurrentPerEndpoint": 1, "maxQueue": 1}}])
    url = router.ingress_url + "/v1/chat/completions"
    admission = router.ctx.admission
    # A stream holds the only slot (the engine waits on its gate after the first token).
    holder = await http.post(url, json={**CHAT, "stream": True})
    await holder.content.readuntil(b"\n\n")
    queued = asyncio.create_task(http.post(url, json=CHAT, headers={"x-priority": "low", "x-request-id": "q-1"}))
    await _until(lambda: admission.queued(MODEL) == 1)
    async with http.post(url, json=CHAT, headers={"x-priority": "low"}) as resp:  # queue full, same class
        assert resp.status == 429 and resp.headers["Retry-After"] == "1"
        assert (await resp.json())["error"]["code"] == "queue_full"
    winner = asyncio.create_task(http.post(url, json=CHAT, headers={"x-priority": "high"}))
    evicted = await asyncio.wait_for(queued, 5)  # the high request took the low one's place
    assert evicted.status == 429 and (await evicted.json())["error"]["code"] == "queue_evicted"
    assert admission.queued(MODEL) == 1
    engine.gate.set()  # the stream ends, its slot goes to the high request
    await holder.read()
    resp = await asyncio.wait_for(winner, 5)
    assert resp.status == 200 and resp.headers["x-fleetroute-endpoint"] == "gpu-0"
    await resp.read()
    assert len(engine.requests) == 2  # shed requests never reached the engine
    text = await _metrics(http, router)
    for line in [
        'fleetroute_admission_shed_total{model="llama-3-8b",priority="low",reason="queue_full"} 1.0',
        'fleetroute_admission_shed_total{model="llama-3-8b",priority="low",reason="evicted"} 1.0',
        'fleetroute_admission_admitted_total{model="llama-3-8b",priority="high"} 1.0',
        'fleetroute_admission_admitted_total{model="llama-3-8b",priority="normal"} 1.0',
        'fleetroute_admission_queue_depth{model="llama-3-8b",priority="low"} 0.0',
        'fleetroute_admission_queue_wait_seconds_count{model="llama-3-8b",priority="high"} 1.0',
        'fleetroute_requests_total{endpoint="",model="llama-3-8b",status="429"} 2.0',
    ]:
        assert line in text, line
    shed_logs = [r for r in caplog.records if r.name == "fleetroute.admission"]
    assert {(r.reason, r.priority) for r in shed_logs} == {("queue_full", "low"), ("evicted", "low")}
    assert any(getattr(r, "request_id", None) == "q-1" for r in shed_logs)


async def test_end_to_end_deadline_shedding_with_a_fake_clock(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    clock = FakeClock()
    router = await make_router([engine], clock=clock, policies=[{
        "name": "default", "strategy": "round-robin",
        "admission": {"maxConcurrentPerEndpoint": 1, "shedStatus": 503, "retryAfter": "5s",
                      "classes": {"interactive": {"deadline": "2s"}, "batch": {"deadline": "10m"}},
                      "defaultClass": "batch", "priorityHeader": "x-tier"}}])
    url = router.ingress_url + "/v1/completions"
    holder = await http.post(url, json={"model": MODEL, "prompt": "x", "stream": True})
    await holder.content.readuntil(b"\n\n")
    waiting = asyncio.create_task(http.post(url, json={"model": MODEL, "prompt": "y"}, headers={"x-tier": "interactive"}))
    await _until(lambda: router.ctx.admission.queued(MODEL) == 1)
    clock.now += 2.5
    router.ctx.admission.sweep()
    resp = await asyncio.wait_for(waiting, 5)
    assert resp.status == 503 and resp.headers["Retry-After"] == "5"
    error = (await resp.json())["error"]
    assert error["code"] == "queue_deadline_exceeded" and error["type"] == "server_error"
    engine.gate.set()
    await holder.read()
    async with http.post(url, json={"model": MODEL, "prompt": "z"}) as resp:  # the router keeps serving
        assert resp.status == 200


async def test_with_caps_off_admission_stays_out_of_the_way(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0", gate=asyncio.Event())
    router = await make_router([engine])  # conftest's policy sets no admission block
    held = [await http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True})
            for _ in range(20)]
    for resp in held:
        await resp.content.readuntil(b"\n\n")
    assert router.ctx.loads.in_flight("gpu-0") == 20  # nothing capped, nothing queued
    engine.gate.set()
    for resp in held:
        await resp.read()
        resp.close()
    assert "fleetroute_admission_admitted_total{" not in await _metrics(http, router)


def test_shortest_first_queue_keeps_its_order_through_many_removals_from_the_middle() -> None:
    # Deadline sheds and client cancels remove waiters from anywhere in the queue; removal is lazy (so a
    # mass expiry of a 10,000-request batch queue is not O(n^2)), and head/last must still be the least and
    # greatest live keys, with put-back waiters (woken, then requeued) keeping their place.
    import random

    from router.traffic.admission import _ByKey

    class Waiter:  # what the queue reads of a waiter: its fixed key (and identity)
        def __init__(self, key: tuple[float, int]) -> None:
            self.key = key

    rng = random.Random(5)
    queue = _ByKey()
    waiters = [Waiter((rng.random(), i)) for i in range(5000)]
    for w in waiters:
        queue.push(w, front=False)
    live = set(map(id, waiters))
    for w in rng.sample(waiters, 4000):
        queue.remove(w)
        live.discard(id(w))
    for w in rng.sample([w for w in waiters if id(w) in live], 100):  # woken, then put back
        queue.remove(w)
        queue.push(w, front=True)
    remaining = sorted((w for w in waiters if id(w) in live), key=lambda w: w.key)
    assert len(queue) == len(remaining) == 1000
    assert queue.head() is remaining[0] and queue.last() is remaining[-1]
    order = []
    while len(queue):
        w = queue.head()
        order.append(w)
        queue.remove(w)
    assert order == remaining


def test_classes_rank_by_priority_whatever_their_order_in_the_mapping() -> None:
    settings = parse_settings(_config({"classes": {"low": {"priority": 1}, "high": {"priority": 9},
                                                   "normal": {"priority": 5, "deadline": "3s"}}})).policies[0]
    classes = settings.admission.classes
    assert [(c.name, c.rank, c.priority) for c in classes] == [("high", 0, 9), ("normal", 1, 5), ("low", 2, 1)]
    assert settings.admission.classify("normal").deadline == 3.0


def test_classes_without_priorities_rank_by_position_with_a_deprecation_warning(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fleetroute.admission"):
        settings = parse_settings(_config({"classes": {"low": {}, "high": {}, "normal": {}}})).policies[0]
    assert [(c.name, c.rank) for c in settings.admission.classes] == [("low", 0), ("high", 1), ("normal", 2)]
    (record,) = [r for r in caplog.records if "give each class a priority" in r.getMessage()]
    assert record.getMessage().startswith("policies[0].admission.classes: classes ranked by their order")


DEPRECATED_CLASSES = {"policies": [{"name": "chat", "admission": {
    "maxConcurrentPerEndpoint": 2, "classes": {"high": {"deadline": "5s"}, "low": {}}, "defaultClass": "low"}}]}


async def test_the_router_logs_the_deprecation_warning_as_json_like_every_other_line(tmp_path) -> None:
    # It is written while the config file is parsed, before the file's logging settings apply: held until then.
    import os
    import signal
    import sys

    import yaml

    config = {**DEPRECATED_CLASSES, "listen": {"host": "127.0.0.1", "port": 0}, "admin": {"host": "127.0.0.1", "port": 0},
              "redis": {"url": None}, "telemetry": {"enabled": False}, "shutdownGrace": "1s"}
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "router", "router", "--config",
                                                str(tmp_path / "router.yaml"), stderr=asyncio.subprocess.PIPE,
                                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        lines = []
        async with asyncio.timeout(30):
            while not lines or lines[-1].get("msg") != "router listening":
                raw = await proc.stderr.readline()
                assert raw, f"router exited: {lines}"
                lines.append(json.loads(raw))  # every line is JSON: the warning too
        (warning,) = [entry for entry in lines if entry.get("deprecated")]
        assert (warning["level"], warning["logger"]) == ("warning", "fleetroute.admission")
        assert warning["msg"].startswith("policies[0].admission.classes: classes ranked by their order")
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 20)


def test_held_records_go_through_the_configured_level(capsys) -> None:
    from router.runtime.logs import HeldRecords, configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        held = HeldRecords()
        parse_settings(DEPRECATED_CLASSES)
        configure_logging("error")  # `logging: {level: error}`: a warning is not wanted
        held.replay()
        assert "classes ranked by their order" not in capsys.readouterr().err
        held = HeldRecords()
        parse_settings(DEPRECATED_CLASSES)
        configure_logging("warning")
        held.replay()
        assert json.loads(capsys.readouterr().err)["deprecated"] == "admission.classes without priority"
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


@pytest.mark.parametrize(
    ("classes", "message"),
    [
        ({"normal": {"priority": 1}, "low": {}}, "admission.classes: every class needs a priority once one has one; "
                                                 "missing: low"),
        ({"normal": {"priority": 1}, "low": {"priority": 1}}, "admission.classes.low.priority: 1 is also normal's"),
        ({"normal": {"priority": 1001}}, "admission.classes.normal.priority"),
        ({"normal": {"priority": True}}, "admission.classes.normal.priority"),
    ],
    ids=["missing", "duplicate", "range", "type"],
)
def test_bad_priorities_are_named(classes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings(_config({"classes": classes}))
    assert message in str(info.value)


def test_the_default_classes_carry_their_priorities() -> None:
    assert [(c.name, c.rank, c.priority) for c in AdmissionSettings().classes] == [
        ("high", 0, 2), ("normal", 1, 1), ("low", 2, 0)]
