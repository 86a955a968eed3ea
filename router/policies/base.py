"""The contracts every routing policy implements.

A `Policy` is a factory: it parses and validates its own parameters once (`parse`), then turns an
immutable list of candidate endpoints into a `Picker` (`build`) each time the fleet changes. A `Picker`
chooses one endpoint per request synchronously: it never awaits, never counts load itself (that is the
`LoadView`'s job, tower's `Load` vs P2C split) and never mutates shared routing structures. State that must
survive rebuilds (a round-robin cursor, a hash ring) lives in a `PoolState` object the balancer keeps per
pool and hands back to `build`.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from router.model import EndpointView, RequestInfo


class PolicyConfigError(ValueError):
    """A policy parameter is wrong. `field` is the dotted path below the strategy's block."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


# Policies report noteworthy decisions (a fallback, missing telemetry) by name; the balancer turns them
# into the `fleetroute_policy_events_total{policy,event}` metric, keeping policies free of I/O.
EventSink = Callable[[str], None]


class LoadView(Protocol):
    """Live load, updated on the event loop as requests start and finish."""

    def in_flight(self, endpoint_id: str) -> int:
        """Requests this router has in flight at the endpoint (exact, now)."""
        ...

    def cluster_in_flight(self, endpoint_id: str) -> int:
        """This router's in-flight requests plus the other replicas' as last shared (Redis); equals
        `in_flight` when no state is shared."""
        ...


class Picker(Protocol):
    def pick(
        self, req: RequestInfo, loads: LoadView, exclude: frozenset[str]
    ) -> EndpointView | None: ...


class Policy(Protocol):
    """A routing strategy, registered by name (see `registry`)."""

    name: str
    # The key of the strategy's parameter block in a policy spec, e.g. `consistentHash`.
    config_key: str

    def parse(self, params: Mapping[str, Any]) -> Any:
        """Validate raw parameters; raise PolicyConfigError naming the field. Returns a frozen config."""
        ...

    def new_state(self) -> Any:
        """Per-pool state carried across rebuilds (or None)."""
        ...

    def build(
        self, views: tuple[EndpointView, ...], config: Any, state: Any, rng: random.Random, events: EventSink
    ) -> Picker: ...


def reject_unknown(params: Mapping[str, Any], known: set[str]) -> None:
    """Unknown parameters are errors that name the field, so typos never silently fall back."""
    for key in params:
        if key not in known:
            expected = f"expected one of: {', '.join(sorted(known))}" if known else "this strategy takes no parameters"
            raise PolicyConfigError(str(key), f"unknown parameter ({expected})")


def least_loaded(
    views: tuple[EndpointView, ...], loads: LoadView, exclude: frozenset[str], rng: random.Random
) -> EndpointView | None:
    """The candidate with the fewest in-flight requests (scaled up by 1/weight while it ramps up after slow
    start); ties broken at random, never by list order.

    Shared by least-connections and by the fallbacks of the other strategies.
    """
    best: list[EndpointView] = []
    best_load = -1.0
    for view in views:
        if view.id in exclude:
            continue
        load = loads.in_flight(view.id)
        if view.weight_factor < 1.0:  # slow start: a ramping endpoint counts as more loaded than it is
            load = (load + 1) / view.weight_factor - 1
        if not best or load < best_load:
            best, best_load = [view], load
        elif load == best_load:
            best.append(view)
    if not best:
        return None
    return best[0] if len(best) == 1 else rng.choice(best)
