"""HTTP handlers: the OpenAI-compatible ingress (`/v1/*`) and the admin surface (`/metrics`, probes,
`/admin/*`).

One inference request: read the body (router/server/request_body.py: size, timeout, encodings, `Expect`), parse the
JSON, check the model, name its tenant (router/traffic/tenants.py, with a `tenancy:` block), estimate its cost when
the model's policy does or tenants are configured (router/routing/cost.py), check its tenant's budgets
(router/traffic/budgets.py), queue it when its pool is saturated (router/traffic/admission.py), pick an endpoint
through the policy, forward and stream (`proxy`), then count and log it, and teach the cost model the
answer's output tokens. A connection failure (the request never left) is retried on another endpoint, up
to the policy's `retries.attempts`. Every error the router produces itself is in the OpenAI shape (`errors`),
client input it quotes is clipped (`errors.clip`), and every unexpected exception becomes a 500 in that shape
plus a log line, never a stack trace to the client.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson
from aiohttp import web

from router.config.redaction import redact_url
from router.model import EndpointState
from router.routing.cost import relative_error
from router.runtime.errors import clip, error_response
from router.server.attempts import Attempts
from router.server.attempts import Request as AttemptsRequest
from router.server.connections import ClientConnection
from router.server.context import CONTEXT, RouterContext
from router.server.explain import Decision
from router.server.request_body import BodyRejected, expect_handler, read_body
from router.server.route import (
    Described,
    Pin,
    describe,
    reject,
    requested_model,
    resolve_alias,
    session_pin,
    unknown_model,
)
from router.server.served import Served
from router.traffic.admission import AdmissionSettings, Pool

log = logging.getLogger("fleetroute.handlers")

INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
# A client's X-Request-Id is kept (it is forwarded, returned and logged) only when it looks like an id: at most
# 128 characters, none that could break a log line or a header. Anything else is replaced by a generated one.
REQUEST_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/+=@-]{0,127}$")


async def inference(request: web.Request) -> web.StreamResponse:
    ctx = request.app[CONTEXT]
    # perf_counter, not loop.time(): uvloop's clock has millisecond resolution, too coarse for TTFB.
    started = time.perf_counter()
    request_id = request_id_of(request)
    served = Served(trace=ctx.tracing.begin(request.headers, request.method, request.path, request_id))
    try:
        await _serve(request, ctx, request_id, started, served)
        assert served.response is not None
        decision = served.decision
        if not served.response.prepared:  # the router's own answer (shed, no endpoint...)
            if decision is not None and decision.requested:
                served.response.headers.update(decision.headers())
            if served.budget is not None:
                served.response.headers.update(served.budget.headers)  # x-ratelimit-*, as on every answer
        return served.response
    except BaseException as exc:
        served.failure = exc
        raise
    finally:
        _record(ctx, request, request_id, served, time.perf_counter() - started)


def request_id_of(request: web.Request) -> str:
    """The client's X-Request-Id when it is a plausible id, else a new one."""
    given = request.headers.get("x-request-id")
    return given if given and REQUEST_ID.match(given) else uuid.uuid4().hex


