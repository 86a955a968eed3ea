"""Admission control: a bounded priority queue in front of each model's pool, used only when it is saturated.

Why. vLLM queues requests itself, but first-come-first-served and blind to who is asking: a burst of batch
jobs delays every interactive request behind it, and one hot engine can be handed far more than it can
batch. A per-endpoint concurrency cap (`maxConcurrentPerEndpoint`) keeps each engine at a load it serves
well; once *every* serving endpoint of a model is at its cap, new requests wait here instead, where the
router can order them by priority, shed the ones whose deadline passed (a fast 429 the client can retry
elsewhere beats a slow timeout), and shed the least important first when the queue is full.

How it fits the request path (router/server/handlers.py `_admit`, then the retry layer, attempts.py):

1. `Admission.pool(spec, model)` returns None unless the policy sets a cap. With caps unset (the default)
   that check is all admission costs: no queue, no lock, no metric (docs/operations.md has the numbers).
2. `Pool.admit()` returns at once while the pool has a free slot and nobody is queued; otherwise the
   request joins the queue and waits for a slot, or is shed (it returns the error response to send).
3. The retry layer picks with `Pool.exclude(tried)`, so endpoints at their cap are skipped by every policy
   (a consistent-hash key walks the ring past a full endpoint, like past a failed one).

Load is read, never counted here: an endpoint is *full* when `LoadTracker.in_flight(id) >= cap` (this
process's requests of every model, so two models sharing an engine share its cap). Waking is
event-driven (no polling): `LoadTracker` calls `released()` when a request's in-flight ends, and the
balancer calls `rebuilt()` after each snapshot swap (a resume or a new endpoint adds slots). A woken
request holds a promise of a slot (`pending`) until it runs, so a newcomer cannot take the slot in between
(no barging past the queue). Nothing awaits between `admit()` returning and the forward that marks the
request in flight, which is what makes the promise hold.

Order: each class has a rank, from its `priority` (higher is served first; rank 0 is the highest priority).
Classes written without priorities rank by their position in `classes` (deprecated: YAML tools and the
Kubernetes API server reorder mapping keys, so the position is not the order anybody wrote). With ageing, a
request's effective rank improves by one class per `agingSeconds` waited, so low requests are delayed, never
starved. Comparing `rank - waited/aging` between two requests at the same instant is the same as comparing
`rank * aging + enqueued_at`, a key that does not change while they wait: the queue is ordered once, on
entry, like a virtual-time scheduler (start-time fair queueing), with no re-sorting as time passes. Within a
class that is arrival order, so one FIFO per class suffices and the next request is the best of the heads.

`order: shortest-expected-first` orders each class by expected cost instead (router/routing/cost.py: the request's
predicted cost C in tokens), with ageing in the same virtual-time form: the key's time part is
`enqueued_at + C / agingTokensPerSecond`. A request of cost C is therefore overtaken only by requests of
its class that arrive less than C / rate seconds after it (and are cheaper): it is served no later than a
FIFO queue would serve a request arriving C / rate seconds after it, so long requests are delayed by a
bounded amount, never starved (default rate 1000 tokens/s: a 5,000-token request yields for at most 5 s).
Keys stay fixed on entry, so each class is a heap on its keys instead of a FIFO; across classes (ageing
on) the key is `rank * aging + enqueued_at + C / rate`, the same virtual time.

Tenants (with a `tenancy:` block, router/traffic/tenants.py): with `tenancy.fairness` on (the default), each class is
one flow per tenant served by weighted fair queueing in predicted tokens (router/traffic/fair_queue.py has the
algorithm and its guarantees); across classes, a class competes with its oldest request's key, as above.
With one tenant (everything `default`), that is exactly the order described above.

Shedding:
- `deadline`: each request has a deadline (`x-request-deadline-ms`, at most the class's `deadline`),
  counted from when it joined the queue. One timer per pool fires at the earliest deadline; `sweep()`
  sheds what is overdue. Timers run on the event loop's clock; deadlines are judged on the injected
  `clock`, so tests move a fake clock and call `sweep()` instead of sleeping.
- `queue_full` / `evicted`: at `maxQueue` waiting, a newcomer of a strictly higher class evicts the
  last request in order of the lowest class present (the newest, or with shortest-expected-first the one
  with the largest key; with fairness, of the tenant with the largest backlog per weight); with fairness, a
  newcomer may instead evict the last request of the tenant of its own class with the largest backlog per
  weight, when that exceeds its own tenant's (router/traffic/fair_queue.py); otherwise the newcomer is shed.
  Eviction looks at classes, not ageing: under sustained overload an old low request must not keep a new
  high one out.

Shed requests get `shedStatus` (429 or 503) with `Retry-After` in the OpenAI error shape, a count in
`fleetroute_admission_shed_total{model,priority,reason}` and one JSON log line each.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import itertools
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from aiohttp import web

from router.config.fields import ConfigError, Fields, _show
from router.model import EndpointView, Snapshot
from router.routing.loads import LoadTracker
from router.runtime.errors import error_response
from router.runtime.metrics import RouterMetrics
from router.traffic.fair_queue import FairClass
from router.traffic.tenants import DEFAULT_TENANT, TenancySettings


class Members(Protocol):
    """What admission reads of the balancer (router/routing/balancer.py): whether its snapshot changed, and
    what a model's picker chooses from now. A protocol, not the class: the config reader imports this module's
    parser, and the balancer imports the config reader."""

    @property
    def snapshot(self) -> Snapshot: ...

    def candidates(self, model: str) -> tuple[EndpointView, ...]: ...


class CappedPolicy(Protocol):
    """What admission reads of a policy (router/config/settings.py PolicySpec): its admission settings."""

    @property
    def admission(self) -> AdmissionSettings | None: ...

log = logging.getLogger("fleetroute.admission")

DEADLINE_HEADER = "x-request-deadline-ms"
SHED_STATUSES = (429, 503)
ORDERS = ("fifo", "shortest-expected-first")
MAX_CLASSES = 16  # class names are metric label values: keep the cardinality bounded
MAX_PRIORITY = 1000  # |priority|: a bounded range the CRD can state
_CLASS_NAME = re.compile(r"^[a-z0-9]([-a-z0-9_]{0,30}[a-z0-9])?$")
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an RFC 9110 token

# (reason label, OpenAI error code) of each way a request is shed.
SHED_CODES = {"deadline": "queue_deadline_exceeded", "queue_full": "queue_full", "evicted": "queue_evicted"}


@dataclass(frozen=True)
class PriorityClass:
    name: str
    rank: int  # 0 is served first
    deadline: float  # seconds a request of this class may wait in the queue at most
    priority: int | None = None  # as written (higher is served first); None: ranked by position (deprecated)


DEFAULT_CLASSES = (
    PriorityClass("high", 0, 30.0, priority=2),
    PriorityClass("normal", 1, 60.0, priority=1),
    PriorityClass("low", 2, 120.0, priority=0),
)


@dataclass(frozen=True)
class AdmissionSettings:
    """One policy's `admission:` block. Without `max_concurrent_per_endpoint` admission is off."""

    max_queue: int = 256
    max_concurrent_per_endpoint: int | None = None
    priority_header: str = "x-priority"
    classes: tuple[PriorityClass, ...] = DEFAULT_CLASSES
    default_class: str = "normal"
    aging: float | None = 10.0  # seconds of waiting that raise a request by one class; None: strict order
    shed_status: int = 429
    retry_after: float = 1.0
    order: str = "fifo"  # within a class; "shortest-expected-first" orders by predicted cost, with ageing
    aging_tokens_per_second: float = 1000.0  # shortest-expected-first: cost worth one second of waiting
    _by_name: Mapping[str, PriorityClass] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {c.name: c for c in self.classes})

    def classify(self, value: str | None) -> PriorityClass:
        """The class a header value names (case-insensitive); the default class for anything else."""
        if value:
            found = self._by_name.get(value.strip().lower())
            if found is not None:
                return found
        return self._by_name[self.default_class]


