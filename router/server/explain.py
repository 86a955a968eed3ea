"""Explainable routing decisions: why a request went where it went, for the few requests someone asks about.

Which requests are explained. Nothing is recorded for a request unless (a) it carries
`x-fleetroute-explain` and its sender may ask (router/server/auth.py `explain_permission`: the admin token as the
header's value, or `1` from a client whose API key is marked `explain`), or (b) it is drawn by the
`explain.sampleRate` sample. An unauthorised header changes nothing: the request is served as usual, no
explanation, no error (counted in `fleetroute_explain_requests_total{outcome="denied"}`), and the header is
never forwarded upstream (router/server/proxy.py). For every other request the cost is one header lookup and, with
sampling on, one random draw: pickers and the balancer fill a `DecisionTrace` only when handed one.

What is recorded (a `Decision`): the policy and strategy, stickiness (session pinned, hit / gone /
overloaded / new), admission (class, time queued, shed), and one `Attempt` per endpoint tried: what the
picker compared per candidate and why it chose (its `DecisionTrace`: loads, scores, prefix matches, ring
steps, the sampled pair, the guard that tripped and its limit), the facts around the picker (telemetry age
and values, slow-start weight, breaker state; router/routing/balancer.py `annotate`), the endpoints left out of the
pool and why (draining, health check, ejected, breaker open, GPU fault) or excluded for this attempt (it
failed earlier, no half-open probe slot, at its admission cap), and the attempt's outcome.

Where it goes:
- asked for: the response carries `x-fleetroute-explanation` (compact ASCII JSON, the last attempt's top
  `headerCandidates` candidates with a count of the rest, at most `MAX_HEADER_BYTES`) and
  `x-fleetroute-decision-id`, on streaming and non-streaming answers alike (set before the first byte) and
  on the router's own errors (no endpoint, shed, all attempts failed);
- every recorded decision: the bounded ring of the `recent` newest, served by `/admin/decisions` (filters)
  and `/admin/decisions/{id}` (the full record), and one JSON log line (logger `fleetroute.decisions`)
  when it ends, with its final status.

Memory is bounded: `recent` records at most, each with at most `MAX_ATTEMPTS` attempts of at most
`MAX_CANDIDATES` candidates (the most relevant kept: chosen, sampled, then the closest contenders). Each
router process keeps its own ring (with `workers > 1`, `/admin/decisions` shows the worker that answers;
the log has them all).
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from router.config.fields import Fields
from router.routing.policies.base import DecisionTrace, Explained
from router.routing.policies.registry import sentence
from router.runtime.metrics import RouterMetrics

log = logging.getLogger("fleetroute.decisions")

EXPLAIN_HEADER = "x-fleetroute-explain"  # request: ask for an explanation
EXPLANATION_HEADER = "x-fleetroute-explanation"  # response: the explanation, compact JSON
DECISION_ID_HEADER = "x-fleetroute-decision-id"  # response: its full record is /admin/decisions/{id}
MAX_HEADER_BYTES = 6144  # under the 8 KiB header-line limit of aiohttp, nginx and most HTTP clients
MAX_CANDIDATES = 64  # kept per attempt in the ring (the response header and log show `headerCandidates`)
MAX_ATTEMPTS = 16  # kept per decision (retries plus endpoints skipped for want of a probe slot)
MAX_RECENT = 10_000

# Attempt outcomes of an endpoint that was chosen but never sent the request.
NOT_SENT = frozenset({None, "no_probe_slot", "not_sent_deadline", "not_sent_retry_budget"})
# Permission to explain, given the header's value and the request's Authorization (router/server/auth.py).
Permission = Callable[[str, str | None], bool]


@dataclass(frozen=True)
class ExplainSettings:
    """The top-level `explain:` block."""

    sample_rate: float = 0.0  # share of routed requests recorded and logged without being asked (0 to 1)
    recent: int = 256  # decisions kept for /admin/decisions (0 keeps none)
    header_candidates: int = 8  # candidates shown in the response header and the log line


def parse_explain(f: Fields) -> ExplainSettings:
    d = ExplainSettings()
    settings = ExplainSettings(
        sample_rate=f.number("sampleRate", d.sample_rate, minimum=0, maximum=1),
        recent=f.integer("recent", d.recent, minimum=0, maximum=MAX_RECENT),
        header_candidates=f.integer("headerCandidates", d.header_candidates, minimum=1, maximum=MAX_CANDIDATES),
    )
    f.done()
    return settings


class Attempt:
    """One endpoint chosen (or none) for one request, and what became of it."""

    __slots__ = ("endpoint", "reason", "trace", "excluded", "pool", "outcome", "status", "error", "omitted")

    def __init__(self, endpoint: str | None, trace: DecisionTrace | None, excluded: dict[str, str],
                 pool: dict[str, Any]) -> None:
        self.endpoint = endpoint
        trace = trace or DecisionTrace()
        self.reason = "no_candidate" if endpoint is None else trace.reason
        self.trace = trace
        self.excluded = excluded
        self.pool = pool
        self.outcome: str | None = None  # sent, answered, an upstream failure kind, no_probe_slot, not_sent_*
        self.status: int | None = None
        self.error: str | None = None
        # Keep the most relevant candidates only: the ring's memory must not grow with the fleet.
        ranked = rank(trace.candidates, endpoint, trace.sampled)
        self.omitted = max(0, len(ranked) - MAX_CANDIDATES)
        trace.candidates = dict(ranked[:MAX_CANDIDATES])

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"endpoint": self.endpoint, "reason": self.reason}
        if self.outcome is not None:
            out["outcome"] = self.outcome
        if self.status is not None:
            out["status"] = self.status
        if self.error is not None:
            out["error"] = self.error
        return out

    def to_dict(self, candidates: int | None = None) -> dict[str, Any]:
        trace = self.trace
        shown = list(trace.candidates.items())
        limit = len(shown) if candidates is None else candidates
        out = self.summary()
        out.update(why=summarise(self), pool=self.pool, excluded=self.excluded, detail=trace.detail)
        if trace.sampled:
            out["sampled"] = trace.sampled
        out["candidates"] = [{"id": i, **values} for i, values in shown[:limit]]
        out["candidates_omitted"] = self.omitted + max(0, len(shown) - limit)
        return out


def summarise(attempt: Attempt) -> str:
    """One sentence on why the attempt's endpoint was chosen, from what the trace recorded (so it can never
    disagree with the fields beside it), in the words of the policy that gave the reason
    (router/routing/policies/registry.py `sentence`). A reason no policy explains gives the reason word itself."""
    trace, chosen = attempt.trace, attempt.endpoint
    if chosen is None:
        return "no candidate: every endpoint serving the model was left out of the pool or excluded"
    explained = Explained(detail=trace.detail, chosen=trace.candidates.get(chosen, {}),
                          candidates=len(trace.candidates), sampled=len(trace.sampled))
    if attempt.reason == "sticky_hit":  # the router's own: the policy was not asked
        return (f"the session's pinned endpoint, within its load bound ({explained.chosen.get('cluster_in_flight')} "
                f"< {explained.chosen.get('sticky_bound')})")
    write = sentence(attempt.reason)
    return write(explained) if write is not None else attempt.reason or "unexplained"


def rank(candidates: Mapping[str, dict[str, Any]], chosen: str | None,
         sampled: Iterable[str]) -> list[tuple[str, dict[str, Any]]]:
    """Candidates in the order an operator reads them: the chosen one, the rest of the sample, then the
    closest contenders (longest prefix match, best score, least load), the picker's order breaking ties."""
    drawn = list(sampled)

    def key(item: tuple[int, tuple[str, dict[str, Any]]]) -> tuple[float, ...]:
        position, (endpoint, values) = item
        group = 0 if endpoint == chosen else 1 if endpoint in drawn else 2
        return (group, -_number(values.get("match_blocks")), -_number(values.get("score")),
                _number(values.get("load"), math.inf), position)

    return [item for _, item in sorted(enumerate(candidates.items()), key=key)]


