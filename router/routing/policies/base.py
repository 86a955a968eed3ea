"""The contracts every routing policy implements.

A `Policy` is a factory: it parses and validates its own parameters once (`parse`), then turns an
immutable list of candidate endpoints into a `Picker` (`build`) each time the fleet changes. A `Picker`
chooses one endpoint per request synchronously: it never awaits, never counts load itself (that is the
`LoadView`'s job, tower's `Load` vs P2C split) and never mutates shared routing structures. State that must
survive rebuilds (a round-robin cursor, a hash ring) lives in a `PoolState` object the balancer keeps per
pool and hands back to `build`.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from router.model import EndpointView, RequestInfo
from router.routing.policies.load_index import LoadIndex


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

    def in_flight_cost(self, endpoint_id: str) -> float:
        """The predicted cost in tokens of this router's in-flight requests at the endpoint (router/routing/cost.py;
        requests without an estimate count 0). Local only, like `in_flight`."""
        ...

    def mean_request_cost(self) -> float:
        """The recent mean predicted cost of the requests this router started (0 before any): the size of
        one request-equivalent when load in tokens must be compared with request counts."""
        ...

    def pending_prefill(self, endpoint_id: str) -> float:
        """Prompt tokens this router expects the endpoint still to compute: booked by least-prefill picks,
        gone at the answer's first byte (router/routing/prefill.py). Local only, like `in_flight`."""
        ...

    def prefill_speed(self, endpoint_id: str) -> float | None:
        """The endpoint's measured prefill speed in tokens/s, None before its first measurement."""
        ...


class DecisionTrace:
    """Why a picker chose what it chose, for a request that asked for an explanation (router/server/explain.py).

    Pickers take it as an optional last argument and fill it in only when it is given, so an unexplained
    pick does no extra work. What goes in is what the picker really compared: the values it weighed per
    candidate (`note`), the candidates a power-of-choices pick drew (`sampled`), strategy-wide values
    (`detail`: the hash key, the blocks hashed, a guard's threshold) and the `reason` for the choice in one
    word (`prefix_hit`, `load_guard_imbalance`, `best_of_sample`, `ring`, `rotation`, ...).

    Values stay exact here (router/server/explain.py rounds them for reading); the balancer adds the facts every
    strategy shares (telemetry, slow-start weight, breaker) without overwriting a picker's own. A detail
    that lists endpoints lists at most MAX_LISTED of them (`listed`), so a trace's size never grows with
    the fleet beyond one entry per candidate.
    """

    __slots__ = ("reason", "candidates", "sampled", "detail")

    def __init__(self) -> None:
        self.reason = ""
        self.candidates: dict[str, dict[str, Any]] = {}
        self.sampled: list[str] = []
        self.detail: dict[str, Any] = {}

    def note(self, endpoint_id: str, **values: Any) -> None:
        self.candidates.setdefault(endpoint_id, {}).update(values)


class Picker(Protocol):
    def pick(
        self, req: RequestInfo, loads: LoadView, exclude: frozenset[str], trace: DecisionTrace | None = None
    ) -> EndpointView | None: ...

    # Optional: `observe(req, view)`, told when a request went to `view` without a pick (a session's pinned
    # endpoint), for pickers that learn from where traffic goes (the prefix index). The balancer calls it
    # only where a picker has it.


@dataclass(frozen=True)
class Explained:
    """What the sentence for a pick's reason is written from (router/server/explain.py `summarise`): the
    picker's own trace, so a sentence can never disagree with the fields shown beside it."""

    detail: Mapping[str, Any]  # DecisionTrace.detail
    chosen: Mapping[str, Any]  # the values the picker noted for the endpoint it chose
    candidates: int  # endpoints it noted
    sampled: int  # of which it drew (pickers of a random sample)


Sentence = Callable[[Explained], str]