def parse_admission(f: Fields) -> AdmissionSettings:
    """Parse a policy's `admission:` block (settings.py calls this; errors name the field)."""
    defaults = AdmissionSettings()
    max_queue = f.integer("maxQueue", defaults.max_queue, minimum=0, maximum=1_000_000)
    cap = None
    if f.get("maxConcurrentPerEndpoint") is not None:
        cap = f.integer("maxConcurrentPerEndpoint", 0, minimum=1, maximum=1_000_000)
    header = f.string("priorityHeader", defaults.priority_header)
    if not _HEADER_NAME.match(header):
        raise ConfigError(f.at("priorityHeader"), f"must be an HTTP header name, got {header!r}")
    classes = _classes(f)
    names = tuple(c.name for c in classes)
    default_class = f.get("defaultClass", defaults.default_class)
    if default_class not in names:
        problem = f"must be one of the classes ({', '.join(names)}); got {_show(default_class)}"
        raise ConfigError(f.at("defaultClass"), problem)
    aging: float | None = None  # `agingSeconds: null`: strict priority, no ageing
    if f.get("agingSeconds", defaults.aging) is not None:
        aging = f.duration("agingSeconds", defaults.aging or 0)
    shed_status = f.get("shedStatus", defaults.shed_status)
    if shed_status not in SHED_STATUSES or isinstance(shed_status, bool):
        raise ConfigError(f.at("shedStatus"), f"must be 429 or 503, got {_show(shed_status)}")
    retry_after = f.duration("retryAfter", defaults.retry_after)
    order = f.choice("order", defaults.order, ORDERS)
    # `null` is "not set", so that an entry switching a preset's shortest-expected-first back to fifo can
    # drop the preset's rate (router/config/presets.py: a written null replaces the preset's value).
    if f.get("agingTokensPerSecond") is not None and order == "fifo":
        raise ConfigError(f.at("agingTokensPerSecond"), "applies only with order: shortest-expected-first "
                                                        "(null unsets it)")
    rate = defaults.aging_tokens_per_second
    if f.get("agingTokensPerSecond") is not None:
        rate = f.number("agingTokensPerSecond", rate, minimum=0, maximum=1e9, exclusive_minimum=True)
    f.done()
    return AdmissionSettings(
        max_queue=max_queue,
        max_concurrent_per_endpoint=cap,
        priority_header=header.lower(),
        classes=classes,
        default_class=default_class,
        aging=aging,
        shed_status=shed_status,
        retry_after=retry_after,
        order=order,
        aging_tokens_per_second=rate,
    )


