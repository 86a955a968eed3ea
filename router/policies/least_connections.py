"""least-connections: the endpoint with the fewest requests in flight *at this router*.

Intent: distribution by live load, no shared state needed. In-flight counts come from the `LoadView`
(incremented when a request is sent, decremented when its response body ends, not at headers: a long
stream is load until its last token). Ties are broken at random, never by list order, so an idle fleet
is not drained into its first endpoint.

Each router replica only sees its own traffic; with many replicas the counts are a sample of the
truth, which is still a good signal for streaming LLM requests that last seconds.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.model import EndpointView, RequestInfo
from router.policies.base import EventSink, LoadView, least_loaded, reject_unknown


@dataclass(frozen=True)
class LeastConnectionsConfig:
    pass


class LeastConnectionsPicker:
    __slots__ = ("_views", "_rng")

    def __init__(self, views: tuple[EndpointView, ...], rng: random.Random) -> None:
        self._views = views
        self._rng = rng

    def pick(self, req: RequestInfo, loads: LoadView, exclude: frozenset[str]) -> EndpointView | None:
        return least_loaded(self._views, loads, exclude, self._rng)


class LeastConnectionsPolicy:
    name = "least-connections"
    config_key = "leastConnections"

    def parse(self, params: Mapping[str, Any]) -> LeastConnectionsConfig:
        reject_unknown(params, set())
        return LeastConnectionsConfig()

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
        return LeastConnectionsPicker(views, rng)
