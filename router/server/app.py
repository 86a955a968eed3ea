"""Wiring: settings -> the router's objects -> two aiohttp applications (ingress and admin) -> sockets.

Resources with a lifetime (the pooled upstream client session, the telemetry task) live in the ingress
app's `cleanup_ctx`, so they are created on start-up and closed on shutdown in reverse order.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import ipaddress
import logging
import random
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from router.config.settings import FALLBACK_POLICY, PolicySpec, Settings
from router.routing.balancer import Balancer
from router.routing.loads import LoadTracker
from router.routing.policies.registry import PolicyRegistry
from router.routing.prefix.sharing import PrefixSharing
from router.routing.prefix.upkeep import PrefixUpkeep, run_upkeep
from router.routing.shared_loads import SharedLoads, replica_id
from router.routing.sticky import StickyTable
from router.runtime.background import contained
from router.runtime.errors import SERVER_NAME
from router.runtime.metrics import RouterMetrics
from router.runtime.redis_client import connect as connect_redis
from router.server import auth
from router.server.connections import (
    ConnectionGuard,
    ListenerSite,
    close_when_draining,
    connection_budget,
    descriptor_limit,
    handler_options,
    raise_descriptor_limit,
)
from router.server.context import CONTEXT, RouterContext
from router.server.drain import drain_listener
from router.server.explain import DecisionLog, ExplainSettings
from router.server.forwarding import Forwarding
from router.server.handlers import add_admin_routes, add_ingress_routes, openai_errors
from router.server.loop_lag import watch_loop_lag
from router.server.proxy import Proxy
from router.server.rescue import release_excluded, run_stall_checks
from router.server.status.page import add_status_page
from router.server.status.sessions import BrowserSessions
from router.server.tracing import Tracing, TracingSettings, build_tracing
from router.telemetry.feed import EmbeddedCollection, MemoryStore, RedisStore, TelemetryFeed, run_feed
from router.traffic.admission import Admission
from router.traffic.budgets import Budgets

if TYPE_CHECKING:
    from opentelemetry.sdk.trace.export import SpanExporter

log = logging.getLogger("fleetroute.app")


def build_context(
    settings: Settings,
    *,
    rng: random.Random | None = None,
    clock: Callable[[], float] = time.monotonic,
    registry: PolicyRegistry | None = None,
    budget_clock: Callable[[], float] | None = None,
    span_exporter: SpanExporter | None = None,
) -> RouterContext:
    registry = registry or PolicyRegistry()
    rng = rng or random.Random()
    metrics = RouterMetrics()
    loads = LoadTracker(metrics)
    balancer = Balancer(
        policies=settings.policies,
        registry=registry,
        metrics=metrics,
        loads=loads,
        stale_after=settings.telemetry.stale_after,
        rng=rng,
        clock=clock,
    )
    balancer.set_endpoints(settings.endpoints)  # static discovery
    balancer.rebuild()
    metrics.set_policies(settings.policies)
    admission = Admission(balancer=balancer, loads=loads, metrics=metrics, clock=clock, tenancy=settings.tenancy)
    loads.on_release = admission.released  # a slot freed: wake the best queued request
    balancer.on_rebuild = admission.rebuilt  # endpoints resumed, joined or recovered: maybe more slots
    decisions = DecisionLog(settings.explain or ExplainSettings(), metrics,
                            permission=auth.explain_permission(settings.auth))
    ctx = RouterContext(
        settings=settings, metrics=metrics, loads=loads, balancer=balancer, registry=registry, admission=admission,
        decisions=decisions, clock=clock, rng=rng, forwarding=Forwarding(settings.listen.trusted_proxies),
        budget_clock=budget_clock, span_exporter=span_exporter,
    )
    # An endpoint ejected, failing its health checks or without its GPU: the requests waiting there go elsewhere.
    balancer.on_excluded = lambda policy, endpoint, reason: release_excluded(ctx, policy, endpoint, reason)
    return ctx


async def _tracing(app: web.Application) -> AsyncIterator[None]:
    """OpenTelemetry (router/server/tracing.py), built here rather than with the context: its batch processor's thread
    must start in the process that serves (after `workers` forked)."""
    ctx = app[CONTEXT]
    ctx.tracing = build_tracing(ctx.settings.tracing or TracingSettings(), ctx.metrics, ctx.span_exporter)
    try:
        yield
    finally:
        tracing, ctx.tracing = ctx.tracing, Tracing()
        if tracing.enabled:
            await asyncio.to_thread(tracing.shutdown)  # the last spans' export: a blocking HTTP call


async def _upstream(app: web.Application) -> AsyncIterator[None]:
    ctx = app[CONTEXT]
    connector = aiohttp.TCPConnector(
        limit=0,  # engines queue requests themselves; a router-side cap would hide that queue
        # Below uvicorn's (vLLM's server) 5 s keep-alive, so the router never reuses a connection the engine
        # is about to close: a POST sent on one would fail and could not be retried safely.
        keepalive_timeout=4,
        ttl_dns_cache=10,
    )
    session = aiohttp.ClientSession(
        connector=connector,
        auto_decompress=False,  # bodies pass through as bytes, compressed or not
        cookie_jar=aiohttp.DummyCookieJar(),  # a proxy must not keep one client's cookies for the next
        skip_auto_headers=("Accept-Encoding", "User-Agent"),
    )
    ctx.proxy = Proxy(session=session, loads=ctx.loads, metrics=ctx.metrics,
                      credentials=auth.upstream_credentials(ctx.settings.auth), forwarding=ctx.forwarding,
                      stalls=ctx.stalls, write_timeout=ctx.settings.client_timeouts.write)
    ctx.http = session
    telemetry = ctx.settings.telemetry
    sync_health_checks(ctx)
    tasks: list[asyncio.Task[None]] = [asyncio.create_task(run_stall_checks(ctx), name="stall-checks"),
                                       asyncio.create_task(watch_loop_lag(ctx.metrics), name="loop-lag")]
    redis_store = None
    if telemetry.enabled:
        wake = asyncio.Event()
        before_refresh = None
        if ctx.settings.redis.enabled:
            redis_store = RedisStore(connect_redis(ctx.settings.redis, timeout=telemetry.timeout))
            store = redis_store
            tasks.append(asyncio.create_task(redis_store.listen(wake, telemetry.interval, ctx.metrics),
                                             name="telemetry-pubsub"))
        else:
            memory = MemoryStore()
            store = memory
            collection = EmbeddedCollection(session=session, store=memory, settings=telemetry, metrics=ctx.metrics)
            before_refresh = lambda: collection.collect(ctx.balancer.endpoints())  # noqa: E731
            ctx.telemetry_collection = collection
        # Between full reads a round reads only the records agents announced; full reads at most half of
        # staleAfter apart catch a lost announcement before the endpoint's telemetry could go stale for it.
        # A round comes up to one interval after a full read falls due, hence the interval taken off.
        feed = ctx.telemetry_feed = TelemetryFeed(
            store=store, balancer=ctx.balancer, metrics=ctx.metrics,
            full_read_every=max(telemetry.interval, telemetry.stale_after / 2 - telemetry.interval))
        tasks.append(asyncio.create_task(
            run_feed(feed, interval=telemetry.interval, wake=wake, before_refresh=before_refresh,
                     on_round=ctx.telemetry_round_done, metrics=ctx.metrics),
            name="telemetry-feed",
        ))
    ctx.started = True
    try:
        yield
    finally:
        ctx.draining = True
        tasks.extend(ctx.health_tasks.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        ctx.telemetry_feed = ctx.telemetry_collection = None
        if redis_store is not None:
            await redis_store.close()
        await session.close()
        ctx.access_log.flush()


async def health_round(ctx: RouterContext, policy: str) -> None:
    """Probe every endpoint of one policy once and apply the results."""
    pool = ctx.balancer.health[policy]
    endpoints = ctx.balancer.endpoints_for_policy(policy)
    assert ctx.http is not None
    headers: CIMultiDict[str] = CIMultiDict()
    credentials = auth.upstream_credentials(ctx.settings.auth)
    if credentials is not None:
        credentials(headers)  # the engines' own API key, when one is configured
    results = await asyncio.gather(*(pool.active.probe(ctx.http, ep, headers) for ep in endpoints))
    changed = False
    known = {ep.id for ep in ctx.balancer.endpoints()}
    for ep, (ok, error) in zip(endpoints, results, strict=True):
        if ep.id not in known:
            continue  # removed while the probes ran: keep no state for it
        ctx.metrics.health_checks.labels(policy, ep.id, "pass" if ok else "fail").inc()
        flipped = pool.active.observe(ep.id, ok, error)
        if flipped is not None:
            changed = True
            (log.info if flipped else log.warning)(
                "endpoint passed its health checks again" if flipped else "endpoint failed its health checks",
                extra={"policy": policy, "endpoint": ep.id, "error": error or None},
            )
    if changed:
        ctx.balancer.rebuild()


def sync_health_checks(ctx: RouterContext) -> None:
    """One probing task per policy with active health checks (after start-up and after a reload)."""
    wanted = {name for name, pool in ctx.balancer.health.items() if pool.settings.active.enabled}
    for name in set(ctx.health_tasks) - wanted:
        ctx.health_tasks.pop(name).cancel()
    for name in wanted - set(ctx.health_tasks):
        ctx.health_tasks[name] = asyncio.create_task(_active_health(ctx, name), name=f"health-{name}")


async def _active_health(ctx: RouterContext, policy: str) -> None:
    interval = ctx.balancer.health[policy].settings.active.interval
    while True:  # endpoints start healthy; the first probes run one interval after start-up
        await asyncio.sleep(interval)
        with contained("health_checks", ctx.metrics):
            await health_round(ctx, policy)


async def _shared_state(app: web.Application) -> AsyncIterator[None]:
    """Session pins (local, plus Redis when configured) and in-flight counts shared between replicas."""
    ctx = app[CONTEXT]
    settings = ctx.settings
    client = None
    if settings.redis.enabled:
        # Pins are read on the request path (on a local miss): fail fast rather than make a request wait.
        client = connect_redis(settings.redis, timeout=0.1)
    ctx.sticky_redis = client
    sync_sticky_tables(ctx)
    shared = SharedLoads(redis=client, loads=ctx.loads, metrics=ctx.metrics, interval=settings.telemetry.interval,
                         endpoints=lambda: [ep.id for ep in ctx.balancer.endpoints()]) if client is not None else None
    ctx.shared_loads = shared
    task = asyncio.create_task(_housekeeping(ctx, shared), name="fleetroute-housekeeping")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for table in ctx.sticky.values():
            await table.close()
        if client is not None:
            await client.aclose()


async def _budgets(app: web.Application) -> AsyncIterator[None]:
    """Tenants' budgets (router/traffic/budgets.py), when a tenant has one: a Redis client with the budget timeout, and
    the task that sends completion charges and refunds; on shutdown, what is still queued is sent once."""
    ctx = app[CONTEXT]
    tenancy = ctx.settings.tenancy
    if tenancy is None or not tenancy.budgets:
        yield
        return
    client = connect_redis(ctx.settings.redis, timeout=tenancy.budget_timeout)
    budgets = ctx.budgets = Budgets(redis=client, tenancy=tenancy, metrics=ctx.metrics, clock=ctx.budget_clock)
    task = asyncio.create_task(budgets.run(), name="fleetroute-budget-charges")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        with contextlib.suppress(Exception):  # best effort: Redis may be what is failing
            await budgets.flush()
        ctx.budgets = None
        await client.aclose()


async def _prefix_upkeep(app: web.Application) -> AsyncIterator[None]:
    """The prefix-aware policy's background task: index clock, tuning against the engines' hit rates, and,
    with Redis, sharing the index with the other replicas (its own client, with the telemetry timeout)."""
    ctx = app[CONTEXT]
    settings = ctx.settings
    client = None
    sharing = None
    if settings.redis.enabled:
        client = connect_redis(settings.redis, timeout=settings.telemetry.timeout)
        router_id = ctx.shared_loads.replica if ctx.shared_loads is not None else replica_id()
        sharing = PrefixSharing(redis=client, router_id=router_id, metrics=ctx.metrics, clock=ctx.clock)
    upkeep = ctx.prefix_upkeep = PrefixUpkeep(balancer=ctx.balancer, metrics=ctx.metrics, sharing=sharing,
                                              clock=ctx.clock,
                                              kv_index=ctx.kv_events.index if ctx.kv_events is not None else None)
    task = asyncio.create_task(run_upkeep(upkeep, ctx.metrics), name="fleetroute-prefix-upkeep")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx.prefix_upkeep = None
        if client is not None:
            await client.aclose()


async def _kv_events(app: web.Application) -> AsyncIterator[None]:
    """The engines' KV-cache events (router/routing/prefix/kv_events.py): one subscription per endpoint that has a
    source, following membership, feeding the precise prefix index."""
    ctx = app[CONTEXT]
    settings = ctx.settings.kv_events
    if settings is None:
        yield
        return
    from router.routing.prefix.kv_block_index import KVBlockIndex
    from router.routing.prefix.kv_events import KVEvents, load_tokenizer, run_kv_events

    index = KVBlockIndex(max_blocks=settings.max_blocks, tokenize=load_tokenizer(settings.tokenizer))
    events = ctx.kv_events = KVEvents(settings, index, ctx.metrics, clock=ctx.clock)
    task = asyncio.create_task(run_kv_events(events, ctx.balancer, ctx.metrics), name="fleetroute-kv-events")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await events.close()
        ctx.kv_events = None


def sync_sticky_tables(ctx: RouterContext) -> None:
    """One session table per policy with stickiness; a table survives a reload that keeps its settings."""
    wanted = {spec.name: spec.stickiness for spec in ctx.settings.policies if spec.stickiness.enabled}
    for name in list(ctx.sticky):
        if wanted.get(name) != ctx.sticky[name].settings:
            table = ctx.sticky.pop(name)
            asyncio.get_running_loop().create_task(table.close())
    for name, stickiness in wanted.items():
        if name not in ctx.sticky:
            ctx.sticky[name] = StickyTable(policy=name, settings=stickiness, metrics=ctx.metrics,
                                           redis=ctx.sticky_redis, clock=ctx.clock)


def install_policies(ctx: RouterContext, policies: tuple[PolicySpec, ...]) -> None:
    """Route by these policies from now on (a RoutingPolicy change): the settings, the pickers, the per-policy
    metrics, session tables and health checks follow."""
    ctx.settings = replace(ctx.settings, policies=policies)
    ctx.balancer.set_policies(policies)
    ctx.metrics.set_policies(policies)
    sync_sticky_tables(ctx)
    if ctx.http is not None:
        sync_health_checks(ctx)


class ReloadRejected(ValueError):
    pass


def apply_settings(ctx: RouterContext, new: Settings) -> None:
    """Apply a reloaded configuration live: policies, static endpoints and per-request limits. Addresses,
    Redis, telemetry and worker count need a restart; a change to them rejects the whole reload."""
    old = ctx.settings
    fixed = ("listen", "admin", "redis", "telemetry", "workers", "auth", "max_header_bytes", "client_timeouts",
             "discovery", "control", "tenancy", "tracing")
    changed = [name for name in fixed if getattr(old, name) != getattr(new, name)]
    if changed:
        raise ReloadRejected(f"these settings need a restart: {', '.join(changed)}")
    if ctx.control is not None:  # the file's policies are the base the RoutingPolicies are merged onto
        new = ctx.control.rebase(new)
    ctx.settings = new
    ctx.decisions.configure(new.explain or ExplainSettings())  # sampling can be raised live while debugging
    ctx.balancer.set_policies(new.policies)
    ctx.metrics.set_policies(new.policies)
    if ctx.discovery is not None:
        ctx.discovery.set_static(new.endpoints)  # joined with the discovered ones, published by discovery
    else:
        ctx.balancer.set_endpoints(new.endpoints)
    ctx.balancer.rebuild()
    sync_sticky_tables(ctx)
    sync_health_checks(ctx)


async def _discovery(app: web.Application) -> AsyncIterator[None]:
    """Kubernetes endpoint discovery, when configured: start-up waits up to `syncTimeout` for the first list
    (then serves with what it has, and keeps trying); shutdown stops the watch."""
    ctx = app[CONTEXT]
    kube = ctx.settings.discovery.kubernetes
    if kube is None:
        yield
        return
    # The client is imported only when used.
    from router.kube.discovery.inference_pool import InferencePoolDiscovery
    from router.kube.discovery.kubernetes import KubernetesDiscovery

    source = InferencePoolDiscovery if kube.inference_pool is not None else KubernetesDiscovery
    discovery = source(settings=kube, balancer=ctx.balancer, static=ctx.settings.endpoints, metrics=ctx.metrics,
                       rng=ctx.rng)
    await discovery.start()
    ctx.discovery = discovery
    try:
        try:
            await asyncio.wait_for(discovery.synced.wait(), kube.sync_timeout)
        except TimeoutError:
            log.warning("kubernetes discovery has not synced yet; serving the endpoints known so far",
                        extra={"sync_timeout_s": kube.sync_timeout, "endpoints": len(ctx.balancer.endpoints())})
        ctx.balancer.rebuild()  # the discovered endpoints are routable before the listener opens
        yield
    finally:
        ctx.discovery = None
        await discovery.close()


async def _control(app: web.Application) -> AsyncIterator[None]:
    """RoutingPolicy resources, when `control.kubernetes` is configured: start-up waits up to `syncTimeout` for
    the first list (their policies route the first request), then they are applied live as they change."""
    ctx = app[CONTEXT]
    kube = ctx.settings.control.kubernetes if ctx.settings.control is not None else None
    if kube is None:
        yield
        return
    from router.kube.control.routing_policies import RoutingPolicyController  # the client is imported only when used

    controller = RoutingPolicyController(settings=kube, ctx=ctx, install=functools.partial(install_policies, ctx))
    await controller.start()
    ctx.control = controller
    try:
        try:
            await asyncio.wait_for(controller.synced.wait(), kube.sync_timeout)
        except TimeoutError:
            log.warning("RoutingPolicies not listed yet; serving with the config file's policies",
                        extra={"sync_timeout_s": kube.sync_timeout})
        yield
    finally:
        ctx.control = None
        await controller.close()


async def _housekeeping(ctx: RouterContext, shared: SharedLoads | None) -> None:
    pinned_series: set[tuple[str, str]] = set()
    while True:
        with contained("housekeeping", ctx.metrics):
            ctx.balancer.tick()  # slow-start ramps, ejections and open breakers expire with time
            if shared is not None:
                await shared.exchange()
            current: set[tuple[str, str]] = set()
            for name, table in ctx.sticky.items():
                for endpoint, count in table.sweep().items():
                    if ctx.balancer.is_member(endpoint):  # a pin read back from Redis may name one that left
                        ctx.metrics.sticky_sessions.labels(name, endpoint).set(count)
                        current.add((name, endpoint))
            for gone in pinned_series - current:
                ctx.metrics.sticky_sessions.remove(*gone)
            pinned_series = current
        ctx.housekeeping_round_done()
        await asyncio.sleep(ctx.settings.telemetry.interval)


def build_apps(ctx: RouterContext) -> tuple[web.Application, web.Application]:
    protect = auth.ingress_middlewares(ctx.settings.auth, ctx.metrics)  # client API keys, when configured
    ingress = web.Application(client_max_size=ctx.settings.max_body_bytes, middlewares=[openai_errors, *protect])
    ingress[CONTEXT] = ctx
    ingress.cleanup_ctx.append(_tracing)  # first: the last to close, after the last request's spans ended
    ingress.cleanup_ctx.append(_discovery)  # then: the first snapshot already has the discovered endpoints
    ingress.cleanup_ctx.append(_upstream)
    ingress.cleanup_ctx.append(_shared_state)
    ingress.cleanup_ctx.append(_budgets)
    ingress.cleanup_ctx.append(_kv_events)
    ingress.cleanup_ctx.append(_prefix_upkeep)  # after _shared_state: it names this replica; after _kv_events
    ingress.cleanup_ctx.append(_control)  # last: its policies get the session tables and health checks above
    add_ingress_routes(ingress)
    sessions = BrowserSessions(ctx.settings.auth)  # the status page's login, accepted on its own routes
    admin = web.Application(middlewares=[openai_errors, *auth.admin_middlewares(ctx.settings.auth, ctx.metrics,
                                                                                 browser=sessions)])
    admin[CONTEXT] = ctx
    add_admin_routes(admin)
    add_status_page(admin, sessions)
    for app in (ingress, admin):
        app.on_response_prepare.append(_server_header)
        app.on_response_prepare.append(close_when_draining)  # a listener that drains says Connection: close
    return ingress, admin


async def _server_header(request: web.Request, response: web.StreamResponse) -> None:
    """Every response, proxied ones included, names the router without versions (aiohttp's default names
    the Python and aiohttp versions, and an engine's would name its server)."""
    response.headers["Server"] = SERVER_NAME


@dataclass
class RunningRouter:
    """A started router: its context, bound addresses, and how to stop it."""

    ctx: RouterContext
    ingress_url: str  # a URL that reaches the listener from this host (loopback for a wildcard address)
    admin_url: str
    ingress_runner: web.AppRunner
    admin_runner: web.AppRunner
    connections: dict[str, ConnectionGuard]  # per listener: open connections, caps and timeouts
    bound: dict[str, tuple[tuple[str, int], ...]]  # per listener: the addresses its sockets are bound to

    async def shutdown(self) -> None:
        """The graceful stop (SIGTERM): readiness fails, the ingress listener stops accepting and drains its
        connections (router/server/drain.py: `Connection: close` on every response for `drainConnections`, then the
        idle ones closed, in-flight requests given until `shutdownGrace`), then everything closes."""
        self.ctx.draining = True
        settings = self.ctx.settings
        await drain_listener(self.ingress_runner, self.connections["ingress"], period=settings.drain_connections,
                             grace=settings.shutdown_grace)
        await self.close()

    async def close(self) -> None:
        """Stop now: idle connections close at once, in-flight requests get `shutdownGrace` (tests, and the
        end of `shutdown`)."""
        self.ctx.draining = True
        await self.ingress_runner.cleanup()  # stops accepting, waits for in-flight requests (shutdown grace)
        await self.admin_runner.cleanup()


def _bound(runner: web.AppRunner) -> tuple[tuple[str, int], ...]:
    """The (host, port) of every socket of the runner's sites: what the OS bound (port 0 resolved, a host name
    resolved to its addresses)."""
    bound = []
    for site in runner.sites:
        server = getattr(site, "_server", None)
        for sock in server.sockets if server is not None else ():
            host, port = sock.getsockname()[:2]
            bound.append((host, port))
    if not bound:
        raise RuntimeError("site is not bound")
    return tuple(bound)


def show_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _local_url(bound: tuple[tuple[str, int], ...]) -> str:
    """A URL that reaches the listener from this host: its first address, loopback for a wildcard one."""
    host, port = bound[0]
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://{show_address(host, port)}"


def is_loopback(host: str) -> bool:
    """Whether a bound address is reachable only from this host (a wildcard address is not)."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback


def warn_if_admin_exposed(settings: Settings, bound: tuple[tuple[str, int], ...]) -> None:
    """One warning at start-up when the admin listener is reachable from other hosts and no admin token is
    set: anyone who reaches it may then drain endpoints and read /admin/* and the status page."""
    if settings.auth is not None and settings.auth.admin_token_digest is not None:
        return
    exposed = [show_address(host, port) for host, port in bound if not is_loopback(host)]
    if exposed:
        log.warning("the admin listener is reachable from other hosts and has no admin token: whoever reaches it "
                    "may drain endpoints and read /admin/* and the status page; set the admin token "
                    f"(${auth.ADMIN_TOKEN_ENV}, or the variable admin.tokenEnv names) or bind admin.host to "
                    "127.0.0.1", extra={"admin": exposed})


async def start_router(ctx: RouterContext, *, reuse_port: bool = False) -> RunningRouter:
    settings = ctx.settings
    ingress, admin = build_apps(ctx)
    # handler_cancellation: a client disconnect cancels the handler, which cancels upstream. No aiohttp
    # access log: ours is structured and written by the handler.
    ingress_runner = web.AppRunner(ingress, access_log=None, handler_cancellation=True,
                                   shutdown_timeout=settings.shutdown_grace)
    admin_runner = web.AppRunner(admin, access_log=None, shutdown_timeout=1.0)
    # Header size limits and no header bytes in logs (router.server.auth), the client timeouts
    # (router.server.connections).
    options = handler_options(settings.client_timeouts, auth.server_options(settings.max_header_bytes))
    admin_guard = ConnectionGuard(listener="admin", max_connections=settings.admin.max_connections
                                  or connection_budget(descriptor_limit(), 0),
                                  max_per_client=settings.admin.max_connections_per_client,
                                  timeouts=settings.client_timeouts, metrics=ctx.metrics)
    budget = connection_budget(descriptor_limit(), admin_guard.max_connections)
    ingress_cap = settings.listen.max_connections or budget
    if ingress_cap > budget:
        log.warning("listen.maxConnections is above what this process's descriptor limit leaves for the ingress; "
                    "a flood could take the descriptors the admin listener and the engines need",
                    extra={"max_connections": ingress_cap, "budget": budget, "descriptor_limit": descriptor_limit()})
    ingress_guard = ConnectionGuard(listener="ingress", max_connections=ingress_cap,
                                    max_per_client=settings.listen.max_connections_per_client,
                                    timeouts=settings.client_timeouts, metrics=ctx.metrics, forwarding=ctx.forwarding)
    await ingress_runner.setup()
    await admin_runner.setup()
    try:
        await ListenerSite(ingress_runner, settings.listen, guard=ingress_guard, handler_options=options,
                           reuse_port=reuse_port).start()
        await ListenerSite(admin_runner, settings.admin, guard=admin_guard, handler_options=options,
                           reuse_port=reuse_port).start()
    except OSError:
        await ingress_runner.cleanup()
        await admin_runner.cleanup()
        raise
    bound = {"ingress": _bound(ingress_runner), "admin": _bound(admin_runner)}
    warn_if_admin_exposed(settings, bound["admin"])
    return RunningRouter(
        ctx=ctx,
        ingress_url=_local_url(bound["ingress"]),
        admin_url=_local_url(bound["admin"]),
        ingress_runner=ingress_runner,
        admin_runner=admin_runner,
        connections={"ingress": ingress_guard, "admin": admin_guard},
        bound=bound,
    )


def reload_from(ctx: RouterContext, path: str) -> None:
    """SIGHUP: re-read the config file; apply it if valid, else keep the running configuration."""
    from router.config.settings import ConfigError, load_settings

    try:
        new = load_settings(path)
        apply_settings(ctx, new)
    except (ConfigError, ReloadRejected) as exc:
        ctx.metrics.config_reloads.labels("rejected").inc()
        log.error("configuration reload rejected; keeping the running configuration", extra={"error": str(exc)})
        return
    ctx.metrics.config_reloads.labels("applied").inc()
    log.info("configuration reloaded", extra={"policies": [p.name for p in new.policies],
                                              "presets": {p.name: p.preset for p in new.policies if p.preset},
                                              "aliases": ctx.balancer.aliases.describe(),
                                              "endpoints": len(new.endpoints)})


async def serve(settings: Settings, *, reuse_port: bool = False, config_path: str | None = None) -> None:
    """Run a router until SIGTERM or SIGINT, then drain (RunningRouter.shutdown): readiness fails first, open
    client connections are told to close, in-flight requests finish. SIGHUP reloads `config_path` live."""
    raise_descriptor_limit()  # before the connection budget is computed from it
    ctx = build_context(settings)
    running = await start_router(ctx, reuse_port=reuse_port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if config_path is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_from, ctx, config_path)
    # Logged once the signal handlers are in place: whoever waits for this line may signal us at once.
    log.info(
        "router listening",
        extra={
            # What the sockets are bound to: the configured host (0.0.0.0 stays 0.0.0.0), the port the OS chose.
            "ingress": [show_address(*address) for address in running.bound["ingress"]],
            "admin": [show_address(*address) for address in running.bound["admin"]],
            "endpoints": len(ctx.balancer.endpoints()),
            "models": list(ctx.balancer.models()),
            "policies": [p.name for p in settings.policies] or [FALLBACK_POLICY],  # none: every model's
            "presets": {p.name: p.preset for p in settings.policies if p.preset},
            "aliases": ctx.balancer.aliases.describe(),  # model aliases: target -> weight (router/routing/aliases.py)
            "max_connections": {name: guard.max_connections for name, guard in running.connections.items()},
            "descriptor_limit": descriptor_limit(),
        },
    )
    try:
        await stop.wait()
    finally:
        log.info("shutting down; draining in-flight requests", extra={"in_flight": ctx.loads.total()})
        await running.shutdown()