def _classes(f: Fields) -> tuple[PriorityClass, ...]:
    """`classes: {name: {priority, deadline}}`, ranked by priority (highest first), in whatever order the
    mapping arrives. Without any priority, ranked by position, with a deprecation warning."""
    raw = f.get("classes")
    if raw is None:
        return DEFAULT_CLASSES
    where = f.at("classes")
    if not isinstance(raw, Mapping) or not raw:
        problem = f"must be a non-empty mapping of class name to settings ({{priority, deadline}}); got {_show(raw)}"
        raise ConfigError(where, problem)
    if len(raw) > MAX_CLASSES:
        raise ConfigError(where, f"at most {MAX_CLASSES} classes, got {len(raw)}")
    written = []
    for name, body in raw.items():
        if not isinstance(name, str) or not _CLASS_NAME.match(name):
            raise ConfigError(f"{where}.{name}", "class names must be lower-case letters, digits, '-' or '_' (1-32)")
        c = Fields(body, f"{where}.{name}")
        deadline = c.duration("deadline", 60.0)
        priority = None
        if c.get("priority") is not None:
            priority = c.integer("priority", 0, minimum=-MAX_PRIORITY, maximum=MAX_PRIORITY)
        c.done()
        written.append((name, priority, deadline))
    if all(priority is None for _, priority, _ in written):
        log.warning("%s: classes ranked by their order in the mapping; give each class a priority (higher is "
                    "served first): YAML tools and the Kubernetes API server reorder mapping keys", where,
                    extra={"field": where, "deprecated": "admission.classes without priority"})
        return tuple(PriorityClass(name, rank, deadline) for rank, (name, _, deadline) in enumerate(written))
    missing = [name for name, priority, _ in written if priority is None]
    if missing:
        raise ConfigError(where, f"every class needs a priority once one has one; missing: {', '.join(missing)}")
    by_priority: dict[int | None, str] = {}
    for name, priority, _ in written:
        if priority in by_priority:
            raise ConfigError(f"{where}.{name}.priority", f"{priority} is also {by_priority[priority]}'s: "
                                                           "priorities must differ (they order the classes)")
        by_priority[priority] = name
    ranked = sorted(written, key=lambda w: -(w[1] or 0))
    return tuple(PriorityClass(name, rank, deadline, priority)
                 for rank, (name, priority, deadline) in enumerate(ranked))


