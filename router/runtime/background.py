"""Background loops must outlive their own bugs: one failed step is logged and counted, and the loop runs
its next step as usual (a dead telemetry or housekeeping task would silently freeze routing state)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from contextlib import contextmanager

from router.runtime.metrics import RouterMetrics

log = logging.getLogger("fleetroute.background")


def raise_if_cancelled() -> None:
    """End the current task if it was asked to stop. A cancellation that lands while a library waits (redis-py
    on a socket, an inner wait_for on Python 3.11) can come out as another error, or not at all; a loop that
    goes on after errors would then never stop (a router's shutdown hung on it). The task's count of pending
    cancellations still says it was asked."""
    current = asyncio.current_task()
    if current is not None and current.cancelling():
        raise asyncio.CancelledError


@contextmanager
def contained(task: str, metrics: RouterMetrics) -> Iterator[None]:
    """Wrap one step of a background loop. Cancellation (a BaseException) still ends the loop, also when a
    library turned it into an error or swallowed it (`raise_if_cancelled`)."""
    try:
        yield
    except Exception:
        raise_if_cancelled()
        metrics.background_errors.labels(task).inc()
        log.exception("background step failed; the loop goes on", extra={"task": task})
    raise_if_cancelled()
