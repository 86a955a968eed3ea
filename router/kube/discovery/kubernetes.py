"""Endpoints from the Kubernetes API: the EndpointSlices of the named Services, listed once and then watched.

The loop is client-go's Reflector, written out on the official `kubernetes` client's asyncio API
(`kubernetes.aio`, on aiohttp, no threads; 37.0 is the first release whose asyncio API has `watch`):

1. **List** the EndpointSlices that match the selector (`kubernetes.io/service-name in (<services>)`, or the
   configured `labelSelector`) in one namespace, keep the list's `resourceVersion`, and replace the known
   slices in one step. They are never cleared first, so a relist cannot make endpoints flap.
2. **Watch** from that resourceVersion with `allowWatchBookmarks=true`. ADDED, MODIFIED and DELETED events
   update one slice each; every event, BOOKMARK included, advances the resourceVersion. A watch that ends
   (the server's `timeoutSeconds`, a dropped connection, a load balancer's idle cut) is resumed at once from
   there, without a list. Bookmarks matter when the watched slices are quiet while the rest of the cluster
   is not: they move our resourceVersion past history the API server may compact, so the resume still
   works.
3. **410 Gone** (an ERROR event with code 410, or an HTTP 410) means our resourceVersion is older than the
   API server keeps. List again (`fleetroute_discovery_relists_total{reason="expired"}`), then watch.
4. **An API-server outage** (a list or watch that cannot be made, or an error answer) is counted in
   `fleetroute_discovery_errors_total{kind}`, sets `fleetroute_discovery_up` to 0, logs one warning, and is
   retried with jittered exponential backoff (`initialBackoff` doubling up to `maxBackoff`). The endpoints
   stay as last known: an unreachable API server says nothing about the pods, which usually keep serving
   (Envoy keeps its last EDS assignment the same way). Recovery logs once and sets the gauge back to 1.

**Endpoints.** Each address in a slice is one endpoint. Its id is the Pod's name (`targetRef.name`), else the
address; its URL is `<scheme>://<address>:<port>`, the port found by name (or given as a number) in the
config, else the slice's first port. Conditions follow the discovery.k8s.io/v1 rules (an unset `ready` or
`serving` means true):

- ready and not terminating: **serving**;
- terminating (still serving or not), or not ready: **draining**. The endpoint is kept, so its in-flight
  requests finish and its models stay known (a request gets 503 `no_endpoint`, not 404), but no new request
  goes there. An operator's drain and discovery's draining combine: either one is enough;
- in no slice any more: removed.

A pod listed twice (by two slices during a slice rebalance, or by an IPv4 and an IPv6 slice) is one
endpoint: the serving entry wins, then IPv4.

**Models**, first source found wins:

1. the Pod's annotation `modelAnnotation` (default `fleetroute.io/models: "llama-3-8b,llama-3-8b-lora"`):
   model names may contain `/` and one vLLM may serve several LoRA adapters, which labels cannot express. It
   costs one Pod GET per new pod (cached by pod uid; a changed annotation is seen when the pod is replaced,
   as a Deployment rollout does). A pod whose read fails is left out and retried with backoff: guessing its
   models could route a model to an engine that lacks it;
2. the EndpointSlice's label `modelLabel` (default `fleetroute.io/model`). The EndpointSlice controller copies
   a Service's labels to its slices, so labelling the Service is enough; one model, label-value characters
   only, no Pod reads (no extra RBAC);
3. the configured `models`.

An endpoint with no model from any source is left out, with one warning.

**Coalescing.** Watch events only update the slice map and set a flag. One publisher task turns the map
into endpoints and calls `Balancer.set_endpoints` once for however many events arrived meanwhile (a burst
that arrived in one read never yields in between), and not at all when nothing routable changed (Finagle's
collapsed updates; `fleetroute_discovery_updates_total` counts the calls). The static `endpoints:` of the
config are always in the set; a discovered endpoint with a static endpoint's id is ignored, with a warning.

**Trust.** Discovery follows only the Services the config names (`services`: the API server filters on the
`kubernetes.io/service-name` label, which the EndpointSlice controller sets from the owning Service), so
whoever may create Services or EndpointSlices in the namespace cannot add an upstream unless they can change
those Services. A `labelSelector` (the older form, still read) follows any slice that carries its labels,
and a Service is enough to make one: start-up logs a warning saying so (docs/kubernetes.md#trust-model).

**Configuration.** With `kubeconfig` unset the router uses the in-cluster service account when it runs in a
pod (`KUBERNETES_SERVICE_HOST` is set), else `$KUBECONFIG` or `~/.kube/config`. The namespace, when not
configured, is the pod's own (in-cluster) or the kubeconfig context's, else `default`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes.aio import client, config, watch
from kubernetes.aio.client.exceptions import ApiException

from router.config.settings import ConfigError, KubernetesDiscoverySettings
from router.model import Endpoint, EndpointState
from router.routing.balancer import Balancer
from router.runtime.metrics import RouterMetrics
from router.runtime.progress import Progress

log = logging.getLogger("fleetroute.discovery")

SOURCE = "kubernetes"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
IN_CLUSTER_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
LIST_PAGE_SIZE = 500
REQUEST_TIMEOUT = 30.0  # seconds, for a list page or a Pod read
POD_READS_AT_ONCE = 8


# What a reflector lists and watches: the list call, its twin that leaves the response unread (for a watch),
# and the model type of the watched objects (`KubernetesDiscovery._resource_calls`).
ResourceCalls = tuple[Callable[..., Any], Callable[..., Any], str]


class Expired(Exception):
    """The API server no longer has our resourceVersion (410 Gone): relist."""


@dataclass(frozen=True, slots=True)
class SliceEndpoint:
    """One address of one EndpointSlice, as discovery reads it."""

    id: str
    url: str
    state: EndpointState
    pod: str | None  # the Pod's name when targetRef is a Pod (its annotation may name the models)
    pod_uid: str | None
    label_models: tuple[str, ...]  # from the slice's model label
    ipv6: bool
    weight: float = 1.0  # from the slice's weight label (its Service's): relative capacity

    @property
    def pod_key(self) -> str | None:
        return self.pod_uid or self.pod


def service_selector(services: Sequence[str]) -> str:
    """The label selector of the named Services' EndpointSlices: the EndpointSlice controller labels each slice
    `kubernetes.io/service-name=<its Service>` (discovery.k8s.io/v1), so a set-based requirement lists them
    all in one list and one watch, filtered by the API server."""
    if len(services) == 1:
        return f"{SERVICE_NAME_LABEL}={services[0]}"
    return f"{SERVICE_NAME_LABEL} in ({','.join(services)})"


def parse_models(text: str | None) -> tuple[str, ...]:
    """`"a, b,,a"` -> `("a", "b")`: comma-separated names, blanks and repeats dropped."""
    return tuple(dict.fromkeys(m.strip() for m in (text or "").split(",") if m.strip()))


def endpoint_state(conditions: Any) -> EndpointState:
    """discovery.k8s.io/v1 conditions -> serving or draining (an unset ready or serving means true)."""
    ready = getattr(conditions, "ready", None)
    serving = getattr(conditions, "serving", None)
    terminating = getattr(conditions, "terminating", None)
    if terminating:
        return EndpointState.DRAINING
    routable = ready if ready is not None else (serving if serving is not None else True)
    return EndpointState.SERVING if routable else EndpointState.DRAINING


def parse_weight(value: str | None) -> float:
    """A weight label's value (`1.8`); absent or unusable: 1 (a label value cannot be validated at apply
    time, so a bad one is logged, never fatal)."""
    if value is None:
        return 1.0
    try:
        weight = float(value)
    except ValueError:
        weight = -1.0
    if not 0 < weight <= 1000:
        log.warning("ignoring an invalid endpoint weight label (want a number in (0, 1000])", extra={"value": value})
        return 1.0
    return weight


def slice_port(ports: Sequence[Any] | None, wanted: str | int | None) -> int | None:
    """The port number to use: `wanted` if a number, the port named `wanted`, else the first port."""
    if isinstance(wanted, int):
        return wanted
    for port in ports or ():
        if port.port is not None and (wanted is None or port.name == wanted):
            return int(port.port)
    return None


def slice_endpoints(obj: Any, settings: KubernetesDiscoverySettings) -> tuple[list[SliceEndpoint], str | None]:
    """The endpoints of one `V1EndpointSlice`, and why there are none when a port is missing."""
    labels = (obj.metadata.labels if obj.metadata is not None else None) or {}
    label_models = parse_models(labels.get(settings.model_label)) if settings.model_label else ()
    weight = parse_weight(labels.get(settings.weight_label)) if settings.weight_label else 1.0
    endpoints = obj.endpoints or []
    port = slice_port(obj.ports, settings.port)
    if port is None:
        wanted = f"a port named {settings.port!r}" if settings.port is not None else "a port"
        return [], f"has no {wanted}" if endpoints else None
    ipv6 = obj.address_type == "IPv6"
    out = []
    for ep in endpoints:
        if not ep.addresses:
            continue
        address = ep.addresses[0]  # the EndpointSlice controller always writes exactly one
        host = f"[{address}]" if ":" in address else address
        ref = ep.target_ref
        name = ref.name if ref is not None and ref.name else None
        is_pod = ref is not None and ref.kind == "Pod" and name is not None
        out.append(SliceEndpoint(
            id=name or address,
            url=f"{settings.scheme}://{host}:{port}",
            state=endpoint_state(ep.conditions),
            pod=name if is_pod else None,
            pod_uid=(ref.uid or None) if is_pod else None,
            label_models=label_models,
            ipv6=ipv6,
            weight=weight,
        ))
    return out, None


def merge(slices: Iterable[list[SliceEndpoint]]) -> list[SliceEndpoint]:
    """One entry per id: serving before draining, IPv4 before IPv6, then by URL (deterministic)."""
    best: dict[str, SliceEndpoint] = {}
    for entries in slices:
        for entry in entries:
            rank = (entry.state is not EndpointState.SERVING, entry.ipv6, entry.url)
            current = best.get(entry.id)
            if current is None or rank < (current.state is not EndpointState.SERVING, current.ipv6, current.url):
                best[entry.id] = entry
    return sorted(best.values(), key=lambda e: e.id)


class KubernetesDiscovery:
    """Watches EndpointSlices and keeps the balancer's endpoint set (static + discovered) current.

    router.kube.discovery.inference_pool subclasses it for Pods selected by an InferencePool: the hooks are
    `_resource_calls` (what is listed and watched), `_endpoints_of` (one object's endpoints), `_start_watching`
    and `EMPTY_WARNING`; the metrics are labelled with `source`.
    """

    source = SOURCE
    EMPTY_WARNING = "no EndpointSlices match; is the Service name or selector right?"

    def __init__(
        self,
        *,
        settings: KubernetesDiscoverySettings,
        balancer: Balancer,
        static: Sequence[Endpoint],
        metrics: RouterMetrics,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self._balancer = balancer
        self._static = tuple(static)
        self._metrics = metrics
        self._rng = rng or random.Random()
        self.namespace = settings.namespace or "default"  # resolved by start()
        self.selector = settings.label_selector or service_selector(settings.services)
        self.resource_version: str | None = None
        self._slices: dict[str, list[SliceEndpoint]] = {}
        self._pod_models: dict[str, tuple[str, ...]] = {}  # pod uid (or name) -> its annotation's models
        self._pod_retry: asyncio.TimerHandle | None = None
        self._pod_failures = 0
        self._published: tuple[Any, ...] | None = None
        self._listed = False
        self._events_since_list = 0
        self._dirty = asyncio.Event()
        self._progress = Progress()  # notified whenever something observable changed (see wait_for)
        self.synced = asyncio.Event()  # set by the first publish after the first successful list
        self.up = False
        self._failures = 0  # consecutive failed list/watch attempts (the backoff exponent)
        self._down_since: float | None = None
        self._warned: set[tuple[str, str]] = set()
        self._api: client.ApiClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._up_gauge = metrics.discovery_up.labels(self.source)
        self._up_gauge.set(0)

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the client configuration (in-cluster or kubeconfig) and start watching."""
        configuration = client.Configuration()
        loader = await self._load_config(configuration)
        self._api = client.ApiClient(configuration)
        self._tasks = [
            *self._start_watching(),
            asyncio.create_task(self._publisher(), name=f"discovery-{self.source}-publish"),
        ]
        if loader is not None:  # exec plugins and GCP tokens expire: the client's own refresher (no-op otherwise)
            self._tasks.append(asyncio.create_task(config.refresh_token(loader, configuration),
                                                   name="discovery-kubernetes-token"))
        log.info("kubernetes discovery started",
                 extra={"namespace": self.namespace, "selector": self.selector, "api": configuration.host})
        if self.settings.label_selector is not None:
            log.warning("discovery follows every EndpointSlice matching labelSelector: whoever may create a Service "
                        "with these labels in the namespace adds upstreams; name the Services instead "
                        "(discovery.kubernetes.services)", extra={"selector": self.selector})

    async def close(self) -> None:
        if self._pod_retry is not None:
            self._pod_retry.cancel()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)  # (a token refresher may have failed)
        self._tasks = []
        if self._api is not None:
            await self._api.close()
            self._api = None

    def set_static(self, endpoints: Sequence[Endpoint]) -> None:
        """New static endpoints (a config reload): published with the discovered ones."""
        self._static = tuple(endpoints)
        self._published = None
        self._dirty.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, re-checking after each watch event, publish or outage change."""
        await self._progress.wait_for(predicate)

    def _notify(self) -> None:
        self._progress.notify()

    async def _load_config(self, configuration: client.Configuration) -> Any:
        s = self.settings
        loader, namespace = await configure_client(configuration, kubeconfig=s.kubeconfig, context=s.context,
                                                   where="discovery.kubernetes.kubeconfig")
        if s.namespace is None:
            self.namespace = namespace
        return loader

    # ---- list and watch (the reflector) -------------------------------------------------------------

    def _start_watching(self) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._reflect(), name="discovery-kubernetes-watch")]

    def _resource_calls(self) -> ResourceCalls:
        api = client.DiscoveryV1Api(self._api)
        return (api.list_namespaced_endpoint_slice, api.list_namespaced_endpoint_slice_without_preload_content,
                "V1EndpointSlice")

    async def _reflect(self, reason: str = "initial") -> None:
        assert self._api is not None
        api = self._resource_calls()
        expired_in_a_row = 0
        while True:
            try:
                if self.resource_version is None:
                    await self._list(api, reason)
                events = await self._watch(api)
                if events == 0:  # ended at once with nothing: never spin on a server that closes every watch
                    await asyncio.sleep(self._backoff(1))
            except Expired:
                log.info("watch expired (410 Gone); relisting", extra={"resource_version": self.resource_version})
                self.resource_version = None
                reason = "expired"
                expired_in_a_row = expired_in_a_row + 1 if self._events_since_list == 0 else 1
                if expired_in_a_row > 1:  # a fresh list's resourceVersion expired at once: do not hammer
                    await asyncio.sleep(self._backoff(expired_in_a_row - 1))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure: keep the endpoints, count it, back off, retry
                self._failed("list" if self.resource_version is None else "watch", exc)
                await asyncio.sleep(self._backoff(self._failures))

    async def _list(self, api: ResourceCalls, reason: str) -> None:
        slices: dict[str, list[SliceEndpoint]] = {}
        token: str | None = None
        while True:
            page = await api[0](
                self.namespace, label_selector=self.selector, limit=LIST_PAGE_SIZE, _continue=token,
                _request_timeout=REQUEST_TIMEOUT,
            )
            for obj in page.items or ():
                if obj.metadata is not None and obj.metadata.name:
                    slices[obj.metadata.name] = self._endpoints_of(obj)
            token = page.metadata.var_continue if page.metadata is not None else None
            if not token:
                break
        self._slices = slices  # one swap: a relist never empties the set on the way
        self.resource_version = page.metadata.resource_version if page.metadata is not None else None
        self._metrics.discovery_relists.labels(self.source, reason).inc()
        if not slices and ("empty", self.selector) not in self._warned:
            self._warned.add(("empty", self.selector))
            log.warning(self.EMPTY_WARNING, extra={"namespace": self.namespace, "selector": self.selector})
        self._listed = True
        self._events_since_list = 0
        self._recovered()
        self._dirty.set()
        self._notify()

    async def _watch(self, api: ResourceCalls) -> int:
        """One watch request from `resource_version`, until the server ends it. Returns the events seen."""
        opened = False

        async def open_stream(**kwargs: Any) -> aiohttp.ClientResponse:
            # Opened here rather than by `Watch` so that an error status is an error (and 410 a relist)
            # and a stream that breaks after opening is told apart from one that never opened.
            nonlocal opened
            kwargs.pop("_preload_content", None)
            response = await api[1](**kwargs)
            if response.status != 200:
                body = await response.text()
                response.release()
                raise ApiException(status=response.status, reason=_status_message(body) or response.reason)
            opened = True
            self._recovered()
            return response

        events = 0
        stream = watch.Watch(return_type=api[2])
        try:
            async for event in stream.stream(
                open_stream,
                namespace=self.namespace,
                label_selector=self.selector,
                resource_version=self.resource_version,
                allow_watch_bookmarks=True,
                timeout_seconds=int(self.settings.watch_timeout),
                # The server ends the watch after timeoutSeconds; this only catches a silent dead connection.
                _request_timeout=float(self.settings.watch_timeout + 30),
            ):
                if not isinstance(event, dict):
                    raise ValueError(f"malformed watch event: {str(event)[:120]!r}")
                events += 1
                self._apply(event, stream.resource_version)
        except ApiException as exc:
            if exc.status == 410:
                raise Expired from None
            raise
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionResetError) as exc:
            if not opened:
                raise
            # A dropped stream is routine (API server restart, idle cut): resume from resource_version. If
            # the server is really gone, the next watch fails to open and that is the error.
            log.debug("watch stream dropped; resuming", extra={"resource_version": self.resource_version,
                                                               "error": _describe(exc)})
        finally:
            await stream.close()
        return events

    def _apply(self, event: dict[str, Any], resource_version: str | None) -> None:
        kind = event.get("type")
        obj = event.get("object")
        self._events_since_list += 1
        if kind in ("ADDED", "MODIFIED") and obj is not None and obj.metadata is not None:
            self._slices[obj.metadata.name] = self._endpoints_of(obj)
            self._dirty.set()
        elif kind == "DELETED" and obj is not None and obj.metadata is not None:
            if self._slices.pop(obj.metadata.name, None) is not None:
                self._dirty.set()
        if resource_version:  # BOOKMARK events carry only this
            self.resource_version = resource_version
        self._notify()

    def _endpoints_of(self, obj: Any) -> list[SliceEndpoint]:
        endpoints, problem = slice_endpoints(obj, self.settings)
        if problem is not None:
            self._warn_once("port", obj.metadata.name, "EndpointSlice ignored: it " + problem,
                            slice=obj.metadata.name, ports=[p.name or p.port for p in obj.ports or ()])
        return endpoints

    # ---- outage accounting --------------------------------------------------------------------------

    def _failed(self, kind: str, exc: BaseException) -> None:
        self._metrics.discovery_errors.labels(self.source, kind).inc()
        self._failures += 1
        self.up = False
        self._up_gauge.set(0)
        if self._down_since is None:
            self._down_since = asyncio.get_running_loop().time()
            log.warning("kubernetes API request failed; keeping the last known endpoints and retrying with backoff",
                        extra={"kind": kind, "error": _describe(exc), "endpoints": self._discovered_count()})
        else:
            log.debug("kubernetes API still failing", extra={"kind": kind, "error": _describe(exc)})
        self._notify()

    def _recovered(self) -> None:
        self._failures = 0
        if self._down_since is not None:
            down = asyncio.get_running_loop().time() - self._down_since
            log.info("kubernetes API reachable again", extra={"down_s": round(down, 3)})
            self._down_since = None
        if not self.up:
            self.up = True
            self._up_gauge.set(1)
            self._notify()

    def _backoff(self, failures: int) -> float:
        """Exponential in the consecutive failures, with jitter in [50%, 100%] so replicas spread out."""
        s = self.settings
        delay = min(s.max_backoff, s.initial_backoff * 2 ** max(failures - 1, 0))
        return delay * self._rng.uniform(0.5, 1.0)

    def _discovered_count(self) -> int:
        return len(self._published[0]) if self._published is not None else 0

    def _warn_once(self, what: str, key: str, message: str, **extra: Any) -> None:
        if (what, key) not in self._warned:
            self._warned.add((what, key))
            log.warning(message, extra=extra)

    # ---- publishing ---------------------------------------------------------------------------------

    async def _publisher(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            try:
                await self._publish()
            except Exception:  # a bug here must not end discovery: the next change publishes again
                log.exception("publishing discovered endpoints failed")

    async def _publish(self) -> None:
        current = merge(self._slices.values())
        if self.settings.model_annotation is not None:
            await self._read_pods([e for e in current if e.pod_key is not None and e.pod_key not in self._pod_models])
            current = merge(self._slices.values())  # the slices may have moved on while we read
        static_ids = {ep.id for ep in self._static}
        endpoints: list[Endpoint] = []
        states: dict[str, EndpointState] = {}
        for entry in current:
            if entry.id in static_ids:
                self._warn_once("static", entry.id, "discovered endpoint has a static endpoint's id; "
                                "the static one is used", endpoint=entry.id)
                continue
            models = self._models_for(entry)
            if models is None:  # its Pod could not be read yet: retried
                continue
            if not models:
                self._warn_once("models", entry.id, "discovered endpoint has no model (no annotation, label or "
                                "configured models); it is not used", endpoint=entry.id, pod=entry.pod)
                continue
            endpoints.append(Endpoint(id=entry.id, url=entry.url, models=models, weight=entry.weight))
            states[entry.id] = entry.state
        pods = {e.pod_key for e in current}
        for gone in set(self._pod_models) - pods:
            del self._pod_models[gone]
        # Warnings about endpoints and slices that are gone: forgotten (pod names churn with every rollout).
        live = {e.id for e in current} | {p for p in pods if p is not None} | set(self._slices)
        self._warned = {w for w in self._warned if w[0] == "empty" or w[1] in live}
        key = (tuple(endpoints), tuple(sorted((k, v.value) for k, v in states.items())), self._static)
        if key != self._published:
            self._published = key
            self._balancer.set_endpoints([*self._static, *endpoints], states)
            # Now rather than on the scheduled rebuild: a terminating pod gets no request from here on, and
            # whoever wait_for()s this publish sees the new snapshot.
            self._balancer.rebuild()
            self._metrics.discovery_updates.labels(self.source).inc()
            log.info("discovered endpoints changed", extra={
                "serving": sorted(i for i, s in states.items() if s is EndpointState.SERVING),
                "draining": sorted(i for i, s in states.items() if s is not EndpointState.SERVING),
            })
        if self._listed:
            self.synced.set()
        self._notify()

    def _models_for(self, entry: SliceEndpoint) -> tuple[str, ...] | None:
        if self.settings.model_annotation is not None and entry.pod_key is not None:
            annotated = self._pod_models.get(entry.pod_key)
            if annotated is None:
                return None
            if annotated:
                return annotated
        return entry.label_models or self.settings.models

    async def _read_pods(self, entries: list[SliceEndpoint]) -> None:
        if not entries or self._api is None:
            return
        core = client.CoreV1Api(self._api)
        limit = asyncio.Semaphore(POD_READS_AT_ONCE)

        async def read(entry: SliceEndpoint) -> bool:
            assert entry.pod is not None and entry.pod_key is not None
            async with limit:
                try:
                    pod = await core.read_namespaced_pod(entry.pod, self.namespace, _request_timeout=REQUEST_TIMEOUT)
                except ApiException as exc:
                    if exc.status != 404:
                        self._pod_failed(entry, exc)
                        return False
                    pod = None  # gone already (the slice lags): no annotation to read
                except (aiohttp.ClientError, OSError, ValueError) as exc:  # OSError: TimeoutError too
                    self._pod_failed(entry, exc)
                    return False
            annotations = (pod.metadata.annotations if pod is not None and pod.metadata is not None else None) or {}
            assert self.settings.model_annotation is not None
            self._pod_models[entry.pod_key] = parse_models(annotations.get(self.settings.model_annotation))
            return True

        results = await asyncio.gather(*(read(e) for e in entries))
        if all(results):
            self._pod_failures = 0
        elif self._pod_retry is None:
            self._pod_failures += 1

            def retry() -> None:
                self._pod_retry = None
                self._dirty.set()

            self._pod_retry = asyncio.get_running_loop().call_later(self._backoff(self._pod_failures), retry)

    def _pod_failed(self, entry: SliceEndpoint, exc: BaseException) -> None:
        self._metrics.discovery_errors.labels(self.source, "pod").inc()
        hint = " (the router needs get on pods, or set modelAnnotation: null)" \
            if isinstance(exc, ApiException) and exc.status == 403 else ""
        self._warn_once("pod", entry.pod_key or entry.id, f"cannot read the Pod for its models annotation{hint}; "
                        "it is left out and retried", pod=entry.pod, error=_describe(exc))


async def configure_client(configuration: client.Configuration, *, kubeconfig: str | None, context: str | None,
                           where: str) -> tuple[Any, str]:
    """Configure the client in-cluster (service account) or from a kubeconfig. Returns the kubeconfig loader
    (None in-cluster) and the namespace the credentials point at. Raises ConfigError naming `where`: without
    a usable configuration there is nothing to retry, so it is not treated as an outage."""
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config(client_configuration=configuration)
            return None, _read_text(IN_CLUSTER_NAMESPACE) or "default"
        path = os.path.expanduser(kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config")
        loader = await config.load_kube_config(config_file=path, context=context,
                                               client_configuration=configuration, persist_config=False)
        contexts, current = config.list_kube_config_contexts(path)
        chosen = next((c for c in contexts if c.get("name") == context), current) if context else current
        return loader, ((chosen or {}).get("context") or {}).get("namespace") or "default"
    except (config.ConfigException, OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(where, f"cannot configure the Kubernetes client: {exc}") from None


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _status_message(body: str) -> str | None:
    """The message of a Kubernetes `Status` answer, if the body is one."""
    try:
        status = json.loads(body)
    except ValueError:
        return body.strip()[:200] or None
    if isinstance(status, dict):
        return f"{status.get('reason', '')}: {status.get('message', '')}".strip(": ") or None
    return None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status}: {exc.reason}"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
