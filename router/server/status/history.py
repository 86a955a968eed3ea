"""The status page's memory of the last minutes: small fixed rings per endpoint and per admission pool.

The router's live objects say how things are *now* (the snapshot, health, in-flight counts, the last
telemetry report); a sparkline and a latency percentile need the recent past too. This recorder keeps it,
bounded whatever the traffic:

- **Per endpoint, sampled every `INTERVAL` (1 s) by the page's sampler task**, `POINTS` (180: three minutes)
  values of each series in `SERIES`: in flight (this process), the engine's waiting queue, KV-cache use and
  GPU utilisation (from fresh telemetry; a gap when it is stale), answered requests per second, and the mean
  TTFT and inter-token latency of the requests that ended in that second. Rings of floats (`array`), about
  10 KB per endpoint.
- **Latency percentiles** (p50, p90, p99 of TTFT and ITL) are over the requests that ended in the last
  `LATENCY_WINDOW` (5 minutes), at most the last `LATENCY_SAMPLES` (256) of each endpoint: on a busy
  endpoint the window is that many requests.
  - TTFT: the router's time to the first body byte, from the start of its handler (admission wait
    included), as `fleetroute_time_to_first_byte_seconds` measures it; answers with status < 400 only.
  - ITL: per streamed (SSE) answer, the mean gap between the chunks the router forwarded after the first:
    (end of the stream - first chunk) / (chunks - 1). vLLM sends one event per token, so this is the time per
    output token; when its API server falls behind and merges steps, a chunk holds several tokens and the gap
    is per chunk. A chunk is what the engine's socket delivered in one read, so events that arrive together
    count once. Non-streamed answers have a TTFT but no ITL.
- **Per admission pool** (models whose policy caps endpoint concurrency): the queue depth per priority
  class now, admitted and shed requests per second over the last `RATE_WINDOW` (10 s) per class, and
  sparklines of the queue and of both rates. Read from the admission metrics, so they count what
  `fleetroute_admission_*` counts.

Recording costs a request one dict lookup and a few additions (`finished`, called where the handler records
the request's metrics); sampling costs one pass over the endpoints per second. An endpoint's rings are created
by the sampler for members of the snapshot only and freed when it leaves (router/routing/departures.py calls
`forget_endpoints`); a request that ends after its endpoint left finds no ring and is not recorded.
"""

from __future__ import annotations

import bisect
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from router.model import EndpointView

INTERVAL = 1.0  # seconds between samples
POINTS = 180  # samples kept per series: three minutes
LATENCY_WINDOW = 300.0  # seconds of requests the percentiles cover...
LATENCY_SAMPLES = 256  # ...at most this many per endpoint
RATE_WINDOW = 10  # samples a rate is averaged over
PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
SERIES = ("in_flight", "waiting", "kv_cache", "gpu_util", "requests_per_s", "ttft_ms", "itl_ms")
ADMISSION_SERIES = ("queued", "admitted_per_s", "shed_per_s")
NAN = math.nan


class Ring:
    """A fixed number of floats, the oldest overwritten; NaN marks a sample without a value. Values are rounded
    to three significant digits as they come in (what a sparkline or a table cell shows), so reading is a
    C-level copy: orjson writes NaN as null."""

    __slots__ = ("_values", "_next", "_filled")

    def __init__(self, size: int) -> None:
        self._values = array("d", [NAN]) * size
        self._next = 0
        self._filled = 0

    def push(self, value: float | None) -> None:
        self._values[self._next] = NAN if value is None else _round(value)
        self._next = (self._next + 1) % len(self._values)
        self._filled = min(self._filled + 1, len(self._values))

    def __len__(self) -> int:
        return self._filled

    def values(self, last: int | None = None) -> list[float]:
        """Oldest first; only the newest `last` when given."""
        n = self._filled if last is None else max(0, min(last, self._filled))
        start = (self._next - n) % len(self._values)
        if start + n <= len(self._values):
            return self._values[start:start + n].tolist()
        return (self._values[start:] + self._values[:self._next]).tolist()


