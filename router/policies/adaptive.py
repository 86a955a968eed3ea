"""adaptive: prefer the endpoint with the most headroom, by a weighted score of its telemetry.

    w = W_gpu * (1 - gpu_util) + W_mem * (1 - mem_util) + W_queue * (1 - queue / maxQueue)

with defaults W = (0.6, 0.3, 0.1) (normalised to sum to 1) and maxQueue = 32, each term clamped to [0, 1];
`queue` is the engine's reported waiting requests plus this router's own in-flight requests there (see
`scorers.queue_free`), and `mem_util` is the KV-cache usage when the telemetry comes from vLLM's `/metrics`.
An endpoint without fresh telemetry for a signal gets the mean of the other endpoints' scores for it
(neutral), counted as the `telemetry_unknown` policy event when such an endpoint is picked. The total is
multiplied by the endpoint's slow-start weight factor.

Selection is power-of-`choices` (default 2): sample that many distinct candidates uniformly and take the
best score. Taking the global argmax instead would send every router replica, all reading the same lagging
telemetry, to the same GPU until the next report (herding); with two random choices the best endpoint
wins only the pairs it is drawn into, the worst never wins, and local in-flight counts break the lag
(Mitzenmacher's power of two choices; Envoy least_request, Finagle P2C). `choices: 1` is random,
a large `choices` approaches argmax.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.model import COUNT_SIGNALS, FRACTION_SIGNALS, EndpointView, RequestInfo
from router.policies.base import EventSink, LoadView, PolicyConfigError, reject_unknown
from router.policies.scorers import clamp, free_fraction, neutral_fill, queue_free

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
    choices: int = 2
    gpu_signal: str = "gpu_util"
    memory_signal: str = "kv_cache_usage"
    queue_signal: str = "num_waiting"


def _number(value: Any, field: str, *, minimum: float, integer: bool = False) -> Any:
    ok_type = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, ok_type):
        kind = "an integer" if integer else "a number"
        raise PolicyConfigError(field, f"must be {kind}, got {value!r}")
    if value < minimum:
        raise PolicyConfigError(field, f"must be >= {minimum}, got {value!r}")
    return value


class AdaptivePicker:
    __slots__ = ("_views", "_static", "_reported_queue", "_config", "_rng", "_events")

    def __init__(
        self,
        views: tuple[EndpointView, ...],
        config: AdaptiveConfig,
        rng: random.Random,
        events: EventSink,
    ) -> None:
        self._views = views
        self._config = config
        self._rng = rng
        self._events = events
        gpu = neutral_fill({v.id: free_fraction(v, config.gpu_signal) for v in views})
        mem = neutral_fill({v.id: free_fraction(v, config.memory_signal) for v in views})
        # The telemetry part of the score is fixed for this snapshot; only the local in-flight part of the
        # queue term changes between picks, so it is the only thing computed per request.
        self._static = {
            v.id: config.gpu_weight * gpu[v.id] + config.memory_weight * mem[v.id] for v in views
        }
        self._reported_queue = neutral_fill(
            {v.id: v.telemetry.signal(config.queue_signal) if v.telemetry is not None else None for v in views},
            default=0.0,
        )

    def score(self, view: EndpointView, in_flight: int) -> float:
        c = self._config
        queue = c.queue_weight * queue_free(self._reported_queue[view.id], in_flight, c.max_queue)
        return clamp(self._static[view.id] + queue) * view.weight_factor

    def pick(self, req: RequestInfo, loads: LoadView, exclude: frozenset[str]) -> EndpointView | None:
        candidates = [v for v in self._views if v.id not in exclude] if exclude else self._views
        if not candidates:
            return None
        # A random draw (a shuffle when the pool is no larger than `choices`) so that exact ties are broken
        # at random, never by list order.
        sample = self._rng.sample(candidates, min(self._config.choices, len(candidates)))
        best, best_score, best_load = None, -1.0, 0
        for view in sample:
            load = loads.in_flight(view.id)
            s = self.score(view, load)
            if s > best_score or (s == best_score and load < best_load):
                best, best_score, best_load = view, s, load
        if best is not None and best.telemetry is None:
            self._events("telemetry_unknown")
        return best


class AdaptivePolicy:
    name = "adaptive"
    config_key = "adaptive"

    def parse(self, params: Mapping[str, Any]) -> AdaptiveConfig:
        reject_unknown(params, {"weights", "maxQueue", "choices", "signals"})
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
        w = {k: _number(weights.get(k, d), f"weights.{k}", minimum=0.0) for k, d in DEFAULT_WEIGHTS.items()}
        total = sum(w.values())
        if total <= 0:
            raise PolicyConfigError("weights", "at least one weight must be positive")
        # Normalised so the score stays in [0, 1] and `{gpu: 6, memory: 3, queue: 1}` means the default.
        return AdaptiveConfig(
            gpu_weight=w["gpu"] / total,
            memory_weight=w["memory"] / total,
            queue_weight=w["queue"] / total,
            max_queue=_number(params.get("maxQueue", 32), "maxQueue", minimum=1, integer=True),
            choices=_number(params.get("choices", 2), "choices", minimum=1, integer=True),
            gpu_signal=chosen["gpu"],
            memory_signal=chosen["memory"],
            queue_signal=chosen["queue"],
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
        return AdaptivePicker(views, config, rng, events)