def _record(ctx: RouterContext, request: web.Request, request_id: str, served: Served, duration: float) -> None:
    outcome = served.outcome
    endpoint = served.endpoint
    status = served.status
    metrics = ctx.metrics
    metrics.child(metrics.requests, served.model, endpoint, str(status)).inc()
    trace_id = served.trace.trace_id  # None unless traced and sampled
    if endpoint:
        metrics.child(metrics.request_duration, served.model, endpoint).observe(duration)
        if outcome is not None and outcome.ttfb is not None:
            # A traced request's TTFT carries its trace id (an exemplar): a slow bucket links to a trace.
            metrics.child(metrics.time_to_first_byte, served.model, endpoint).observe(
                outcome.ttfb, {"trace_id": trace_id} if trace_id is not None else None)
        if outcome is not None:  # the status page's per-endpoint rates and latencies (router/server/status/history.py)
            ctx.status_history.finished(endpoint, status=status, ttfb=outcome.ttfb, duration=duration,
                                        chunks=outcome.chunks,
                                        streamed=outcome.chunks > 1
                                        and outcome.response.content_type == "text/event-stream")
    learned = _learn_cost(ctx, served, status) if served.estimate is not None else None
    if served.tenant is not None:
        _count_completion(ctx, served, learned)
    if served.decision is not None:
        ctx.decisions.finish(served.decision, status, duration)
    if served.trace.recording:
        _end_trace(served, status, learned)
    if ctx.settings.access_log:
        fields = {
            "request_id": request_id,
            "method": request.method,
            "path": request.path,
            "model": clip(served.requested_model),
            "endpoint": endpoint,
            "status": status,
            "attempts": served.attempts,
            "ttfb_ms": round(outcome.ttfb * 1000, 3) if outcome and outcome.ttfb is not None else None,
            "duration_ms": round(duration * 1000, 3),
            "upstream_error": outcome.error if outcome else None,
            "failure": type(served.failure).__name__ if served.failure else None,
            "client": ctx.forwarding.client(request),  # behind trusted proxies: the address they forwarded
        }
        if served.tenant is not None:
            fields["tenant"] = served.tenant.name
        if served.alias is not None:
            fields["alias_target"] = served.alias.target  # `model` is the alias the client asked for
        if trace_id is not None:
            fields["trace_id"] = trace_id
        if served.decision is not None:
            fields["decision_id"] = served.decision.id  # the routing record: /admin/decisions/{id}
        if served.estimate is not None:
            cost = served.estimate.cost
            fields["prompt_tokens_estimate"] = cost.prompt_tokens
            fields["predicted_output_tokens"] = round(cost.output_tokens, 1)
            fields["cost_tokens"] = round(cost.total, 1)
            if learned is not None:
                fields["output_tokens"], fields["output_tokens_source"] = learned
        ctx.access_log.write(fields)


def _end_trace(served: Served, status: int, learned: tuple[int | None, str] | None) -> None:
    outcome = served.outcome
    count = outcome.output if outcome is not None else None
    served.trace.end(status, {
        "gen_ai.request.model": served.model or None,
        "fleetroute.endpoint": served.endpoint or None,
        "fleetroute.attempts": served.attempts,
        "fleetroute.tenant": served.tenant.name if served.tenant is not None else None,
        "fleetroute.upstream_error": outcome.error if outcome is not None else None,
        "gen_ai.usage.input_tokens": count.prompt_tokens if count is not None else None,
        "gen_ai.usage.output_tokens": learned[0] if learned is not None else None,
    })


def _count_completion(ctx: RouterContext, served: Served, learned: tuple[int | None, str] | None) -> None:
    """A tenant's completion tokens: the answer's count when it was complete (`learned`), else the tokens a cut
    stream carried (a lower bound: the client read them); counted, and charged to its token budget."""
    tenant = served.tenant
    assert tenant is not None
    if learned is not None and learned[0] is not None:
        tokens = learned[0]
    elif served.counter is not None:
        tokens = served.counter.events()
    else:
        return
    if tokens > 0:
        ctx.metrics.child(ctx.metrics.tenant_tokens, tenant.name, "completion").inc(tokens)
        if ctx.budgets is not None:
            ctx.budgets.charge(tenant, tokens)


def _learn_cost(ctx: RouterContext, served: Served, status: int) -> tuple[int | None, str] | None:
    """Teach the predictor a request's actual output tokens and report its error; returns (tokens, outcome)
    for the access log, or None for requests without output (embeddings) or never sent to an endpoint."""
    estimate = served.estimate
    assert estimate is not None and served.cost_settings is not None
    if not estimate.learns:
        return None
    if not served.attempts:  # never sent (shed, no endpoint): nothing to learn, nothing to report
        return None
    metrics = ctx.metrics
    model = served.model
    outcome = served.outcome
    count = outcome.output if outcome is not None else None
    if count is None or status != 200:
        metrics.child(metrics.cost_outcomes, model, "incomplete").inc()
        return None, "incomplete"
    actual, source = ctx.cost.observed_output(model, count)
    metrics.child(metrics.cost_outcomes, model, source).inc()
    if actual is None:
        return None, source
    ctx.cost.learn(estimate, actual, count.prompt_tokens, served.cost_settings)
    predicted = estimate.cost.output_tokens
    metrics.child(metrics.cost_abs_error, model).observe(abs(predicted - actual))
    metrics.child(metrics.cost_relative_error, model).observe(relative_error(predicted, actual))
    metrics.child(metrics.cost_predicted_tokens, model).inc(predicted)
    metrics.child(metrics.cost_actual_tokens, model).inc(actual)
    predictor = ctx.cost.predictor(model)
    metrics.child(metrics.cost_sessions, model).set(len(predictor.sessions))
    if predictor.chars_per_token is not None:
        metrics.child(metrics.cost_chars_per_token, model).set(predictor.chars_per_token)
    return actual, source


