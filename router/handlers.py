"""HTTP handlers: the OpenAI-compatible ingress (`/v1/*`) and the admin surface (`/metrics`, probes,
`/admin/*`).

One inference request: check the size, parse the JSON, check the model, pick an endpoint through the
model's policy, forward and stream (`proxy`), then count and log it. A connection failure (the request
never left) is retried on another endpoint, up to the policy's `retries.attempts`. Every error the
router produces itself is in the OpenAI shape (`errors`), and every unexpected exception becomes a 500 in
that shape plus a log line, never a stack trace to the client.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import orjson
from aiohttp import web

from router.context import CONTEXT, RouterContext
from router.errors import error_response
from router.model import EndpointState, EndpointView, RequestInfo
from router.proxy import Outcome, UpstreamFailed
from router.sticky import StickyTable

log = logging.getLogger("fleetroute.handlers")

INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


def _reject(ctx: RouterContext, status: int, message: str, *, code: str, param: str | None = None,
            headers: dict[str, str] | None = None) -> web.Response:
    ctx.metrics.rejected.labels(code).inc()
    return error_response(status, message, code=code, param=param, headers=headers)


@dataclass
class Served:
    """What became of one inference request, filled in as it progresses (for metrics and the access log)."""

    response: web.StreamResponse | None = None
    model: str = ""  # a model the fleet serves (metric label: never arbitrary client input)
    requested_model: str = ""
    endpoint: str = ""  # the endpoint of the latest attempt
    outcome: Outcome | None = None  # set once an endpoint answered
    attempts: int = 0
    failure: BaseException | None = None  # what interrupted the handler, if anything

    @property
    def status(self) -> int:
        # 499 (nginx's "client closed request") when the client left before the end of the answer.
        if isinstance(self.failure, asyncio.CancelledError):
            return 499
        if self.failure is not None:
            return 500
        if self.outcome is not None:
            return 499 if self.outcome.error == "client_disconnect" else self.outcome.status
        return self.response.status if self.response is not None else 500


async def inference(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    # perf_counter, not loop.time(): uvloop's clock has millisecond resolution, too coarse for TTFB.
    started = time.perf_counter()
    request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
    served = Served()
    try:
        await _serve(request, ctx, request_id, started, served)
        assert served.response is not None
        return served.response
    except BaseException as exc:
        served.failure = exc
        raise
    finally:
        _record(ctx, request, request_id, served, time.perf_counter() - started)


def _record(ctx: RouterContext, request: web.Request, request_id: str, served: Served, duration: float) -> None:
    outcome = served.outcome
    endpoint = served.endpoint
    status = served.status
    metrics = ctx.metrics
    metrics.child(metrics.requests, served.model, endpoint, str(status)).inc()
    if endpoint:
        metrics.child(metrics.request_duration, served.model, endpoint).observe(duration)
        if outcome is not None and outcome.ttfb is not None:
            metrics.child(metrics.time_to_first_byte, served.model, endpoint).observe(outcome.ttfb)
    if ctx.settings.access_log:
        ctx.access_log.write(
            {
                "request_id": request_id,
                "method": request.method,
                "path": request.path,
                "model": served.requested_model,
                "endpoint": endpoint,
                "status": status,
                "attempts": served.attempts,
                "ttfb_ms": round(outcome.ttfb * 1000, 3) if outcome and outcome.ttfb is not None else None,
                "duration_ms": round(duration * 1000, 3),
                "upstream_error": outcome.error if outcome else None,
                "failure": type(served.failure).__name__ if served.failure else None,
                "client": request.remote,
            }
        )


async def _serve(request: web.Request, ctx: RouterContext, request_id: str, started: float, served: Served) -> None:
    limit = ctx.settings.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        served.response = _too_large(ctx, limit)
        return
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        served.response = _too_large(ctx, limit)
        return
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        served.response = _reject(ctx, 400, f"request body is not valid JSON: {exc}", code="invalid_json")
        return
    if not isinstance(payload, dict):
        served.response = _reject(ctx, 400, "request body must be a JSON object", code="invalid_json")
        return
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        message = "you must provide a model parameter" if model is None else "model must be a non-empty string"
        served.response = _reject(ctx, 400, message, code="missing_model", param="model")
        return
    served.requested_model = model  # for the access log; metric labels only ever carry served models
    balancer = ctx.balancer
    if not balancer.serves(model):
        available = ", ".join(balancer.models()) or "none"
        served.response = _reject(
            ctx, 404, f"The model `{model}` does not exist. Available models: {available}",
            code="model_not_found", param="model",
        )
        return
    served.model = model
    info = RequestInfo(model=model, request_id=request_id, headers=request.headers, body=payload)
    spec = balancer.policy_for(model)
    pin = await _session_pin(ctx, spec.name, info)
    # Admission (router/admission.py): None unless the policy caps endpoint concurrency. No await may come
    # between `admit` and the forward below, which is what marks the admitted request in flight.
    admission = ctx.admission.pool(spec, model)
    if admission is not None and (shed := await admission.admit(request_id, request.headers)) is not None:
        served.response = shed
        return
    tried: frozenset[str] = frozenset()  # endpoints that failed this request
    denied: frozenset[str] = frozenset()  # endpoints whose half-open breaker had no probe slot free
    failure: UpstreamFailed | None = None
    retries = spec.retries
    # Deadlines are on the loop's clock (asyncio timeouts use it); `started` is on perf_counter.
    total = spec.timeouts.total
    deadline = asyncio.get_running_loop().time() - (time.perf_counter() - started) + total if total else None
    loop = asyncio.get_running_loop()
    while len(tried) < retries.attempts:
        view = _choose(ctx, info, tried | denied if admission is None else admission.exclude(tried | denied), pin)
        if view is None:
            break
        allowed, probe = balancer.acquire(spec, view.id)
        if not allowed:
            denied |= {view.id}
            continue
        reported = False  # a half-open probe slot must be given back whatever happens to the attempt
        try:
            if not tried:
                ctx.retry_budget.request_started()
            elif deadline is not None and loop.time() > deadline - MIN_ATTEMPT_SECONDS:
                break  # no time left for another attempt: answer with the last failure
            elif not ctx.retry_budget.try_spend(retries.budget_percent, retries.min_per_second):
                ctx.metrics.retry_budget_exhausted.labels(model).inc()
                break
            else:
                ctx.metrics.retries.labels(model).inc()
            served.attempts = len(tried) + 1
            served.endpoint = view.id
            # A failure is turned into a retry (rather than passed through) only if one can really follow.
            retryable = (
                len(tried) + 1 < retries.attempts
                and balancer.has_alternative(model, tried | denied | {view.id})
                and (deadline is None or loop.time() < deadline - 2 * MIN_ATTEMPT_SECONDS)
            )
            if retryable and not ctx.retry_budget.allows(retries.budget_percent, retries.min_per_second):
                retryable = False  # a failure of this attempt will be answered, not retried
                ctx.metrics.retry_budget_exhausted.labels(model).inc()
            try:
                served.outcome = await ctx.proxy.forward(
                    request, view, body, request_id=request_id, timeouts=spec.timeouts, started=started,
                    retryable=retryable, deadline=deadline,
                )
            except UpstreamFailed as exc:
                balancer.report_outcome(spec, model, view.id, False, exc.kind, probe=probe)
                reported = True
                tried |= {view.id}
                failure = exc
                continue
            outcome = served.outcome
            if outcome.error != "client_disconnect":  # the client leaving says nothing about the endpoint
                failed = outcome.status >= 500 or outcome.error in FAILURE_KINDS
                balancer.report_outcome(spec, model, view.id, not failed, outcome.error or "http_5xx", probe=probe)
                reported = True
            served.response = outcome.response
            return
        finally:
            if probe and not reported:
                balancer.release_probe(spec, view.id)
    if failure is not None:
        served.response = _failed_response(model, failure, tried)
        return
    served.response = _reject(
        ctx, 503, f"no healthy endpoint is serving model `{model}` right now", code="no_endpoint",
        headers={"Retry-After": "1"},
    )


# Below this much time left before `timeouts.total`, no new attempt is started.
MIN_ATTEMPT_SECONDS = 0.05
# Outcomes that count against an endpoint (a client disconnect does not).
FAILURE_KINDS = frozenset({"timeout", "idle_timeout", "total_timeout", "disconnect"})


def _failed_response(model: str, failure: UpstreamFailed, tried: frozenset[str]) -> web.Response:
    """Every endpoint tried failed before answering (or no retry was left): say so, with the last reason."""
    where = f"{len(tried)} endpoint(s) tried for model `{model}`; last: {failure}"
    if failure.kind == "timeout":
        return error_response(504, f"no answer in time: {where}", code="upstream_timeout")
    if failure.kind == "http_5xx":
        return error_response(502, f"upstream error: {where}", code="upstream_error")
    return error_response(502, f"could not connect: {where}", code="upstream_unreachable")


@dataclass
class _Pin:
    """A request's session and the endpoint its session is pinned to (None: not pinned yet)."""

    table: StickyTable
    session: str
    pinned: str | None
    outcome: str | None = None


