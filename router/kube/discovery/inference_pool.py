"""Endpoints from a Gateway API Inference Extension `InferencePool` (`inference.networking.k8s.io/v1`): the
Pods its selector matches, one endpoint per target port, as GIE's own endpoint picker builds its datastore
(gateway-api-inference-extension `pkg/lwepp/datastore`, `IsPodReady`).

Two watches, both the reflector of router.kube.discovery.kubernetes (list, watch from the list's resourceVersion
with bookmarks, resume a dropped watch, 410 Gone -> relist, an outage -> keep the endpoints and retry with
backoff, counted in `fleetroute_discovery_errors_total{source="inferencepool"}`):

1. **The pool**: the one InferencePool named in the config (`discovery.kubernetes.inferencePool`), listed and
   watched with the field selector `metadata.name=<name>`. Its `spec.selector.matchLabels` and
   `spec.targetPorts[].number` say which Pods and ports. A pool that does not exist (yet) is waited for,
   with one log line saying so; nothing is routed from it meanwhile (start-up serves the static endpoints
   after `syncTimeout`). When its selector or ports change, the Pods are listed again with the new selector
   (`fleetroute_discovery_relists_total{reason="pool-changed"}`): the list replaces the endpoints in one
   step, so the pods both selectors match never leave. A deleted pool removes its endpoints.
2. **Its Pods**: the Pods of the namespace that match the selector, the inherited EndpointSlice reflector
   with Pods as its objects. A Pod is an endpoint when it has a `podIP`, has not finished (phase Succeeded or
   Failed) and either is Ready (its `Ready` condition is True) or is terminating (`deletionTimestamp` set):
   a terminating pod is **draining** (in-flight requests finish, its models stay known, no new request goes
   there), as a terminating EndpointSlice endpoint is. A pod that is not Ready and not terminating is not an
   endpoint (GIE leaves it out of its datastore too).

**Endpoints.** One per target port, at `<scheme>://<podIP>:<port>`. With one target port the endpoint's id
is the Pod's name, as with EndpointSlices (the telemetry agent's id); with several, `<pod>-rank-<i>` for the
i-th port, GIE's naming. **Models** come from the Pod itself: its `modelAnnotation`
(`fleetroute.io/models`), else its `modelLabel`, else the configured `models`; the capacity weight from its
`weightLabel`. No Pod GETs: the watched Pods carry their annotations.

**Trust.** The pool's selector decides which pods receive traffic, so whoever may edit the InferencePool (or
label pods in the namespace so that they match it) adds upstreams: the same power GIE's picker gives them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp
from kubernetes.aio import client, watch
from kubernetes.aio.client.exceptions import ApiException

from router.config.settings import KubernetesDiscoverySettings
from router.kube.discovery.kubernetes import (
    Expired,
    KubernetesDiscovery,
    ResourceCalls,
    SliceEndpoint,
    _describe,
    parse_models,
    parse_weight,
)
from router.model import EndpointState

log = logging.getLogger("fleetroute.discovery")

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"
SOURCE = "inferencepool"


def pool_selector(spec: dict[str, Any]) -> str | None:
    """`spec.selector.matchLabels` as a label selector (`a=b,c=d`, sorted), or None when it has none (the
    v1 schema requires at least one label)."""
    labels = ((spec.get("selector") or {}).get("matchLabels")) or {}
    if not isinstance(labels, dict) or not labels:
        return None
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def pool_ports(spec: dict[str, Any]) -> tuple[int, ...]:
    """`spec.targetPorts[].number`, in order, without repeats."""
    ports = [p.get("number") for p in spec.get("targetPorts") or () if isinstance(p, dict)]
    return tuple(dict.fromkeys(p for p in ports if isinstance(p, int) and 1 <= p <= 65535))


def pod_ready(pod: Any) -> bool:
    """The Pod's `Ready` condition is True (k8s.io/kubectl podutil.IsPodReady, without the deletion check)."""
    conditions = (pod.status.conditions if pod.status is not None else None) or ()
    return any(c.type == "Ready" and c.status == "True" for c in conditions)


def pod_endpoints(pod: Any, ports: Sequence[int], settings: KubernetesDiscoverySettings) -> list[SliceEndpoint]:
    """The endpoints of one `V1Pod` of the pool: one per target port, or none (see the module docstring)."""
    meta, status = pod.metadata, pod.status
    ip = status.pod_ip if status is not None else None
    if meta is None or not meta.name or not ip or (status.phase in ("Succeeded", "Failed")):
        return []
    terminating = meta.deletion_timestamp is not None
    if not terminating and not pod_ready(pod):
        return []
    labels = meta.labels or {}
    label_models = parse_models(labels.get(settings.model_label)) if settings.model_label else ()
    weight = parse_weight(labels.get(settings.weight_label)) if settings.weight_label else 1.0
    host = f"[{ip}]" if ":" in ip else ip
    return [SliceEndpoint(
        id=meta.name if len(ports) == 1 else f"{meta.name}-rank-{rank}",
        url=f"{settings.scheme}://{host}:{port}",
        state=EndpointState.DRAINING if terminating else EndpointState.SERVING,
        pod=meta.name,
        pod_uid=meta.uid or None,
        label_models=label_models,
        ipv6=":" in ip,
        weight=weight,
    ) for rank, port in enumerate(ports)]