def fmt(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def least_loaded_sentence(e: Explained) -> str:
    unit = "tokens" if e.detail.get("load_unit") == "tokens" else "requests"
    text = f"least load in flight ({fmt(e.chosen.get('load'))} {unit}) of {e.candidates} candidates"
    return text + (f", a tie of {e.detail['tied']} broken at random" if e.detail.get("tied") else "")


# The reasons `least_loaded_choice` gives (any policy may pick through it).
REASONS: dict[str, Sentence] = {"least_loaded": least_loaded_sentence}


class Policy(Protocol):
    """A routing strategy, registered by name (see `registry`)."""

    name: str
    # The key of the strategy's parameter block in a policy spec, e.g. `consistentHash`.
    config_key: str
    # Each reason its pickers give (`DecisionTrace.reason`) with the sentence that explains it to an operator.
    reasons: Mapping[str, Sentence]

    def parse(self, params: Mapping[str, Any]) -> Any:
        """Validate raw parameters; raise PolicyConfigError naming the field. Returns a frozen config."""
        ...

    # Optional: `reads_telemetry = False` on a policy whose build and picks never read `EndpointView.telemetry`:
    # a telemetry round then keeps its pickers as they are (balancer.py `refresh_telemetry`). Absent: True.
    # Optional: `refresh(picker, views, changed) -> Picker | None`, for a policy that reads telemetry: the picker
    # for `views`, the pool `picker` was built or refreshed over with the endpoints in `changed` (id -> new view)
    # given new telemetry (same endpoints, order and weights). A telemetry round calls it instead of `build`, so
    # its cost can follow what changed (adaptive). It must not change `picker`, which a pick may still hold;
    # None (or no hook) means: build a new picker over `views`.

    def new_state(self) -> Any:
        """Per-pool state carried across rebuilds (or None). A state that keeps anything per endpoint has a
        `forget_endpoints(gone: frozenset[str])` method, which the balancer calls when endpoints leave the fleet
        (router/routing/departures.py): endpoint ids are pod names, and every rollout brings new ones."""
        ...

    def build(
        self, views: tuple[EndpointView, ...], config: Any, state: Any, rng: random.Random, events: EventSink
    ) -> Picker: ...


# An explanation lists at most this many endpoint ids in one detail value (ties, ring walks): its size must not
# grow with the fleet (router/server/explain.py bounds the candidates themselves).
MAX_LISTED = 16


def listed(ids: Iterable[str]) -> list[str]:
    """At most MAX_LISTED of `ids`, for a DecisionTrace detail."""
    return list(itertools.islice(ids, MAX_LISTED))


LOAD_UNITS = ("requests", "tokens")


def parse_load_unit(params: Mapping[str, Any]) -> str:
    """`loadUnit`: count in-flight requests (`requests`, the default) or their predicted cost (`tokens`)."""
    unit = params.get("loadUnit", "requests")
    if unit not in LOAD_UNITS:
        raise PolicyConfigError("loadUnit", f"must be one of {', '.join(LOAD_UNITS)}, got {unit!r}")
    return unit


def finite_number(value: Any, field: str, *, minimum: float, exclusive: bool = False,
                  maximum: float | None = None, nullable: bool = False) -> float | None:
    """A number parameter within bounds; never NaN or infinite (YAML's `.inf` would otherwise reach the
    pick path, where `math.ceil(inf)` fails every request)."""
    if value is None and nullable:
        return None
    numeric = not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)
    if (not numeric or (value <= minimum if exclusive else value < minimum)
            or (maximum is not None and value > maximum)):
        rule = f"> {minimum}" if exclusive else f">= {minimum}"
        if maximum is not None:
            rule += f" and <= {maximum}"
        null = " or null" if nullable else ""
        raise PolicyConfigError(field, f"must be a number {rule}{null}, got {value!r}")
    return float(value)