def _number(value: Any, default: float = 0.0) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else default


class Decision:
    """Everything recorded about one request's routing, filled in as the request goes (by the handler)."""

    __slots__ = ("id", "request_id", "at", "recorded", "model", "policy", "strategy", "stickiness", "admission",
                 "alias", "attempts", "attempts_omitted", "status", "duration_ms", "header_candidates")

    def __init__(self, *, request_id: str, at: float, recorded: tuple[str, ...], model: str, policy: str,
                 strategy: str, header_candidates: int) -> None:
        self.id = uuid.uuid4().hex[:20]
        self.request_id = request_id
        self.at = at
        self.recorded = recorded  # why it was recorded: ("requested",), ("sampled",) or both
        self.model = model
        self.policy = policy
        self.strategy = strategy
        self.stickiness: dict[str, Any] | None = None
        self.admission: dict[str, Any] | None = None
        self.alias: dict[str, Any] | None = None  # a request for a model alias: its target and how (routing/aliases.py)
        self.attempts: list[Attempt] = []
        self.attempts_omitted = 0
        self.status: int | None = None  # final HTTP status, once the response has ended
        self.duration_ms: float | None = None
        self.header_candidates = header_candidates

    @property
    def requested(self) -> bool:
        return "requested" in self.recorded

    def add(self, attempt: Attempt) -> Attempt:
        if len(self.attempts) < MAX_ATTEMPTS:
            self.attempts.append(attempt)
        else:
            self.attempts_omitted += 1
        return attempt

    def served_by(self) -> Attempt | None:
        """The attempt that answered or is answering; failing that the last one sent (every attempt failed);
        failing that the last one (none was sent: no candidate, no probe slot)."""
        for attempt in reversed(self.attempts):
            if attempt.status is not None or attempt.outcome in ("sent", "answered"):
                return attempt
        for attempt in reversed(self.attempts):
            if attempt.outcome not in NOT_SENT:
                return attempt
        return self.attempts[-1] if self.attempts else None

    def to_dict(self, candidates: int | None = None) -> dict[str, Any]:
        """The full record (candidates: per attempt, at most this many; None: all that were kept)."""
        served = self.served_by()
        return _clean({
            "decision_id": self.id,
            "request_id": self.request_id,
            "time": _iso(self.at),
            "recorded": list(self.recorded),
            "model": self.model,
            "policy": self.policy,
            "strategy": self.strategy,
            "alias": self.alias,
            "endpoint": served.endpoint if served else None,
            "reason": served.reason if served else "no_attempt",
            "why": summarise(served) if served else "no attempt: the request never reached the picker",
            "status": self.status,
            "duration_ms": self.duration_ms,
            "stickiness": self.stickiness,
            "admission": self.admission,
            "attempts": [a.to_dict(candidates) for a in self.attempts],
            "attempts_omitted": self.attempts_omitted,
            "pid": os.getpid(),  # with workers > 1, the process whose ring holds the record
        })

    def explanation(self) -> dict[str, Any]:
        """What the response header carries: the decision in short, every attempt's summary, and the last
        attempt's pool, exclusions, detail, sample and top candidates."""
        served = self.served_by()
        out: dict[str, Any] = {
            "decision_id": self.id,
            "policy": self.policy,
            "strategy": self.strategy,
            "endpoint": served.endpoint if served else None,
            "reason": served.reason if served else "no_attempt",
            "why": summarise(served) if served else "no attempt: the request never reached the picker",
        }
        if self.alias is not None:
            out["alias"] = self.alias
        if self.stickiness is not None:
            out["stickiness"] = self.stickiness
        if self.admission is not None:
            out["admission"] = self.admission
        out["attempts"] = [a.summary() for a in self.attempts]
        if served is not None:
            last = served.to_dict(self.header_candidates)
            for key in ("pool", "excluded", "detail", "sampled", "candidates", "candidates_omitted"):
                if key in last:
                    out[key] = last[key]
        return _clean(out)

    def header_value(self) -> str:
        """`explanation()` as compact ASCII JSON of at most MAX_HEADER_BYTES: candidates are dropped from the
        end (counted in candidates_omitted), then the detail, until it fits. Client-supplied text never
        appears in it unescaped (ASCII escapes, no control characters)."""
        out = self.explanation()
        text = _compact(out)
        candidates = out.get("candidates", [])
        while len(text) > MAX_HEADER_BYTES and candidates:
            candidates.pop()
            out["candidates_omitted"] = out.get("candidates_omitted", 0) + 1
            text = _compact(out)
        if len(text) > MAX_HEADER_BYTES:
            out.pop("detail", None)
            out["truncated"] = True
            text = _compact(out)
        if len(text) > MAX_HEADER_BYTES:  # a pathological pool report or exclusion list: the short form
            text = _compact({"decision_id": self.id, "endpoint": out["endpoint"], "reason": out["reason"],
                             "truncated": True})
        return text

    def headers(self) -> dict[str, str]:
        return {EXPLANATION_HEADER: self.header_value(), DECISION_ID_HEADER: self.id}

    def matches(self, *, model: str | None, endpoint: str | None, policy: str | None, reason: str | None) -> bool:
        if model is not None and self.model != model:
            return False
        if policy is not None and self.policy != policy:
            return False
        if endpoint is not None and not any(a.endpoint == endpoint for a in self.attempts):
            return False
        if reason is not None:
            served = self.served_by()
            if served is None or served.reason != reason:
                return False
        return True