async def _session_pin(ctx: RouterContext, policy: str, info: RequestInfo) -> _Pin | None:
    table = ctx.sticky.get(policy)
    if table is None:
        return None
    session = table.settings.session(info)
    if session is None:
        return None
    return _Pin(table, session, await table.lookup(session))


def _choose(ctx: RouterContext, info: RequestInfo, tried: frozenset[str], pin: _Pin | None) -> EndpointView | None:
    """The session's pinned endpoint while it may take the request, else the policy's pick (re-pinned)."""
    if pin is not None and pin.pinned is not None and pin.pinned not in tried:
        view, outcome = ctx.balancer.sticky_candidate(info.model, pin.pinned, pin.table.settings.max_load_factor)
        if pin.outcome is None:
            pin.outcome = outcome
            ctx.metrics.sticky_decisions.labels(pin.table.policy, outcome).inc()
        if view is not None:
            pin.table.pin(pin.session, view.id)
            return view
    view = ctx.balancer.pick(info, tried)
    if pin is not None and view is not None:
        if pin.outcome is None:
            pin.outcome = "new"
            ctx.metrics.sticky_decisions.labels(pin.table.policy, "new").inc()
        pin.table.pin(pin.session, view.id)
    return view


def _too_large(ctx: RouterContext, limit: int) -> web.Response:
    return _reject(ctx, 413, f"request body exceeds the limit of {limit} bytes", code="body_too_large")


