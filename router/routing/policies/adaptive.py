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

adaptive is the composite strategy (router/routing/policies/composite.py) with three telemetry scorers.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.model import COUNT_SIGNALS, FRACTION_SIGNALS, EndpointView
from router.routing.policies.base import (
    EventSink,
    PolicyConfigError,
    finite_number,
    parse_load_unit,
    reject_unknown,
    whole_number,
)
from router.routing.policies.composite import MAX_QUEUE, PICKS, CompositeConfig, CompositePicker, Scorer, parse_choices
from router.routing.policies.composite import REASONS as COMPOSITE_REASONS

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
    ) -> CompositePicker:
        return CompositePicker(views, config.composite, rng, events)
