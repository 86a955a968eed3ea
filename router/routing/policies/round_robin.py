"""round-robin: each request goes to the next serving endpoint in turn.

Intent: even distribution of *requests*, blind to their cost and to endpoint load. Good for homogeneous
fleets with uniform requests; poor when GPUs or requests differ (capacity ~ n * slowest replica).

The cursor lives in the pool state so it survives picker rebuilds (health changes and housekeeping ticks
rebuild pickers often; restarting the rotation each time would favour the first endpoints). A telemetry
round does not rebuild this picker at all: it reads no telemetry (`reads_telemetry = False`). Each pool
starts at a random offset so that many router replicas do not march in lock-step over the same endpoints.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.model import EndpointView, RequestInfo
from router.routing.policies.base import DecisionTrace, EventSink, LoadView, Sentence, reject_unknown


@dataclass(frozen=True)
class RoundRobinConfig:
    pass


class RoundRobinState:
    __slots__ = ("cursor",)

    def __init__(self) -> None:
        self.cursor: int | None = None


class RoundRobinPicker:
    __slots__ = ("_views", "_state", "_rng")

    def __init__(self, views: tuple[EndpointView, ...], state: RoundRobinState, rng: random.Random) -> None:
        self._views = views
        self._state = state
        self._rng = rng

    def pick(
        self, req: RequestInfo, loads: LoadView, exclude: frozenset[str], trace: DecisionTrace | None = None
    ) -> EndpointView | None:
        views = self._views
        n = len(views)
        fallback = None
        for _ in range(n):
            index = self._state.cursor % n
            self._state.cursor = index + 1
            view = views[index]
            if view.id in exclude:
                continue
            # A ramping endpoint (slow start) takes its turn with probability = its weight factor.
            if view.weight_factor >= 1.0 or self._rng.random() < view.weight_factor:
                if trace is not None:
                    trace.reason = "rotation"
                    trace.note(view.id, position=index)
                    trace.detail["position"] = index
                    trace.detail["pool"] = n
                return view
            if trace is not None:
                trace.note(view.id, position=index, turn="declined_slow_start")
            fallback = fallback or view
        if trace is not None and fallback is not None:
            # Every candidate was ramping and declined its turn: the first of them takes it anyway.
            trace.reason = "rotation_all_ramping"
            trace.detail["pool"] = n
        return fallback


REASONS: dict[str, Sentence] = {
    "rotation": lambda e: f"its turn in the rotation (position {e.detail.get('position')} of {e.detail.get('pool')})",
    "rotation_all_ramping": lambda e: "every candidate is ramping up (slow start) and declined its turn; "
                                      "the first one takes it",
}


class RoundRobinPolicy:
    name = "round-robin"
    reasons = REASONS
    config_key = "roundRobin"
    # Neither its build nor its picks read telemetry: a telemetry round keeps its picker (balancer.py).
    reads_telemetry = False

    def parse(self, params: Mapping[str, Any]) -> RoundRobinConfig:
        reject_unknown(params, set())
        return RoundRobinConfig()

    def new_state(self) -> RoundRobinState:
        return RoundRobinState()

    def build(
        self,
        views: tuple[EndpointView, ...],
        config: RoundRobinConfig,
        state: RoundRobinState,
        rng: random.Random,
        events: EventSink,
    ) -> RoundRobinPicker:
        if state.cursor is None:
            state.cursor = rng.randrange(max(len(views), 1))
        return RoundRobinPicker(views, state, rng)
