"""Router configuration: one YAML file -> frozen dataclasses, validated before anything starts.

Every error names the field by its path in the file and the offending value
(`policies[0].adaptive.weights.gpu: must be a number, got 'high'`), so an operator can fix a config without
reading code. Unknown fields are errors too: a misspelt option must never silently fall back to a default.

Durations are numbers of seconds or strings with a unit (`500ms`, `2s`, `1m`). Environment variables
`FLEETROUTE_LISTEN_HOST`, `FLEETROUTE_LISTEN_PORT`, `FLEETROUTE_ADMIN_HOST`, `FLEETROUTE_ADMIN_PORT`
override the listen and admin addresses (handy in containers).
"""

from __future__ import annotations

import fnmatch
import ipaddress
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import SplitResult, parse_qs, unquote, urlsplit

import yaml
from redis.asyncio.connection import parse_url as parse_redis_url

from router.config import presets
from router.config.durations import parse_duration
from router.config.fields import ConfigError, Fields, _label_selector_problem, _secret, _show
from router.health.active import ActiveHealthSettings
from router.health.breaker import BreakerSettings
from router.health.outlier import OutlierSettings
from router.health.pool import HealthSettings
from router.health.slow_start import SlowStartSettings
from router.health.stall import StallSettings
from router.model import Endpoint
from router.routing.aliases import Alias, AliasConfigError, cross_check, parse_aliases
from router.routing.cost import CHARS_PER_TOKEN_RANGE, CostSettings
from router.routing.policies.base import PolicyConfigError
from router.routing.policies.consistent_hash import HashKey, parse_key
from router.routing.policies.lora_affinity import LoraAffinity, LoraConfigError, parse_lora
from router.routing.policies.registry import PolicyRegistry
from router.routing.sticky import StickinessSettings
from router.runtime.redis_client import RedisSettings, SentinelSettings

if TYPE_CHECKING:  # parsed by their own modules, which build on router/config/fields.py
    from router.kube.control import ControlSettings
    from router.server.auth import AuthSettings
    from router.server.explain import ExplainSettings
    from router.server.tracing import TracingSettings
    from router.traffic.admission import AdmissionSettings
    from router.traffic.tenants import TenancySettings

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_ADMIN_CONNECTIONS = 64  # kubelet probes and a few Prometheus scrapers need a handful
# Per client address on the admin listener: a quarter of its budget, so one client (a scraper gone wrong, or
# anyone who can reach the port) cannot hold every admin connection and make the kubelet's /healthz fail.
DEFAULT_ADMIN_CONNECTIONS_PER_CLIENT = 16
ENDPOINT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$")
POLICY_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a Kubernetes object name, for the CRD
LOG_LEVELS = ("debug", "info", "warning", "error")
GPU_SOURCES = ("none", "sim")


IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
MAX_CONNECTIONS_LIMIT = 1_000_000


@dataclass(frozen=True)
class Address:
    """A listener: where it binds, and how many client connections it holds (router/server/connections.py)."""

    host: str
    port: int
    # Client connections open at once, per router process; None: derived from the process's descriptor
    # limit at start-up (`connections.connection_budget`), so a flood cannot take the descriptors the other
    # listener, the engines and Redis need.
    max_connections: int | None = None
    # Per client address (an IPv6 client: per /64); 0: no per-client cap. Trusted proxies are exempt.
    max_connections_per_client: int = 0
    # The ingress only: peers whose X-Forwarded-* headers are believed (router/server/forwarding.py).
    trusted_proxies: tuple[IPNetwork, ...] = ()


@dataclass(frozen=True)
class ClientTimeouts:
    """How long a client connection may take, on both listeners (router/server/connections.py). Near nginx's
    defaults (client_header_timeout 60s, client_body_timeout 60s, keepalive_timeout 75s)."""

    # From a connection's first byte (or its opening) to the end of the request head. A real client sends
    # its head in one or two packets; 30 s (half nginx's) bounds how long a slowloris holds a connection.
    header: float = 30.0
    # Between two reads of a request body (nginx's client_body_timeout): a stalled upload gets 408.
    body: float = 60.0
    # An idle connection between two requests. Above the 60 s idle timeout of common cloud load balancers,
    # so one never reuses a connection the router has just closed.
    keep_alive: float = 75.0
    # The longest a write of a response chunk may wait for the client to read (nginx's send_timeout, 60 s): a
    # client that stops reading a stream holds its engine's batch slot until then (router/server/proxy.py).
    write: float = 60.0


@dataclass(frozen=True)
class Timeouts:
    connect: float = 5.0
    # Until the upstream's response headers. vLLM sends a non-streaming response's headers only when the
    # whole completion is done, so this bounds the longest generation, not just queueing.
    first_byte: float = 300.0
    # Longest silence between two chunks of a response body (a stalled stream).
    idle: float = 60.0
    # The whole request, all attempts included; None: no limit beyond the others.
    total: float | None = None


@dataclass(frozen=True)
class Retries:
    # Total tries per request. A request is retried on another endpoint (never one already tried) only
    # while no byte has reached the client: after a refused or timed-out connection, no response headers
    # within `firstByte`, or a 5xx answer.
    attempts: int = 2
    # Over any 10 s, retries may be at most this share of the requests started plus `min_per_second`, so
    # retries cannot multiply the load of a fleet-wide outage (Finagle's and Envoy's retry budgets).
    budget_percent: float = 20.0
    min_per_second: float = 10.0


