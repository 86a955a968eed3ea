"""composite: a routing policy assembled from scorers in configuration, without code: filter -> score -> pick.

The endpoint picker of the Gateway API Inference Extension (GIE) is built the same way: plugins filter the
candidates, scorers rate each in [0, 1], and a picker chooses from the weighted sum. Here:

    filter   the load guard (optional): drop endpoints whose load trips it, measured against the other
             candidates (maxInFlight, maxImbalance, maxLoadFactor, sigmaK: the prefix-aware guards). If it
             would drop every candidate, none is dropped (counted as the `guard_all_tripped` event).
    score    s(e) = clamp(sum_i w_i * clamp(scorer_i(e))) * slow_start_weight(e), with the weights normalised
             to sum to 1. The scorers (gpu, memory, queue, load, prefix) are plug-ins read from the scorer
             registry (router/routing/policies/scorers.py, scorer_registry.py): each says what it reads and how
             it scores, and the clamp of each scorer's output is here, in `_key`, the one place. The parts of
             s(e) that do not change between picks (telemetry scorers) are computed once per rebuild.
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

The indexed pick (`_indexed`): with least-load over every candidate, no guard and loads in requests, the
pick finds the scan's choice by looking at a few endpoints: the prompt's holders in the prefix index, then the
pool's endpoints least in flight first (load_index.py) and best snapshot score first, until a bound on the key
of every endpoint not yet looked at (`_bound`) shows none can win (Fagin's threshold algorithm). Its cost
depends on how far the best endpoint is from the top of either order, not on the pool's size; every other
configuration, and every explained pick, scans (`_scan`). tests/test_composite_index.py holds the two together.

As prefix-aware does, a composite with a prefix scorer records the chosen endpoint's prompt blocks in its
pool's index on the pick path (the one mutation a picker makes: an observation of where traffic went).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.model import EndpointView, RequestInfo
from router.routing.policies.base import (
    DecisionTrace,
    EventSink,
    Explained,
    LoadView,
    PolicyConfigError,
    Sentence,
    finite_number,
    fmt,
    listed,
    parse_load_unit,
    pool_index,
    reject_unknown,
    whole_number,
)
from router.routing.policies.load_index import LoadIndex
from router.routing.policies.prefix_aware import (
    GuardLimits,
    Matcher,
    PrefixAwareConfig,
    PrefixAwarePolicy,
    prompt_blocks,
    remember,
    size_index,
)
from router.routing.policies.scorer_registry import SCORERS, ScorerRegistry
from router.routing.policies.scorers import MAX_QUEUE, At, ScorerSpec, clamp
from router.routing.policies.scorers import Scorer as ScorerPlugin
from router.routing.prefix.index import PrefixIndex

Scorer = ScorerSpec  # the configured entry under its older name (adaptive builds its three with it)
PICKS = ("least-load", "best-score")
# Bounds of sanity, the same as the RoutingPolicy CRD's: a larger sample is "all".
MAX_CHOICES = 4096
MIN_SCORE = 0.01  # least-load divides by the score: an endpoint with no headroom left is costly, not infinite
# Per-request scorer shapes the indexed pick can bound (router/routing/policies/scorers.py).
INDEXED_SHAPES = frozenset({"falls_with_load", "prompt_holders"})
# The indexed pick walks endpoints in order of snapshot score per group of equal (slow-start factor, weight);
# groups smaller than this share one walk bounded by their largest factor and weight (endpoints ramping up).
MIN_GROUP = 8
__all__ = ["MAX_QUEUE", "PICKS", "CompositeConfig", "CompositePicker", "CompositePolicy", "Scorer", "parse_choices"]


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
    scorers: tuple[ScorerSpec, ...]
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


def prefix_holders(index: PrefixIndex, hashes: list[int]) -> dict[str, int]:
    """Every endpoint whose index holds at least the first of `hashes`, with how many leading blocks it holds
    (`PrefixIndex.matched`). An index that keeps block -> holders answers itself (`holders`, its cost the
    prompt's length); this index's current API has no such map, so the fallback tests each indexed endpoint for
    the first block (one dict lookup each, no walk of the chain for the endpoints that miss)."""
    holders = getattr(index, "holders", None)
    if holders is not None:
        found: dict[str, int] = holders(hashes)
        return found
    first = hashes[0]
    return {e: index.matched(e, hashes) for e, blocks in index.by_endpoint.items() if first in blocks}


class _Walk:
    """One group of endpoints with the same capacity (or the small groups together), in decreasing order of their
    snapshot score: the indexed pick reads it from the top."""

    __slots__ = ("ids", "static", "factor", "weight")

    def __init__(self, entries: list[tuple[float, str]], factor: float, weight: float) -> None:
        self.ids = [e for _, e in entries]
        self.static = [a for a, _ in entries]
        self.factor = factor  # the largest slow-start factor in the group (bounds only)
        self.weight = weight  # the largest configured weight in the group (bounds only)


class CompositePicker:
    __slots__ = ("_views", "_by_id", "_config", "_rng", "_events", "_index", "_tokens", "_least", "_static",
                 "_dynamic", "_all_loads", "_uses_telemetry", "_indexable", "_walks", "_at", "_parts_of")

    def __init__(self, views: tuple[EndpointView, ...], config: CompositeConfig, rng: random.Random,
                 events: EventSink, index: PrefixIndex | None = None, scorers: ScorerRegistry = SCORERS) -> None:
        self._views = views
        self._by_id = {v.id: v for v in views}
        self._config = config
        self._rng = rng
        self._events = events
        self._index = index
        self._tokens = config.load_unit == "tokens"
        self._least = config.pick == "least-load"
        self._at = At()
        plugins = [(spec, scorers.require(spec.name, f"scorers.{spec.name}")) for spec in config.scorers]
        # The request-independent part of each endpoint's score is fixed for this snapshot: computed once per
        # rebuild, each scorer's score clamped (the one clamp) and weighted.
        static = dict.fromkeys(self._by_id, 0.0)
        dynamic: list[tuple[ScorerSpec, ScorerPlugin, dict[str, float]]] = []
        at = self._at
        parts: list[tuple[ScorerSpec, ScorerPlugin, dict[str, float]]] = []
        for spec, scorer in plugins:
            table = scorer.table(views, spec)
            parts.append((spec, scorer, table))
            if scorer.per_request or (scorer.counts_queued and not self._least):
                dynamic.append((spec, scorer, table))
                continue
            for view_id in static:
                static[view_id] += spec.weight * clamp(scorer.score(spec, table.get(view_id, 0.0), at))
        self._static = static
        self._parts_of = tuple(parts)  # every scorer with its table, for explanations
        self._dynamic = tuple(dynamic)
        # Every candidate's load is read when a scorer compares it with the others' or the guard does.
        self._all_loads = any(scorer.shape == "falls_with_load" for _, scorer in plugins) or config.guard.active
        self._uses_telemetry = any(scorer.uses_telemetry for _, scorer in plugins)
        # The indexed pick (`_indexed`) finds the scan's choice by looking at a few endpoints. It needs the least-load
        # key, every candidate (no sample, no guard comparing them all), loads in requests (what the load index
        # orders), per-request scorers it can bound, and the approximate prefix index (holders are found by block).
        self._indexable = (
            self._least and config.choices is None and not config.guard.active and not self._tokens
            and all(scorer.shape in INDEXED_SHAPES for _, scorer, _ in dynamic)
            and (config.prefix is None or config.prefix.index != "precise"))
        self._walks: list[_Walk] | None = None  # built at the first indexed pick

    # ---- scores -------------------------------------------------------------------------------------

    def _key(self, view: EndpointView, lv: float, matched: int) -> tuple[float, float]:
        """(the pick key, lower is better; s(e)) for `view` at load `lv` with `matched` prompt blocks: the formula
        of every path, so the indexed pick and the scan compare the same floats."""
        at = self._at
        at.load = lv
        at.matched = matched
        s = self._static[view.id]
        for spec, scorer, table in self._dynamic:
            s += spec.weight * clamp(scorer.score(spec, table.get(view.id, 0.0), at))
        s = clamp(s) * view.weight_factor
        key = (lv + 1.0) / (max(s, MIN_SCORE) * view.endpoint.weight) if self._least else -s
        return key, s

    def _bound(self, walk: _Walk, position: int, lv: float) -> float:
        """The least key an endpoint of `walk` not yet looked at can have: its snapshot score is at most the one at
        `position`, its load at least `lv`, it holds none of the prompt's blocks (holders are all looked at), its
        factor and weight at most the group's. Each step of `_key` is monotonic, so this bounds it exactly."""
        at = self._at
        at.load = lv
        at.matched = 0
        s = walk.static[position]
        for spec, scorer, _table in self._dynamic:
            s += spec.weight * clamp(scorer.score(spec, 0.0, at))
        s = clamp(s) * walk.factor
        return (lv + 1.0) / (max(s, MIN_SCORE) * walk.weight)

    def score(self, view: EndpointView, in_flight: float = 0.0, *, matched: int = 0, blocks: int = 0) -> float:
        """s(e) outside a pick, with `in_flight` requests of this router there added to a reported queue (what a
        best-score pick does) and `matched` of `blocks` prompt blocks cached there; no other candidate's load to
        compare, so the load scorer gives 1."""
        at = self._at
        at.load, at.most, at.queued, at.matched, at.blocks = in_flight, 0.0, in_flight, matched, blocks
        s = 0.0
        for spec, scorer, table in self._parts_of:
            s += spec.weight * clamp(scorer.score(spec, table.get(view.id, 0.0), at))
        return clamp(s) * view.weight_factor

    def _load(self, view: EndpointView, loads: LoadView, unit: float) -> float:
        if self._tokens and unit > 0.0:  # in request-equivalents of predicted cost
            return loads.in_flight_cost(view.id) / unit
        return float(loads.in_flight(view.id))

    # ---- pick ---------------------------------------------------------------------------------------

    def pick(self, req: RequestInfo, loads: LoadView, exclude: frozenset[str],
             trace: DecisionTrace | None = None) -> EndpointView | None:
        c = self._config
        index = self._index if c.prefix is not None else None
        hashes: list[int] = []
        prompt_chars = 0
        if index is not None and c.prefix is not None:
            hashes, prompt_chars = prompt_blocks(req.body, c.prefix.block_chars, c.prefix.max_blocks)
        found: tuple[EndpointView, int] | None = None
        load_index = pool_index(loads, self._views) if self._indexable and trace is None else None
        if load_index is not None:  # an explained pick scans, to list what it compared
            found = self._indexed(loads, exclude, load_index, index, hashes)
        else:
            found = self._scan(req, loads, exclude, trace, index, hashes, prompt_chars)
        if found is None:
            return None
        best, best_match = found
        if best.telemetry is None and self._uses_telemetry:
            self._events("telemetry_unknown")
        if index is not None and c.prefix is not None:
            remember(index, best.id, hashes, prompt_chars, best_match, c.prefix.block_chars)
        return best

    def _indexed(self, loads: LoadView, exclude: frozenset[str], load_index: LoadIndex, index: PrefixIndex | None,
                 hashes: list[int]) -> tuple[EndpointView, int] | None:
        """The scan's choice without the scan (Fagin's threshold algorithm): endpoints are looked at in two orders
        at once, least in-flight first (the pool's load index) and best snapshot score first (`_walks`), after every
        endpoint holding some of the prompt's blocks; the walk stops when no endpoint not yet looked at can beat
        (or tie with a lower load) the best one found, by `_bound`. Ties are broken at random among the tied
        endpoints looked at."""
        at = self._at
        at.most = float(load_index.highest(exclude)) if self._all_loads else 0.0
        at.blocks = len(hashes)
        at.queued = 0.0
        by_id = self._by_id
        seen: set[str] = set(exclude)
        best: list[tuple[EndpointView, int]] = []
        best_key = best_lv = math.inf

        def look(endpoint_id: str, matched: int) -> None:
            nonlocal best, best_key, best_lv
            seen.add(endpoint_id)
            view = by_id[endpoint_id]
            lv = float(loads.in_flight(endpoint_id))
            key = self._key(view, lv, matched)[0]
            if key < best_key or (key == best_key and lv < best_lv):
                best, best_key, best_lv = [(view, matched)], key, lv
            elif key == best_key and lv == best_lv:
                best.append((view, matched))

        if index is not None and hashes:
            for endpoint_id, matched in prefix_holders(index, hashes).items():
                if endpoint_id in by_id and endpoint_id not in seen:
                    look(endpoint_id, matched)
        walks = self._walks if self._walks is not None else self._build_walks()
        positions = [0] * len(walks)
        by_load: Iterator[tuple[int, str]] = load_index.ascending()
        head = next(by_load, None)
        while True:
            while head is not None and head[1] in seen:
                head = next(by_load, None)
            if head is None:
                break  # every endpoint looked at
            threshold = math.inf
            for w, walk in enumerate(walks):
                position = positions[w]
                ids = walk.ids
                while position < len(ids) and ids[position] in seen:
                    position += 1
                positions[w] = position
                if position < len(ids):
                    threshold = min(threshold, self._bound(walk, position, float(head[0])))
            if threshold > best_key or (threshold == best_key and best_lv <= head[0]):
                break
            look(head[1], 0)
            for w, walk in enumerate(walks):
                position = positions[w]
                if position < len(walk.ids) and walk.ids[position] not in seen:
                    look(walk.ids[position], 0)
        if not best:
            return None
        return best[0] if len(best) == 1 else self._rng.choice(best)

    def _build_walks(self) -> list[_Walk]:
        """Endpoints by decreasing snapshot score, per group of equal (slow-start factor, weight); shuffled first,
        so equal scores are met in a random order, never the list's."""
        order = list(self._views)
        self._rng.shuffle(order)
        groups: dict[tuple[float, float], list[EndpointView]] = {}
        for view in order:
            groups.setdefault((view.weight_factor, view.endpoint.weight), []).append(view)
        static = self._static
        walks: list[_Walk] = []
        small: list[EndpointView] = []
        for (factor, weight), members in groups.items():
            if len(members) < MIN_GROUP:
                small.extend(members)
                continue
            walks.append(_Walk(sorted(((static[v.id], v.id) for v in members), key=lambda e: -e[0]), factor, weight))
        if small:
            walks.append(_Walk(sorted(((static[v.id], v.id) for v in small), key=lambda e: -e[0]),
                               max(v.weight_factor for v in small), max(v.endpoint.weight for v in small)))
        self._walks = walks
        return walks

    def _scan(self, req: RequestInfo, loads: LoadView, exclude: frozenset[str], trace: DecisionTrace | None,
              index: PrefixIndex | None, hashes: list[int], prompt_chars: int) -> tuple[EndpointView, int] | None:
        """Score every sampled candidate (all of them with `choices: all`): the reference the indexed pick must
        agree with, and the path of every configuration it cannot take."""
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
        match: Matcher | None = None
        if index is not None and c.prefix is not None:
            match = Matcher(index, hashes, prompt_chars, req.body, c.prefix)
        # A random draw (a shuffle when `choices` covers the pool), so exact ties never go by list order.
        sample = self._rng.sample(candidates, len(candidates) if c.choices is None else min(c.choices, len(candidates)))
        at = self._at
        at.most = max(load[v.id] for v in candidates) if load else 0.0
        at.blocks = len(hashes)
        best: EndpointView | None = None
        best_key = best_load = 0.0
        best_match = 0
        for view in sample:
            lv = load[view.id] if self._all_loads else self._load(view, loads, unit)
            matched = match(view.id) if match is not None else 0
            at.queued = 0.0 if self._least else lv
            key, s = self._key(view, lv, matched)
            if trace is not None:
                trace.note(view.id, score=s, load=lv, key=key, scorers=self._parts(view, lv, matched),
                           **({"prefix_blocks": matched} if hashes else {}))
            if best is None or key < best_key or (key == best_key and lv < best_load):
                best, best_key, best_load, best_match = view, key, lv, matched
        assert best is not None
        if trace is not None:
            trace.sampled = [v.id for v in sample]
            trace.reason = "least_load_per_score" if self._least else "best_score"
            trace.detail["weights"] = {spec.name: spec.weight for spec in c.scorers}
            if hashes:
                trace.detail["prompt_blocks"] = len(hashes)
        if match is not None:
            event = match.event()
            if event is not None:
                self._events(event)
            if trace is not None:
                match.explain(trace)
        return best, best_match

    def _parts(self, view: EndpointView, lv: float, matched: int) -> dict[str, float]:
        """Each scorer's clamped score for `view` (an explanation's per-scorer contribution: weight x this)."""
        at = self._at
        at.load = lv
        at.matched = matched
        return {spec.name: clamp(scorer.score(spec, table.get(view.id, 0.0), at))
                for spec, scorer, table in self._parts_of}

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


def parse_scorers(raw: Any, scorers: ScorerRegistry = SCORERS) -> tuple[ScorerSpec, ...]:
    """`{gpu: 0.6, queue: {weight: 0.1, maxQueue: 64}}` -> normalised specs. Names, fields and their rules come from
    the scorer registry (router/routing/policies/scorer_registry.py): each scorer parses its own block."""
    if not isinstance(raw, Mapping) or not raw:
        raise PolicyConfigError("scorers", f"must map scorer names ({', '.join(scorers.names())}) to weights, "
                                           f"got {raw!r}")
    parsed: list[ScorerSpec] = []
    for name, spec in raw.items():
        where = f"scorers.{name}"
        scorer = scorers.require(name, where)
        body: Mapping[str, Any] = spec if isinstance(spec, Mapping) else {"weight": spec}
        known = {"weight", *scorer.fields}
        for key in body:
            if key not in known:
                expected = ", ".join(sorted(known))
                raise PolicyConfigError(f"{where}.{key}", f"unknown field (expected one of: {expected})")
        weight = finite_number(body.get("weight"), f"{where}.weight" if isinstance(spec, Mapping) else where,
                               minimum=0.0, maximum=1000.0)
        parsed.append(scorer.parse(body, where, float(weight or 0.0)))
    total = sum(s.weight for s in parsed)
    if total <= 0:
        raise PolicyConfigError("scorers", "at least one weight must be positive")
    return tuple(ScorerSpec(s.name, s.weight / total, s.signal, s.max_queue) for s in parsed if s.weight > 0)


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


def _contributions(e: Explained) -> str:
    """The chosen endpoint's score as each scorer's part of it, in each scorer's own words."""
    weights: Mapping[str, float] = e.detail.get("weights", {})
    scores: Mapping[str, float] = e.chosen.get("scorers", {})
    parts = []
    for name, weight in weights.items():
        scorer = SCORERS.get(name)
        if scorer is not None and name in scores:
            parts.append(scorer.explain(round(weight, 4), round(scores[name], 4)))
    return " = " + " + ".join(parts) if parts else ""


REASONS: dict[str, Sentence] = {
    "least_load_per_score": lambda e: (
        f"the least load per unit of score and weight of the {e.sampled} sampled (load {fmt(e.chosen.get('load'))}, "
        f"score {fmt(e.chosen.get('score'))}{_contributions(e)}, key {fmt(e.chosen.get('key'))})"),
    "best_score": lambda e: (f"the best score of the {e.sampled} sampled ({fmt(e.chosen.get('score'))}"
                             f"{_contributions(e)})"),
}


class CompositePolicy:
    name = "composite"
    reasons = REASONS
    config_key = "composite"

    def __init__(self, scorers: ScorerRegistry = SCORERS) -> None:
        self.scorers = scorers  # a test may register its own

    def parse(self, params: Mapping[str, Any]) -> CompositeConfig:
        reject_unknown(params, {"scorers", "pick", "choices", "loadUnit", "loadGuard", "prefix"})
        if "scorers" not in params:
            names = ", ".join(self.scorers.names())
            raise PolicyConfigError("scorers", f"is required: scorer names ({names}) and weights")
        scorers = parse_scorers(params["scorers"], self.scorers)
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
            return CompositePicker(views, config, rng, events, scorers=self.scorers)
        size_index(state, views, config.prefix)
        return CompositePicker(views, config, rng, events, index=state, scorers=self.scorers)
