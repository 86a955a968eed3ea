"""The retry layer: pick an endpoint, forward, and on a failure that left nothing with the client, try another.

What bounds the attempts of one request (Envoy's retry policy, tower's Retry):
- **exclusions**: an endpoint that failed this request is not picked again, nor one whose half-open breaker
  had no probe slot free; admission adds those at capacity (router/traffic/admission.py);
- **the policy's `retries.attempts`**, counting every endpoint tried;
- **the retry budget** (router/routing/retry_budget.py): a retry is sent only while retries stay under
  `budgetPercent` of requests (or `minRetriesPerSecond`), and a failure is passed through rather than turned
  into a retry when none could follow (`retryable`, told to the proxy before the attempt);
- **the deadline** (`timeouts.total`): no attempt starts with less than MIN_ATTEMPT_SECONDS left;
- **probe slots**: a half-open breaker's slot taken for an attempt is given back whatever became of it.

Every attempt is recorded for an explained request (router/server/explain.py) and traced (router/server/
tracing.py); for a request that is neither, the record is `UNRECORDED`, which keeps nothing, so the loop never
asks whether the request is explained.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from router.model import EndpointView
from router.routing.output_tokens import OutputCounter
from router.routing.policies.base import MAX_LISTED, DecisionTrace
from router.runtime.errors import error_response
from router.server.explain import Attempt, Decision
from router.server.proxy import UpstreamFailed, UpstreamRescued
from router.server.route import Described, Pin, choose, failed, no_endpoint
from router.server.served import Served

if TYPE_CHECKING:
    from router.server.context import RouterContext
    from router.traffic.admission import Pool

# Below this much time left before `timeouts.total`, no new attempt is started.
MIN_ATTEMPT_SECONDS = 0.05


class _Unrecorded:
    """The attempt record of a request that is not explained: what is written to it goes nowhere."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        pass


UNRECORDED: Any = _Unrecorded()


@dataclass
class Request:
    """What the retry layer needs of one request, as the stages before it left it."""

    http: web.Request
    request_id: str
    started: float  # perf_counter at arrival
    model: str
    body: bytes
    payload: dict[str, Any]
    described: Described
    pin: Pin | None
    admission: Pool | None


class Attempts:
    def __init__(self, ctx: RouterContext, req: Request, served: Served) -> None:
        self.ctx, self.req, self.served = ctx, req, served
        self.spec = req.described.spec
        self.tried: frozenset[str] = frozenset()  # endpoints that failed this request
        self.denied: frozenset[str] = frozenset()  # endpoints whose half-open breaker had no probe slot free
        self.failure: UpstreamFailed | None = None
        self.budget_refused = False  # the retry budget refused a retry after the current attempt
        self.picks = 0
        self.loop = asyncio.get_running_loop()
        # Deadlines are on the loop's clock (asyncio timeouts use it); `started` is on perf_counter.
        total = self.spec.timeouts.total
        self.deadline = self.loop.time() - (time.perf_counter() - req.started) + total if total else None

    async def run(self) -> web.StreamResponse:
        """The first answer an endpoint gave (passed through, success or not), else why there is none."""
        while len(self.tried) < self.spec.retries.attempts:
            view, record = self._pick()
            if view is None:
                break
            allowed, probe = self.ctx.balancer.acquire(self.spec, view.id)
            if not allowed:
                self.denied |= {view.id}
                record.outcome = "no_probe_slot"  # its breaker is half-open and every probe slot is taken
                continue
            reported = False  # a half-open probe slot must be given back whatever happens to the attempt
            try:
                if not self._may_send(record):
                    break
                response, reported = await self._send(view, record, probe)
                if response is not None:
                    return response
            finally:
                if probe and not reported:
                    self.ctx.balancer.release_probe(self.spec, view.id)
        if self.failure is not None:
            return failed_response(self.req.model, self.failure, self.tried)
        return no_endpoint(self.ctx, self.req.model)

    def _pick(self) -> tuple[EndpointView | None, Any]:
        """The policy's choice outside the exclusions, and the attempt's record (UNRECORDED if unexplained)."""
        req, trace, decision = self.req, self.served.trace, self.served.decision
        excluded = self.tried | self.denied
        if req.admission is not None:
            excluded = req.admission.exclude(excluded)
        # The picker explains itself to an explained request, and gives a traced one its reason (the pick span).
        why = DecisionTrace() if decision is not None or trace.recording else None
        trace.pick_began()
        view = choose(self.ctx, req.described.info, excluded, req.pin, why)
        self.picks += 1
        trace.picked(self.picks, self.spec.name, self.spec.strategy, view.id if view is not None else None,
                     why.reason if why is not None else "")
        if decision is None:
            return view, UNRECORDED
        return view, explain_attempt(self.ctx, decision, req.model, view, why, self.tried, self.denied, excluded,
                                     req.pin)

    def _may_send(self, record: Any) -> bool:
        """Whether this attempt may go: the first always; a retry while time and the retry budget allow."""
        ctx, retries = self.ctx, self.spec.retries
        if not self.tried:
            ctx.retry_budget.request_started()
        elif self.deadline is not None and self.loop.time() > self.deadline - MIN_ATTEMPT_SECONDS:
            record.outcome = "not_sent_deadline"
            return False  # no time left for another attempt: answer with the last failure
        elif not ctx.retry_budget.try_spend(retries.budget_percent, retries.min_per_second):
            ctx.metrics.retry_budget_exhausted.labels(self.req.model).inc()
            record.outcome = "not_sent_retry_budget"
            return False
        else:
            ctx.metrics.retries.labels(self.req.model).inc()
        return True

    def _retryable(self, view: EndpointView) -> bool:
        """Whether a failure of this attempt becomes a retry (rather than the answer): only if one can follow."""
        ctx, retries, deadline = self.ctx, self.spec.retries, self.deadline
        retryable = (
            len(self.tried) + 1 < retries.attempts
            and ctx.balancer.has_alternative(self.req.model, self.tried | self.denied | {view.id})
            and (deadline is None or self.loop.time() < deadline - 2 * MIN_ATTEMPT_SECONDS)
        )
        if retryable and not ctx.retry_budget.allows(retries.budget_percent, retries.min_per_second):
            self.budget_refused = True  # counted if this attempt fails and is answered (`_send`)
            return False  # a failure of this attempt will be answered, not retried
        return retryable

    async def _send(self, view: EndpointView, record: Any, probe: bool) -> tuple[web.StreamResponse | None, bool]:
        """Forward to `view`: (the answer, or None to try another; whether the outcome went to its health)."""
        ctx, req, served, spec = self.ctx, self.req, self.served, self.spec
        served.attempts = len(self.tried) + 1
        served.endpoint = view.id
        self.budget_refused = False
        retryable = self._retryable(view)
        record.outcome = "sent"
        served.counter = OutputCounter() if served.estimate is not None and served.estimate.learns else None
        try:
            served.outcome = await ctx.proxy.forward(
                req.http, view, req.body, request_id=req.request_id, timeouts=spec.timeouts, started=req.started,
                retryable=retryable, deadline=self.deadline, cost=req.described.cost,
                prefill=req.described.info.note.prefill_tokens, streamed=req.payload.get("stream") is True,
                counter=served.counter, extra_headers=answer_headers(served), policy=spec.name,
                trace_headers=served.trace.attempt_began(served.attempts, view.id),
                on_first_byte=served.trace.first_byte if served.trace.recording else None,
            )
        except UpstreamFailed as exc:
            served.trace.attempt_ended(exc.kind, None)
            reported = False
            if isinstance(exc, UpstreamRescued):
                # Taken off an endpoint already judged (stalled, ejected, unhealthy): its health has its verdict,
                # and this request goes elsewhere like any retry (attempts, retry budget).
                ctx.metrics.child(ctx.metrics.rescued, req.model, exc.kind).inc()
            else:
                ctx.balancer.report_outcome(spec, req.model, view.id, False, exc.kind, probe=probe)
                reported = True
            self.tried |= {view.id}
            self.failure = exc
            record.outcome, record.error = exc.kind, str(exc)
            return None, reported
        outcome = served.outcome
        served.trace.attempt_ended(outcome.error or "answered", outcome.status)
        record.outcome, record.status = outcome.error or "answered", outcome.status
        if outcome.error == "client_disconnect":  # the client leaving says nothing about the endpoint
            return outcome.response, False
        bad = failed(outcome.status, outcome.error)
        if bad and self.budget_refused:  # a failure answered because the retry budget allowed no retry
            ctx.metrics.retry_budget_exhausted.labels(req.model).inc()
        ctx.balancer.report_outcome(spec, req.model, view.id, not bad, outcome.error or "http_5xx", probe=probe)
        return outcome.response, True