@dataclass(frozen=True)
class PolicySpec:
    name: str
    models: tuple[str, ...]
    strategy: str
    params: Any  # the strategy's frozen config, parsed by the strategy itself
    timeouts: Timeouts = Timeouts()
    retries: Retries = Retries()
    stickiness: StickinessSettings = StickinessSettings()
    health: HealthSettings = HealthSettings()
    admission: AdmissionSettings | None = None  # router.traffic.admission; None or no cap: admission off
    cost: CostSettings | None = None  # router.routing.cost: request cost estimates; None: none are made
    aliases: tuple[Alias, ...] = ()  # router.routing.aliases: model aliases with weighted targets
    lora: LoraAffinity | None = None  # router.routing.policies.lora_affinity: the models are LoRA adapters
    # The preset the entry was expanded from (router.config.presets), or None. Where the settings came from, not
    # what they are: two specs that route alike are equal whether written out or from a preset.
    preset: str | None = field(default=None, compare=False)

    def matches(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


@dataclass(frozen=True)
class TelemetrySettings:
    """Load telemetry: read from Redis (agents publish) or, with no Redis, collected by the router itself."""

    enabled: bool = True
    interval: float = 1.0  # how often the router refreshes (and, embedded, collects)
    # A report older than this is "unknown" to the policies (neutral score), never trusted as current.
    stale_after: float = 5.0
    timeout: float = 0.5  # per store read / per engine scrape
    gpu_source: str = "none"  # embedded mode: "sim" also reads a simulator's /sim/gpu


@dataclass(frozen=True)
class KubernetesDiscoverySettings:
    """`discovery.kubernetes`: watch the EndpointSlices of the named Services (or of a label selector) in one
    namespace.

    Read by router.kube.discovery.kubernetes, which documents the behaviour; docs/kubernetes.md is the reference.
    """

    # The Services whose slices to watch (label kubernetes.io/service-name): only what the config names. Written
    # as `services: [a, b]`, or `service: a` for one.
    services: tuple[str, ...] = ()
    # Or any EndpointSlice label selector (the older form): it follows every slice that carries the labels, so
    # whoever may create a Service with them in the namespace adds upstreams (docs/kubernetes.md#trust-model).
    label_selector: str | None = None
    # Or the Pods an InferencePool (inference.networking.k8s.io/v1) selects, one endpoint per target port
    # (router.kube.discovery.inference_pool): the pool's selector and ports are followed as they change.
    inference_pool: str | None = None
    namespace: str | None = None  # None: the pod's own (in-cluster), the kubeconfig context's, or "default"
    port: str | int | None = None  # a port name, or a number; None: each slice's first port
    scheme: str = "http"
    # Where an endpoint's served models come from, first found wins: the Pod's annotation (a Pod read per
    # new pod, cached), the EndpointSlice's label (the EndpointSlice controller copies Service labels), then
    # `models`. None turns a source off.
    model_annotation: str | None = "fleetroute.io/models"
    model_label: str | None = "fleetroute.io/model"
    # The EndpointSlice label (copied from the Service) with the endpoints' capacity weight; None: all 1.
    weight_label: str | None = "fleetroute.io/weight"
    models: tuple[str, ...] = ()
    kubeconfig: str | None = None  # None: in-cluster config when in a pod, else $KUBECONFIG or ~/.kube/config
    context: str | None = None  # kubeconfig context; None: its current context
    sync_timeout: float = 10.0  # start-up waits this long for the first list, then serves what it has
    watch_timeout: float = 300.0  # the API server ends each watch after this; it is resumed at once
    initial_backoff: float = 0.5  # retry delay after a failure, doubling per failure up to max_backoff
    max_backoff: float = 30.0


@dataclass(frozen=True)
class DiscoverySettings:
    """Dynamic endpoint sources; their endpoints join the static `endpoints:` list."""

    kubernetes: KubernetesDiscoverySettings | None = None


@dataclass(frozen=True)
class Settings:
    listen: Address = Address("0.0.0.0", 8080)
    # The admin listener's own connection budget: /healthz answers while the ingress is flooded.
    admin: Address = Address("127.0.0.1", 9090, max_connections=DEFAULT_ADMIN_CONNECTIONS,
                             max_connections_per_client=DEFAULT_ADMIN_CONNECTIONS_PER_CLIENT)
    endpoints: tuple[Endpoint, ...] = ()
    policies: tuple[PolicySpec, ...] = ()
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    telemetry: TelemetrySettings = TelemetrySettings()
    redis: RedisSettings = RedisSettings()
    log_level: str = "info"
    access_log: bool = True
    workers: int = 1
    # Seconds to let in-flight requests finish on shutdown.
    shutdown_grace: float = 30.0
    # The first part of shutdown_grace: open client connections are served with `Connection: close` before the
    # idle ones are closed (router/server/drain.py). Above the idle timeouts of common HTTP clients (httpx 5 s,
    # aiohttp 15 s), so they close their idle connections first. At most shutdown_grace.
    drain_connections: float = 15.0
    max_header_bytes: int = 8190  # per header line and for the request line (aiohttp parser limits)
    client_timeouts: ClientTimeouts = ClientTimeouts()
    auth: AuthSettings | None = None  # router.server.auth; None: no client keys, no admin token
    discovery: DiscoverySettings = DiscoverySettings()
    control: ControlSettings | None = None  # router.kube.control: RoutingPolicy resources; None: file policies only
    explain: ExplainSettings | None = None  # router.server.explain: sampling and recent decisions; None: the defaults
    tenancy: TenancySettings | None = None  # router.traffic.tenants: tenants, fair sharing, budgets; None: no tenants
    # router.routing.prefix.kv_events.KVEventsSettings: engines' KV-cache events; None: not subscribed
    kv_events: Any = None
    # Wedged engines (router/health/stall.py, router/server/rescue.py): for the router, not per policy, because an
    # engine stalls whichever policy sent it the request.
    stall: StallSettings = StallSettings()
    tracing: TracingSettings | None = None  # router.server.tracing: OpenTelemetry spans and export; None: off


def _address(fields: Fields, key: str, default: Address, env_prefix: str, *, others: tuple[str, ...] = (),
             ingress: bool = False) -> Address:
    sub = fields.sub(key)
    host = sub.string("host", default.host)
    port = sub.integer("port", default.port, minimum=0, maximum=65535)
    max_connections = default.max_connections
    raw = sub.get("maxConnections", "auto")
    if isinstance(raw, str) and raw != "auto":
        raise ConfigError(sub.at("maxConnections"), f"must be auto or an integer, got {_show(raw)}")
    if raw != "auto":
        max_connections = sub.integer("maxConnections", 0, minimum=1, maximum=MAX_CONNECTIONS_LIMIT)
    per_client = sub.integer("maxConnectionsPerClient", default.max_connections_per_client, minimum=0,
                             maximum=MAX_CONNECTIONS_LIMIT)
    trusted = _trusted_proxies(sub) if ingress else ()
    sub.used.update(others)  # fields another module reads (admin.tokenEnv: router.server.auth)
    sub.done()
    env_host = os.environ.get(f"{env_prefix}_HOST")
    env_port = os.environ.get(f"{env_prefix}_PORT")
    if env_host:
        host = env_host
    if env_port:
        if not env_port.isdigit() or int(env_port) > 65535:
            raise ConfigError(f"${env_prefix}_PORT", f"must be a port number, got {env_port!r}")
        port = int(env_port)
    return Address(host, port, max_connections=max_connections, max_connections_per_client=per_client,
                   trusted_proxies=trusted)


def _trusted_proxies(f: Fields) -> tuple[IPNetwork, ...]:
    """`listen.trustedProxies`: addresses or CIDR networks (`10.0.0.0/8`, `fd00::/8`, `192.0.2.7`)."""
    networks: list[IPNetwork] = []
    for path, item in f.items("trustedProxies"):
        if not isinstance(item, str):
            raise ConfigError(path, f"must be an IP address or a CIDR network like 10.0.0.0/8, got {_show(item)}")
        try:
            networks.append(ipaddress.ip_network(item.strip()))
        except ValueError:
            try:
                hint = f" (did you mean {ipaddress.ip_network(item.strip(), strict=False)}?)"
            except ValueError:
                hint = ""
            raise ConfigError(path, f"must be an IP address or a CIDR network like 10.0.0.0/8, got {_show(item)}"
                                    f"{hint}") from None
    return tuple(dict.fromkeys(networks))


def _endpoint(path: str, raw: Any) -> Endpoint:
    f = Fields(raw, path)
    endpoint_id = f.string("id")
    if not ENDPOINT_ID.match(endpoint_id):
        raise ConfigError(f.at("id"), f"must be letters, digits, '.', '_', ':' or '-', got {endpoint_id!r}")
    url = f.string("url").rstrip("/")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f.at("url"), f"must be an http:// or https:// URL with a host, got {_show(url)}")
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ConfigError(f.at("url"), f"has an invalid port: {_show(url)}") from None
    models = f.get("models")
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f.at("models"), f"must be a non-empty list of model names, got {_show(models)}")
    weight = f.number("weight", 1.0, minimum=0.0, maximum=1000.0, exclusive_minimum=True)
    f.done()
    return Endpoint(id=endpoint_id, url=url, models=tuple(dict.fromkeys(models)), weight=weight)


