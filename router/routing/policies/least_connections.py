"""least-connections: the endpoint with the fewest requests in flight *at this router*.

Intent: distribution by live load, no shared state needed. In-flight counts come from the `LoadView`
(incremented when a request is sent, decremented when its response body ends, not at headers: a long
stream is load until its last token). Ties are broken at random, never by list order, so an idle fleet
is not drained into its first endpoint.

Each router replica only sees its own traffic; with many replicas the counts are a sample of the
truth, which is still a good signal for streaming LLM requests that last seconds.

`loadUnit: tokens` weighs each in-flight request by its predicted cost (router/routing/cost.py:
`prefillWeight * prompt_tokens + predicted output tokens`) and picks the least *work* in flight, so one
30k-token document counts for what it is rather than as one more request. The default, `requests`, is
the plain count.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.model import EndpointView, RequestInfo
from router.routing.policies.base import (
    REASONS,
    DecisionTrace,
    EventSink,
    LoadView,
    least_cost_loaded,
    least_loaded,
    parse_load_unit,
    reject_unknown,
)


@dataclass(frozen=True)
class LeastConnectionsConfig:
    load_unit: str = "requests"

    @property
    def needs_cost(self) -> bool:
        """Whether requests must carry a cost estimate (read by settings.py to turn estimation on)."""
        return self.load_unit == "tokens"


class LeastConnectionsPicker:
    __slots__ = ("_views", "_rng", "_tokens")

    def __init__(self, views: tuple[EndpointView, ...], rng: random.Random, tokens: bool = False) -> None:
        self._views = views
        self._rng = rng
        self._tokens = tokens

    def pick(
        self, req: RequestInfo, loads: LoadView, exclude: frozenset[str], trace: DecisionTrace | None = None
    ) -> EndpointView | None:
        if self._tokens:
            cost = req.cost.total if req.cost is not None else loads.mean_request_cost()
            if trace is not None:
                trace.detail["request_cost_source"] = "estimate" if req.cost is not None else "mean_request_cost"
            return least_cost_loaded(self._views, loads, exclude, self._rng, max(cost, 1.0), trace)
        return least_loaded(self._views, loads, exclude, self._rng, trace)


class LeastConnectionsPolicy:
    name = "least-connections"
    config_key = "leastConnections"
    reasons = REASONS  # least_loaded, as every least-loaded choice explains itself (base.py)
    # Neither its build nor its picks read telemetry: a telemetry round keeps its picker (balancer.py).
    reads_telemetry = False

    def parse(self, params: Mapping[str, Any]) -> LeastConnectionsConfig:
        reject_unknown(params, {"loadUnit"})
        return LeastConnectionsConfig(load_unit=parse_load_unit(params))

    def new_state(self) -> None:
        return None

    def build(
        self,
        views: tuple[EndpointView, ...],
        config: LeastConnectionsConfig,
        state: None,
        rng: random.Random,
        events: EventSink,
    ) -> LeastConnectionsPicker:
        return LeastConnectionsPicker(views, rng, tokens=config.load_unit == "tokens")