class _State(enum.Enum):
    QUEUED = "queued"
    WOKEN = "woken"  # promised a slot, not yet running
    ADMITTED = "admitted"
    SHED = "shed"


class _Waiter:
    __slots__ = ("cls", "request_id", "enqueued_at", "deadline_at", "key", "seq", "future", "state", "tenant",
                 "cost")

    def __init__(self, cls: PriorityClass, request_id: str, now: float, deadline_at: float,
                 key: tuple[float, ...], seq: int, tenant: str = "", cost: float = 0.0):
        self.cls = cls
        self.request_id = request_id
        self.tenant = tenant  # router/traffic/tenants.py ("" without tenancy)
        self.cost = cost  # predicted tokens (router/routing/cost.py): fair queueing charges them
        self.enqueued_at = now
        self.deadline_at = deadline_at
        self.key = key  # the service order, fixed on entry (lower first); its last element is `seq`
        self.seq = seq
        self.future: asyncio.Future[web.Response | None] = asyncio.get_running_loop().create_future()
        self.state = _State.QUEUED


class _Fifo(deque[_Waiter]):
    """A class's queue in arrival order (the default)."""

    def push(self, waiter: _Waiter, front: bool) -> None:
        if front:  # back at the head, keeping the place it earned
            self.appendleft(waiter)
        else:
            self.append(waiter)

    def head(self) -> _Waiter:
        return self[0]

    def last(self) -> _Waiter:
        return self[-1]

    # What a class queue answers with fairness (router/traffic/fair_queue.py); here, one flow in arrival order.
    def lead_key(self) -> tuple[float, ...]:
        return self[0].key

    def served(self, waiter: _Waiter) -> None:
        pass

    def unserved(self, waiter: _Waiter) -> None:
        pass

    def heavier_than(self, tenant: str, cost: float) -> _Waiter | None:
        return None