def expand_policy(path: str, raw: Any, registry: PolicyRegistry) -> tuple[Any, str | None]:
    """A policy entry with its `preset` expanded (router/config/presets.py), and the preset's name; an entry
    without one as it is, and None."""
    if not isinstance(raw, Mapping) or "preset" not in raw:
        return raw, None
    try:
        return presets.expand(raw, strategy_blocks={p.name: p.config_key for p in registry.all()})
    except presets.PresetError as exc:
        raise ConfigError(f"{path}.{exc.field}" if path else exc.field, exc.message) from None


def _policy(path: str, raw: Any, registry: PolicyRegistry) -> PolicySpec:
    # Expanded before parsing, so the expanded entry gets every check a hand-written one gets. Errors in it
    # name the entry as `policies[0] (preset realtime-chat)`: its fields are the operator's or the preset's
    # (`fleetroute router --show-preset` prints those).
    raw, preset = expand_policy(path, raw, registry)
    if preset is not None:
        path = f"{path} (preset {preset})"
    f = Fields(raw, path)
    f.used.add("preset")  # listed among the known fields in an unknown-field error
    name = f.string("name")
    if not POLICY_NAME.match(name):
        raise ConfigError(f.at("name"), f"must be a lower-case DNS label (a-z, 0-9, '-'), got {name!r}")
    if name == FALLBACK_POLICY:
        raise ConfigError(f.at("name"), f"{name!r} is reserved for the built-in policy of unmatched models")
    models = f.get("models", ["*"])
    if not isinstance(models, list) or not models or not all(isinstance(m, str) and m for m in models):
        raise ConfigError(f.at("models"), f"must be a non-empty list of model names or patterns, got {_show(models)}")
    strategy_name = f.choice("strategy", "adaptive", registry.names())
    f.used.update(p.config_key for p in registry.all())  # known fields, whether present or not
    params = None
    # Every strategy block present is validated (a typo in an unused block is still a typo), but only
    # the selected strategy's config is kept.
    for policy in registry.all():
        if not f.has(policy.config_key) and policy.name != strategy_name:
            continue
        block = f.get(policy.config_key)  # the selected strategy's block may be left out: its defaults
        if block is None:
            block = {}
        if not isinstance(block, Mapping):
            raise ConfigError(f.at(policy.config_key), f"must be a mapping, got {_show(block)}")
        try:
            parsed = policy.parse(block)
        except PolicyConfigError as exc:
            where = f.at(policy.config_key)
            raise ConfigError(f"{where}.{exc.field}" if exc.field else where, exc.message) from None
        if policy.name == strategy_name:
            params = parsed
    t = f.sub("timeouts")
    timeouts = Timeouts(
        connect=t.duration("connect", Timeouts.connect),
        first_byte=t.duration("firstByte", Timeouts.first_byte),
        idle=t.duration("idle", Timeouts.idle),
        total=t.duration("total", 1.0) if t.get("total") is not None else None,
    )
    t.done()
    r = f.sub("retries")
    retries = Retries(
        attempts=r.integer("attempts", Retries.attempts, minimum=1, maximum=10),
        budget_percent=r.number("budgetPercent", Retries.budget_percent, minimum=0, maximum=100),
        min_per_second=r.number("minRetriesPerSecond", Retries.min_per_second, minimum=0, maximum=100_000),
    )
    r.done()
    health = _health(f)
    stickiness = _stickiness(f.sub("stickiness"))
    from router.traffic.admission import (
        parse_admission,  # here: a layer above the reader (docs/architecture.md)
    )

    admission = parse_admission(f.sub("admission"))
    needed_by = None
    if getattr(params, "needs_cost", False):
        needed_by = f"strategy {strategy_name} with loadUnit: tokens"
    elif admission.order != "fifo" and admission.max_concurrent_per_endpoint is not None:
        needed_by = f"admission.order: {admission.order}"
    cost = _cost(f.sub("cost"), present=f.get("cost") is not None, needed_by=needed_by)
    try:
        aliases = parse_aliases(f.get("aliases"))
    except AliasConfigError as exc:
        raise ConfigError(f.at("aliases") + exc.field, exc.message) from None
    try:
        lora = parse_lora(f.get("lora"))
    except LoraConfigError as exc:
        raise ConfigError(f.at("lora") + exc.field, exc.message) from None
    f.done()
    return PolicySpec(
        name=name,
        models=tuple(models),
        strategy=strategy_name,
        params=params,
        timeouts=timeouts,
        retries=retries,
        stickiness=stickiness,
        health=health,
        admission=admission,
        cost=cost,
        preset=preset,
        aliases=aliases,
        lora=lora,
    )


