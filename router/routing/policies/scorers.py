"""Scorers: each rates one endpoint for one request in [0, 1] (1 = the best place to send it), and the composite
policy (router/routing/policies/composite.py) weighs them. The contract is the Gateway API Inference Extension's
endpoint-picker scorer: a scorer says what it reads and returns a number; the composite clamps that number to
[0, 1] in one place (`clamp`, called by the composite only) and weights it from configuration, so a scorer that
returns 1.7, -0.2 or NaN cannot distort a pick.

A scorer has two halves, so that a pick need not recompute what does not change between picks:

- `table(views, spec)`: per endpoint, the value it reads from the snapshot (telemetry), fixed until the next
  rebuild; computed once per rebuild. An endpoint without fresh telemetry gets the mean of the others (the
  neutral value that neither attracts nor repels traffic: grpc-go weighted round robin treats stale load reports
  the same way); scorers that read no telemetry return an empty table.
- `score(spec, fixed, at)`: the score from the table's value and, for per-request scorers, what the pick knows
  about the endpoint now (`At`: this router's load there, the most loaded candidate's, the prompt's blocks it
  holds). A scorer with `per_request = False` ignores `at` (but see `counts_queued`), so the composite adds its
  weighted score into each endpoint's snapshot part at build.

The composite's indexed pick (no scan of the pool) needs to bound what the endpoints it has not looked at can
score; a per-request scorer says how through `shape`: `falls_with_load` (its score depends only on the load and
the most loaded candidate's load, and never rises with the load) or `prompt_holders` (its score is the same for
every endpoint holding none of the prompt's blocks). A scorer with another shape (None) makes the composite scan.

Adding a scorer: one module with a class that has these members, one line in `scorer_registry.BUILTIN`, and
its tests; config validation, the docs table test and explanations read the registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from router.model import COUNT_SIGNALS, FRACTION_SIGNALS, EndpointView
from router.routing.policies.base import PolicyConfigError, fmt, whole_number

MAX_QUEUE = 1_000_000  # a queue bound no engine reaches (the RoutingPolicy CRD's bound too)


@dataclass(frozen=True)
class ScorerSpec:
    """One configured scorer of a composite: its name, its weight (normalised: a policy's weights sum to 1) and
    its own settings."""

    name: str
    weight: float
    signal: str | None = None  # telemetry scorers
    max_queue: int = 32  # queue


class At:
    """What the pick knows about one endpoint now, for per-request scorers. One object per pick, refilled per
    endpoint (a pick must not allocate per endpoint)."""

    __slots__ = ("load", "most", "matched", "blocks", "queued")

    def __init__(self) -> None:
        self.load = 0.0  # this router's load at the endpoint (requests, or request-equivalents of cost)
        self.most = 0.0  # the most loaded candidate's load
        self.matched = 0  # leading prompt blocks the endpoint's prefix index holds
        self.blocks = 0  # prompt blocks hashed
        self.queued = 0.0  # this router's in-flight to add to a reported queue (best-score only; 0 for least-load)


class Scorer(Protocol):
    name: str
    reads: str  # what it reads (docs/policies.md's scorer table)
    formula: str  # how it scores (docs/policies.md's scorer table)
    fields: tuple[str, ...]  # its config fields beside `weight`
    per_request: bool  # False: fixed per snapshot, computed at build
    shape: str | None  # per-request scorers: how the indexed pick bounds it (module docstring)
    uses_telemetry: bool  # a pick of an endpoint without telemetry counts `telemetry_unknown`
    counts_queued: bool  # adds this router's in-flight under best-score (then it is per request)

    def parse(self, body: Mapping[str, Any], where: str, weight: float) -> ScorerSpec:
        """Its spec from its config block (`weight` already read); errors name the field under `where`."""
        ...

    def table(self, views: tuple[EndpointView, ...], spec: ScorerSpec) -> dict[str, float]: ...

    def score(self, spec: ScorerSpec, fixed: float, at: At) -> float:
        """Its raw score: the composite clamps it to [0, 1]."""
        ...

    def explain(self, weight: float, score: float) -> str:
        """Its part of a pick's explanation sentence: weight, score and what the score means."""
        ...


def clamp(value: float) -> float:
    """A score into [0, 1]; NaN is the worst score rather than a value that poisons every comparison."""
    if value != value:
        return 0.0
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else value


def free_fraction(view: EndpointView, signal: str) -> float | None:
    """1 - a utilisation fraction (`gpu_util`, `gpu_mem_util` or `kv_cache_usage`)."""
    t = view.telemetry
    value = None if t is None else t.signal(signal)
    return None if value is None else clamp(1.0 - value)


def queue_free(reported_queue: float, in_flight: float, max_queue: int) -> float:
    """1 - queue/max_queue, where queue = what the engine last reported + what this router has in flight
    there. The local count is fresh while the report lags by up to one telemetry interval, so requests this
    router just sent lower the score at once (the correction rule 6 of STYLE.md asks for)."""
    return clamp(1.0 - (reported_queue + in_flight) / max_queue)


def neutral_fill(scores: dict[str, float | None], default: float = 0.5) -> dict[str, float]:
    """Replace unknown values by the mean of the known ones (`default` when none is known)."""
    known = [s for s in scores.values() if s is not None]
    fill = sum(known) / len(known) if known else default
    return {k: (fill if s is None else s) for k, s in scores.items()}


def _signal(body: Mapping[str, Any], where: str, default: str, allowed: tuple[str, ...]) -> str:
    signal = body.get("signal", default)
    if signal not in allowed:
        raise PolicyConfigError(f"{where}.signal", f"must be one of {', '.join(allowed)}, got {signal!r}")
    return str(signal)


class _Headroom:
    """1 - a utilisation fraction from telemetry (gpu, memory)."""

    reads = ""
    fields = ("signal",)
    per_request = False
    shape = None
    uses_telemetry = True
    counts_queued = False
    default_signal = ""
    name = ""
    what = ""  # what its score measures, for explanations

    @property
    def formula(self) -> str:
        return "1 - signal"

    def parse(self, body: Mapping[str, Any], where: str, weight: float) -> ScorerSpec:
        return ScorerSpec(self.name, weight, _signal(body, where, self.default_signal, FRACTION_SIGNALS))

    def table(self, views: tuple[EndpointView, ...], spec: ScorerSpec) -> dict[str, float]:
        assert spec.signal is not None
        return neutral_fill({v.id: free_fraction(v, spec.signal) for v in views})

    def score(self, spec: ScorerSpec, fixed: float, at: At) -> float:
        return fixed

    def explain(self, weight: float, score: float) -> str:
        return f"{self.name} {fmt(weight)} x {fmt(score)} ({self.what})"


class GpuScorer(_Headroom):
    name = "gpu"
    reads = "telemetry (signal: gpu_util, default; gpu_mem_util, kv_cache_usage)"
    default_signal = "gpu_util"
    what = "GPU headroom"


class MemoryScorer(_Headroom):
    name = "memory"
    reads = "telemetry (signal: kv_cache_usage, default; gpu_util, gpu_mem_util)"
    default_signal = "kv_cache_usage"
    what = "KV cache free"


class QueueScorer:
    name = "queue"
    reads = ("telemetry (signal: num_waiting, default; num_running, num_requests); with best-score, this router's "
             "in-flight")
    formula = "1 - (reported queue + in-flight here, best-score only) / maxQueue"
    fields = ("signal", "maxQueue")
    per_request = False
    shape = None
    uses_telemetry = True
    # Under best-score the queue also counts this router's in-flight requests there, as adaptive's formula does.
    counts_queued = True

    def parse(self, body: Mapping[str, Any], where: str, weight: float) -> ScorerSpec:
        signal = _signal(body, where, "num_waiting", COUNT_SIGNALS)
        max_queue = whole_number(body.get("maxQueue", 32), f"{where}.maxQueue", minimum=1, maximum=MAX_QUEUE) or 32
        return ScorerSpec(self.name, weight, signal, max_queue)

    def table(self, views: tuple[EndpointView, ...], spec: ScorerSpec) -> dict[str, float]:
        # The unknown queue is the mean reported one (0 when none is known), not the mean score.
        signal = spec.signal
        return neutral_fill({v.id: v.telemetry.signal(signal) if v.telemetry is not None and signal else None
                             for v in views}, default=0.0)

    def score(self, spec: ScorerSpec, fixed: float, at: At) -> float:
        return queue_free(fixed, at.queued, spec.max_queue)

    def explain(self, weight: float, score: float) -> str:
        return f"queue {fmt(weight)} x {fmt(score)} (queue room left)"


class LoadScorer:
    name = "load"
    reads = "this router's in-flight requests, or their predicted cost (loadUnit: tokens)"
    formula = "1 - load / (most loaded candidate's load)"
    fields = ()
    per_request = True
    shape = "falls_with_load"
    uses_telemetry = False
    counts_queued = False

    def parse(self, body: Mapping[str, Any], where: str, weight: float) -> ScorerSpec:
        return ScorerSpec(self.name, weight)

    def table(self, views: tuple[EndpointView, ...], spec: ScorerSpec) -> dict[str, float]:
        return {}

    def score(self, spec: ScorerSpec, fixed: float, at: At) -> float:
        return 1.0 - at.load / at.most if at.most > 0 else 1.0

    def explain(self, weight: float, score: float) -> str:
        return f"load {fmt(weight)} x {fmt(score)} (1 - its load / the most loaded's)"


class PrefixScorer:
    name = "prefix"
    reads = "the prefix index (as prefix-aware keeps it; the composite's `prefix` block)"
    formula = "leading prompt blocks cached there / prompt blocks hashed"
    fields = ()
    per_request = True
    shape = "prompt_holders"
    uses_telemetry = False
    counts_queued = False

    def parse(self, body: Mapping[str, Any], where: str, weight: float) -> ScorerSpec:
        return ScorerSpec(self.name, weight)

    def table(self, views: tuple[EndpointView, ...], spec: ScorerSpec) -> dict[str, float]:
        return {}

    def score(self, spec: ScorerSpec, fixed: float, at: At) -> float:
        return at.matched / at.blocks if at.blocks else 0.0

    def explain(self, weight: float, score: float) -> str:
        return f"prefix {fmt(weight)} x {fmt(score)} (share of the prompt's blocks cached there)"
