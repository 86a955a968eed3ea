"""A retry budget: over any `window` (10 s), retries may be at most `percent` of the requests started, plus
`min_per_second` (Finagle's RetryBudget; Envoy's retry budgets bound retries the same way).

During a fleet-wide outage every request fails; if each were retried, the failing fleet would receive twice
the load exactly when it can least take it. With 20% the retries add at most a fifth. The floor lets a
quiet router, or a short burst of failures from one bad endpoint, still be retried in full.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable


class RetryBudget:
    def __init__(self, clock: Callable[[], float], window: float = 10.0) -> None:
        self._clock = clock
        self._window = window
        self._requests: deque[float] = deque()  # start times within the window
        self._retries: deque[float] = deque()

    def _trim(self, now: float) -> None:
        horizon = now - self._window
        for times in (self._requests, self._retries):
            while times and times[0] <= horizon:
                times.popleft()

    def request_started(self) -> None:
        now = self._clock()
        self._trim(now)  # keeps the deques to one window of entries
        self._requests.append(now)

    def allows(self, percent: float, min_per_second: float) -> bool:
        """Would the budget allow one more retry now?"""
        self._trim(self._clock())
        return len(self._retries) + 1 <= percent / 100.0 * len(self._requests) + min_per_second * self._window

    def try_spend(self, percent: float, min_per_second: float) -> bool:
        """Take one retry from the budget if it allows one now."""
        if not self.allows(percent, min_per_second):
            return False
        self._retries.append(self._clock())
        return True
