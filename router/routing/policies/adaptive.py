"""adaptive: prefer the endpoint with the most headroom, by a weighted score of its telemetry.

    w = W_gpu * (1 - gpu_util) + W_mem * (1 - mem_util) + W_queue * (1 - queue / maxQueue)

with defaults W = (0.6, 0.3, 0.1) (normalised to sum to 1) and maxQueue = 32, each term clamped to [0, 1];
`mem_util` is the KV-cache usage when the telemetry comes from vLLM's `/metrics` and `queue` the engine's
reported waiting requests. An endpoint without fresh telemetry for a signal gets the mean of the other
endpoints' scores for it (neutral), counted as the `telemetry_unknown` policy event when such an endpoint is
picked. The total is multiplied by the endpoint's slow-start weight factor.

Selection (`selection`, from a random sample of `choices` candidates, default 2; `choices: all` scans them
all):

- `least-load` (the default): the least `(load + 1) / w`, load per unit of headroom, where load is this
  router's in-flight requests at the endpoint (Envoy's weighted least-request). w comes from telemetry that
  is up to one report interval old; the load is exact and grows with every request sent, so however stale
  w is, an endpoint that has just been sent many requests stops winning at once.
- `best-score`: the highest score, ties to the less loaded, with this router's in-flight requests added to
  the reported queue (`scorers.queue_free`) as the only correction for stale telemetry. This was adaptive's
  rule until the load-test lab measured it (docs/benchmarks.md): at 400 requests per report interval, the
  queue term (a tenth of the score, saturating at maxQueue) cannot offset a GPU-utilisation gap, so every
  request between two reports went to the GPUs that looked idle at the last one: on a heterogeneous fleet
  its P99 TTFT was worse than round-robin's.

Sampling two candidates rather than taking the global argmax keeps router replicas that read the same
telemetry from herding onto one GPU (Mitzenmacher's power of two choices; Envoy least_request, Finagle P2C).

With `loadUnit: tokens` the load is counted in request-equivalents of predicted cost instead of requests:
`in_flight_cost / mean_request_cost` (router/routing/cost.py; the mean over the requests this router started
recently), so a router holding one 30k-token document at an endpoint counts it as the tens of average
requests it is, while `maxQueue` keeps its meaning. The engine's reported queue stays a request count.

adaptive is the composite strategy (router/routing/policies/composite.py) with three telemetry scorers, and picks
exactly as a `CompositePicker` of that configuration would (the same scores to the last bit, the same random
draws; tests/test_adaptive_refresh.py holds them to it). Its own picker exists for telemetry rounds: a round
changes a few endpoints' telemetry, and `AdaptivePolicy.refresh` patches those endpoints' values instead of
scoring the whole pool again. An endpoint without a report takes the mean of the others' values at pick time
(from per-signal sums kept with the values), so one endpoint's report never needs the others rewritten.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.model import COUNT_SIGNALS, FRACTION_SIGNALS, EndpointView, RequestInfo
from router.routing.policies.base import (
    DecisionTrace,
    EventSink,
    LoadView,
    PolicyConfigError,
    finite_number,
    parse_load_unit,
    reject_unknown,
    whole_number,
)
from router.routing.policies.composite import (
    MAX_QUEUE,
    MIN_SCORE,
    PICKS,
    CompositeConfig,
    Scorer,
    parse_choices,
)
from router.routing.policies.composite import REASONS as COMPOSITE_REASONS
from router.routing.policies.scorer_registry import SCORERS
from router.routing.policies.scorers import clamp, free_fraction, queue_free

DEFAULT_WEIGHTS = {"gpu": 0.6, "memory": 0.3, "queue": 0.1}
# Which telemetry signal feeds each term. "memory" is the KV cache, not GPU memory: vLLM pre-allocates
# ~90% of GPU memory at start-up, so NVML's memory barely moves with load while the KV cache fills.
DEFAULT_SIGNALS = {"gpu": "gpu_util", "memory": "kv_cache_usage", "queue": "num_waiting"}


@dataclass(frozen=True)
class AdaptiveConfig:
    gpu_weight: float = 0.6
    memory_weight: float = 0.3
    queue_weight: float = 0.1
    max_queue: int = 32
    choices: int | None = 2  # None: all
    gpu_signal: str = "gpu_util"
    memory_signal: str = "kv_cache_usage"
    queue_signal: str = "num_waiting"
    load_unit: str = "requests"
    selection: str = "least-load"

    @property
    def needs_cost(self) -> bool:
        """Whether requests must carry a cost estimate (read by settings.py to turn estimation on)."""
        return self.load_unit == "tokens"

    @property
    def composite(self) -> CompositeConfig:
        """The same policy as composite scorers (how it is built)."""
        return CompositeConfig(
            scorers=(Scorer("gpu", self.gpu_weight, self.gpu_signal), Scorer("memory", self.memory_weight,
                     self.memory_signal), Scorer("queue", self.queue_weight, self.queue_signal, self.max_queue)),
            pick=self.selection, choices=self.choices, load_unit=self.load_unit,
        )


class AdaptivePolicy:
    name = "adaptive"
    reasons = COMPOSITE_REASONS  # it is the composite strategy with three telemetry scorers
    config_key = "adaptive"

    def parse(self, params: Mapping[str, Any]) -> AdaptiveConfig:
        reject_unknown(params, {"weights", "maxQueue", "choices", "signals", "loadUnit", "selection"})
        selection = params.get("selection", "least-load")
        if selection not in PICKS:
            raise PolicyConfigError("selection", f"must be one of {', '.join(PICKS)}, got {selection!r}")
        signals = params.get("signals", {})
        if not isinstance(signals, Mapping):
            raise PolicyConfigError("signals", f"must map gpu/memory/queue to signal names, got {signals!r}")
        chosen = dict(DEFAULT_SIGNALS)
        for term, name in signals.items():
            allowed = COUNT_SIGNALS if term == "queue" else FRACTION_SIGNALS
            if term not in DEFAULT_SIGNALS:
                raise PolicyConfigError(f"signals.{term}", "unknown term (expected one of: gpu, memory, queue)")
            if name not in allowed:
                raise PolicyConfigError(f"signals.{term}", f"must be one of {', '.join(allowed)}, got {name!r}")
            chosen[term] = name
        weights = params.get("weights", {})
        if not isinstance(weights, Mapping):
            raise PolicyConfigError("weights", f"must be a mapping of gpu/memory/queue, got {weights!r}")
        for key in weights:
            if key not in DEFAULT_WEIGHTS:
                raise PolicyConfigError(f"weights.{key}", "unknown weight (expected one of: gpu, memory, queue)")
        w = {k: finite_number(weights.get(k, d), f"weights.{k}", minimum=0.0, maximum=1000.0)
             for k, d in DEFAULT_WEIGHTS.items()}
        total = sum(w.values())
        if total <= 0:
            raise PolicyConfigError("weights", "at least one weight must be positive")
        # Normalised so the score stays in [0, 1] and `{gpu: 6, memory: 3, queue: 1}` means the default.
        return AdaptiveConfig(
            gpu_weight=w["gpu"] / total,
            memory_weight=w["memory"] / total,
            queue_weight=w["queue"] / total,
            max_queue=whole_number(params.get("maxQueue", 32), "maxQueue", minimum=1, maximum=MAX_QUEUE),
            choices=parse_choices(params.get("choices", 2)),
            gpu_signal=chosen["gpu"],
            memory_signal=chosen["memory"],
            queue_signal=chosen["queue"],
            load_unit=parse_load_unit(params),
            selection=selection,
        )

    def new_state(self) -> None:
        return None

    def build(
        self,
        views: tuple[EndpointView, ...],
        config: AdaptiveConfig,
        state: None,
        rng: random.Random,
        events: EventSink,
    ) -> AdaptivePicker:
        return AdaptivePicker(views, config.composite, rng, events)

    def refresh(self, picker: object, views: tuple[EndpointView, ...],
                changed: Mapping[str, EndpointView]) -> AdaptivePicker | None:
        """The picker for `views`, the pool of `picker` with the endpoints in `changed` given new telemetry
        (balancer.py `refresh_telemetry`): a copy with their values replaced. None: build one instead."""
        return picker.refreshed(views, changed) if isinstance(picker, AdaptivePicker) else None


class _Signal:
    """One telemetry signal's value per pool position (None: unknown), with what the neutral fill needs."""

    __slots__ = ("values", "unknown", "default")

    def __init__(self, values: list[float | None], default: float) -> None:
        self.values = values
        self.unknown = values.count(None)
        self.default = default

    def copy(self) -> _Signal:
        other = _Signal.__new__(_Signal)
        other.values, other.unknown, other.default = list(self.values), self.unknown, self.default
        return other

    def set(self, position: int, value: float | None) -> None:
        self.unknown += (value is None) - (self.values[position] is None)
        self.values[position] = value

    def fill(self) -> float:
        """What an unknown endpoint gets: the mean of the known values, as scorers.neutral_fill computes it
        (summed in pool order; zeros are skipped, which leaves a sum of non-negative floats unchanged)."""
        known = len(self.values) - self.unknown
        return sum(filter(None, self.values)) / known if known else self.default