def answer_headers(served: Served) -> dict[str, str] | None:
    """Headers the answer carries before its first byte, streamed or not: the tenant's x-ratelimit-*, and an
    explanation asked for by the client."""
    headers = served.budget.headers if served.budget is not None and served.budget.headers else None
    decision = served.decision
    if decision is not None and decision.requested:
        headers = {**(headers or {}), **decision.headers()}
    return headers


def failed_response(model: str, failure: UpstreamFailed, tried: frozenset[str]) -> web.Response:
    """Every endpoint tried failed before answering (or no retry was left): say so, with the last reason."""
    where = f"{len(tried)} endpoint(s) tried for model `{model}`; last: {failure}"
    if failure.kind in ("timeout", "stalled"):
        return error_response(504, f"no answer in time: {where}", code="upstream_timeout")
    if failure.kind in ("http_5xx", "disconnect", "invalid_response", "ejected", "health_check", "gpu_lost"):
        # ejected, health_check, gpu_lost: taken off (rescue); disconnect: it closed without answering
        return error_response(502, f"upstream error: {where}", code="upstream_error")
    return error_response(502, f"could not connect: {where}", code="upstream_unreachable")


def explain_attempt(ctx: RouterContext, decision: Decision, model: str, view: EndpointView | None,
                    trace: DecisionTrace | None, tried: frozenset[str], denied: frozenset[str],
                    excluded: frozenset[str], pin: Pin | None) -> Attempt:
    """Record one pick: why each excluded endpoint was out of this attempt, the pool, and stickiness."""
    reasons = {}
    for endpoint_id in sorted(excluded)[:MAX_LISTED]:  # bounded: a retry storm on a big fleet stays small
        reasons[endpoint_id] = ("failed_attempt" if endpoint_id in tried else
                                "no_probe_slot" if endpoint_id in denied else "at_capacity")
    if len(excluded) > MAX_LISTED:
        reasons["(more)"] = f"{len(excluded) - MAX_LISTED} more"
    if pin is not None:
        decision.stickiness = {"session": True, "pinned": pin.pinned, "outcome": pin.outcome}
    return decision.add(Attempt(view.id if view is not None else None, trace, reasons, ctx.balancer.pool_report(model)))
