"""A retry budget: retries may be at most a share of the requests in flight (Envoy's retry budgets).

During a fleet-wide outage every request fails; if each were retried, the failing fleet would receive
twice the load exactly when it can least take it. With a budget of 20% (and a floor of a few concurrent
retries so a quiet router can still retry), retries add at most a fifth to the load.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager


class RetryBudget:
    def __init__(self) -> None:
        self.active = 0  # retry attempts in progress

    def allows(self, requests_in_flight: int, budget_percent: float, min_concurrency: int) -> bool:
        return self.active < max(min_concurrency, budget_percent / 100.0 * requests_in_flight)

    @contextmanager
    def spend(self) -> Iterator[None]:
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
