"""Router-local live load: requests in flight per endpoint, and their predicted cost in tokens.

A request counts from the moment it is sent until its response *body* ends (or fails), not when the
headers arrive: a streaming completion is load on the engine until its last token (tower's
`TrackCompletion`). Only the event loop touches these counts, so they need no lock.

A request with a cost estimate (router/routing/cost.py; only for policies that make them) also adds its predicted
cost to its endpoint's in-flight cost for as long as it counts, and to a running mean of request costs that
turns tokens back into request-equivalents (`loadUnit: tokens` in the adaptive policy). Requests without an
estimate add nothing there, and with no estimates anywhere this costs one comparison per request.

A request whose picker expected the endpoint to compute some prompt tokens (prefix-aware's least-prefill)
books them as pending prefill until its first byte (router/routing/prefill.py), which also times the endpoint.

Each routing pool (one per model) may have a `LoadIndex` (router/routing/policies/load_index.py): its endpoints
ordered by in-flight count, moved here at every count change, so least-load picks do not scan the pool. The
balancer sets them at each rebuild (`set_pools`); a picker finds its pool's by the pool's tuple
(`load_index`).

An endpoint that leaves keeps all of this until its last request here ends (router/routing/departures.py), so its
counts stay exact while a terminating pod finishes its streams; then `forget_endpoints` frees it.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from router.model import EndpointView
from router.routing.policies.load_index import LoadIndex
from router.routing.prefill import Prefill, PrefillBook
from router.runtime.metrics import RouterMetrics

# The mean request cost is exact over the first requests, then an EWMA over about this many.
MEAN_COST_WINDOW = 256


class LoadTracker:
    def __init__(self, metrics: RouterMetrics) -> None:
        self._counts: defaultdict[str, int] = defaultdict(int)
        self._gauge = metrics.in_flight
        self._children: dict[str, Any] = {}
        self._costs: defaultdict[str, float] = defaultdict(float)
        self._cost_gauge = metrics.in_flight_cost
        self._cost_children: dict[str, Any] = {}
        self._mean_cost = 0.0
        self._costed = 0
        # Other router replicas' in-flight counts, as last read from shared state (empty without Redis).
        self.others: dict[str, int] = {}
        # Called with the endpoint id whenever a request's in-flight ends (admission hands the slot on).
        self.on_release: Callable[[str], None] | None = None
        # Called with the endpoint id when its last request in flight ends (a departed endpoint is freed then).
        self.on_idle: Callable[[str], None] | None = None
        self.prefill = PrefillBook()
        self._prefill_gauge = metrics.pending_prefill
        self._prefill_children: dict[str, Any] = {}
        self._speed_gauge = metrics.prefill_speed
        self._indexes: dict[str, LoadIndex] = {}  # pool (model) -> its index
        self._by_pool: dict[int, LoadIndex] = {}  # id() of the pool's views tuple -> its index
        self._indexed: dict[str, tuple[LoadIndex, ...]] = {}  # endpoint -> the indexes that hold it

    def in_flight(self, endpoint_id: str) -> int:
        return self._counts.get(endpoint_id, 0)

    def cluster_in_flight(self, endpoint_id: str) -> int:
        return self._counts.get(endpoint_id, 0) + self.others.get(endpoint_id, 0)

    def in_flight_cost(self, endpoint_id: str) -> float:
        return self._costs.get(endpoint_id, 0.0)

    def mean_request_cost(self) -> float:
        return self._mean_cost

    def pending_prefill(self, endpoint_id: str) -> float:
        return self.prefill.pending(endpoint_id)

    def prefill_speed(self, endpoint_id: str) -> float | None:
        return self.prefill.speed(endpoint_id)

    def load_index(self, views: tuple[EndpointView, ...]) -> LoadIndex | None:
        """The index of the pool whose views are exactly `views` (the same tuple), if it has one."""
        index = self._by_pool.get(id(views))
        return index if index is not None and index.views is views else None

    def set_pools(self, pools: Mapping[str, tuple[EndpointView, ...]], *, replace: bool = True) -> None:
        """Index these pools (by model) from the current counts; with `replace`, they are all the pools and any
        other's index goes. A pool with too many distinct capacity scales is left to scans. Costs O(pool)
        per pool given, as the rebuild that built it; an unchanged pool (the same endpoints at the same scales, as
        after a telemetry round) keeps its index."""
        indexes = {} if replace else dict(self._indexes)
        for model, views in pools.items():
            old = self._indexes.get(model)
            if old is not None and (old.views is views or old.rebind(views)):
                indexes[model] = old
            elif LoadIndex.fits(views):
                indexes[model] = LoadIndex(views, self._counts)
            else:
                indexes.pop(model, None)
        self._indexes = indexes
        self._by_pool = {id(ix.views): ix for ix in indexes.values()}
        indexed: dict[str, list[LoadIndex]] = {}
        for ix in indexes.values():
            for view in ix.views:
                indexed.setdefault(view.id, []).append(ix)
        self._indexed = {k: tuple(v) for k, v in indexed.items()}

    def repoint(self, pools: Mapping[str, tuple[tuple[EndpointView, ...], Mapping[str, EndpointView]]]) -> None:
        """Pools a telemetry refresh patched (model -> (new tuple, the views that changed)): the same endpoints at
        the same scales, so each index keeps its buckets and takes the new tuple in O(changed)."""
        for model, (views, changed) in pools.items():
            index = self._indexes.get(model)
            if index is None:
                continue
            self._by_pool.pop(id(index.views), None)
            index.patch(views, changed)
            self._by_pool[id(views)] = index

    def snapshot(self) -> dict[str, int]:
        return {k: v for k, v in self._counts.items() if v}

    def total(self) -> int:
        return sum(self._counts.values())

    @contextmanager
    def track(self, endpoint_id: str, cost: float = 0.0, prefill: float = 0.0, *,
              streamed: bool = False) -> Iterator[Prefill | None]:
        """Count a request at the endpoint for the body of the `with`. With `prefill` tokens, they are booked
        as pending and the booking is yielded, for `prefill_done` at the answer's first byte."""
        booked = self.prefill.start(endpoint_id, prefill, time.monotonic(), streamed=streamed) if prefill > 0.0 \
            else None
        if booked is not None:
            self._show_prefill(endpoint_id)
        count = self._counts[endpoint_id] = self._counts[endpoint_id] + 1
        for index in self._indexed.get(endpoint_id, ()):
            index.moved(endpoint_id, count)
        gauge = self._children.get(endpoint_id)
        if gauge is None:  # labels() costs microseconds: resolve each endpoint's child once
            gauge = self._children[endpoint_id] = self._gauge.labels(endpoint_id)
        gauge.inc()
        if cost > 0.0:
            self._add_cost(endpoint_id, cost)
            n = self._costed = min(self._costed + 1, MEAN_COST_WINDOW)
            self._mean_cost += (cost - self._mean_cost) / n
        try:
            yield booked
        finally:
            if booked is not None and booked.open:
                self.prefill.end(booked)
                self._show_prefill(endpoint_id)
            left = self._counts[endpoint_id] = self._counts[endpoint_id] - 1
            for index in self._indexed.get(endpoint_id, ()):
                index.moved(endpoint_id, left)
            gauge.dec()
            if cost > 0.0:
                self._add_cost(endpoint_id, -cost, idle=left == 0)
            if self.on_release is not None:
                self.on_release(endpoint_id)
            if left == 0 and self.on_idle is not None:
                self.on_idle(endpoint_id)

    def prefill_done(self, booked: Prefill, *, timed: bool) -> None:
        """A booked request's answer began: its prefill is done. `timed` (a stream that is not an error) lets
        its wait measure the endpoint; an error answer or a non-streamed body says nothing of its speed."""
        if not booked.open:
            return
        e = booked.endpoint_id
        if timed:
            self.prefill.first_token(booked, time.monotonic())
            speed = self.prefill.speed(e)
            if speed is not None:
                self._speed_gauge.labels(e).set(speed)
        else:
            self.prefill.end(booked)
        self._show_prefill(e)

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Free what is kept for endpoints that left and hold no request of this router any more (router/
        departures.py removes their series). Their cached gauge children go too: an id that comes back later
        must get new, exported ones."""
        for endpoint_id in gone:
            for table in (self._counts, self._costs, self._children, self._cost_children, self._prefill_children):
                table.pop(endpoint_id, None)
        self.prefill.forget_endpoints(gone)

    def _show_prefill(self, endpoint_id: str) -> None:
        gauge = self._prefill_children.get(endpoint_id)
        if gauge is None:
            gauge = self._prefill_children[endpoint_id] = self._prefill_gauge.labels(endpoint_id)
        gauge.set(self.prefill.pending(endpoint_id))

    def _add_cost(self, endpoint_id: str, cost: float, *, idle: bool = False) -> None:
        gauge = self._cost_children.get(endpoint_id)
        if gauge is None:
            gauge = self._cost_children[endpoint_id] = self._cost_gauge.labels(endpoint_id)
        # An idle endpoint holds exactly nothing: no float residue from adding and removing costs.
        total = 0.0 if idle else max(0.0, self._costs[endpoint_id] + cost)
        self._costs[endpoint_id] = total
        gauge.set(total)

