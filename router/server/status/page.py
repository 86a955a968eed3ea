"""The status page's routes on the admin listener, its data feed, and the sampler that fills its history.

Routes (all under `/status`, on the admin app):

| Route | What |
|---|---|
| `GET /status` | The page (`assets/index.html`); without a session, when an admin token is set, the login form (401). |
| `POST /status/login`, `POST /status/logout` | Start a session (the admin token in a form) or end it (sessions.py). |
| `GET /status/feed` | Everything the page shows, as JSON, built from the router's live objects on each call. |
| `GET /status/decisions/{id}` | One routing decision's full record: `/admin/decisions/{id}`'s handler. |
| `POST /status/endpoints/{id}/drain`, `.../resume` | Drain or resume, as `/admin/endpoints/{id}/drain`. |
| `GET /status/assets/{name}` | The page's script, style sheet and icon: package data, read once at start-up. |

The feed reads what `/admin/endpoints` and `/admin/decisions` read (the snapshot, `Balancer.health_report`,
`pool_report`, the load tracker, the decision ring), plus the recent past from `StatusHistory` (history.py),
which the sampler task fills once per second. The page polls it every second while it is visible.

Every answer under `/status` carries a strict Content-Security-Policy (`default-src 'self'`, no inline script
or style, no framing), `X-Content-Type-Options: nosniff` and `Referrer-Policy: no-referrer`; data is never
cached (`no-store`), assets are revalidated (`no-cache` with an ETag). Nothing is loaded from elsewhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import html
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from importlib import resources
from typing import Any
from urllib.parse import parse_qs

import orjson
from aiohttp import web

from router.config.redaction import redact_url
from router.model import EndpointState
from router.runtime.background import contained
from router.runtime.errors import clip, error_response
from router.runtime.logs import RateLimitedLog
from router.server.auth import is_admin_token
from router.server.context import CONTEXT, RouterContext
from router.server.explain import Decision, summarise
from router.server.handlers import get_decision
from router.server.request_body import BodyRejected, expect_handler, read_body
from router.server.status.history import INTERVAL, LATENCY_SAMPLES, LATENCY_WINDOW, POINTS, RATE_WINDOW, ClassCounts
from router.server.status.sessions import COOKIE, CSRF_HEADER, PREFIX, BrowserSessions

log = logging.getLogger("fleetroute.status")

SESSIONS = web.AppKey("fleetroute.status.sessions", BrowserSessions)
ASSETS = web.AppKey("fleetroute.status.assets", dict)
LOGIN_LOG = web.AppKey("fleetroute.status.login_log", RateLimitedLog)
DECISIONS_SHOWN = 15  # newest decisions in the feed (each expands to its full record on demand)
MAX_LOGIN_BYTES = 4096
ASSET_TYPES = {"status.js": "text/javascript", "status.css": "text/css", "favicon.svg": "image/svg+xml"}
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}
LOGIN_MESSAGES = {"": "", "wrong": "That is not the admin token.", "expired": "Your session ended; log in again."}


def add_status_page(app: web.Application, sessions: BrowserSessions) -> None:
    """Register the page on the admin app (its middleware already knows `sessions`: router/server/auth.py)."""
    app[SESSIONS] = sessions
    app[ASSETS] = _load_assets()
    app[LOGIN_LOG] = RateLimitedLog(log)
    routes = app.router
    routes.add_get(PREFIX, page, expect_handler=expect_handler)
    routes.add_post(PREFIX + "/login", login, expect_handler=expect_handler)
    routes.add_post(PREFIX + "/logout", logout, expect_handler=expect_handler)
    routes.add_get(PREFIX + "/feed", feed, expect_handler=expect_handler)
    routes.add_get(PREFIX + "/decisions/{id}", get_decision, expect_handler=expect_handler)
    routes.add_post(PREFIX + "/endpoints/{id}/drain", _set_state(EndpointState.DRAINING), expect_handler=expect_handler)
    routes.add_post(PREFIX + "/endpoints/{id}/resume", _set_state(EndpointState.SERVING), expect_handler=expect_handler)
    routes.add_get(PREFIX + "/assets/{name}", asset, expect_handler=expect_handler)
    app.on_response_prepare.append(_security_headers)
    app.cleanup_ctx.append(_sampler)


def _load_assets() -> dict[str, tuple[bytes, str]]:
    """Every file the page needs, read once: {name: (bytes, etag)}."""
    folder = resources.files("router.server.status") / "assets"
    out = {}
    for name in (*ASSET_TYPES, "index.html", "login.html"):
        body = (folder / name).read_bytes()
        out[name] = (body, '"' + hashlib.sha256(body).hexdigest()[:16] + '"')
    return out


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    if request.path == PREFIX or request.path.startswith(PREFIX + "/"):
        response.headers.update(SECURITY_HEADERS)
        response.headers.setdefault("Cache-Control", "no-store")


# ---- pages and assets ------------------------------------------------------------------------------------


async def page(request: web.Request) -> web.Response:
    sessions = request.app[SESSIONS]
    if sessions.required and not _signed_in(request):
        expired = request.cookies.get(COOKIE) is not None
        return _login_form(request, 401, "expired" if expired else "")
    body, _ = request.app[ASSETS]["index.html"]
    return web.Response(body=body, content_type="text/html", charset="utf-8")


def _signed_in(request: web.Request) -> bool:
    """A session cookie, or the admin token in the header (curl, tests)."""
    sessions = request.app[SESSIONS]
    if sessions.session_of(request) is not None:
        return True
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and is_admin_token(sessions.auth, token.strip())


def _login_form(request: web.Request, status: int, message: str) -> web.Response:
    body, _ = request.app[ASSETS]["login.html"]
    text = body.decode().replace("{{message}}", html.escape(LOGIN_MESSAGES[message]))
    response = web.Response(text=text, status=status, content_type="text/html", charset="utf-8")
    if message == "expired":
        request.app[SESSIONS].clear_cookie(response)
    return response


async def asset(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    if name not in ASSET_TYPES:
        raise web.HTTPNotFound()
    body, etag = request.app[ASSETS][name]
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if request.headers.get("If-None-Match") == etag:
        return web.Response(status=304, headers=headers)
    return web.Response(body=body, content_type=ASSET_TYPES[name], headers=headers)


# ---- sessions --------------------------------------------------------------------------------------------


async def login(request: web.Request) -> web.StreamResponse:
    sessions = request.app[SESSIONS]
    ctx = request.app[CONTEXT]
    if not sessions.required:
        raise web.HTTPSeeOther(PREFIX)  # no admin token: nothing to log in to
    try:
        body = await read_body(request, limit=MAX_LOGIN_BYTES, timeout=ctx.settings.client_timeouts.body)
    except BodyRejected as exc:
        return exc.response
    try:
        fields = parse_qs(body.decode("utf-8", "replace"), max_num_fields=8)
    except ValueError:  # more fields than a login form has
        fields = {}
    token = (fields.get("token") or [""])[0].strip()
    client = request.remote or ""
    if not is_admin_token(sessions.auth, token):
        ctx.metrics.status_logins.labels("failure").inc()
        request.app[LOGIN_LOG].warning("failure", "status page login failed: wrong or missing admin token",
                                       client=client)
        return _login_form(request, 401, "wrong")
    ctx.metrics.status_logins.labels("success").inc()
    request.app[LOGIN_LOG].log(logging.INFO, ("success", client), "status page login", client=client)
    response = web.Response(status=303, headers={"Location": PREFIX})  # POST-redirect-GET: a reload resends nothing
    sessions.set_cookie(request, response, sessions.issue())
    return response


async def logout(request: web.Request) -> web.Response:
    response = web.json_response({"signed_out": True})
    request.app[SESSIONS].clear_cookie(response)
    return response


# ---- drain and resume ------------------------------------------------------------------------------------


def _set_state(state: EndpointState) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        # With a token, the middleware has checked the session's CSRF token (router/server/auth.py). Without one the
        # listener is open; the custom header still keeps other sites' pages from posting here (sessions.py).
        if not request.app[SESSIONS].required and not request.headers.get(CSRF_HEADER):
            return error_response(403, f"a browser POST needs the {CSRF_HEADER} header", code="csrf_token_missing")
        ctx = request.app[CONTEXT]
        endpoint_id = request.match_info["id"]
        if not ctx.balancer.set_state(endpoint_id, state):
            return error_response(404, f"unknown endpoint {clip(endpoint_id, 64)!r}", code="endpoint_not_found")
        log.info("endpoint state set from the status page", extra={"endpoint": endpoint_id, "state": state.value})
        return web.json_response({"id": endpoint_id, "state": state.value})

    return handler


# ---- the feed --------------------------------------------------------------------------------------------


async def feed(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT]
    sessions = request.app[SESSIONS]
    ctx.metrics.status_feed_requests.inc()
    # The page's previous feed, if it came from this process (with workers > 1 another one may answer).
    since = request.query.get("since", "")
    ours = request.query.get("pid") == str(os.getpid())
    body = build_feed(ctx, since=int(since) if ours and since.isascii() and since.isdigit() and len(since) < 12
                      else None)
    cookie = sessions.session_of(request)
    body["session"] = {"required": sessions.required, "cookie": cookie is not None,
                       # the POSTs' CSRF token (with a session); any value does without an admin token
                       "csrf": sessions.csrf(cookie) if cookie is not None else "open"}
    return web.Response(body=orjson.dumps(body), content_type="application/json")


def build_feed(ctx: RouterContext, *, since: int | None = None) -> dict[str, Any]:
    """Everything the page shows, from the live objects (this process's view, like /admin/endpoints).

    `since`: the `history.samples` of the caller's previous feed. The series then hold only the samples taken
    after it (one per sampling round: the page appends them to what it has), else all of them (a first call,
    or one from before a restart: `since` ahead of this history)."""
    balancer = ctx.balancer
    history = ctx.status_history
    new = history.samples - since if since is not None and 0 <= history.samples - since < POINTS else None
    now = ctx.clock()
    snapshot = balancer.snapshot
    stale_ages = _telemetry_ages(ctx)
    models = []
    for model in snapshot.models():
        spec = balancer.policy_for(model)
        pool = balancer.pool_report(model)
        health = balancer.health.get(spec.name)
        endpoints = []
        for view in snapshot.views:
            if model not in view.endpoint.models:
                continue
            report = balancer.health_report(view.id).get(spec.name, {})
            excluded = report.get("excluded")
            t = view.telemetry
            entry: dict[str, Any] = {
                "id": view.id,
                "url": redact_url(view.endpoint.url),
                "weight": view.endpoint.weight,
                "state": view.state.value,
                "excluded": excluded,
                "breaker": report.get("breaker"),
                "slow_start_weight": report.get("slow_start_weight"),
                "health_check_error": report.get("health_check_error"),
                "in_flight": ctx.loads.in_flight(view.id),
                "telemetry": None if t is None else {
                    "source": t.source,
                    "age_s": round(now - t.reported_at, 2),
                    "gpu_util": t.gpu_util,
                    "kv_cache_usage": t.kv_cache_usage,
                    "num_waiting": t.num_waiting,
                    "num_running": t.num_running,
                    "prefix_cache_hit_rate": t.prefix_cache_hit_rate,
                },
                "telemetry_age_s": round(now - t.reported_at, 2) if t is not None else stale_ages.get(view.id),
                "latency": history.latency(view.id),
                "requests_per_s": history.request_rate(view.id),
            }
            if excluded == "ejected" and health is not None:
                entry["ejected_for_s"] = round(max(0.0, health.outlier.ejected_until(view.id) - now), 1)
                entry["ejected_because"] = health.outlier.ejection_reason(view.id)  # the failure kind that tipped it
            endpoints.append(entry)
        admission = None
        if spec.admission is not None and spec.admission.max_concurrent_per_endpoint is not None:
            admission = {"max_concurrent_per_endpoint": spec.admission.max_concurrent_per_endpoint,
                         "max_queue": spec.admission.max_queue, **(history.admission(model) or {"classes": []})}
        models.append({
            "model": model,
            "policy": {"name": spec.name, "strategy": spec.strategy, "preset": spec.preset},
            "routable": pool["routable"],
            "panic": pool["panic"],
            "endpoints": endpoints,
            "admission": admission,
        })
    return {
        "time": time.time(),
        "pid": os.getpid(),
        "snapshot_version": snapshot.version,
        "history": {"interval_s": INTERVAL, "points": POINTS, "rate_window_s": RATE_WINDOW * INTERVAL,
                    "latency_window_s": LATENCY_WINDOW, "latency_samples": LATENCY_SAMPLES,
                    "samples": history.samples, "series_since": since if new is not None else None},
        "models": models,
        "series": {view.id: history.series(view.id, new) for view in snapshot.views},
        "decisions": [_decision_summary(d) for d in ctx.decisions.recent(limit=DECISIONS_SHOWN)],
        "explain": {"sample_rate": ctx.decisions.settings.sample_rate, "kept": len(ctx.decisions),
                    "recent": ctx.decisions.settings.recent},
    }


def _telemetry_ages(ctx: RouterContext) -> dict[str, float]:
    """`fleetroute_telemetry_age_seconds` per endpoint: the age of its last report when the router last applied
    it (its arrival, its going stale, a full rebuild), also when it is too old to use (the snapshot keeps only
    fresh reports)."""
    ages = {}
    for family in ctx.metrics.telemetry_age.collect():
        for sample in family.samples:
            ages[sample.labels["endpoint"]] = round(sample.value, 1)
    return ages


def _decision_summary(decision: Decision) -> dict[str, Any]:
    """A line of the page's list (the full record is one click away: /status/decisions/{id})."""
    served = decision.served_by()
    if served is not None:
        reason, why = served.reason, summarise(served)
    else:  # never reached the picker: shed by admission, or still queued there
        admission = decision.admission or {}
        if "shed" in admission:
            reason = "shed"
            why = (f"shed by admission control ({admission['shed']}) after {admission.get('queued_ms', 0):g} ms in "
                   f"the {admission.get('class')} queue")
        elif decision.status is None:
            reason, why = "queued", "waiting for a slot in the admission queue"
        else:
            reason, why = "no_attempt", "no attempt: the request never reached the picker"
    return {
        "id": decision.id,
        "time": decision.at,
        "model": decision.model,
        "policy": decision.policy,
        "strategy": decision.strategy,
        "endpoint": served.endpoint if served else None,
        "reason": reason,
        "why": why,
        "attempts": len(decision.attempts),
        "status": decision.status,
        "duration_ms": decision.duration_ms,
        "recorded": list(decision.recorded),
    }


# ---- the sampler -----------------------------------------------------------------------------------------


def admission_counts(ctx: RouterContext) -> dict[str, dict[str, ClassCounts]]:
    """Per capped model and priority class: queue depth, admitted and shed so far (the admission metrics)."""
    capped = set()
    for model in ctx.balancer.models():
        spec = ctx.balancer.policy_for(model)
        if spec.admission is not None and spec.admission.max_concurrent_per_endpoint is not None:
            capped.add(model)
    if not capped:
        return {}
    out: dict[str, dict[str, dict[str, float]]] = {}
    for model in capped:  # every class of the policy, those without requests yet at zero
        settings = ctx.balancer.policy_for(model).admission
        assert settings is not None
        out[model] = {c.name: {} for c in settings.classes}
    metrics = ctx.metrics
    for field, family in (("depth", metrics.admission_queue_depth), ("admitted", metrics.admission_admitted),
                          ("shed", metrics.admission_shed)):
        for collected in family.collect():
            for sample in collected.samples:
                if sample.name.endswith("_created"):
                    continue
                classes = out.get(sample.labels["model"])
                if classes is not None:
                    counts = classes.setdefault(sample.labels["priority"], {})
                    counts[field] = counts.get(field, 0.0) + sample.value  # shed: summed over reasons
    return {model: {name: ClassCounts(**values) for name, values in classes.items()}
            for model, classes in out.items()}


def sample(ctx: RouterContext) -> None:
    ctx.status_history.sample(ctx.balancer.snapshot.views, ctx.loads.in_flight, admission_counts(ctx))


async def _sample_forever(ctx: RouterContext) -> None:
    while True:
        with contained("status_sampler", ctx.metrics):
            sample(ctx)
        await asyncio.sleep(INTERVAL)


async def _sampler(app: web.Application) -> AsyncIterator[None]:
    task = asyncio.create_task(_sample_forever(app[CONTEXT]), name="fleetroute-status-sampler")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
