"""The routing core: one request description in, one endpoint out, and the rule for judging its outcome.

Two data paths call it: the aiohttp proxy (router/server/handlers.py), which forwards the bytes itself, and the
ext_proc endpoint picker (router/gateway/), which tells Envoy where to send them. Neither the core nor any
policy knows which one called: both build the same `RequestInfo` from the parsed body and headers, estimate
its cost, look up its session pin, and pick through the balancer (stickiness first, then the policy). What is
the data path's own (reading the body, forwarding, retries, how a refusal reaches the client) stays there.

Refusals are OpenAI-shaped `web.Response`s (router/runtime/errors.py): the proxy sends them as they are, the endpoint
picker copies their status, headers and body into an ImmediateResponse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from router.config.settings import PolicySpec
from router.model import EndpointView, RequestInfo
from router.routing.aliases import Choice
from router.routing.aliases import choose as choose_target
from router.routing.cost import CostEstimate, CostSettings
from router.routing.policies.base import DecisionTrace
from router.routing.policies.consistent_hash import load_bound
from router.routing.sticky import StickyTable
from router.runtime.errors import clip, error_response
from router.server.context import RouterContext
from router.traffic.tenants import Tenant

# Costs are estimated with the defaults for policies without a `cost:` block once tenants are configured: a
# tenant's tokens, budgets and fair share are all counted in them.
TENANT_COST = CostSettings()
MAX_LISTED_MODELS = 20  # models a model_not_found message lists
# Outcomes that count against an endpoint (a client disconnect does not).
FAILURE_KINDS = frozenset({"timeout", "idle_timeout", "total_timeout", "disconnect", "invalid_response", "stalled"})


def reject(ctx: RouterContext, status: int, message: str, *, code: str, param: str | None = None,
           headers: dict[str, str] | None = None) -> web.Response:
    """The router's own refusal, counted by reason."""
    ctx.metrics.rejected.labels(code).inc()
    return error_response(status, message, code=code, param=param, headers=headers)


def no_endpoint(ctx: RouterContext, model: str) -> web.Response:
    return reject(ctx, 503, f"no healthy endpoint is serving model `{model}` right now", code="no_endpoint",
                  headers={"Retry-After": "1"})


def requested_model(ctx: RouterContext, payload: Any) -> str | web.Response:
    """The model a parsed body asks for, or the 400 that says what is wrong with the body."""
    if not isinstance(payload, dict):
        return reject(ctx, 400, "request body must be a JSON object", code="invalid_json")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        message = "you must provide a model parameter" if model is None else "model must be a non-empty string"
        return reject(ctx, 400, message, code="missing_model", param="model")
    return model


def unknown_model(ctx: RouterContext, model: str) -> web.Response | None:
    """None when the fleet serves the model, else its 404 listing (a bounded number of) the models served."""
    balancer = ctx.balancer
    if balancer.serves(model):
        return None
    models = balancer.models()
    available = ", ".join(models[:MAX_LISTED_MODELS]) or "none"
    if len(models) > MAX_LISTED_MODELS:
        available += f" and {len(models) - MAX_LISTED_MODELS} more (GET /v1/models)"
    return reject(ctx, 404, f"The model `{clip(model)}` does not exist. Available models: {available}",
                  code="model_not_found", param="model")


def resolve_alias(ctx: RouterContext, model: str, request_id: str, headers: Mapping[str, str],
                  payload: dict[str, Any]) -> Choice | web.Response | None:
    """None when `model` is no alias; else the target the request goes to (router/routing/aliases.py), counted, or the
    503 when no endpoint serves any of the alias's targets."""
    entry = ctx.balancer.aliases.get(model)
    if entry is None:
        return None
    alias = entry.alias
    session = None
    if alias.sticky:  # the defining policy's session key, digested as session pins are (router/routing/sticky.py)
        session = entry.stickiness.session(RequestInfo(model=model, request_id=request_id, headers=headers,
                                                       body=payload))
    choice = choose_target(alias, session=session, rng=ctx.rng, serves=ctx.balancer.serves)
    if choice.unserved is not None:
        ctx.metrics.alias_unserved.labels(alias.name, choice.unserved).inc()
    if choice.target is None:
        return no_endpoint(ctx, model)
    ctx.metrics.alias_requests.labels(alias.name, choice.target).inc()
    return choice


