"""Summaries of one load-test run: latency percentiles, throughput, goodput under an SLO, errors by kind.

Definitions (the same for every router measured, ours or a peer):

- **TTFT**: send to the first token-carrying event. **ITL**: every gap between consecutive tokens of a
  request, pooled over all requests (what a streaming reader feels); also each request's mean gap.
  **E2E**: send to the end of the stream.
- **Window**: statistics are over the steady part of a run: requests planned from `warmup` (simulated
  seconds; the fleet starts empty, so the first requests see idle engines) to the last planned arrival (in
  a closed loop, by send times).
- **Span**: from the window's start to the last answer of a request of the window (vLLM's benchmark_serving
  counts a benchmark's duration the same way): how long the window's work took.
- **Failures count**: TTFT and E2E percentiles include every failed request of the window as infinitely
  slow (shown as "failed"), so shedding or timing out the worst requests never improves a P99 or a capacity.
- **Throughput**: the window's requests that succeeded (and their output tokens), per second of the span. A
  fleet that keeps up serves at the arrival rate (the span exceeds the window by about one answer); one that
  falls behind drains its backlog after the last arrival, the span grows, and throughput shows what it
  served. However short the run or long the answers, it never reads a fraction of what was served.
- **Goodput**: the window's requests that met the SLO, per second of the span: TTFT <= `ttft` and the
  request's mean ITL <= `itl` (DistServe's per-request definition); a subset of throughput, never above it.
  **Attainment** is the share of the window's requests that met it.
- **Capacity** (computed over a sweep, in `loadtest.report`): the highest offered rate whose P99 TTFT is within
  the SLO's `ttft`, the definition of the design's policy table.

Times are reported in *simulated* seconds when the fleet is time-scaled: every wall duration is divided by
the time scale, and every wall rate multiplied by it.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from loadtest.client import Result


@dataclass(frozen=True)
class Slo:
    ttft: float = 1.0  # seconds, per request and for the P99 capacity criterion
    itl: float = 0.1  # seconds, a request's mean inter-token gap


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[min(rank, len(ordered)) - 1]


def _dist(values: Sequence[float], failed: int = 0) -> dict[str, float | None]:
    """Mean over `values`; percentiles and max with `failed` more requests counted as infinitely slow."""
    everything = [*values, *([math.inf] * failed)]
    return {
        "mean": statistics.fmean(values) if values else None,
        "p50": percentile(everything, 50),
        "p90": percentile(everything, 90),
        "p99": percentile(everything, 99),
        "max": max(everything) if everything else None,
    }


@dataclass
class RunSummary:
    offered_rate: float  # requests/s the plan offered (simulated)
    sent: int
    ok: int
    errors: dict[str, int]
    duration: float  # the measurement window (its arrivals), simulated seconds
    realised_rate: float  # requests that arrived in the window, per simulated second of it
    throughput_rps: float  # the window's requests that succeeded, per second of `span`
    output_tokens_per_s: float  # their output tokens, per second of `span`
    goodput_rps: float  # the window's requests that met the SLO, per second of `span`
    slo_attainment: float
    ttft: dict[str, float | None]
    itl: dict[str, float | None]
    e2e: dict[str, float | None]
    client_lateness_p99: float | None  # wall seconds the generator fired late (high: the client was overloaded)
    by_priority: dict[str, dict[str, Any]] = field(default_factory=dict)
    served: dict[str, int] = field(default_factory=dict)  # requests per endpoint, where the router said
    # From the window's start to the last answer of a request that arrived in it (the window itself when
    # that is later): the time the window's work took, as vLLM's benchmark_serving counts a benchmark's
    # duration. Rates over it never exceed what was served, however short the run or long the answers.
    span: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def meets(result: Result, slo: Slo, scale: float) -> bool:
    if not result.ok or result.ttft is None:
        return False
    if result.ttft / scale > slo.ttft:
        return False
    if result.itl and statistics.fmean(result.itl) / scale > slo.itl:
        return False
    return True


def _arrival(result: Result, closed: bool) -> float:
    """When a request entered the run: its planned time (open loop) or when a user sent it (closed loop)."""
    return result.sent_at if closed else result.planned.at


def window_of(results: Sequence[Result], *, scale: float, warmup: float, closed: bool = False) -> tuple[float, float]:
    """The measurement window in the run's own (wall) seconds: from `warmup` (simulated seconds after the
    first arrival) to the last arrival; the whole run when it is too short for a warm-up."""
    times = [_arrival(r, closed) for r in results]
    return warmup_start(times, warmup * scale), max(times, default=0.0)


def warmup_start(arrivals: Sequence[float], warmup: float) -> float:
    """Where the statistics start: `warmup` after the first arrival, or the first arrival itself when the
    run is too short for a warm-up (same units as the arrivals)."""
    if not arrivals:
        return 0.0
    first, last = min(arrivals), max(arrivals)
    return first + warmup if last > first + warmup else first


def summarise(results: Sequence[Result], *, offered_rate: float, slo: Slo, scale: float = 1.0,
              warmup: float = 0.0, closed: bool = False) -> RunSummary:
    """`scale`: the fleet's time scale (wall seconds per simulated second; 1 for a real fleet); `warmup` in
    simulated seconds; `closed`: the run was closed loop (arrivals are send times, not planned times).

    Latency percentiles cover every request that arrived inside the window, failed ones included as an
    infinite TTFT and E2E: a policy that sheds or times out its worst requests must not look faster for it.
    Means and ITL are over the successful ones. Throughput and goodput count the window's requests over the
    time their work took (`span`), so goodput (a subset) never exceeds throughput, and a fleet that falls
    behind shows what it served, not what was offered."""
    start, end = window_of(results, scale=scale, warmup=warmup, closed=closed)
    window = (end - start) / scale or 1.0 / max(offered_rate, 1e-9)
    inside = [r for r in results if _arrival(r, closed) >= start]
    ok = [r for r in inside if r.ok]
    completed = [r for r in ok if r.e2e is not None]
    last = max((r.sent_at + r.e2e for r in completed if r.e2e is not None), default=end)
    span = (max(end, last) - start) / scale or window
    errors = Counter(r.error for r in inside if r.error)
    failed = len(inside) - len(ok)
    ttft = [r.ttft / scale for r in ok if r.ttft is not None]
    itl = [gap / scale for r in ok for gap in r.itl]
    e2e = [r.e2e / scale for r in ok if r.e2e is not None]
    good = sum(1 for r in inside if meets(r, slo, scale))
    served = Counter(r.endpoint for r in ok if r.endpoint)
    by_priority: dict[str, dict[str, Any]] = {}
    for cls in sorted({r.planned.priority for r in inside if r.planned.priority}):
        mine = [r for r in inside if r.planned.priority == cls]
        mine_ttft = [r.ttft / scale if r.ok and r.ttft is not None else math.inf for r in mine]
        by_priority[cls] = {"sent": len(mine), "ok": sum(r.ok for r in mine),
                            "ttft_p50": percentile(mine_ttft, 50), "ttft_p99": percentile(mine_ttft, 99),
                            "slo_attainment": sum(meets(r, slo, scale) for r in mine) / len(mine)}
    return RunSummary(
        offered_rate=offered_rate,
        sent=len(inside),
        ok=len(ok),
        errors=dict(sorted(errors.items())),
        duration=window,
        realised_rate=len(inside) / window,
        throughput_rps=len(completed) / span,
        output_tokens_per_s=sum(r.output_tokens for r in completed) / span,
        goodput_rps=good / span,
        slo_attainment=good / len(inside) if inside else 0.0,
        ttft=_dist(ttft, failed),
        itl=_dist(itl),
        e2e=_dist(e2e, failed),
        client_lateness_p99=percentile([r.lateness for r in inside], 99),
        by_priority=by_priority,
        served=dict(sorted(served.items())),
        span=span,
    )


def coefficient_of_variation(values: Mapping[str, float] | Sequence[float]) -> float:
    """pstdev / mean: how unevenly a quantity (replica utilisation) is spread; 0 = perfectly even."""
    data = list(values.values()) if isinstance(values, Mapping) else list(values)
    if not data:
        return 0.0
    mean = statistics.fmean(data)
    return statistics.pstdev(data) / mean if mean > 0 else 0.0