class _ByKey:
    """A class's queue in key order (shortest-expected-first): heaps on the waiters' fixed keys.

    Removal is lazy: a shed or cancelled waiter only leaves `_live`, and the heaps drop it when it reaches
    their top (or when dead entries outnumber live ones, in one rebuild). A mass expiry of thousands of
    queued requests is then O(n log n), not the O(n^2) of removing each from the heap's middle. `last()`
    (the newest, longest-expected waiter, evicted first) reads a second heap on the negated keys.
    """

    __slots__ = ("_heap", "_reverse", "_live", "_pushes")

    def __init__(self) -> None:
        # (key, push number, waiter): a waiter put back may meet its own stale entry, and the push number
        # keeps equal keys from ever comparing the waiters themselves.
        self._heap: list[tuple[tuple[float, ...], int, _Waiter]] = []
        self._reverse: list[tuple[tuple[float, ...], int, _Waiter]] = []
        self._live: set[_Waiter] = set()
        self._pushes = itertools.count()

    def push(self, waiter: _Waiter, front: bool) -> None:
        # Its key alone restores the place it earned (a woken waiter put back keeps its key).
        n = next(self._pushes)
        heapq.heappush(self._heap, (waiter.key, n, waiter))
        heapq.heappush(self._reverse, (tuple(-k for k in waiter.key), n, waiter))
        self._live.add(waiter)

    def _top(self, heap: list[tuple[tuple[float, ...], int, _Waiter]]) -> _Waiter:
        while heap[0][2] not in self._live:
            heapq.heappop(heap)
        return heap[0][2]

    def head(self) -> _Waiter:
        return self._top(self._heap)

    def last(self) -> _Waiter:
        return self._top(self._reverse)

    def lead_key(self) -> tuple[float, ...]:
        return self.head().key

    def served(self, waiter: _Waiter) -> None:
        pass

    def unserved(self, waiter: _Waiter) -> None:
        pass

    def heavier_than(self, tenant: str, cost: float) -> _Waiter | None:
        return None

    def remove(self, waiter: _Waiter) -> None:
        self._live.discard(waiter)
        if len(self._heap) > 2 * len(self._live) + 64:  # bound the dead weight
            self._heap = [entry for entry in self._heap if entry[2] in self._live]
            self._reverse = [entry for entry in self._reverse if entry[2] in self._live]
            heapq.heapify(self._heap)
            heapq.heapify(self._reverse)

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[_Waiter]:
        return iter(list(self._live))


class Admission:
    """The admission pools of one router process, one per capped model; wired to load and rebuild events."""

    def __init__(
        self,
        *,
        balancer: Members,
        loads: LoadTracker,
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
        tenancy: TenancySettings | None = None,
    ) -> None:
        self._balancer = balancer
        self._loads = loads
        self._metrics = metrics
        self._clock = clock
        self._tenancy = tenancy  # with tenants: per-tenant metrics, and fair queueing unless switched off
        self._pools: dict[str, Pool] = {}
        self._busy: set[Pool] = set()  # pools with someone queued: the only ones a release can concern

    def pool(self, spec: CappedPolicy, model: str) -> Pool | None:
        """The model's admission pool, or None when its policy caps no endpoint (admission is off)."""
        settings = spec.admission
        if settings is None or settings.max_concurrent_per_endpoint is None:
            return None
        pool = self._pools.get(model)
        if pool is None or pool.settings is not settings:
            pool = self._pools[model] = Pool(model, settings, self)
        return pool

    def released(self, endpoint_id: str) -> None:
        """A request's in-flight at `endpoint_id` ended (LoadTracker hook): hand the slot to a waiter."""
        if not self._busy:
            return
        for pool in list(self._busy):
            if endpoint_id in pool.endpoint_ids():
                pool.dispatch()

    def rebuilt(self) -> None:
        """The routing snapshot changed (Balancer hook): endpoints may have joined, left or resumed."""
        for pool in list(self._busy):
            pool.dispatch()

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Endpoints left: each pool's cached candidates are recomputed (they may name them) at next use."""
        for pool in self._pools.values():
            pool.forget_endpoints(gone)

    def sweep(self) -> None:
        """Shed every queued request whose deadline has passed (the pools' timers call this per pool)."""
        for pool in list(self._busy):
            pool.sweep()

    def queued(self, model: str) -> int:
        pool = self._pools.get(model)
        return pool.queued if pool is not None else 0


