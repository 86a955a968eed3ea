"""A circuit breaker per endpoint, on the failure ratio of real requests.

closed    requests flow; outcomes are counted in a rolling window (`window`, in 10 buckets). When the window
          holds at least `minRequests` and the failure ratio reaches `failureRatio`, the breaker opens.
open      no requests for `openDuration`; then half-open.
half-open at most `halfOpenRequests` probe requests at a time; if `halfOpenRequests` probes succeed in a
          row the breaker closes, the first failure opens it again.

Where outlier ejection reacts to a streak of failures, the breaker reacts to a sustained share of them
(an endpoint failing every other request never builds a streak).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerSettings:
    enabled: bool = True
    window: float = 10.0
    min_requests: int = 20
    failure_ratio: float = 0.5
    open_duration: float = 30.0
    half_open_requests: int = 3


BUCKETS = 10


class CircuitBreaker:
    def __init__(self, settings: BreakerSettings) -> None:
        self.settings = settings
        self.state = BreakerState.CLOSED
        self.opened_at = 0.0
        self._buckets: list[list[float]] = []  # [bucket start, requests, failures]
        self._probes_in_flight = 0
        self._probe_successes = 0

    def _roll(self, now: float) -> None:
        width = self.settings.window / BUCKETS
        start = now - now % width
        if not self._buckets or self._buckets[-1][0] != start:
            self._buckets.append([start, 0, 0])
        horizon = now - self.settings.window
        while self._buckets and self._buckets[0][0] + width <= horizon:
            self._buckets.pop(0)

    def current(self, now: float) -> BreakerState:
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.settings.open_duration:
            self.state = BreakerState.HALF_OPEN
            self._probes_in_flight = 0
            self._probe_successes = 0
        return self.state

    def try_acquire(self, now: float) -> bool:
        """May a request go to this endpoint now? In half-open, this takes one of the probe slots."""
        state = self.current(now)
        if state is BreakerState.CLOSED:
            return True
        if state is BreakerState.HALF_OPEN and self._probes_in_flight < self.settings.half_open_requests:
            self._probes_in_flight += 1
            return True
        return False

    def release(self) -> None:
        """Give back a probe slot without a verdict (the attempt ended without an outcome)."""
        self._probes_in_flight = max(0, self._probes_in_flight - 1)

    def record(self, ok: bool, now: float, *, probe: bool) -> BreakerState | None:
        """Count an outcome; returns the new state if it changed."""
        if probe:
            self._probes_in_flight = max(0, self._probes_in_flight - 1)
        state = self.current(now)
        if state is BreakerState.HALF_OPEN:
            if not ok:
                return self._open(now)
            self._probe_successes += 1
            if self._probe_successes >= self.settings.half_open_requests:
                self.state = BreakerState.CLOSED
                self._buckets.clear()
                return BreakerState.CLOSED
            return None
        if state is BreakerState.OPEN:
            return None
        self._roll(now)
        bucket = self._buckets[-1]
        bucket[1] += 1
        bucket[2] += 0 if ok else 1
        requests = sum(b[1] for b in self._buckets)
        failures = sum(b[2] for b in self._buckets)
        s = self.settings
        if requests >= s.min_requests and failures / requests >= s.failure_ratio:
            return self._open(now)
        return None

    def _open(self, now: float) -> BreakerState:
        self.state = BreakerState.OPEN
        self.opened_at = now
        self._buckets.clear()
        self._probes_in_flight = 0
        return BreakerState.OPEN
