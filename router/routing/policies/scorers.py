"""Scorers for the adaptive policy: each maps one signal of one endpoint to a score in [0, 1] (1 = idle).

Scores are clamped in one place (`clamp`) and weighted by configuration (GIE endpoint-picker scorer
contract). A scorer returns None when it does not know the signal (no or stale telemetry); the adaptive
policy then gives that endpoint the mean of the known scores, a neutral value that neither attracts nor
repels traffic (grpc-go weighted round robin treats stale load reports the same way).
"""

from __future__ import annotations

from router.model import EndpointView


def clamp(value: float) -> float:
    if value != value:  # NaN: treat as the worst score rather than let it poison comparisons
        return 0.0
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value


def free_fraction(view: EndpointView, signal: str) -> float | None:
    """1 - a utilisation fraction (`gpu_util`, `gpu_mem_util` or `kv_cache_usage`)."""
    t = view.telemetry
    value = None if t is None else t.signal(signal)
    return None if value is None else clamp(1.0 - value)


def queue_free(reported_queue: float, in_flight: float, max_queue: int) -> float:
    """1 - queue/max_queue, where queue = what the engine last reported + what this router has in flight
    there. The local count is fresh while the report lags by up to one telemetry interval, so requests this
    router just sent lower the score at once (the correction rule 6 of STYLE.md asks for)."""
    return clamp(1.0 - (reported_queue + in_flight) / max_queue)


def neutral_fill(scores: dict[str, float | None], default: float = 0.5) -> dict[str, float]:
    """Replace unknown values by the mean of the known ones (`default` when none is known)."""
    known = [s for s in scores.values() if s is not None]
    fill = sum(known) / len(known) if known else default
    return {k: (fill if s is None else s) for k, s in scores.items()}