class Pool:
    """The admission queue of one model: one queue per priority class (with fairness, one flow per tenant in
    each: router/traffic/fair_queue.py) plus a deadline heap."""

    def __init__(self, model: str, settings: AdmissionSettings, admission: Admission) -> None:
        self.model = model
        self.settings = settings
        self.cap: int = settings.max_concurrent_per_endpoint or 0
        self._admission = admission
        self._loads = admission._loads
        self._clock = admission._clock
        self._by_cost = settings.order == "shortest-expected-first"
        queue = _ByKey if self._by_cost else _Fifo
        tenancy = admission._tenancy
        self._queues: dict[str, _Fifo | _ByKey | FairClass]
        if tenancy is not None and tenancy.fairness:
            weights = tenancy.weights()
            self._queues = {c.name: FairClass(queue, weights) for c in settings.classes}
        else:
            self._queues = {c.name: queue() for c in settings.classes}
        self._lowest_first = tuple(reversed(settings.classes))
        self.queued = 0
        self.pending = 0  # woken requests that hold a promised slot but have not started yet
        self._deadlines: list[tuple[float, int, _Waiter]] = []
        self._seq = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._ids: tuple[str, ...] = ()
        self._version = -1
        m = admission._metrics
        self._depth = {c.name: m.admission_queue_depth.labels(model, c.name) for c in settings.classes}
        self._admitted = {c.name: m.admission_admitted.labels(model, c.name) for c in settings.classes}
        self._waited = {c.name: m.admission_wait.labels(model, c.name) for c in settings.classes}
        self._shed_count = m.admission_shed
        self._per_tenant = tenancy is not None
        if tenancy is not None:
            self._tenant_depth = {t: m.tenant_queue_depth.labels(t, model) for t in tenancy.names()}
            self._tenant_waited = {t: m.tenant_wait.labels(t, model) for t in tenancy.names()}
            self._tenant_shed = m.tenant_shed

    # ---- capacity (read from the load tracker, never counted here) --------------------------------------

    def endpoint_ids(self) -> tuple[str, ...]:
        """The endpoints the picker may choose (serving, healthy), recomputed once per snapshot."""
        balancer = self._admission._balancer
        version = balancer.snapshot.version
        if version != self._version:
            self._ids = tuple(v.id for v in balancer.candidates(self.model))
            self._version = version
        return self._ids

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        if not gone.isdisjoint(self._ids):
            self._ids, self._version = (), -1

    def _has_room(self, ids: tuple[str, ...]) -> bool:
        """More free slots across the pool than requests already promised one."""
        promised = self.pending
        cap = self.cap
        in_flight = self._loads.in_flight
        for endpoint_id in ids:
            promised -= cap - min(cap, in_flight(endpoint_id))
            if promised < 0:
                return True
        return False

    def exclude(self, tried: frozenset[str]) -> frozenset[str]:
        """`tried` plus the endpoints at their cap: what the picker must not choose."""
        in_flight = self._loads.in_flight
        full = [i for i in self.endpoint_ids() if in_flight(i) >= self.cap]
        return tried.union(full) if full else tried

    # ---- the request path ------------------------------------------------------------------------------

    async def admit(self, request_id: str, headers: Mapping[str, str], cost: float = 0.0,
                    tenant: str = "") -> web.Response | None:
        """Wait for a slot. Returns None when the request may go on, or the response to shed it with.
        `cost` (tokens, router/routing/cost.py) orders the request within its class under shortest-expected-first, and
        is what fair queueing charges `tenant` (a configured tenant name, router/traffic/tenants.py; "" without)."""
        settings = self.settings
        cls = settings.classify(headers.get(settings.priority_header))
        ids = self.endpoint_ids()
        # No serving endpoint: nothing to wait for; the picker answers 503 no_endpoint at once.
        if not ids or (not self.queued and self._has_room(ids)):  # _has_room counts promised slots
            self._admitted[cls.name].inc()
            return None
        now = self._clock()
        deadline = cls.deadline
        budget = _deadline_ms(headers.get(DEADLINE_HEADER))
        if budget is not None:
            deadline = min(deadline, budget)  # a client may shorten its wait, never extend its class's
        aging = settings.aging
        seq = next(self._seq)
        start = now + cost / settings.aging_tokens_per_second if self._by_cost else now
        if aging is not None:
            key: tuple[float, ...] = (cls.rank * aging + start, seq)
        else:
            key = (cls.rank, start, seq) if self._by_cost else (cls.rank, seq)
        if self._per_tenant and tenant not in self._tenant_depth:
            tenant = DEFAULT_TENANT  # only configured names become labels
        waiter = _Waiter(cls, request_id, now, now + deadline, key, seq, tenant, cost)
        if deadline <= 0:
            return self._shed(waiter, "deadline")
        if self.queued >= settings.max_queue:
            victim = self._victim()
            fair = False
            if victim is None or victim.cls.rank <= cls.rank:
                # With fairness, the tenant with the most waiting in this class gives up its newest instead.
                victim = self._queues[cls.name].heavier_than(tenant, cost)
                fair = True
            if victim is None:
                return self._shed(waiter, "queue_full")
            self._remove(victim)
            victim.future.set_result(self._shed(victim, "evicted", fair=fair))
        self._enqueue(waiter)
        self.dispatch()
        return await self._wait(waiter)

    async def _wait(self, waiter: _Waiter) -> web.Response | None:
        try:
            while True:
                shed = await waiter.future
                if shed is not None:
                    return shed
                self.pending -= 1
                waiter.state = _State.ADMITTED
                ids = self.endpoint_ids()
                if not ids or self._has_room(ids):
                    waited = self._clock() - waiter.enqueued_at
                    self._admitted[waiter.cls.name].inc()
                    self._waited[waiter.cls.name].observe(waited)
                    if self._per_tenant:
                        self._tenant_waited[waiter.tenant].observe(waited)
                    return None
                # Rare: a request of another model sharing one of our endpoints took the slot between the
                # wake-up and now. Back to the head of the class's queue, keeping the place it earned.
                if self._clock() >= waiter.deadline_at:
                    return self._shed(waiter, "deadline")
                waiter.future = asyncio.get_running_loop().create_future()
                self._enqueue(waiter, front=True)
                self._queues[waiter.cls.name].unserved(waiter)  # fairness: its tenant gets the cost back
                self.dispatch()
        except asyncio.CancelledError:  # the client went away while queued: give its place or slot on
            if waiter.state is _State.QUEUED:
                self._remove(waiter)
            elif waiter.state is _State.WOKEN:
                self.pending -= 1
                self.dispatch()
            raise

    def dispatch(self) -> None:
        """Wake the best queued requests, one per free slot not already promised."""
        ids = self.endpoint_ids()
        while self.queued and (not ids or self._has_room(ids)):
            queue = self._best()
            waiter = queue.head()
            self._remove(waiter)
            queue.served(waiter)  # fairness: the tenant's virtual clock advances by the request's cost
            waiter.state = _State.WOKEN
            self.pending += 1
            waiter.future.set_result(None)

    def sweep(self) -> None:
        now = self._clock()
        heap = self._deadlines
        while heap and (heap[0][0] <= now or heap[0][2].state is not _State.QUEUED):
            _, _, waiter = heapq.heappop(heap)
            if waiter.state is _State.QUEUED:
                self._remove(waiter)
                waiter.future.set_result(self._shed(waiter, "deadline"))
        self._arm()

    # ---- queue structure -------------------------------------------------------------------------------

    def _enqueue(self, waiter: _Waiter, *, front: bool = False) -> None:
        self._queues[waiter.cls.name].push(waiter, front)
        waiter.state = _State.QUEUED
        self.queued += 1
        self._depth[waiter.cls.name].inc()
        if self._per_tenant:
            self._tenant_depth[waiter.tenant].inc()
        self._admission._busy.add(self)
        heapq.heappush(self._deadlines, (waiter.deadline_at, waiter.seq, waiter))
        self._arm()

    def _remove(self, waiter: _Waiter) -> None:
        self._queues[waiter.cls.name].remove(waiter)
        self.queued -= 1
        self._depth[waiter.cls.name].dec()
        if self._per_tenant:
            self._tenant_depth[waiter.tenant].dec()
        if not self.queued:
            self._admission._busy.discard(self)
        # Deadline entries of requests that left are dropped lazily (at the heap's top); compact now and
        # then so that, under load with long deadlines, they cannot pile up beyond twice the queue.
        if len(self._deadlines) > 2 * self.queued + 64:
            self._deadlines = [entry for entry in self._deadlines if entry[2].state is _State.QUEUED]
            heapq.heapify(self._deadlines)

    def _best(self) -> _Fifo | _ByKey | FairClass:
        """The class queue to serve from: the one whose first request in admission order (rank, ageing) is
        first. Without fairness its head is that request; with fairness, the class's fair choice."""
        return min((q for q in self._queues.values() if q), key=lambda q: q.lead_key())

    def _victim(self) -> _Waiter | None:
        """The last request in order (FIFO: the newest) of the lowest class that has any."""
        for cls in self._lowest_first:
            queue = self._queues[cls.name]
            if queue:
                return queue.last()
        return None

    def _arm(self) -> None:
        """Keep one loop timer set for the earliest deadline still queued."""
        if not self._deadlines:
            if self._timer is not None:
                self._timer.cancel()
                self._timer, self._timer_at = None, math.inf
            return
        earliest = self._deadlines[0][0]
        if self._timer is not None and self._timer_at <= earliest:
            return
        if self._timer is not None:
            self._timer.cancel()
        delay = max(0.0, earliest - self._clock())
        self._timer = asyncio.get_running_loop().call_later(delay, self._on_timer)
        self._timer_at = earliest

    def _on_timer(self) -> None:
        self._timer, self._timer_at = None, math.inf
        self.sweep()

    # ---- shedding --------------------------------------------------------------------------------------

    def _shed(self, waiter: _Waiter, reason: str, *, fair: bool = False) -> web.Response:
        settings = self.settings
        waiter.state = _State.SHED
        waited = max(0.0, self._clock() - waiter.enqueued_at)
        cls = waiter.cls.name
        self._shed_count.labels(self.model, cls, reason).inc()
        tenant = {}
        if self._per_tenant:
            self._tenant_shed.labels(waiter.tenant, self.model, reason).inc()
            tenant = {"tenant": waiter.tenant}
        log.warning(
            "request shed",
            extra={
                "request_id": waiter.request_id,
                "model": self.model,
                "priority": cls,
                **tenant,
                "reason": reason,
                "waited_ms": round(waited * 1000, 3),
                "queued": self.queued,
                "status": settings.shed_status,
            },
        )
        if reason == "deadline":
            message = (
                f"model `{self.model}` is at capacity and this request waited {waited:.3g}s, past its deadline of "
                f"{waiter.deadline_at - waiter.enqueued_at:.3g}s; retry later"
            )
        elif reason == "queue_full":
            message = (
                f"model `{self.model}` is at capacity and its queue is full ({settings.max_queue} requests of "
                f"priority `{cls}` or higher); retry later"
            )
        elif fair:
            message = (
                f"model `{self.model}` is at capacity and its queue is full; this request's tenant had the most "
                f"waiting, so it was dropped to make room for another tenant's; retry later"
            )
        else:
            message = (
                f"model `{self.model}` is at capacity; this `{cls}` request was dropped from the queue to make "
                f"room for a higher-priority one; retry later"
            )
        return error_response(
            settings.shed_status, message, code=SHED_CODES[reason],
            headers={"Retry-After": str(max(1, math.ceil(settings.retry_after)))},
        )


def _deadline_ms(raw: str | None) -> float | None:
    """Seconds from an `x-request-deadline-ms` value; None (use the class's) when absent or malformed."""
    if not raw:
        return None
    raw = raw.strip()
    if not raw.isascii() or not raw.isdigit() or len(raw) > 12:
        return None
    return int(raw) / 1000.0