async def _serve(request: web.Request, ctx: RouterContext, request_id: str, started: float, served: Served) -> None:
    """The request's stages in order; each either answers (sets `served.response`) or hands on to the next."""
    parsed = await _parse(request, ctx, request_id, served)
    if parsed is None:
        return
    described = await _classify(request, ctx, request_id, parsed, served)
    if described is None:
        return
    admitted = await _admit(request, ctx, request_id, described, served)
    if admitted is None:
        return
    # No await between admission and the first forward (Attempts.run): that is what marks the request in flight.
    model, payload, body = parsed
    pin, pool = admitted
    served.response = await Attempts(ctx, AttemptsRequest(request, request_id, started, model, body, payload,
                                                          described, pin, pool), served).run()


async def _parse(request: web.Request, ctx: RouterContext, request_id: str,
                 served: Served) -> tuple[str, dict[str, Any], bytes] | None:
    """Headers, body and JSON read, the model checked and an alias resolved: (model, payload, body) as the
    engine will see them, or None with the answer set."""
    bad_header = _undecodable_header(request)
    if bad_header is not None:
        served.response = reject(ctx, 400, f"header {clip(bad_header, 64)} holds bytes that are not UTF-8; the "
                                           "router forwards header values unchanged or not at all",
                                 code="invalid_header_value", param=clip(bad_header, 64))
        return None
    try:
        body = await read_body(request, limit=ctx.settings.max_body_bytes, timeout=ctx.settings.client_timeouts.body,
                               on_timeout=lambda: _body_timed_out(request))
    except BodyRejected as exc:
        ctx.metrics.rejected.labels(exc.code).inc()
        ctx.client_log.log(logging.INFO, (exc.code,), "request body refused", code=exc.code, reason=str(exc),
                           client=ctx.forwarding.client(request))
        served.response = exc.response
        return None
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        served.response = reject(ctx, 400, f"request body is not valid JSON: {exc}", code="invalid_json")
        return None
    model = requested_model(ctx, payload)
    if isinstance(model, web.Response):
        served.response = model
        return None
    served.requested_model = model  # for the access log; metric labels only ever carry served models
    aliased = resolve_alias(ctx, model, request_id, request.headers, payload)
    if isinstance(aliased, web.Response):
        served.response = aliased
        return None
    if aliased is not None:  # an alias: the request is now one for its target, and the engine is told so
        assert aliased.target is not None
        model, served.alias = aliased.target, aliased
        payload = {**payload, "model": model}
        body = orjson.dumps(payload)
    unknown = unknown_model(ctx, model)
    if unknown is not None:
        served.response = unknown
        return None
    served.model = model
    return model, payload, body


async def _classify(request: web.Request, ctx: RouterContext, request_id: str,
                    parsed: tuple[str, dict[str, Any], bytes], served: Served) -> Described | None:
    """The request's tenant, policy, cost estimate and explanation record; its tenant's budgets checked."""
    model, payload, _ = parsed
    tenancy = ctx.settings.tenancy
    tenant = served.tenant = tenancy.identify(request) if tenancy is not None else None
    described = describe(ctx, model, request_id, request.headers, payload, request.path, tenant=tenant)
    served.estimate, served.cost_settings = described.estimate, described.cost_settings
    spec = described.spec
    # None unless this request is explained (asked for by someone allowed to, or sampled): router/server/explain.py.
    decision = served.decision = ctx.decisions.begin(request.headers, request_id, model, spec.name, spec.strategy)
    if decision is not None and served.alias is not None:
        decision.alias = served.alias.to_dict()
    if tenant is not None and tenant.budgeted and ctx.budgets is not None:
        # Before the queue: the check awaits Redis, and nothing may await between admission and the forward.
        assert served.estimate is not None  # tenants always have estimates (TENANT_COST)
        verdict = served.budget = await ctx.budgets.check(tenant, served.estimate.cost.prompt_tokens, model)
        if verdict.response is not None:
            ctx.metrics.tenant_shed.labels(tenant.name, model, verdict.reason).inc()
            served.response = verdict.response
            return None
    return described


