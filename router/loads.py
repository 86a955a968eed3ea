"""Router-local live load: requests in flight per endpoint.

A request counts from the moment it is sent until its response *body* ends (or fails), not when the
headers arrive: a streaming completion is load on the engine until its last token (tower's
`TrackCompletion`). Only the event loop touches these counts, so they need no lock.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from router.metrics import RouterMetrics


class LoadTracker:
    def __init__(self, metrics: RouterMetrics) -> None:
        self._counts: defaultdict[str, int] = defaultdict(int)
        self._gauge = metrics.in_flight
        self._children: dict[str, Any] = {}
        # Other router replicas' in-flight counts, as last read from shared state (empty without Redis).
        self.others: dict[str, int] = {}
        # Called with the endpoint id whenever a request's in-flight ends (admission hands the slot on).
        self.on_release: Callable[[str], None] | None = None

    def in_flight(self, endpoint_id: str) -> int:
        return self._counts.get(endpoint_id, 0)

    def cluster_in_flight(self, endpoint_id: str) -> int:
        return self._counts.get(endpoint_id, 0) + self.others.get(endpoint_id, 0)

    def snapshot(self) -> dict[str, int]:
        return {k: v for k, v in self._counts.items() if v}

    def total(self) -> int:
        return sum(self._counts.values())

    @contextmanager
    def track(self, endpoint_id: str) -> Iterator[None]:
        self._counts[endpoint_id] += 1
        gauge = self._children.get(endpoint_id)
        if gauge is None:  # labels() costs microseconds: resolve each endpoint's child once
            gauge = self._children[endpoint_id] = self._gauge.labels(endpoint_id)
        gauge.inc()
        try:
            yield
        finally:
            self._counts[endpoint_id] -= 1
            gauge.dec()
            if self.on_release is not None:
                self.on_release(endpoint_id)