class _Latencies:
    """The last LATENCY_SAMPLES requests of an endpoint: when each ended, its TTFT and its ITL (NaN: none).
    One push per request on the request path, so three plain array stores, nothing more."""

    __slots__ = ("at", "ttft", "itl", "_next", "_filled")

    def __init__(self) -> None:
        self.at = array("d", [NAN]) * LATENCY_SAMPLES
        self.ttft = array("d", [NAN]) * LATENCY_SAMPLES
        self.itl = array("d", [NAN]) * LATENCY_SAMPLES
        self._next = 0
        self._filled = 0

    def push(self, at: float, ttft: float, itl: float) -> None:
        i = self._next
        self.at[i] = at
        self.ttft[i] = ttft
        self.itl[i] = itl
        self._next = (i + 1) % LATENCY_SAMPLES
        if self._filled < LATENCY_SAMPLES:
            self._filled += 1

    def since(self, start: float) -> tuple[list[float], list[float]]:
        """TTFTs and ITLs (NaN included) of the requests that ended at or after `start`, oldest first."""
        first = (self._next - self._filled) % LATENCY_SAMPLES
        order = [(first + k) % LATENCY_SAMPLES for k in range(self._filled)]
        # Requests are recorded in the order they end: those in the window are the newest ones.
        skip = bisect.bisect_left([self.at[i] for i in order], start)
        kept = order[skip:]
        return [self.ttft[i] for i in kept], [self.itl[i] for i in kept]


class _Track:
    """One endpoint: its series, the requests of the current interval, and its recent latencies."""

    __slots__ = ("series", "done", "ttft_sum", "ttft_n", "itl_sum", "itl_n", "latencies")

    def __init__(self) -> None:
        self.series = {name: Ring(POINTS) for name in SERIES}
        self.done = 0  # requests that ended since the last sample
        self.ttft_sum = self.itl_sum = 0.0
        self.ttft_n = self.itl_n = 0
        self.latencies = _Latencies()


@dataclass(frozen=True)
class ClassCounts:
    """One priority class of an admission pool, as its metrics say: depth now, admitted and shed so far."""

    depth: float = 0.0
    admitted: float = 0.0
    shed: float = 0.0


class _AdmissionTrack:
    __slots__ = ("series", "totals", "current")

    def __init__(self) -> None:
        self.series = {name: Ring(POINTS) for name in ADMISSION_SERIES}
        self.totals: deque[tuple[float, dict[str, ClassCounts]]] = deque(maxlen=RATE_WINDOW + 1)
        self.current: dict[str, ClassCounts] = {}