async def _admit(request: web.Request, ctx: RouterContext, request_id: str, described: Described,
                 served: Served) -> tuple[Pin | None, Pool | None] | None:
    """The session's pin, and a place in the pool when the policy caps endpoint concurrency (router/traffic/
    admission.py): (pin, the admission pool or None), or None with the shed answer set."""
    spec, model, tenant = described.spec, served.model, served.tenant
    pin = await session_pin(ctx, spec.name, described.info)
    pool = ctx.admission.pool(spec, model)
    if pool is not None:
        queued_at = ctx.clock()
        served.trace.admission_began()
        shed = await pool.admit(request_id, request.headers, described.cost, tenant.name if tenant is not None else "")
        served.trace.admission_ended("admitted" if shed is None else f"shed_{shed.status}")
        if served.decision is not None:
            explain_admission(served.decision, pool.settings, request.headers, ctx.clock() - queued_at, shed)
        if shed is not None:
            if tenant is not None and served.budget is not None and ctx.budgets is not None:
                ctx.budgets.refund(tenant, served.budget)  # a full fleet is not the tenant's spending
            served.response = shed
            return None
    if tenant is not None:
        ctx.metrics.child(ctx.metrics.tenant_admitted, tenant.name, model).inc()
        if served.estimate is not None and served.estimate.cost.prompt_tokens:
            ctx.metrics.child(ctx.metrics.tenant_tokens, tenant.name, "prompt").inc(served.estimate.cost.prompt_tokens)
    return pin, pool


def explain_admission(decision: Decision, settings: AdmissionSettings, headers: Mapping[str, str], waited: float,
                      shed: web.Response | None) -> None:
    decision.admission = {"class": settings.classify(headers.get(settings.priority_header)).name,
                          "queued_ms": round(waited * 1000, 3)}
    if shed is not None:
        try:
            decision.admission["shed"] = orjson.loads(shed.body)["error"]["code"]  # type: ignore[arg-type]
        except (orjson.JSONDecodeError, KeyError, TypeError):
            decision.admission["shed"] = True


def _undecodable_header(request: web.Request) -> str | None:
    """The name of a header whose value is not UTF-8, or None. aiohttp keeps such bytes as surrogates, which
    its client cannot send: they would be dropped silently (`caf\\xe9` reaching the engine as `caf`)."""
    for name, value in request.headers.items():
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return name
    return None


def _body_timed_out(request: web.Request) -> None:
    protocol = request.protocol
    if isinstance(protocol, ClientConnection):
        protocol.guard.timed_out("body", request.remote)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


async def list_models(request: web.Request) -> web.Response:
    """The models served, and the model aliases with a target served (a client may ask for either), each
    listed once, in OpenAI's model-list shape."""
    ctx = request.app[CONTEXT]
    balancer = ctx.balancer
    served = balancer.models()
    aliases = sorted(set(balancer.aliases.available(balancer.serves)) - set(served))
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "fleetroute"} for m in (*served, *aliases)]
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
        return reject(
            request.app[CONTEXT], 405,
            f"method {clip(request.method, 32)} is not allowed on {clip(request.path)} (allowed: {allowed})",
            code="method_not_allowed", headers={"Allow": allowed},
        )
    except web.HTTPNotFound:
        return reject(request.app[CONTEXT], 404, f"no such route: {clip(request.method, 32)} {clip(request.path)}",
                       code="not_found")
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("unhandled error", extra={"path": request.path})
        return error_response(500, "internal router error; see the router log", code="internal_error")


# ---- admin -------------------------------------------------------------------------------------------


async def metrics(request: web.Request) -> web.Response:
    body, content_type = request.app[CONTEXT].metrics.render(request.headers.get("Accept", ""))
    return web.Response(body=body, headers={"Content-Type": content_type})


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
                "url": redact_url(view.endpoint.url),
                "models": list(view.endpoint.models),
                "state": view.state.value,
                "in_flight": ctx.loads.in_flight(view.id),
                "in_flight_cost_tokens": round(ctx.loads.in_flight_cost(view.id), 1),
                "pending_prefill_tokens": round(ctx.loads.pending_prefill(view.id), 1),
                "prefill_speed_tokens_per_s": _rounded(ctx.loads.prefill_speed(view.id)),
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


