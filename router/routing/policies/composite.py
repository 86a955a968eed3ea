"""composite: a routing policy assembled from scorers in configuration, without code: filter -> score -> pick.

The endpoint picker of the Gateway API Inference Extension (GIE) is built the same way: plugins filter the
candidates, scorers rate each in [0, 1], and a picker chooses from the weighted sum. Here:

    filter   the load guard (optional): drop endpoints whose load trips it, measured against the other
             candidates (maxInFlight, maxImbalance, maxLoadFactor, sigmaK: the prefix-aware guards). If it
             would drop every candidate, none is dropped (counted as the `guard_all_tripped` event).
    score    s(e) = clamp(sum_i w_i * scorer_i(e)) * slow_start_weight(e), with the weights normalised to
             sum to 1. The scorers:
               gpu      1 - gpu_util                          telemetry (signal: gpu_util)
               memory   1 - kv_cache_usage                    telemetry (signal: kv_cache_usage | gpu_mem_util)
               queue    1 - queue / maxQueue                  telemetry (signal: num_waiting | num_running |
                                                              num_requests); with `pick: best-score` the
                                                              queue also counts this router's in-flight
                                                              requests there, as adaptive's formula does
               load     1 - load / (most loaded candidate)    this router's in-flight requests, or their
                                                              predicted cost (loadUnit: tokens)
               prefix   leading prompt blocks cached there    the prefix index (as prefix-aware keeps it:
                        / prompt blocks hashed                sized from the engine's KV cache, shared
                                                              through Redis, tuned on the engine's hit rate)
             A telemetry scorer with no fresh report for an endpoint gives it the mean of the others
             (neutral), so missing telemetry neither attracts nor repels traffic.
    pick     from a random sample of `choices` candidates (all when `choices: all`):
               least-load   the least (load + 1) / (s(e) * weight(e)): load per unit of headroom and of
                            the endpoint's configured capacity weight (Envoy's weighted least-request).
                            Scores come from telemetry and the prefix index, the load is exact and
                            changes with every request, so a score that lags cannot herd: each request
                            sent makes its endpoint costlier for the next.
               best-score   the highest s(e), ties to the less loaded: what adaptive did before it measured
                            worse than least-load (docs/benchmarks.md).

`adaptive` is this policy with the gpu, memory and queue scorers (0.6, 0.3, 0.1). A mix such as
`{prefix: 0.5, load: 0.3, memory: 0.2}` gives prefix affinity that softens with load rather than switching
off at a threshold as prefix-aware's guard does. Scores and choices can be explained per request
(DecisionTrace).

As prefix-aware does, a composite with a prefix scorer records the chosen endpoint's prompt blocks in its
pool's index on the pick path (the one mutation a picker makes: an observation of where traffic went).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from router.model import COUNT_SIGNALS, FRACTION_SIGNALS, EndpointView, RequestInfo
from router.routing.policies.base import (
    DecisionTrace,
    EventSink,
    LoadView,
    PolicyConfigError,
    Sentence,
    finite_number,
    fmt,
    listed,
    parse_load_unit,
    reject_unknown,
    whole_number,
)
from router.routing.policies.prefix_aware import (
    GuardLimits,
    Matcher,
    PrefixAwareConfig,
    PrefixAwarePolicy,
    prompt_blocks,
    remember,
    size_index,
)
from router.routing.policies.scorers import clamp, free_fraction, neutral_fill, queue_free
from router.routing.prefix.index import PrefixIndex

TELEMETRY_SCORERS = {"gpu": "gpu_util", "memory": "kv_cache_usage", "queue": "num_waiting"}  # default signals
SCORERS = (*TELEMETRY_SCORERS, "load", "prefix")
PICKS = ("least-load", "best-score")
# Bounds of sanity, the same as the RoutingPolicy CRD's: a larger sample is "all", a larger queue bound no
# engine reaches.
MAX_CHOICES = 4096
MAX_QUEUE = 1_000_000
MIN_SCORE = 0.01  # least-load divides by the score: an endpoint with no headroom left is costly, not infinite


@dataclass(frozen=True)
class Scorer:
    name: str
    weight: float  # normalised: the weights of a policy sum to 1
    signal: str | None = None  # telemetry scorers
    max_queue: int = 32  # queue


@dataclass(frozen=True)
class LoadGuard:
    """The composite's filter; the fields mean what prefix-aware's guards mean (policies/prefix_aware.py)."""

    max_in_flight: int | None = None
    max_imbalance: int | None = None
    max_load_factor: float | None = None
    sigma_k: float | None = None

    @property
    def active(self) -> bool:
        return any(v is not None for v in (self.max_in_flight, self.max_imbalance, self.max_load_factor,
                                           self.sigma_k))


@dataclass(frozen=True)
class CompositeConfig:
    scorers: tuple[Scorer, ...]
    pick: str = "least-load"
    choices: int | None = 2  # None: every candidate
    load_unit: str = "requests"
    guard: LoadGuard = field(default_factory=LoadGuard)
    prefix: PrefixAwareConfig | None = None  # set when a prefix scorer is used: its index's settings

    @property
    def needs_cost(self) -> bool:
        """Whether requests must carry a cost estimate (read by settings.py to turn estimation on)."""
        return self.load_unit == "tokens"

    def weight(self, name: str) -> float:
        return sum(s.weight for s in self.scorers if s.name == name)


class CompositePicker:
    __slots__ = ("_views", "_config", "_rng", "_events", "_static", "_reported_queue", "_queue", "_load_w",
                 "_prefix_w", "_index", "_tokens", "_all_loads", "_uses_telemetry")

    def __init__(self, views: tuple[EndpointView, ...], config: CompositeConfig, rng: random.Random,
                 events: EventSink, index: PrefixIndex | None = None) -> None:
        self._views = views
        self._config = config
        self._rng = rng
        self._events = events
        self._index = index
        self._tokens = config.load_unit == "tokens"
        # The telemetry part of the score is fixed for this snapshot: computed once per rebuild.
        static = dict.fromkeys((v.id for v in views), 0.0)
        self._queue: Scorer | None = None
        for scorer in config.scorers:
            if scorer.name in ("gpu", "memory"):
                assert scorer.signal is not None
                filled = neutral_fill({v.id: free_fraction(v, scorer.signal) for v in views})
                for v in views:
                    static[v.id] += scorer.weight * filled[v.id]
            elif scorer.name == "queue":
                self._queue = scorer
        self._static = static
        queue_signal = self._queue.signal if self._queue is not None else None
        self._reported_queue = neutral_fill(
            {v.id: (v.telemetry.signal(queue_signal) if v.telemetry is not None and queue_signal else None)
             for v in views},
            default=0.0,
        )
        self._load_w = config.weight("load")
        self._prefix_w = config.weight("prefix")
        self._all_loads = bool(self._load_w) or config.guard.active
        self._uses_telemetry = any(s.name in TELEMETRY_SCORERS for s in config.scorers)

    # ---- scores -------------------------------------------------------------------------------------

    def score(self, view: EndpointView, in_flight: float, *, load_score: float = 1.0,
              prefix_score: float = 0.0) -> float:
        """s(e), with `in_flight` requests of this router added to the reported queue (the least-load pick
        passes 0: it weighs the load itself)."""
        s = self._static[view.id] + self._load_w * load_score + self._prefix_w * prefix_score
        q = self._queue
        if q is not None:
            s += q.weight * queue_free(self._reported_queue[view.id], in_flight, q.max_queue)
        return clamp(s) * view.weight_factor

    def _load(self, view: EndpointView, loads: LoadView, unit: float) -> float:
        if self._tokens and unit > 0.0:  # in request-equivalents of predicted cost
            return loads.in_flight_cost(view.id) / unit
        return float(loads.in_flight(view.id))

    # ---- pick ---------------------------------------------------------------------------------------

    def pick(self, req: RequestInfo, loads: LoadView, exclude: frozenset[str],
             trace: DecisionTrace | None = None) -> EndpointView | None:
        candidates = [v for v in self._views if v.id not in exclude] if exclude else self._views
        if not candidates:
            return None
        c = self._config
        unit = loads.mean_request_cost() if self._tokens else 0.0
        # Every candidate's load only when the guard or the load scorer compares it with the others.
        load = {v.id: self._load(v, loads, unit) for v in candidates} if self._all_loads else {}
        if c.guard.active:
            limits = GuardLimits.of(load, c.guard)  # once per pick: every candidate meets the same limits
            kept = [v for v in candidates if limits.tripped(load[v.id]) is None]
            if len(kept) < len(candidates):
                self._events("guard_filtered" if kept else "guard_all_tripped")
                if trace is not None:
                    trace.detail["filtered_by_guard"] = listed(v.id for v in candidates if v not in kept)
                candidates = kept or candidates
        hashes: list[int] = []
        prompt_chars = 0
        index = self._index
        match: Matcher | None = None
        if index is not None and c.prefix is not None:
            hashes, prompt_chars = prompt_blocks(req.body, c.prefix.block_chars, c.prefix.max_blocks)
            match = Matcher(index, hashes, prompt_chars, req.body, c.prefix)
        # A random draw (a shuffle when `choices` covers the pool), so exact ties never go by list order.
        sample = self._rng.sample(candidates, len(candidates) if c.choices is None else min(c.choices, len(candidates)))
        most = max(load[v.id] for v in candidates) if self._load_w else 0.0
        best: EndpointView | None = None
        best_key = best_load = 0.0
        best_match = 0
        for view in sample:
            lv = load[view.id] if self._all_loads else self._load(view, loads, unit)
            matched = match(view.id) if match is not None else 0
            least_load = c.pick == "least-load"
            s = self.score(view, 0.0 if least_load else lv, load_score=1.0 - lv / most if most > 0 else 1.0,
                           prefix_score=matched / len(hashes) if hashes else 0.0)
            # One key, lower is better, for both picks.
            key = (lv + 1.0) / (max(s, MIN_SCORE) * view.endpoint.weight) if least_load else -s
            if trace is not None:
                trace.note(view.id, score=round(s, 4), load=round(lv, 3), key=round(key, 4),
                           **({"prefix_blocks": matched} if hashes else {}))
            if best is None or key < best_key or (key == best_key and lv < best_load):
                best, best_key, best_load, best_match = view, key, lv, matched
        assert best is not None
        if best.telemetry is None and self._uses_telemetry:
            self._events("telemetry_unknown")
        if trace is not None:
            trace.sampled = [v.id for v in sample]
            trace.reason = "least_load_per_score" if c.pick == "least-load" else "best_score"
            if hashes:
                trace.detail["prompt_blocks"] = len(hashes)
        if index is not None and c.prefix is not None:
            if match is not None:
                event = match.event()
                if event is not None:
                    self._events(event)
                if trace is not None:
                    match.explain(trace)
            remember(index, best.id, hashes, prompt_chars, best_match, c.prefix.block_chars)
        return best

    def observe(self, req: RequestInfo, view: EndpointView) -> None:
        """A request went to `view` without a pick (a session's pinned endpoint): its blocks are there now."""
        c, index = self._config, self._index
        if index is None or c.prefix is None:
            return
        hashes, prompt_chars = prompt_blocks(req.body, c.prefix.block_chars, c.prefix.max_blocks)
        matched = Matcher(index, hashes, prompt_chars, req.body, c.prefix)(view.id)
        remember(index, view.id, hashes, prompt_chars, matched, c.prefix.block_chars)


# ---- parsing ----------------------------------------------------------------------------------------


def parse_choices(value: Any) -> int | None:
    if value == "all":
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_CHOICES:
        raise PolicyConfigError("choices", f"must be an integer from 1 to {MAX_CHOICES} or all, got {value!r}")
    return value


def parse_scorers(raw: Any) -> tuple[Scorer, ...]:
    """`{gpu: 0.6, queue: {weight: 0.1, maxQueue: 64}}` -> normalised Scorers."""
    if not isinstance(raw, Mapping) or not raw:
        raise PolicyConfigError("scorers", f"must map scorer names ({', '.join(SCORERS)}) to weights, got {raw!r}")
    parsed: list[tuple[str, float, str | None, int]] = []
    for name, spec in raw.items():
        where = f"scorers.{name}"
        if name not in SCORERS:
            raise PolicyConfigError(where, f"unknown scorer (expected one of: {', '.join(SCORERS)})")
        body: Mapping[str, Any] = spec if isinstance(spec, Mapping) else {"weight": spec}
        known = {"weight"} | ({"signal"} if name in TELEMETRY_SCORERS else set()) | \
            ({"maxQueue"} if name == "queue" else set())
        for key in body:
            if key not in known:
                expected = ", ".join(sorted(known))
                raise PolicyConfigError(f"{where}.{key}", f"unknown field (expected one of: {expected})")
        weight = finite_number(body.get("weight"), f"{where}.weight" if isinstance(spec, Mapping) else where,
                               minimum=0.0, maximum=1000.0)
        signal = None
        if name in TELEMETRY_SCORERS:
            signal = body.get("signal", TELEMETRY_SCORERS[name])
            allowed = COUNT_SIGNALS if name == "queue" else FRACTION_SIGNALS
            if signal not in allowed:
                raise PolicyConfigError(f"{where}.signal", f"must be one of {', '.join(allowed)}, got {signal!r}")
        max_queue = whole_number(body.get("maxQueue", 32), f"{where}.maxQueue", minimum=1, maximum=MAX_QUEUE) or 32
        parsed.append((name, float(weight), signal, max_queue))
    total = sum(w for _, w, _, _ in parsed)
    if total <= 0:
        raise PolicyConfigError("scorers", "at least one weight must be positive")
    return tuple(Scorer(name, w / total, signal, mq) for name, w, signal, mq in parsed if w > 0)


def parse_guard(raw: Any) -> LoadGuard:
    if raw is None:
        return LoadGuard()
    if not isinstance(raw, Mapping):
        raise PolicyConfigError("loadGuard", f"must be a mapping, got {raw!r}")
    reject_unknown(raw, {"maxInFlight", "maxImbalance", "maxLoadFactor", "sigmaK"})
    try:
        return LoadGuard(
            max_in_flight=whole_number(raw.get("maxInFlight"), "maxInFlight", minimum=1, nullable=True),
            max_imbalance=whole_number(raw.get("maxImbalance"), "maxImbalance", minimum=0, nullable=True),
            max_load_factor=finite_number(raw.get("maxLoadFactor"), "maxLoadFactor", minimum=1.0, nullable=True),
            sigma_k=finite_number(raw.get("sigmaK"), "sigmaK", minimum=0.0, exclusive=True, nullable=True),
        )
    except PolicyConfigError as exc:
        raise PolicyConfigError(f"loadGuard.{exc.field}", exc.message) from None


PREFIX_FIELDS = {"blockChars", "maxBlocks", "maxBlocksPerEndpoint", "index", "sharing", "tuning"}


def parse_prefix(raw: Any) -> PrefixAwareConfig:
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise PolicyConfigError("prefix", f"must be a mapping, got {raw!r}")
    try:
        reject_unknown(raw, PREFIX_FIELDS)
        return PrefixAwarePolicy().parse(raw)
    except PolicyConfigError as exc:
        raise PolicyConfigError(f"prefix.{exc.field}", exc.message) from None


REASONS: dict[str, Sentence] = {
    "least_load_per_score": lambda e: (
        f"the least load per unit of score and weight of the {e.sampled} sampled (load {fmt(e.chosen.get('load'))}, "
        f"score {fmt(e.chosen.get('score'))}, key {fmt(e.chosen.get('key'))})"),
    "best_score": lambda e: f"the best score of the {e.sampled} sampled ({fmt(e.chosen.get('score'))})",
}


class CompositePolicy:
    name = "composite"
    reasons = REASONS
    config_key = "composite"

    def parse(self, params: Mapping[str, Any]) -> CompositeConfig:
        reject_unknown(params, {"scorers", "pick", "choices", "loadUnit", "loadGuard", "prefix"})
        if "scorers" not in params:
            raise PolicyConfigError("scorers", f"is required: scorer names ({', '.join(SCORERS)}) and weights")
        scorers = parse_scorers(params["scorers"])
        pick = params.get("pick", "least-load")
        if pick not in PICKS:
            raise PolicyConfigError("pick", f"must be one of {', '.join(PICKS)}, got {pick!r}")
        uses_prefix = any(s.name == "prefix" for s in scorers)
        if "prefix" in params and not uses_prefix:
            raise PolicyConfigError("prefix", "configures the prefix index, but no prefix scorer is weighted")
        # A prefix match counts only when its endpoint is in the sample, which two random draws rarely give:
        # with a prefix scorer, every candidate is compared unless the operator says otherwise.
        default_choices = "all" if uses_prefix else 2
        return CompositeConfig(
            scorers=scorers, pick=pick, choices=parse_choices(params.get("choices", default_choices)),
            load_unit=parse_load_unit(params), guard=parse_guard(params.get("loadGuard")),
            prefix=parse_prefix(params.get("prefix")) if uses_prefix else None,
        )

    def new_state(self) -> PrefixIndex:
        # Every composite pool gets an index; one without a prefix scorer never records into it (empty).
        return PrefixIndex()

    def build(self, views: tuple[EndpointView, ...], config: CompositeConfig, state: PrefixIndex,
              rng: random.Random, events: EventSink) -> CompositePicker:
        if config.prefix is None:
            return CompositePicker(views, config, rng, events)
        size_index(state, views, config.prefix)
        return CompositePicker(views, config, rng, events, index=state)