async def list_models(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "fleetroute"} for m in ctx.balancer.models()]
    return web.json_response({"object": "list", "data": data}, dumps=lambda o: orjson.dumps(o).decode())


@web.middleware
async def openai_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turn aiohttp's routing errors and any unexpected exception into OpenAI-shaped errors."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return _reject(
            request.app[CONTEXT], 405, f"method {request.method} is not allowed on {request.path} (allowed: {allowed})",
            code="method_not_allowed", headers={"Allow": allowed},
        )
    except web.HTTPNotFound:
        return _reject(request.app[CONTEXT], 404, f"no such route: {request.method} {request.path}", code="not_found")
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error", extra={"path": request.path})
        return error_response(500, "internal router error; see the router log", code="internal_error")


# ---- admin -------------------------------------------------------------------------------------------


async def metrics(request: web.Request) -> web.Response:
    body = request.app[CONTEXT].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    if ctx.draining:
        return web.json_response({"status": "draining"}, status=503)
    if not ctx.started:
        return web.json_response({"status": "starting"}, status=503)
    return web.json_response({"status": "ready", "endpoints": len(ctx.balancer.snapshot.views)})


async def list_endpoints(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    now = ctx.clock()
    out = []
    for view in ctx.balancer.snapshot.views:
        t = view.telemetry
        out.append(
            {
                "id": view.id,
                "url": view.endpoint.url,
                "models": list(view.endpoint.models),
                "state": view.state.value,
                "in_flight": ctx.loads.in_flight(view.id),
                "health": ctx.balancer.health_report(view.id),
                "telemetry": None if t is None else {
                    "source": t.source,
                    "age_s": round(now - t.reported_at, 3),
                    "gpu_util": t.gpu_util,
                    "gpu_mem_util": t.gpu_mem_util,
                    "kv_cache_usage": t.kv_cache_usage,
                    "num_waiting": t.num_waiting,
                    "num_running": t.num_running,
                },
            }
        )
    return web.json_response({"endpoints": out, "snapshot_version": ctx.balancer.snapshot.version})


def _set_state(state: EndpointState) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        ctx = request.app[CONTEXT]
        endpoint_id = request.match_info["id"]
        if not ctx.balancer.set_state(endpoint_id, state):
            return error_response(404, f"unknown endpoint {endpoint_id!r}", code="endpoint_not_found")
        return web.json_response({"id": endpoint_id, "state": state.value})

    return handler


def add_ingress_routes(app: web.Application) -> None:
    for path in INFERENCE_PATHS:
        app.router.add_post(path, inference)
    app.router.add_get("/v1/models", list_models)


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/admin/endpoints", list_endpoints)
    app.router.add_post("/admin/endpoints/{id}/drain", _set_state(EndpointState.DRAINING))
    app.router.add_post("/admin/endpoints/{id}/resume", _set_state(EndpointState.SERVING))