DECISION_FILTERS = ("model", "endpoint", "policy", "reason")
DEFAULT_DECISIONS = 20


async def list_decisions(request: web.Request) -> web.Response:
    """Recent explained routing decisions, newest first: `?model=`, `?endpoint=` (any attempt's),
    `?policy=`, `?reason=` (the serving attempt's) and `?limit=` (default 20, at most `explain.recent`)."""
    ctx = request.app[CONTEXT]
    query = request.query
    unknown = sorted(set(query) - {*DECISION_FILTERS, "limit"})
    if unknown:
        expected = ", ".join((*DECISION_FILTERS, "limit"))
        return error_response(400, f"unknown query parameter {unknown[0][:40]!r} (expected one of: {expected})",
                              code="invalid_query", param=unknown[0][:40])
    kept = ctx.decisions.settings.recent
    raw = query.get("limit", str(DEFAULT_DECISIONS))
    digits = raw.lstrip("0")
    if not (raw.isascii() and raw.isdigit()) or not digits:
        return error_response(400, f"limit must be a positive integer, got {raw[:40]!r}", code="invalid_query",
                              param="limit")
    # More than 9 digits is more than any ring holds (and int() of thousands of digits is slow or refused).
    limit = min(int(digits) if len(digits) <= 9 else kept, max(kept, 1))
    filters = {name: query.get(name) or None for name in DECISION_FILTERS}
    found = ctx.decisions.recent(limit=limit, **filters)
    body = {"decisions": [d.to_dict() for d in found], "kept": len(ctx.decisions), "recent": kept,
            "sample_rate": ctx.decisions.settings.sample_rate}
    return web.json_response(body, dumps=lambda o: orjson.dumps(o).decode())


async def get_decision(request: web.Request) -> web.Response:
    """One decision's full record, by the id in its response's `x-fleetroute-decision-id`."""
    ctx = request.app[CONTEXT]
    decision_id = request.match_info["id"]
    decision = ctx.decisions.find(decision_id)
    if decision is None:
        return error_response(404, f"no recent decision {decision_id[:64]!r} (only the newest "
                                   f"{ctx.decisions.settings.recent} are kept, per router process)",
                              code="decision_not_found")
    return web.json_response(decision.to_dict(), dumps=lambda o: orjson.dumps(o).decode())


def _set_state(state: EndpointState) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        ctx = request.app[CONTEXT]
        endpoint_id = request.match_info["id"]
        if not ctx.balancer.set_state(endpoint_id, state):
            return error_response(404, f"unknown endpoint {clip(endpoint_id, 64)!r}", code="endpoint_not_found")
        return web.json_response({"id": endpoint_id, "state": state.value})

    return handler


def add_ingress_routes(app: web.Application) -> None:
    # Every route's Expect handler is the router's: 100 Continue only after the checks (for the inference
    # routes, which read a body), and an unknown expectation answered in the OpenAI shape.
    for path in INFERENCE_PATHS:
        app.router.add_post(path, inference, expect_handler=expect_handler)
    app.router.add_get("/v1/models", list_models, expect_handler=expect_handler)


def add_admin_routes(app: web.Application) -> None:
    routes = app.router
    routes.add_get("/metrics", metrics, expect_handler=expect_handler)
    routes.add_get("/healthz", healthz, expect_handler=expect_handler)
    routes.add_get("/readyz", readyz, expect_handler=expect_handler)
    routes.add_get("/admin/endpoints", list_endpoints, expect_handler=expect_handler)
    routes.add_post("/admin/endpoints/{id}/drain", _set_state(EndpointState.DRAINING), expect_handler=expect_handler)
    routes.add_post("/admin/endpoints/{id}/resume", _set_state(EndpointState.SERVING), expect_handler=expect_handler)
    routes.add_get("/admin/decisions", list_decisions, expect_handler=expect_handler)
    routes.add_get("/admin/decisions/{id}", get_decision, expect_handler=expect_handler)