def _cost(f: Fields, *, present: bool, needed_by: str | None) -> CostSettings | None:
    """A policy's `cost:` block. Present, it turns estimation on unless it says `enabled: false`; absent, the
    defaults apply when `needed_by` (what in the policy uses estimates) is set, else nothing is estimated."""
    enabled = f.boolean("enabled", True)
    d = CostSettings()
    keys: list[HashKey | None] = []
    for field_name, default in (("sessionKey", "header:x-session-id"), ("fallbackKey", "body:user")):
        raw = f.get(field_name, default)
        if raw is None:
            keys.append(None)
            continue
        try:
            keys.append(parse_key(raw))
        except PolicyConfigError as exc:
            raise ConfigError(f.at(field_name), exc.message) from None
    low, high = CHARS_PER_TOKEN_RANGE
    settings = CostSettings(
        prefill_weight=f.number("prefillWeight", d.prefill_weight, minimum=0, maximum=100),
        chars_per_token=f.number("charsPerToken", d.chars_per_token, minimum=low, maximum=high),
        prior_output_tokens=f.number("priorOutputTokens", d.prior_output_tokens, minimum=0, maximum=10_000_000),
        session_key=keys[0],
        fallback_key=keys[1],
        max_sessions=f.integer("maxSessions", d.max_sessions, minimum=0, maximum=1_000_000),
        window=f.integer("window", d.window, minimum=1, maximum=100_000),
    )
    f.done()
    if not enabled:
        if needed_by is not None:
            raise ConfigError(f.at("enabled"), f"cannot be false: {needed_by} needs cost estimates")
        return None
    return settings if present or needed_by is not None else None


