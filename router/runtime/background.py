"""Background loops must outlive their own bugs: one failed step is logged and counted, and the loop runs
its next step as usual (a dead telemetry or housekeeping task would silently freeze routing state)."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from router.runtime.metrics import RouterMetrics

log = logging.getLogger("fleetroute.background")


@contextmanager
def contained(task: str, metrics: RouterMetrics) -> Iterator[None]:
    """Wrap one step of a background loop. Cancellation (a BaseException) still ends the loop."""
    try:
        yield
    except Exception:
        metrics.background_errors.labels(task).inc()
        log.exception("background step failed; the loop goes on", extra={"task": task})
