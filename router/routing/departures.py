"""What happens inside the router when an endpoint leaves: everything kept for it is freed, and every metric
series labelled with it is removed, so that endpoint churn costs nothing for the life of the process. (With
Kubernetes discovery endpoint ids are pod names: every rollout brings new ones.)

Membership changes reach the router in one place, `Balancer.set_endpoints` (the static list at start-up and
on a reload, Kubernetes discovery), which hands the ids that left to `Departures.left`. Everything else that
keeps per-endpoint state is an `EndpointStateOwner` and is told from here, in two steps:

1. **Routing state, at once**, because nothing can route to the endpoint any more. Every owner listed by
   `owners` (the router's: `RouterContext.endpoint_state_owners`) forgets it: the balancer (telemetry,
   drains, GPU faults, each policy's health: active checks, outlier ejection, breaker, slow start; picker
   pool state: prefix index, hash ring), the session tables (pins to it), the telemetry feed and embedded
   collection (records, scrapers), admission (cached pools) and the prefix upkeep (the series it exports).
2. **Load state and series, once no request of this router is in flight there.** That is at once, usually:
   Kubernetes marks a pod terminating, the router drains it, its streams finish, and only then does the pod
   leave its EndpointSlice. A pod deleted with requests still streaming (force-deleted, or crashed) keeps
   its in-flight count, cost and pending prefill, and their gauges, exact until the last one ends; then the
   load tracker forgets it and every series with its `endpoint` label is removed, whatever its other labels
   (`RouterMetrics.forget_endpoints`). This waits one turn of the event loop after the last request's
   in-flight ends: the handler records that request (`fleetroute_requests_total`, durations) right after,
   in the same turn, and a removal before it would let the record bring the series back.

An id that comes back with another URL (a StatefulSet pod recreated on a new IP) is a new incarnation: step 1
applies (its health and telemetry were the old pod's), step 2 does not (the id's in-flight requests still
count, and its series carry on). An id that comes back before step 2 cancels it.

Whoever adds a per-endpoint structure gives its owner a `forget_endpoints` (a new owner is listed in
`RouterContext.endpoint_state_owners`); tests/test_endpoint_churn.py rolls 200 endpoints through Kubernetes
discovery and fails on anything reachable from the router that still names one of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Protocol

from router.routing.loads import LoadTracker
from router.runtime.metrics import RouterMetrics
from router.runtime.progress import Progress

log = logging.getLogger("fleetroute.departures")


class EndpointStateOwner(Protocol):
    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Free everything kept for these endpoints: they left the endpoint set."""
        ...


class Departures:
    def __init__(self, *, loads: LoadTracker, metrics: RouterMetrics, is_member: Callable[[str], bool],
                 owners: Callable[[], Iterable[EndpointStateOwner]]) -> None:
        self._loads = loads
        self._metrics = metrics
        self._is_member = is_member
        self.owners = owners
        self._leaving: set[str] = set()  # left while requests were in flight there (step 2 waits for them)
        self.progress = Progress()  # notified after every step 2: tests wait on it instead of sleeping
        loads.on_idle = self._idle

    @property
    def leaving(self) -> frozenset[str]:
        return frozenset(self._leaving)

    def left(self, gone: frozenset[str], moved: frozenset[str] = frozenset()) -> None:
        """`gone` left the endpoint set; `moved` came back under the same id with another URL."""
        for owner in self.owners():
            owner.forget_endpoints(gone | moved)
        busy = frozenset(i for i in gone if self._loads.in_flight(i))
        for endpoint_id in busy - self._leaving:
            log.info("endpoint left with requests in flight; its load state and series are kept until they end",
                     extra={"endpoint": endpoint_id, "in_flight": self._loads.in_flight(endpoint_id)})
        self._leaving = (self._leaving - gone) | busy
        self._metrics.endpoints_leaving.set(len(self._leaving))
        if gone - busy:
            self._free(gone - busy)

    def _idle(self, endpoint_id: str) -> None:
        """The load tracker's hook: the endpoint's last request in flight has ended."""
        if endpoint_id not in self._leaving:
            return
        try:
            asyncio.get_running_loop().call_soon(self._last_request_ended, endpoint_id)
        except RuntimeError:  # no event loop (a tool driving the tracker by hand): nothing is left to record
            self._last_request_ended(endpoint_id)

    def _last_request_ended(self, endpoint_id: str) -> None:
        if endpoint_id not in self._leaving or self._loads.in_flight(endpoint_id):
            return
        self._leaving.discard(endpoint_id)
        self._metrics.endpoints_leaving.set(len(self._leaving))
        if self._is_member(endpoint_id):
            return  # it came back meanwhile: its load state and series are live again
        log.info("endpoint's last request ended; its load state and series are freed",
                 extra={"endpoint": endpoint_id})
        self._free(frozenset({endpoint_id}))

    def _free(self, gone: frozenset[str]) -> None:
        self._loads.forget_endpoints(gone)
        self._metrics.forget_endpoints(gone)
        self._metrics.endpoints_forgotten.inc(len(gone))
        log.debug("endpoints forgotten", extra={"endpoints": sorted(gone)})
        self.progress.notify()
