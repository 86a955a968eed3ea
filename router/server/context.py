"""The router's shared objects for one process, reachable from handlers through a typed app key.

Built by `app.build_apps`; nothing here is module-level state, so tests can run many routers in one
process, each with its own clock, random source and metrics registry.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import aiohttp
from aiohttp import web

from router.config.settings import Settings
from router.health.stall import StallDetector
from router.routing.balancer import Balancer
from router.routing.cost import CostModel
from router.routing.departures import EndpointStateOwner
from router.routing.loads import LoadTracker
from router.routing.policies.registry import PolicyRegistry
from router.routing.prefix.upkeep import PrefixUpkeep
from router.routing.shared_loads import SharedLoads
from router.routing.sticky import StickyTable
from router.runtime.logs import RateLimitedLog
from router.runtime.metrics import RouterMetrics
from router.server.access_log import AccessLog
from router.server.explain import DecisionLog
from router.server.forwarding import Forwarding
from router.server.proxy import Proxy
from router.server.status.history import StatusHistory
from router.server.tracing import Tracing
from router.telemetry.feed import EmbeddedCollection, TelemetryFeed
from router.traffic.admission import Admission
from router.traffic.budgets import Budgets
from router.traffic.retry_budget import RetryBudget

if TYPE_CHECKING:  # imported only when Kubernetes discovery is configured (the client is heavy to import)
    from opentelemetry.sdk.trace.export import SpanExporter

    from router.kube.discovery.kubernetes import KubernetesDiscovery


class PolicyControl(Protocol):
    """What the context needs of the RoutingPolicy controller (router/kube/control/routing_policies.py), which
    is handed this context: a reload's policies become the base its RoutingPolicies merge onto."""

    def rebase(self, new: Settings) -> Settings: ...


@dataclass
class RouterContext:
    settings: Settings
    metrics: RouterMetrics
    loads: LoadTracker
    balancer: Balancer
    registry: PolicyRegistry
    admission: Admission  # priority queues of policies that cap endpoint concurrency
    decisions: DecisionLog  # explained routing decisions: who may ask, the recent ones, their log lines
    clock: Callable[[], float] = time.monotonic
    rng: random.Random = field(default_factory=random.Random)
    proxy: Proxy | None = None  # set once the upstream client session exists (app start-up)
    http: aiohttp.ClientSession | None = None  # the pooled upstream session (proxy, probes, telemetry)
    sticky: dict[str, StickyTable] = field(default_factory=dict)  # policy name -> session pins
    shared_loads: SharedLoads | None = None  # with Redis: in-flight counts exchanged with other replicas
    budgets: Budgets | None = None  # tenants' budgets through Redis (app start-up to shutdown; router.traffic.budgets)
    budget_clock: Callable[[], float] | None = None  # budgets' wall clock (tests); None: the Redis server's
    sticky_redis: Any = None  # the Redis client session pins use (None without Redis)
    # router.routing.prefix.kv_events.KVEvents while KV events are configured (app start-up to shutdown)
    kv_events: Any = None
    prefix_upkeep: PrefixUpkeep | None = None  # prefix-aware tuning and sharing (app start-up to shutdown)
    telemetry_feed: TelemetryFeed | None = None  # while telemetry is read (app start-up to shutdown)
    telemetry_collection: EmbeddedCollection | None = None  # the router's own scrapes, without Redis
    health_tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)  # active probes per policy
    discovery: KubernetesDiscovery | None = None  # while Kubernetes discovery runs (app start-up to shutdown)
    control: PolicyControl | None = None  # while RoutingPolicies are watched (router.kube.control)
    retry_budget: RetryBudget = field(init=False)
    # requests in flight per endpoint, their progress (router/server/rescue.py)
    stalls: StallDetector = field(init=False)
    stall_task: asyncio.Task[None] | None = None  # the stall checks (app start-up to shutdown)
    status_history: StatusHistory = field(init=False)  # the status page's recent past (router/server/status/history.py)
    access_log: AccessLog = field(default_factory=AccessLog)
    tracing: Tracing = field(default_factory=Tracing)  # OpenTelemetry (server/tracing.py): off until app start-up
    span_exporter: SpanExporter | None = None  # tests: spans go here (in process) instead of over OTLP
    forwarding: Forwarding = field(default_factory=Forwarding)  # whose X-Forwarded-* to believe (listen.trustedProxies)
    # Log lines about what clients send (refused bodies): a client can repeat them at will.
    client_log: RateLimitedLog = field(default_factory=lambda: RateLimitedLog(logging.getLogger("fleetroute.handlers")))
    cost: CostModel = field(default_factory=CostModel)  # output-length predictors (policies with estimates)
    # Set (and replaced) after each telemetry round has been applied: lets tests and tools wait for fresh
    # telemetry instead of sleeping.
    telemetry_round: asyncio.Event = field(default_factory=asyncio.Event)
    housekeeping_round: asyncio.Event = field(default_factory=asyncio.Event)  # the same, for housekeeping
    started: bool = False

    def __post_init__(self) -> None:
        self.retry_budget = RetryBudget(self.clock)
        self.stalls = StallDetector(self.clock)
        self.status_history = StatusHistory(self.clock)
        self.balancer.departures.owners = self.endpoint_state_owners

    def telemetry_round_done(self) -> None:
        done, self.telemetry_round = self.telemetry_round, asyncio.Event()
        done.set()

    def housekeeping_round_done(self) -> None:
        done, self.housekeeping_round = self.housekeeping_round, asyncio.Event()
        done.set()

    def endpoint_state_owners(self) -> list[EndpointStateOwner]:
        """Everything that keeps state per endpoint and must forget an endpoint that leaves, told at once
        (router/routing/departures.py; the load tracker and the metrics are told once nothing is in flight there)."""
        owners: list[EndpointStateOwner] = [self.balancer, self.admission, self.status_history, self.stalls,
                                            *self.sticky.values()]
        for owner in (self.telemetry_feed, self.telemetry_collection, self.prefix_upkeep):
            if owner is not None:
                owners.append(owner)
        return owners
    draining: bool = False


CONTEXT = web.AppKey("fleetroute.context", RouterContext)