def _health(f: Fields) -> HealthSettings:
    """The policy's `health`, `outlierDetection`, `circuitBreaker`, `slowStart` and `panicThreshold`."""
    a = f.sub("health")
    d = ActiveHealthSettings()
    path = a.string("path", d.path)
    if not path.startswith("/"):
        raise ConfigError(a.at("path"), f"must start with '/', got {path!r}")
    active = ActiveHealthSettings(
        enabled=a.boolean("enabled", d.enabled),
        interval=a.duration("interval", d.interval),
        timeout=a.duration("timeout", d.timeout),
        path=path,
        healthy_threshold=a.integer("healthyThreshold", d.healthy_threshold, minimum=1, maximum=100),
        unhealthy_threshold=a.integer("unhealthyThreshold", d.unhealthy_threshold, minimum=1, maximum=100),
        probe_request=a.boolean("probeRequest", d.probe_request),
    )
    gpu = a.boolean("gpu", True)
    a.done()
    o = f.sub("outlierDetection")
    od = OutlierSettings()
    outlier = OutlierSettings(
        enabled=o.boolean("enabled", od.enabled),
        consecutive_failures=o.integer("consecutiveFailures", od.consecutive_failures, minimum=1, maximum=1000),
        base_ejection_time=o.duration("baseEjectionTime", od.base_ejection_time),
        max_ejection_time=o.duration("maxEjectionTime", od.max_ejection_time),
        max_ejection_percent=o.integer("maxEjectionPercent", od.max_ejection_percent, minimum=0, maximum=100),
    )
    if outlier.max_ejection_time < outlier.base_ejection_time:
        raise ConfigError(o.at("maxEjectionTime"), "must be >= baseEjectionTime")
    o.done()
    b = f.sub("circuitBreaker")
    bd = BreakerSettings()
    breaker = BreakerSettings(
        enabled=b.boolean("enabled", bd.enabled),
        window=b.duration("window", bd.window),
        min_requests=b.integer("minRequests", bd.min_requests, minimum=1, maximum=1_000_000),
        failure_ratio=b.number("failureRatio", bd.failure_ratio, minimum=0, maximum=1, exclusive_minimum=True),
        open_duration=b.duration("openDuration", bd.open_duration),
        half_open_requests=b.integer("halfOpenRequests", bd.half_open_requests, minimum=1, maximum=100),
    )
    b.done()
    s = f.sub("slowStart")
    sd = SlowStartSettings()
    slow_start = SlowStartSettings(
        enabled=s.boolean("enabled", sd.enabled),
        window=s.duration("window", sd.window),
        aggression=s.number("aggression", sd.aggression, minimum=0, maximum=100, exclusive_minimum=True),
        min_weight=s.number("minWeight", sd.min_weight, minimum=0, maximum=1, exclusive_minimum=True),
    )
    s.done()
    panic = f.integer("panicThreshold", HealthSettings.panic_threshold, minimum=0, maximum=100)
    return HealthSettings(active=active, outlier=outlier, breaker=breaker, slow_start=slow_start, gpu=gpu,
                          panic_threshold=panic)


def _stickiness(f: Fields) -> StickinessSettings:
    defaults = StickinessSettings()
    enabled = f.boolean("enabled", bool(f.raw))  # a stickiness block turns it on unless it says otherwise
    keys = []
    for field_name, default in (("key", "header:x-session-id"), ("fallbackKey", "body:user")):
        raw = f.get(field_name, default)
        if raw is None and field_name == "fallbackKey":
            keys.append(None)
            continue
        try:
            keys.append(parse_key(raw))
        except PolicyConfigError as exc:
            raise ConfigError(f.at(field_name), exc.message) from None
    ttl = f.duration("ttl", defaults.ttl)
    factor = f.get("maxLoadFactor", defaults.max_load_factor)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 1 < factor < math.inf:
        raise ConfigError(f.at("maxLoadFactor"), f"must be a number > 1, got {_show(factor)}")
    f.done()
    return StickinessSettings(enabled=enabled, key=keys[0], fallback_key=keys[1], ttl=ttl,
                              max_load_factor=float(factor))


def _redis(top: Fields) -> RedisSettings:
    """`redis:` (router/runtime/redis_client.py connects): a standalone server or a cluster node by `url` (without the
    key, $REDIS_URL; `url: null` turns Redis off), or a Sentinel-watched master by `sentinel`; the password
    from `passwordEnv` or `passwordFile`, never from this file."""
    sub = top.sub("redis")
    sentinel = _sentinel(sub.sub("sentinel")) if sub.get("sentinel") is not None else None
    sub.used.add("url")  # a known field whether present or not (the unknown-field error lists it)
    if sub.has("url") or sentinel is not None:
        url = sub.get("url")
        where = sub.at("url")
    else:
        url = os.environ.get("REDIS_URL") or None
        where = "$REDIS_URL"
    cluster = sub.boolean("cluster", False)
    username = sub.string("username") if sub.get("username") is not None else None
    password, source = _secret(sub, "password")
    sub.done()
    if sentinel is not None:
        if url is not None:
            raise ConfigError(where, "must be left out with redis.sentinel (the sentinels name the master)")
        if cluster:
            raise ConfigError(sub.at("cluster"), "cannot be combined with redis.sentinel")
        return RedisSettings(sentinel=sentinel, username=username, password=password, password_source=source)
    if url is None:
        if password is not None or username is not None or cluster:
            raise ConfigError(sub.path, "has connection options but no url or sentinel (Redis is off)")
        return RedisSettings()
    parts = _redis_url(where, url)
    if password is not None and parts.password:
        raise ConfigError(where, "carries a password and redis.passwordEnv/passwordFile gives another: keep one")
    if cluster and (parts.scheme == "unix" or _redis_db(where, parts) != 0):
        raise ConfigError(where, "must be redis:// or rediss:// with database 0 for a cluster")
    return RedisSettings(url=url, cluster=cluster, username=username, password=password, password_source=source)


MAX_REDIS_DB = 1023  # as sentinel.db: far above Redis's default 16 databases, and a bound on a typo


