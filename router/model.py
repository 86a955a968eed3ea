"""Pure routing data: what discovery, telemetry and health know about endpoints, frozen.

Discovery says *who exists* (`Endpoint`), telemetry says *how busy they are* (`Telemetry`), health says
*whether to use them* (`EndpointView.state`). They meet in an immutable `Snapshot` from which every
policy builds its picker (grpc-go `balancer.Picker`, Finagle's distributor): nothing here changes on the
request path, so a pick never needs a lock and never awaits.

This module imports no I/O library (enforced by import-linter).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One inference engine (a vLLM pod): identity from discovery."""

    id: str
    url: str
    models: tuple[str, ...]
    # Relative capacity, from the operator (an H100 beside A100s: about 1.8, their decode throughput ratio).
    # Load-aware picks compare load per unit of weight; 1 everywhere changes nothing.
    weight: float = 1.0


@dataclass(frozen=True, slots=True)
class Telemetry:
    """One load report about an endpoint. `None` means the source does not know that signal.

    Fractions are in [0, 1]; request counts are counts. `reported_at` is on the router's monotonic clock
    (converted from the reporter's wall clock once, on receipt) so ages compare without more clock maths.
    """

    reported_at: float
    gpu_util: float | None = None  # NVML utilisation or GPM SM activity
    gpu_mem_util: float | None = None  # GPU memory used / total (vLLM pre-allocates ~90%)
    kv_cache_usage: float | None = None  # the engine's KV-cache blocks in use
    num_waiting: float | None = None  # the engine's queue
    num_running: float | None = None  # the engine's running batch
    # The engine's prefix cache (vLLM automatic prefix caching), in tokens: the hit rate over the reporter's
    # last interval, and the cumulative counters it comes from (for rates over longer windows).
    prefix_cache_hit_rate: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    kv_capacity_tokens: int | None = None  # tokens the engine's KV cache holds (vllm:cache_config_info)
    # LoRA (engines with --enable-lora; vllm:lora_requests_info): adapters with requests running or waiting,
    # and the engine's adapter slots. None: the engine reports no LoRA state.
    lora_running: frozenset[str] | None = None
    lora_waiting: frozenset[str] | None = None
    max_lora: int | None = None
    # GPU health from NVML (via the agent): cumulative XID / uncorrectable ECC counts, clocks-event reasons.
    gpu_lost: bool = False
    gpu_xid_errors: int | None = None
    gpu_ecc_uncorrected: int | None = None
    gpu_throttle_reasons: int | None = None
    source: str = "embedded"

    def signal(self, name: str) -> float | None:
        """A signal by name (see `SIGNALS`); `num_requests` is waiting + running."""
        if name == "num_requests":
            if self.num_waiting is None and self.num_running is None:
                return None
            return (self.num_waiting or 0.0) + (self.num_running or 0.0)
        return getattr(self, name)


# Signals a policy may be configured to read: fractions in [0, 1], and request counts.
FRACTION_SIGNALS = ("gpu_util", "gpu_mem_util", "kv_cache_usage")
COUNT_SIGNALS = ("num_waiting", "num_running", "num_requests")


class EndpointState(enum.Enum):
    """Whether new requests may go to an endpoint."""

    SERVING = "serving"
    DRAINING = "draining"  # an operator took it out of rotation; in-flight requests finish


@dataclass(frozen=True, slots=True)
class EndpointView:
    """An endpoint as the pickers see it: identity, fresh-enough telemetry (or None) and state."""

    endpoint: Endpoint
    telemetry: Telemetry | None = None
    state: EndpointState = EndpointState.SERVING
    # Multiplier in (0, 1] for gradual ramp-up (slow start); 1.0 is full weight.
    weight_factor: float = 1.0

    @property
    def id(self) -> str:
        return self.endpoint.id


@dataclass(frozen=True, slots=True)
class Snapshot:
    """An immutable view of the fleet at one moment. `version` grows with every rebuild and refresh.

    A telemetry round changes a few endpoints' telemetry, not the fleet's membership: `patched` makes the next
    snapshot from this one by replacing those views in place of position (`positions`, shared while the
    membership stands) and sharing every other view, so a round costs what changed plus two C-level copies,
    and whoever still holds this snapshot keeps reading it unchanged."""

    version: int
    views: tuple[EndpointView, ...]
    by_id: Mapping[str, EndpointView] = field(default_factory=dict)
    positions: Mapping[str, int] = field(default_factory=dict)  # endpoint id -> its index in `views`
    model_names: tuple[str, ...] = ()  # sorted; membership decides it, so a patch keeps it

    @classmethod
    def of(cls, version: int, views: tuple[EndpointView, ...]) -> Snapshot:
        return cls(version=version, views=views, by_id={v.id: v for v in views},
                   positions={v.id: i for i, v in enumerate(views)},
                   model_names=tuple(sorted({m for v in views for m in v.endpoint.models})))

    def patched(self, version: int, changed: Mapping[str, EndpointView]) -> Snapshot:
        """This snapshot with the views in `changed` (by id: the same endpoints, new telemetry) replaced."""
        views = list(self.views)
        for endpoint_id, view in changed.items():
            views[self.positions[endpoint_id]] = view
        by_id = dict(self.by_id)
        by_id.update(changed)
        return Snapshot(version=version, views=tuple(views), by_id=by_id, positions=self.positions,
                        model_names=self.model_names)

    def serving(self, model: str) -> tuple[EndpointView, ...]:
        """Endpoints that serve `model` and accept new requests."""
        return tuple(
            v for v in self.views if model in v.endpoint.models and v.state is EndpointState.SERVING
        )

    def models(self) -> tuple[str, ...]:
        return self.model_names


@dataclass(frozen=True, slots=True)
class RequestCost:
    """A request's expected cost, estimated before it is routed (router/routing/cost.py explains the model).

    `total` is its load in tokens: `prefill_weight * prompt_tokens + output_tokens`.
    """

    prompt_tokens: int  # estimated from the prompt's text (exact for token-id prompts)
    output_tokens: float  # predicted, all choices together, never above the request's max_tokens
    total: float


@dataclass(slots=True)
class PickNote:
    """What a picker learned about the request it placed, for the proxy to book: the one mutable part of a
    request's routing data, written by the pick (or a session pin's observation) and read once after it."""

    prefill_tokens: float = 0.0  # the prompt tokens the chosen endpoint will compute (uncached), when estimated


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """What a policy may know about one request. `headers` keys are lower-case. `cost` is set only for
    policies that estimate request costs (a `cost:` block, `loadUnit: tokens`, or cost-ordered admission).
    `note` is where a picker leaves what the proxy should book for its choice (prefix-aware's least-prefill)."""

    model: str
    request_id: str
    headers: Mapping[str, str]
    body: Mapping[str, Any]
    cost: RequestCost | None = None
    note: PickNote = field(default_factory=PickNote)