class InferencePoolDiscovery(KubernetesDiscovery):
    """Follows one InferencePool and the Pods it selects; publishes as the EndpointSlice discovery does."""

    source = SOURCE
    EMPTY_WARNING = "no Pods match the InferencePool's selector (yet)"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        assert self.settings.inference_pool is not None
        self.pool = self.settings.inference_pool
        self.selector = ""  # the pool's, once read
        self.ports: tuple[int, ...] = ()
        self.pool_found = False
        self._missing_logged = False
        self.pool_resource_version: str | None = None
        self._pods_task: asyncio.Task[None] | None = None

    def _start_watching(self) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self._follow_pool(), name="discovery-inferencepool-watch")]

    def _resource_calls(self) -> ResourceCalls:
        api = client.CoreV1Api(self._api)
        return api.list_namespaced_pod, api.list_namespaced_pod_without_preload_content, "V1Pod"

    def _endpoints_of(self, obj: Any) -> list[SliceEndpoint]:
        endpoints = pod_endpoints(obj, self.ports, self.settings)
        if endpoints and self.settings.model_annotation is not None and endpoints[0].pod_key is not None:
            # The watched Pod carries its annotation: no Pod GET (the base class reads only unknown pods).
            annotations = (obj.metadata.annotations or {})
            self._pod_models[endpoints[0].pod_key] = parse_models(annotations.get(self.settings.model_annotation))
        return endpoints

    async def close(self) -> None:
        for task in self._tasks:  # the pool's watch first: it is what starts a Pod reflector
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._stop_pods()
        await super().close()

    # ---- the pool -----------------------------------------------------------------------------------

    async def _follow_pool(self) -> None:
        """The pool's reflector: list it by name, watch it, and (re)start the Pod reflector as it changes."""
        assert self._api is not None
        api = client.CustomObjectsApi(self._api)
        log.info("following InferencePool", extra={"namespace": self.namespace, "pool": self.pool})
        while True:
            try:
                if self.pool_resource_version is None:
                    await self._list_pool(api)
                if await self._watch_pool(api) == 0:
                    await asyncio.sleep(self._backoff(1))
            except Expired:
                log.info("InferencePool watch expired (410 Gone); relisting",
                         extra={"resource_version": self.pool_resource_version})
                self.pool_resource_version = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the endpoints, count it, back off, retry
                if isinstance(exc, ApiException) and exc.status == 404:
                    exc = ApiException(status=404, reason="the InferencePool resource is not served: is the Gateway "
                                       "API Inference Extension CRD (inference.networking.k8s.io/v1) installed?")
                self._failed("pool", exc)
                await asyncio.sleep(self._backoff(self._failures))

    def _pool_query(self) -> dict[str, Any]:
        return {"group": GROUP, "version": VERSION, "namespace": self.namespace, "plural": PLURAL,
                "field_selector": f"metadata.name={self.pool}"}

    async def _list_pool(self, api: client.CustomObjectsApi) -> None:
        page = await api.list_namespaced_custom_object(**self._pool_query(), _request_timeout=30.0)
        items = [o for o in page.get("items") or () if (o.get("metadata") or {}).get("name") == self.pool]
        self._metrics.discovery_relists.labels(self.source, "pool").inc()
        await self._set_pool(items[0] if items else None)
        self.pool_resource_version = (page.get("metadata") or {}).get("resourceVersion")
        self._recovered()

    async def _watch_pool(self, api: client.CustomObjectsApi) -> int:
        events = 0
        stream = watch.Watch(return_type="object")
        try:
            async for event in stream.stream(
                api.list_namespaced_custom_object, **self._pool_query(),
                resource_version=self.pool_resource_version, allow_watch_bookmarks=True,
                timeout_seconds=int(self.settings.watch_timeout),
                _request_timeout=float(self.settings.watch_timeout + 30),
            ):
                events += 1
                self._recovered()
                kind, obj = event.get("type"), event.get("raw_object") or {}
                if kind in ("ADDED", "MODIFIED"):
                    await self._set_pool(obj)
                elif kind == "DELETED":
                    await self._set_pool(None)
                if stream.resource_version:
                    self.pool_resource_version = stream.resource_version
                self._notify()
        except ApiException as exc:
            if exc.status == 410:
                raise Expired from None
            raise
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionResetError) as exc:
            log.debug("InferencePool watch dropped; resuming", extra={"error": _describe(exc)})
        finally:
            await stream.close()
        return events

    async def _set_pool(self, obj: dict[str, Any] | None) -> None:
        """A new state of the pool (None: it does not exist): restart the Pod reflector when the selector or the
        ports changed, and drop every endpoint when the pool is gone."""
        spec = (obj or {}).get("spec") or {}
        selector, ports = pool_selector(spec), pool_ports(spec)
        if obj is not None and (selector is None or not ports):
            log.warning("InferencePool has no selector labels or no target ports; it selects no endpoints",
                        extra={"pool": self.pool, "spec": spec})
        if obj is None or selector is None or not ports:
            if self.pool_found or not self._missing_logged:
                self._missing_logged = True
                log.warning("waiting for InferencePool %s/%s: it does not exist (or selects nothing); no endpoints "
                            "come from it until it does", self.namespace, self.pool,
                            extra={"namespace": self.namespace, "pool": self.pool})
            await self._stop_pods()
            self.pool_found, self.selector, self.ports = False, "", ()
            if self._slices:
                self._slices = {}
                self._dirty.set()
            self._notify()
            return
        if self._pods_task is not None and (selector, ports) == (self.selector, self.ports):
            return  # status or metadata only
        first = not self.pool_found
        await self._stop_pods()
        self.pool_found, self.selector, self.ports = True, selector, ports
        self.resource_version = None  # the Pod reflector lists first
        log.info("InferencePool selects pods", extra={
            "pool": self.pool, "selector": selector, "target_ports": list(ports), "changed": not first})
        self._pods_task = asyncio.create_task(self._reflect("initial" if first else "pool-changed"),
                                              name="discovery-inferencepool-pods")

    async def _stop_pods(self) -> None:
        task, self._pods_task = self._pods_task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
