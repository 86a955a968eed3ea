"""Checking the prefix index against the engine, and tuning its bound: the index claims, the engine delivers.

Per endpoint, over windows of `window` seconds:

    estimated = sum(matched chars) / sum(prompt chars)      over the requests this router sent there
    engine    = delta(prefix_cache_hits) / delta(prefix_cache_queries)     vLLM's token counters, telemetry

`matched chars` is the length of the prompt prefix the index said the endpoint held when the request was
routed (matched blocks x blockChars); `prompt chars` is the whole rendered prompt. The engine's counters
count tokens of every request it admitted; characters and tokens cancel in the ratios. A window closes only
once it holds `MIN_REQUESTS` requests, so a quiet endpoint is judged over a longer time, not on noise; one
still short of them after `STALE_WINDOWS` window lengths starts over (the engine's counters would by then
cover mostly other routers' traffic).

The controller (multiplicative decrease, slower multiplicative increase, with a dead band):

    estimated - engine >  tolerance        factor = max(MIN_FACTOR, factor x SHRINK)    reason shrink
    estimated - engine <= tolerance / 2    factor = min(1, factor x GROW)               reason grow
    otherwise                              hold

The effective bound is base x factor (prefix_index). An index that claims much more than the engine
delivers remembers prefixes the engine has already evicted (under memory pressure from running requests,
generated tokens, prompts longer than `maxBlocks`, or traffic this router does not see): shrinking it makes
the index forget sooner, as the engine does. When the two agree the bound grows back toward its base, so a
burst of pressure does not leave the index small for ever. The estimate tends to sit *below* the engine's
rate when things are right (the engine also hits on the generated tokens of earlier turns, which the
router never hashes), which the asymmetric band tolerates; an engine without prefix caching (rate 0) drives
the factor to its floor, where the index still keeps affinity for the hottest prefixes.

Pure: the background task calls `tune` with the time and the endpoints' telemetry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from router.model import Telemetry
from router.routing.prefix.index import PrefixIndex

SHRINK = 0.7
GROW = 1.25
MIN_FACTOR = 1 / 64
MIN_REQUESTS = 20
STALE_WINDOWS = 10  # a window still short of MIN_REQUESTS after this many window lengths starts over


@dataclass(frozen=True)
class TuningConfig:
    enabled: bool = True  # False: hit rates are still compared and exported, the bound never moves
    window: float = 30.0  # seconds; windows close only with MIN_REQUESTS requests in them
    tolerance: float = 0.1  # estimated - engine above this shrinks; at most half of it grows back


@dataclass
class _Window:
    started: float
    estimate: tuple[float, float, float]  # the index's (requests, matched, prompt) at the start
    engine: tuple[float, float] | None  # the engine's (hits, queries) at the start, if reported


@dataclass(frozen=True, slots=True)
class WindowResult:
    """One closed window of one endpoint: both hit rates (None when unknown) and the factor after it."""

    endpoint_id: str
    requests: int
    estimated: float | None
    engine: float | None
    factor: float
    reason: str | None  # shrink | grow when the factor moved


def _engine_counters(telemetry: Telemetry | None) -> tuple[float, float] | None:
    if telemetry is None or telemetry.prefix_cache_hits is None or telemetry.prefix_cache_queries is None:
        return None
    return telemetry.prefix_cache_hits, telemetry.prefix_cache_queries


def decide(factor: float, estimated: float, engine: float, tolerance: float) -> tuple[float, str | None]:
    """The controller step: the new factor and why it moved (None: it held)."""
    gap = estimated - engine
    if gap > tolerance and factor > MIN_FACTOR:
        return max(MIN_FACTOR, factor * SHRINK), "shrink"
    if gap <= tolerance / 2 and factor < 1.0:
        return min(1.0, factor * GROW), "grow"
    return factor, None


def tune(index: PrefixIndex, telemetry: Mapping[str, Telemetry | None], now: float,
         config: TuningConfig) -> list[WindowResult]:
    """Close the windows that are due for the endpoints in `telemetry` (the pool's), adjust their factors,
    and return what each closed window measured."""
    results: list[WindowResult] = []
    for endpoint_id, tel in telemetry.items():
        estimate = index.estimate(endpoint_id)
        engine = _engine_counters(tel)
        window = index.tuning.get(endpoint_id)
        if not isinstance(window, _Window):
            index.tuning[endpoint_id] = _Window(now, estimate, engine)
            continue
        if window.engine is None and engine is not None:
            # The engine's first report in this window: both sides restart together, or the engine's
            # share of the window would be shorter than the index's.
            index.tuning[endpoint_id] = _Window(now, estimate, engine)
            continue
        requests = estimate[0] - window.estimate[0]
        if requests < MIN_REQUESTS and now - window.started >= STALE_WINDOWS * config.window:
            # Too few requests for too long: the engine's counters have moved with other routers' traffic
            # over a span this router's few requests do not represent. Start over.
            index.tuning[endpoint_id] = _Window(now, estimate, engine)
            continue
        if now - window.started < config.window or requests < MIN_REQUESTS:
            continue
        prompt = estimate[2] - window.estimate[2]
        estimated = (estimate[1] - window.estimate[1]) / prompt if prompt > 0 else None
        engine_rate = None
        if engine is not None and window.engine is not None:
            hits, queries = engine[0] - window.engine[0], engine[1] - window.engine[1]
            if queries > 0 and hits >= 0:  # a negative delta: the engine restarted and its counters reset
                engine_rate = min(1.0, hits / queries)
        index.tuning[endpoint_id] = _Window(now, estimate, engine)
        factor, reason = index.factor(endpoint_id), None
        if config.enabled and estimated is not None and engine_rate is not None:
            factor, reason = decide(factor, estimated, engine_rate, config.tolerance)
            if reason is not None:
                index.set_factor(endpoint_id, factor, reason)
        results.append(WindowResult(endpoint_id, int(requests), estimated, engine_rate, factor, reason))
    return results