class StatusHistory:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tracks: dict[str, _Track] = {}
        self._admission: dict[str, _AdmissionTrack] = {}
        self.samples = 0  # sampling rounds so far

    # ---- recording: the request path and the sampler ------------------------------------------------------

    def finished(self, endpoint_id: str, *, status: int, ttfb: float | None, duration: float, chunks: int,
                 streamed: bool) -> None:
        """A request answered by `endpoint_id` has ended (`ttfb` and `duration` in seconds from the start of the
        handler; `chunks`: body chunks forwarded; `streamed`: an SSE answer)."""
        track = self._tracks.get(endpoint_id)
        if track is None:
            return  # not sampled yet, or it left: nothing is kept for endpoints outside the snapshot
        track.done += 1
        if ttfb is None or status >= 400:
            return
        ttft = ttfb * 1000.0
        track.ttft_sum += ttft
        track.ttft_n += 1
        itl = NAN
        if streamed and chunks >= 2:
            itl = (duration - ttfb) * 1000.0 / (chunks - 1)
            track.itl_sum += itl
            track.itl_n += 1
        track.latencies.push(self._clock(), ttft, itl)

    def sample(self, views: Iterable[EndpointView], in_flight: Callable[[str], int],
               admission: Mapping[str, Mapping[str, ClassCounts]]) -> None:
        """One sampling round: every endpoint of the snapshot, and every admission pool (model -> class ->
        counts; models no longer listed are dropped)."""
        for view in views:
            track = self._tracks.get(view.id)
            if track is None:
                track = self._tracks[view.id] = _Track()
            t = view.telemetry
            s = track.series
            s["in_flight"].push(in_flight(view.id))
            s["waiting"].push(t.num_waiting if t is not None else None)
            s["kv_cache"].push(t.kv_cache_usage if t is not None else None)
            s["gpu_util"].push(t.gpu_util if t is not None else None)
            s["requests_per_s"].push(track.done / INTERVAL)
            s["ttft_ms"].push(track.ttft_sum / track.ttft_n if track.ttft_n else None)
            s["itl_ms"].push(track.itl_sum / track.itl_n if track.itl_n else None)
            track.done = track.ttft_n = track.itl_n = 0
            track.ttft_sum = track.itl_sum = 0.0
        now = self._clock()
        for model in self._admission.keys() - admission.keys():
            del self._admission[model]
        for model, classes in admission.items():
            pool = self._admission.get(model)
            if pool is None:
                pool = self._admission[model] = _AdmissionTrack()
            previous = pool.totals[-1][1] if pool.totals else None
            current = dict(classes)
            pool.series["queued"].push(sum(c.depth for c in current.values()))
            for name in ("admitted", "shed"):
                rate = None if previous is None else _increase(previous, current, name) / INTERVAL
                pool.series[f"{name}_per_s"].push(rate)
            pool.totals.append((now, current))
            pool.current = current
        self.samples += 1

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """router/routing/departures.py: the endpoints left; their rings go."""
        for endpoint_id in gone:
            self._tracks.pop(endpoint_id, None)

    # ---- reading: the page's feed -------------------------------------------------------------------------

    def series(self, endpoint_id: str, last: int | None = None) -> dict[str, list[float]] | None:
        """The endpoint's series, oldest first (NaN: no value), or only their newest `last` samples (what a
        page that has the rest needs: the feed's `since`)."""
        track = self._tracks.get(endpoint_id)
        if track is None:
            return None
        return {name: ring.values(last) for name, ring in track.series.items()}

    def request_rate(self, endpoint_id: str) -> float | None:
        """Requests answered per second over the last RATE_WINDOW samples."""
        track = self._tracks.get(endpoint_id)
        if track is None or not len(track.series["requests_per_s"]):
            return None
        recent = track.series["requests_per_s"].values(RATE_WINDOW)
        return _round(sum(recent) / len(recent))

    def latency(self, endpoint_id: str) -> dict[str, dict[str, float | int | None]] | None:
        """p50/p90/p99 (ms) and the sample count of TTFT and ITL over the recent window."""
        track = self._tracks.get(endpoint_id)
        if track is None:
            return None
        ttfts, itls = track.latencies.since(self._clock() - LATENCY_WINDOW)
        return {"ttft_ms": _percentiles(ttfts), "itl_ms": _percentiles([v for v in itls if not math.isnan(v)])}

    def admission(self, model: str) -> dict[str, object] | None:
        pool = self._admission.get(model)
        if pool is None:
            return None
        classes = []
        first, last = (pool.totals[0], pool.totals[-1]) if pool.totals else (None, None)
        elapsed = last[0] - first[0] if first is not None and last is not None else 0.0
        for name, counts in pool.current.items():
            before = first[1].get(name, ClassCounts()) if first is not None else counts
            classes.append({
                "name": name,
                "queued": int(counts.depth),
                "admitted_per_s": _round((counts.admitted - before.admitted) / elapsed) if elapsed > 0 else None,
                "shed_per_s": _round((counts.shed - before.shed) / elapsed) if elapsed > 0 else None,
            })
        return {"classes": classes, "series": {name: ring.values() for name, ring in pool.series.items()}}


def _increase(before: Mapping[str, ClassCounts], after: Mapping[str, ClassCounts], counter: str) -> float:
    """How much a counter (admitted, shed) grew across all classes; a class that is new started at zero."""
    empty = ClassCounts()
    return sum(max(0.0, getattr(c, counter) - getattr(before.get(name, empty), counter)) for name, c in after.items())


def _percentiles(values: list[float]) -> dict[str, float | int | None]:
    """Nearest-rank percentiles (the smallest value with at least q of the samples at or below it)."""
    ordered = sorted(values)
    n = len(ordered)
    out: dict[str, float | int | None] = {"n": n}
    for name, q in PERCENTILES:
        out[name] = _round(ordered[max(0, math.ceil(q * n) - 1)]) if n else None
    return out


def _round(value: float) -> float:
    """Three significant digits are what a sparkline or a table cell shows (NaN stays NaN)."""
    if value == 0 or not math.isfinite(value):
        return value
    return round(value, 2 - math.floor(math.log10(abs(value))))