@dataclass
class Described:
    """A request as the core sees it: its description for the policy, its policy, and its estimated cost."""

    info: RequestInfo
    spec: PolicySpec
    estimate: CostEstimate | None = None  # policies (or tenancy) that estimate request costs (router/routing/cost.py)
    cost_settings: CostSettings | None = None

    @property
    def cost(self) -> float:
        return self.estimate.cost.total if self.estimate is not None else 0.0


def describe(ctx: RouterContext, model: str, request_id: str, headers: Mapping[str, str], payload: dict[str, Any],
             path: str, *, tenant: Tenant | None = None) -> Described:
    """The request's `RequestInfo`, with its predicted cost when its policy (or tenancy) estimates costs."""
    info = RequestInfo(model=model, request_id=request_id, headers=headers, body=payload)
    spec = ctx.balancer.policy_for(model)
    cost_settings = spec.cost or (TENANT_COST if tenant is not None else None)
    if cost_settings is None:
        return Described(info, spec)
    estimate = ctx.cost.estimate(info, path, cost_settings)  # microseconds
    info = RequestInfo(model=model, request_id=request_id, headers=headers, body=payload, cost=estimate.cost)
    return Described(info, spec, estimate, cost_settings)


def failed(status: int, error: str | None) -> bool:
    """Does an answered attempt count against its endpoint (outlier detection, breakers)?"""
    return status >= 500 or error in FAILURE_KINDS


# ---- stickiness and the pick ---------------------------------------------------------------------------


@dataclass
class Pin:
    """A request's session and the endpoint its session is pinned to (None: not pinned yet)."""

    table: StickyTable
    session: str
    pinned: str | None
    outcome: str | None = None


async def session_pin(ctx: RouterContext, policy: str, info: RequestInfo) -> Pin | None:
    table = ctx.sticky.get(policy)
    if table is None:
        return None
    session = table.settings.session(info)
    if session is None:
        return None
    return Pin(table, session, await table.lookup(session))


def choose(ctx: RouterContext, info: RequestInfo, tried: frozenset[str], pin: Pin | None,
           trace: DecisionTrace | None = None) -> EndpointView | None:
    """The session's pinned endpoint while it may take the request, else the policy's pick (re-pinned)."""
    if pin is not None and pin.pinned is not None and pin.pinned not in tried:
        view, outcome = ctx.balancer.sticky_candidate(info.model, pin.pinned, pin.table.settings.max_load_factor)
        if pin.outcome is None:
            pin.outcome = outcome
            ctx.metrics.sticky_decisions.labels(pin.table.policy, outcome).inc()
        if trace is not None:
            explain_pin(ctx, info.model, pin.pinned, outcome, pin.table.settings.max_load_factor, trace)
        if view is not None:
            pin.table.pin(pin.session, view.id)
            ctx.balancer.observe(info, view)
            if trace is not None:
                trace.reason = "sticky_hit"  # the policy was not asked: the session keeps its endpoint
                ctx.balancer.annotate(info.model, trace, tried)
            return view
    view = ctx.balancer.pick(info, tried) if trace is None else ctx.balancer.pick(info, tried, trace)
    if pin is not None and view is not None:
        if pin.outcome is None:
            pin.outcome = "new"
            ctx.metrics.sticky_decisions.labels(pin.table.policy, "new").inc()
        pin.table.pin(pin.session, view.id)
    return view


def explain_pin(ctx: RouterContext, model: str, pinned: str, outcome: str, factor: float,
                trace: DecisionTrace) -> None:
    """The pinned endpoint's side of the sticky check: its load and the bound it was held to."""
    pool = ctx.balancer.candidates(model)
    if any(v.id == pinned for v in pool):
        trace.note(pinned, sticky=outcome, cluster_in_flight=ctx.loads.cluster_in_flight(pinned),
                   sticky_bound=load_bound(pool, ctx.loads, factor))
    trace.detail["sticky"] = {"pinned": pinned, "outcome": outcome}