def _redis_url(where: str, url: Any) -> SplitResult:
    """A Redis URL checked as redis-py will read it, so that a bad port or database is a config error naming
    the field, not a traceback when the client is made (a bad port), a failure at the first command (`/-1`)
    or silently database 0 (`/x`)."""
    try:
        parts = urlsplit(url) if isinstance(url, str) else None
    except ValueError:  # an unclosed IPv6 bracket
        parts = None
    if parts is None or parts.scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(where, f"must be a redis://, rediss:// or unix:// URL, got {_show(url)}")
    try:
        port = parts.port
    except ValueError:  # not digits, or above 65535
        port = 0
    if port == 0:
        raise ConfigError(where, f"has an invalid port (want 1 to 65535): {_show(url)}")
    _redis_db(where, parts)
    try:  # the query's other connection options (socket_timeout=...), as redis-py parses them
        parse_redis_url(url)
    except ValueError as exc:  # its messages name the option, never the URL
        raise ConfigError(where, f"has an invalid query option: {str(exc).rstrip('.')}") from None
    return parts


def _redis_db(where: str, parts: SplitResult) -> int:
    """The database a Redis URL selects: `?db=N`, else the path's `/N` (redis:// and rediss://), else 0."""
    query = parse_qs(parts.query)
    if "db" in query:
        raw, what = query["db"][0], "the db query parameter"
    elif parts.scheme != "unix":
        raw, what = unquote(parts.path).replace("/", ""), "the database (the URL's path)"
    else:
        return 0
    if raw == "":
        return 0
    if not raw.isascii() or not raw.isdigit() or int(raw) > MAX_REDIS_DB:
        raise ConfigError(where, f"{what} must be an integer from 0 to {MAX_REDIS_DB}, got {raw!r}")
    return int(raw)


def parse_redis(block: Any) -> RedisSettings:
    """A `redis:` block on its own (the agent's --redis* flags); errors name `redis.<field>`."""
    return _redis(Fields({"redis": block}, ""))


def _sentinel(f: Fields) -> SentinelSettings:
    master = f.string("masterName")
    addresses: list[tuple[str, int]] = []
    for path, item in f.items("addresses"):
        host, _, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
        host = host.strip("[]")  # [::1]:26379
        if not host or "/" in host or "@" in host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(path, f"must be host:port, got {_show(item)}")
        addresses.append((host, int(port)))
    if not addresses:
        raise ConfigError(f.at("addresses"), "must list at least one sentinel as host:port")
    if len(addresses) > 32:
        raise ConfigError(f.at("addresses"), f"lists {len(addresses)} sentinels, at most 32 are allowed")
    db = f.integer("db", 0, minimum=0, maximum=MAX_REDIS_DB)
    tls = f.boolean("tls", False)
    password, _ = _secret(f, "password")
    f.done()
    return SentinelSettings(master_name=master, addresses=tuple(addresses), db=db, tls=tls, password=password)