def _compact(value: Any) -> str:
    """Compact JSON in ASCII (header values must be): orjson, or the standard library's escaping in the rare
    case a value holds non-ASCII text (orjson escapes control characters itself, as JSON requires)."""
    text = orjson.dumps(value, default=str).decode()
    return text if text.isascii() else json.dumps(value, separators=(",", ":"), ensure_ascii=True, default=str)


def _clean(value: Any) -> Any:
    """Floats rounded for reading (loads, scores, ages); the trace itself keeps the exact values. Exact type
    checks, not isinstance: this walks every value of a record, and bools and ints pass through as they are."""
    kind = type(value)
    if kind is float:
        return round(value, 4) if math.isfinite(value) else str(value)
    if kind is dict:
        return {k: _clean(v) for k, v in value.items()}
    if kind is list or kind is tuple:
        return [_clean(v) for v in value]
    return value


def _iso(at: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(at)) + f".{int(at % 1 * 1000):03d}Z"


class DecisionLog:
    """Who gets explained, the ring of recent decisions, their log lines and counters."""

    def __init__(self, settings: ExplainSettings, metrics: RouterMetrics, *, permission: Permission | None = None,
                 rng: random.Random | None = None, wall: Callable[[], float] = time.time) -> None:
        self._metrics = metrics
        self._permission = permission
        # Its own random source: drawing samples must not shift the pickers' seeded sequences.
        self._rng = rng or random.Random()
        self._wall = wall
        self._recent: deque[Decision] = deque(maxlen=settings.recent)
        self._explained = metrics.explain_requests.labels("explained")
        self._denied = metrics.explain_requests.labels("denied")
        self.settings = settings
        self._rate = settings.sample_rate

    def configure(self, settings: ExplainSettings) -> None:
        """Apply a reloaded `explain:` block; the newest decisions are kept up to the new bound."""
        if settings.recent != self._recent.maxlen:
            self._recent = deque(self._recent, maxlen=settings.recent)
            self._metrics.decisions_kept.set(len(self._recent))
        self.settings = settings
        self._rate = settings.sample_rate

    def begin(self, headers: Mapping[str, str], request_id: str, model: str, policy: str,
              strategy: str) -> Decision | None:
        """A new record if this request is to be explained (asked for and allowed, or sampled), else None.
        The request path's whole cost when nobody asks and sampling is off: one header lookup."""
        asked = headers.get(EXPLAIN_HEADER)
        requested = False
        if asked is not None:
            requested = self._permission is not None and self._permission(asked, headers.get("Authorization"))
            (self._explained if requested else self._denied).inc()
        sampled = self._rate > 0.0 and self._rng.random() < self._rate
        if not (requested or sampled):
            return None
        recorded = (("requested", "sampled") if requested and sampled else ("requested",) if requested
                    else ("sampled",))
        if sampled:
            self._metrics.decisions_sampled.inc()
        decision = Decision(request_id=request_id, at=self._wall(), recorded=recorded, model=model, policy=policy,
                            strategy=strategy, header_candidates=self.settings.header_candidates)
        if self._recent.maxlen:
            self._recent.append(decision)  # kept from the start: its id may be looked up while it streams
            self._metrics.decisions_kept.set(len(self._recent))
        return decision

    def finish(self, decision: Decision, status: int, duration: float) -> None:
        """The response has ended: note how, and write the decision's log line."""
        decision.status = status
        decision.duration_ms = round(duration * 1000, 3)
        if log.isEnabledFor(logging.INFO):
            log.info("routing decision", extra=decision.to_dict(self.settings.header_candidates))

    def find(self, decision_id: str) -> Decision | None:
        for decision in self._recent:
            if decision.id == decision_id:
                return decision
        return None

    def recent(self, *, model: str | None = None, endpoint: str | None = None, policy: str | None = None,
               reason: str | None = None, limit: int = 50) -> list[Decision]:
        """Newest first, those matching every filter given."""
        out: list[Decision] = []
        for decision in reversed(self._recent):
            if len(out) >= limit:
                break
            if decision.matches(model=model, endpoint=endpoint, policy=policy, reason=reason):
                out.append(decision)
        return out

    def __len__(self) -> int:
        return len(self._recent)