class AdaptivePicker:
    """The composite picker's least-load and best-score picks over adaptive's scorers (gpu, memory, queue;
    no load guard, prefix or load scorer), with each signal's values kept per pool position so a telemetry
    round replaces the changed endpoints' values only (`refreshed`). Immutable once built: `refreshed` returns
    a new picker, and one still held by a pick in progress reads the values it was built with."""

    __slots__ = ("_views", "_config", "_rng", "_events", "_positions", "_fractions", "_queue", "_queued", "_fills",
                 "_queue_fill", "_tokens", "_uses_telemetry")

    def __init__(self, views: tuple[EndpointView, ...], config: CompositeConfig, rng: random.Random,
                 events: EventSink) -> None:
        self._views = views
        self._config = config
        self._rng = rng
        self._events = events
        self._tokens = config.load_unit == "tokens"
        self._positions = {v.id: i for i, v in enumerate(views)}
        # The fraction scorers in configuration order (the order composite sums them in), each with its values.
        self._fractions: list[tuple[float, str, _Signal]] = [
            (s.weight, s.signal, _Signal([free_fraction(v, s.signal) for v in views], 0.5))
            for s in config.scorers if s.name in ("gpu", "memory") and s.signal is not None]
        self._queue = next((s for s in config.scorers if s.name == "queue"), None)
        signal = self._queue.signal if self._queue is not None else None
        self._queued = _Signal([_reported(v, signal) for v in views], 0.0)
        self._uses_telemetry = any(getattr(SCORERS.get(s.name), "uses_telemetry", False) for s in config.scorers)
        self._fills = [signal.fill() for _w, _n, signal in self._fractions]
        self._queue_fill = self._queued.fill()

    def refreshed(self, views: tuple[EndpointView, ...], changed: Mapping[str, EndpointView]) -> AdaptivePicker:
        """This picker over `views` (the same endpoints in the same order) where `changed` have new telemetry."""
        new = AdaptivePicker.__new__(AdaptivePicker)
        new._views, new._config, new._rng, new._events = views, self._config, self._rng, self._events
        new._tokens, new._positions, new._queue = self._tokens, self._positions, self._queue
        new._uses_telemetry = self._uses_telemetry
        new._fractions = [(w, name, signal.copy()) for w, name, signal in self._fractions]
        new._queued = self._queued.copy()
        queue_signal = self._queue.signal if self._queue is not None else None
        for endpoint_id, view in changed.items():
            i = self._positions[endpoint_id]
            for _w, name, signal in new._fractions:
                signal.set(i, free_fraction(view, name))
            new._queued.set(i, _reported(view, queue_signal))
        new._fills = [signal.fill() for _w, _n, signal in new._fractions]
        new._queue_fill = new._queued.fill()
        return new

    def score(self, view: EndpointView, in_flight: float) -> float:
        """s(e) as composite's `CompositePicker.score` computes it, `in_flight` added to the reported queue."""
        i = self._positions[view.id]
        s = 0.0
        for (weight, _name, signal), fill in zip(self._fractions, self._fills, strict=True):
            value = signal.values[i]
            s += weight * (fill if value is None else value)
        q = self._queue
        if q is not None:
            reported = self._queued.values[i]
            s += q.weight * queue_free(self._queue_fill if reported is None else reported, in_flight, q.max_queue)
        return clamp(s) * view.weight_factor

    def pick(self, req: RequestInfo, loads: LoadView, exclude: frozenset[str],
             trace: DecisionTrace | None = None) -> EndpointView | None:
        candidates = [v for v in self._views if v.id not in exclude] if exclude else self._views
        if not candidates:
            return None
        c = self._config
        unit = loads.mean_request_cost() if self._tokens else 0.0
        # A random draw (a shuffle when `choices` covers the pool), so exact ties never go by list order.
        sample = self._rng.sample(candidates, len(candidates) if c.choices is None else min(c.choices, len(candidates)))
        least_load = c.pick == "least-load"
        best: EndpointView | None = None
        best_key = best_load = 0.0
        for view in sample:
            if self._tokens and unit > 0.0:  # in request-equivalents of predicted cost
                lv = loads.in_flight_cost(view.id) / unit
            else:
                lv = float(loads.in_flight(view.id))
            s = self.score(view, 0.0 if least_load else lv)
            # One key, lower is better, for both picks.
            key = (lv + 1.0) / (max(s, MIN_SCORE) * view.endpoint.weight) if least_load else -s
            if trace is not None:
                trace.note(view.id, score=round(s, 4), load=round(lv, 3), key=round(key, 4))
            if best is None or key < best_key or (key == best_key and lv < best_load):
                best, best_key, best_load = view, key, lv
        assert best is not None
        if best.telemetry is None and self._uses_telemetry:
            self._events("telemetry_unknown")
        if trace is not None:
            trace.sampled = [v.id for v in sample]
            trace.reason = "least_load_per_score" if least_load else "best_score"
        return best


def _reported(view: EndpointView, signal: str | None) -> float | None:
    """The engine's reported queue (the queue scorer's signal), None when unknown."""
    t = view.telemetry
    return t.signal(signal) if t is not None and signal else None