# Kubernetes names, as the API server validates them (apimachinery validation): a DNS-1123 label (namespace),
# a DNS-1035 label (Service), an IANA service name (port name), a qualified name (label/annotation key) and
# a label value.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?$")
_QUALIFIED_NAME = re.compile(
    r"^(?:(?=[^/]{1,253}/)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"(?=[^/]{1,63}$)[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
def _optional_key(f: Fields, key: str, default: str | None) -> str | None:
    """A label or annotation key, or null to turn that source off."""
    if f.has(key) and f.get(key) is None:
        return None
    value = f.string(key, default)
    if not _QUALIFIED_NAME.match(value):
        raise ConfigError(f.at(key), f"must be a Kubernetes label or annotation key like fleetroute.io/models, "
                                     f"got {value!r}")
    return value


def _kubernetes_discovery(f: Fields) -> KubernetesDiscoverySettings:
    d = KubernetesDiscoverySettings()
    # A misspelt key is reported as such, before the checks below would complain about what it meant to set.
    f.used.update(("service", "services", "labelSelector", "inferencePool", "namespace", "port", "scheme",
                   "modelAnnotation", "modelLabel", "weightLabel",
                   "models", "kubeconfig", "context", "syncTimeout", "watchTimeout", "initialBackoff", "maxBackoff"))
    f.done()
    services = _services(f)
    selector = f.string("labelSelector") if f.get("labelSelector") is not None else None
    pool = f.string("inferencePool") if f.get("inferencePool") is not None else None
    sources = [name for name, set_ in (("services", bool(services)), ("labelSelector", selector is not None),
                                       ("inferencePool", pool is not None)) if set_]
    if len(sources) > 1:
        raise ConfigError(f.at(sources[1]), f"set one of services, labelSelector or inferencePool, not "
                                            f"{' and '.join(sources)}")
    if not sources:
        raise ConfigError(f.at("services"), "is required (or labelSelector, or inferencePool): the Services "
                                            "whose EndpointSlices to watch")
    if pool is not None and not _DNS_SUBDOMAIN.match(pool):
        raise ConfigError(f.at("inferencePool"), f"must be an InferencePool name (a lower-case DNS subdomain), "
                                                 f"got {pool!r}")
    if pool is not None and f.get("port") is not None:
        raise ConfigError(f.at("port"), "cannot be set with inferencePool: the pool's targetPorts are the ports")
    if selector is not None and (problem := _label_selector_problem(selector)):
        raise ConfigError(f.at("labelSelector"), problem)
    namespace = f.string("namespace") if f.get("namespace") is not None else None
    if namespace is not None and not _DNS_LABEL.match(namespace):
        raise ConfigError(f.at("namespace"), f"must be a namespace name (a lower-case DNS label), got {namespace!r}")
    port = f.get("port")
    if port is not None:
        by_number = isinstance(port, int) and not isinstance(port, bool) and 1 <= port <= 65535
        if not by_number and not (isinstance(port, str) and _PORT_NAME.match(port)):
            raise ConfigError(f.at("port"), f"must be a port name (like http) or a number from 1 to 65535, "
                                            f"got {_show(port)}")
    models = f.get("models", [])
    if not isinstance(models, list) or not all(isinstance(m, str) and m.strip() for m in models):
        raise ConfigError(f.at("models"), f"must be a list of model names, got {_show(models)}")
    annotation = _optional_key(f, "modelAnnotation", d.model_annotation)
    label = _optional_key(f, "modelLabel", d.model_label)
    weight_label = _optional_key(f, "weightLabel", d.weight_label)
    if annotation is None and label is None and not models:
        raise ConfigError(f.at("models"), "is required when modelAnnotation and modelLabel are both null: "
                                          "discovered endpoints need a model")
    kubeconfig = f.string("kubeconfig") if f.get("kubeconfig") is not None else None
    context = f.string("context") if f.get("context") is not None else None
    settings = KubernetesDiscoverySettings(
        services=services,
        label_selector=selector,
        inference_pool=pool,
        namespace=namespace,
        port=port,
        scheme=f.choice("scheme", d.scheme, ("http", "https")),
        model_annotation=annotation,
        model_label=label,
        weight_label=weight_label,
        models=tuple(dict.fromkeys(m.strip() for m in models)),
        kubeconfig=kubeconfig,
        context=context,
        sync_timeout=f.duration("syncTimeout", d.sync_timeout),
        watch_timeout=f.duration("watchTimeout", d.watch_timeout),
        initial_backoff=f.duration("initialBackoff", d.initial_backoff),
        max_backoff=f.duration("maxBackoff", d.max_backoff),
    )
    if settings.watch_timeout < 1:
        raise ConfigError(f.at("watchTimeout"), f"must be at least 1s, got {_show(f.get('watchTimeout'))}")
    if settings.max_backoff < settings.initial_backoff:
        raise ConfigError(f.at("maxBackoff"), "must be >= initialBackoff")
    f.done()
    return settings


MAX_SERVICES = 64  # one label selector lists them all: keep it well inside the API server's URL limits


def _services(f: Fields) -> tuple[str, ...]:
    """`services: [a, b]`, or `service: a`; () when neither is set."""
    if f.get("service") is not None and f.get("services") is not None:
        raise ConfigError(f.at("services"), "set either service or services, not both")
    if f.get("service") is not None:
        names, where = [f.string("service")], f.at("service")
    else:
        names, where = f.get("services") or [], f.at("services")
        if not isinstance(names, list) or len(names) > MAX_SERVICES:
            raise ConfigError(where, f"must be a list of at most {MAX_SERVICES} Service names, got {_show(names)}")
    for name in names:
        if not isinstance(name, str) or not _DNS_1035.match(name):
            raise ConfigError(where, f"must be a Service name (a lower-case DNS label), got {_show(name)}")
    return tuple(dict.fromkeys(names))


def _discovery(top: Fields) -> DiscoverySettings:
    """`discovery: {kubernetes: {...}}`; a null or absent block turns that source off."""
    d = top.sub("discovery")
    kubernetes = _kubernetes_discovery(d.sub("kubernetes")) if d.get("kubernetes") is not None else None
    d.done()
    return DiscoverySettings(kubernetes=kubernetes)


FALLBACK_POLICY = "builtin-fallback"  # reserved: per-policy state is keyed by name


def default_policy(registry: PolicyRegistry) -> PolicySpec:
    """Used for models no configured policy matches."""
    adaptive = registry.get("adaptive")
    assert adaptive is not None
    return PolicySpec(name=FALLBACK_POLICY, models=("*",), strategy="adaptive", params=adaptive.parse({}))


def parse_settings(raw: Any, registry: PolicyRegistry | None = None) -> Settings:
    registry = registry or PolicyRegistry()
    top = Fields(raw, "")
    listen = _address(top, "listen", Settings.listen, "FLEETROUTE_LISTEN", ingress=True)
    admin = _address(top, "admin", Settings.admin, "FLEETROUTE_ADMIN", others=("tokenEnv",))
    endpoints = tuple(_endpoint(path, item) for path, item in top.items("endpoints"))
    seen: set[str] = set()
    for i, ep in enumerate(endpoints):
        if ep.id in seen:
            raise ConfigError(f"endpoints[{i}].id", f"duplicate endpoint id {ep.id!r}")
        seen.add(ep.id)
    policies = tuple(_policy(path, item, registry) for path, item in top.items("policies"))
    names: set[str] = set()
    for i, pol in enumerate(policies):
        if pol.name in names:
            raise ConfigError(f"policies[{i}].name", f"duplicate policy name {pol.name!r}")
        names.add(pol.name)
    limits = top.sub("limits")
    max_body = limits.integer("maxBodyBytes", DEFAULT_MAX_BODY_BYTES, minimum=1024)
    max_header = limits.integer("maxHeaderBytes", Settings.max_header_bytes, minimum=1024, maximum=65536)
    client_timeouts = ClientTimeouts(
        header=limits.duration("headerTimeout", ClientTimeouts.header),
        body=limits.duration("bodyTimeout", ClientTimeouts.body),
        keep_alive=limits.duration("keepAliveTimeout", ClientTimeouts.keep_alive),
        write=limits.duration("writeTimeout", ClientTimeouts.write),
    )
    limits.done()
    tel = top.sub("telemetry")
    telemetry = TelemetrySettings(
        enabled=tel.boolean("enabled", True),
        interval=tel.duration("interval", TelemetrySettings.interval),
        stale_after=tel.duration("staleAfter", TelemetrySettings.stale_after),
        timeout=tel.duration("timeout", TelemetrySettings.timeout),
        gpu_source=tel.choice("gpuSource", "none", GPU_SOURCES),
    )
    tel.done()
    redis = _redis(top)
    discovery = _discovery(top)
    log = top.sub("logging")
    log_level = log.choice("level", "info", LOG_LEVELS)
    access_log = log.boolean("accessLog", True)
    log.done()
    workers = top.integer("workers", 1, minimum=1, maximum=256)
    shutdown_grace = top.duration("shutdownGrace", Settings.shutdown_grace)
    drain_connections = _drain_connections(top, shutdown_grace)
    from router.traffic.tenants import DEFAULT_TENANT, parse_tenancy  # here: a layer above the reader

    tenancy = parse_tenancy(top.sub("tenancy")) if top.get("tenancy") is not None else None
    if tenancy is not None and tenancy.budgets and not redis.enabled:
        budgeted = next(t.name for t in tenancy.tenants if t.budgeted)
        raise ConfigError("tenancy.tenants", f"tenant {budgeted!r} has a budget, and budgets need redis (they are "
                                             "shared between router replicas through it): set redis.url, or leave "
                                             "requestsPerMinute and tokensPerMinute out")
    from router.server.auth import parse_auth  # here: a layer above the reader (docs/architecture.md)

    auth = parse_auth(top, tenancy.names() if tenancy is not None else (DEFAULT_TENANT,))
    from router.kube.control import parse_control  # here: a layer above the reader (docs/architecture.md)

    control = parse_control(top)
    from router.server.explain import parse_explain  # here: a layer above the reader (docs/architecture.md)

    explain = parse_explain(top.sub("explain")) if top.get("explain") is not None else None
    stall = _stall(top.sub("stallDetection"))
    from router.server.tracing import parse_tracing  # here: a layer above the reader (docs/architecture.md)

    tracing = parse_tracing(top.sub("tracing")) if top.get("tracing") is not None else None
    # Aliases across policies; their targets against the endpoints when discovery cannot add any (routing/aliases.py).
    served = {m for ep in endpoints for m in ep.models} if discovery.kubernetes is None else None
    problem = cross_check(((f"policies[{i}].aliases[{j}]", alias) for i, pol in enumerate(policies)
                           for j, alias in enumerate(pol.aliases)), served)
    if problem is not None:
        raise ConfigError(*problem)
    kv_events = None
    if top.get("kvEvents") is not None:
        from router.routing.prefix.kv_events import (
            parse_kv_events,  # here: a layer above the reader (docs/architecture.md)
        )

        kv_events = parse_kv_events(top.sub("kvEvents"))
    top.done()
    return Settings(
        listen=listen,
        admin=admin,
        endpoints=endpoints,
        policies=policies,
        max_body_bytes=max_body,
        telemetry=telemetry,
        redis=redis,
        log_level=log_level,
        access_log=access_log,
        workers=workers,
        shutdown_grace=shutdown_grace,
        drain_connections=drain_connections,
        max_header_bytes=max_header,
        client_timeouts=client_timeouts,
        auth=auth,
        discovery=discovery,
        control=control,
        explain=explain,
        tenancy=tenancy,
        stall=stall,
        tracing=tracing,
        kv_events=kv_events,
    )


def _stall(f: Fields) -> StallSettings:
    d = StallSettings()
    stall = StallSettings(
        enabled=f.boolean("enabled", d.enabled),
        min_silence=f.duration("minSilence", d.min_silence),
        silence_factor=f.number("silenceFactor", d.silence_factor, minimum=1, maximum=1000),
        probe_timeout=f.duration("probeTimeout", d.probe_timeout),
    )
    f.done()
    return stall


def _drain_connections(top: Fields, shutdown_grace: float) -> float:
    """`drainConnections`: 0 (close idle connections at once) up to `shutdownGrace`, which it is part of; by
    default 15 s, or all of a shorter shutdownGrace."""
    top.used.add("drainConnections")  # a known field whether present or not (the unknown-field error lists it)
    if not top.has("drainConnections"):
        return min(Settings.drain_connections, shutdown_grace)
    value = top.get("drainConnections")
    seconds = parse_duration(value)
    if seconds is None or seconds < 0:
        raise ConfigError("drainConnections", f"must be a duration like 15s or 0s, got {_show(value)}")
    if seconds > shutdown_grace:
        raise ConfigError("drainConnections", f"must not exceed shutdownGrace ({shutdown_grace:g}s), which it is "
                                              f"part of; got {_show(value)}")
    return seconds


def load_settings(path: str, registry: PolicyRegistry | None = None) -> Settings:
    """Read and validate a YAML config file. Raises ConfigError with a precise message."""
    try:
        with open(path, encoding="utf-8") as fh:
            raw = yaml.safe_load(fh)
    except FileNotFoundError:
        raise ConfigError(path, "config file not found") from None
    except OSError as exc:
        raise ConfigError(path, f"cannot read config file: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(path, f"invalid YAML{where}: {problem}") from None
    return parse_settings(raw, registry)