def whole_number(value: Any, field: str, *, minimum: int, maximum: int | None = None,
                 nullable: bool = False) -> int | None:
    """An integer parameter within bounds (a float such as `.inf` or 2.5 is refused, not truncated)."""
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        null = " or null" if nullable else ""
        raise PolicyConfigError(field, f"must be an integer{null}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise PolicyConfigError(field, f"must be {bounds}, got {value!r}")
    return value


def number_param(params: Mapping[str, Any], field: str, default: float | None, *, minimum: float,
                 exclusive: bool = False, maximum: float | None = None, nullable: bool = False,
                 where: str = "") -> float | None:
    return finite_number(params.get(field, default), where + field, minimum=minimum, exclusive=exclusive,
                         maximum=maximum, nullable=nullable)


def integer_param(params: Mapping[str, Any], field: str, default: int | None, *, minimum: int,
                  maximum: int | None = None, nullable: bool = False, where: str = "") -> int | None:
    return whole_number(params.get(field, default), where + field, minimum=minimum, maximum=maximum,
                        nullable=nullable)


def reject_unknown(params: Mapping[str, Any], known: set[str]) -> None:
    """Unknown parameters are errors that name the field, so typos never silently fall back."""
    for key in params:
        if key not in known:
            expected = f"expected one of: {', '.join(sorted(known))}" if known else "this strategy takes no parameters"
            raise PolicyConfigError(str(key), f"unknown parameter ({expected})")


def capacity_scale(view: EndpointView) -> float:
    """How much load an endpoint takes relative to a plain one: its slow-start weight (< 1 while ramping up)
    times its configured capacity weight (`Endpoint.weight`)."""
    return view.weight_factor * view.endpoint.weight


def scaled_load(view: EndpointView, load: float, step: float = 1.0) -> float:
    """`load` per unit of capacity: `(load + step) / scale - step`, where `step` is what the new request
    adds (1 request, or its cost in tokens); the plain load when the scale is 1. An idle endpoint ramping
    up at half weight then counts as holding one request, and one of weight 2 holds twice the load before
    it stops winning."""
    scale = capacity_scale(view)
    return load if scale == 1.0 else (load + step) / scale - step


def least_loaded(
    views: tuple[EndpointView, ...],
    loads: LoadView,
    exclude: frozenset[str],
    rng: random.Random,
    trace: DecisionTrace | None = None,
) -> EndpointView | None:
    """The candidate with the fewest in-flight requests per unit of capacity: `(load + 1) / scale - 1` with
    `scale` = the slow-start weight x the endpoint's configured weight (both 1 usually, and then it is the
    plain count); ties broken at random, never by list order.

    Shared by least-connections and by the fallbacks of the other strategies. When `loads` keeps an index of
    exactly this pool (router/routing/policies/load_index.py) the pick reads it instead of scanning: same choice rule,
    cost independent of the pool's size.
    """
    index = pool_index(loads, views)
    if index is not None and trace is None:  # an explained pick scans, below, to list what it compared
        return index.least(exclude, rng)[0]
    choice, best = _least(views, exclude, rng, lambda v: scaled_load(v, loads.in_flight(v.id)))
    if trace is not None and choice is not None:
        _explain_least(trace, views, exclude, best, "requests", lambda v: (loads.in_flight(v.id), 1.0))
    return choice


def pool_index(loads: LoadView, views: tuple[EndpointView, ...]) -> LoadIndex | None:
    """The load index `loads` keeps for exactly this pool, if any (a test's plain LoadView keeps none)."""
    find: Callable[[tuple[EndpointView, ...]], LoadIndex | None] | None = getattr(loads, "load_index", None)
    return find(views) if find is not None else None


def _least(views: tuple[EndpointView, ...], exclude: frozenset[str], rng: random.Random,
           load_of: Callable[[EndpointView], float]) -> tuple[EndpointView | None, list[EndpointView]]:
    """The candidate of least `load_of`, ties broken at random; and the tied best."""
    best: list[EndpointView] = []
    best_load = -1.0
    for view in views:
        if view.id in exclude:
            continue
        load = load_of(view)
        if not best or load < best_load:
            best, best_load = [view], load
        elif load == best_load:
            best.append(view)
    if not best:
        return None, best
    return (best[0] if len(best) == 1 else rng.choice(best)), best


def least_cost_loaded(
    views: tuple[EndpointView, ...],
    loads: LoadView,
    exclude: frozenset[str],
    rng: random.Random,
    cost: float,
    trace: DecisionTrace | None = None,
) -> EndpointView | None:
    """`least_loaded` in tokens: the candidate with the least predicted cost in flight. `cost` is the new
    request's own, so slow start scales the load the endpoint would hold with it:
    `(in_flight_cost + cost) / scale - cost` (the request-count formula with 1 replaced by `cost`)."""
    choice, best = _least(views, exclude, rng, lambda v: scaled_load(v, loads.in_flight_cost(v.id), cost))
    if trace is not None and choice is not None:
        trace.detail["request_cost_tokens"] = cost
        _explain_least(trace, views, exclude, best, "tokens", lambda v: (loads.in_flight_cost(v.id), cost))
    return choice


def _explain_least(
    trace: DecisionTrace,
    views: tuple[EndpointView, ...],
    exclude: frozenset[str],
    best: list[EndpointView],
    unit: str,
    raw: Callable[[EndpointView], tuple[float, float]],
) -> None:
    """What `least_loaded` / `least_cost_loaded` compared, written after the choice so that an unexplained
    pick runs the loop above unchanged. Recomputed with the same formula from the same `LoadView`, read in
    the same synchronous call, so the values are the ones that were compared."""
    key = "in_flight" if unit == "requests" else "in_flight_cost"
    for view in views:
        if view.id in exclude:
            continue
        value, step = raw(view)
        load = scaled_load(view, value, step)
        trace.note(view.id, **{key: value, "load": load})
    trace.reason = "least_loaded"
    trace.detail["load_unit"] = unit
    if len(best) > 1:  # broken at random
        trace.detail["tied"] = len(best)
        trace.detail["tied_with"] = listed(v.id for v in best)
