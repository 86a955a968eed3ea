"""A fake Kubernetes API server for tests (aiohttp, 127.0.0.1, a free port), faithful where clients look.

It serves what the official `kubernetes` client (sync and `kubernetes.aio`) and kubectl need for the
resources it knows (`BUILTIN_RESOURCES`: every kind the chart renders, plus RoutingPolicies by default; a
created CustomResourceDefinition adds its resource, with its schema):

- discovery: `/version` (every field: the official client's models are strict), `/api`, `/api/v1`, `/apis`,
  `/apis/<group>/<version>` (resource lists with verbs and short names);
- list with `labelSelector` (equality and set-based) and `fieldSelector` on `metadata.name`/`namespace`,
  answering a `<Kind>List` with `metadata.resourceVersion`; get; create (POST), update (PUT, with a
  resourceVersion conflict check), merge-patch (PATCH) and delete; errors are `Status` objects;
- watch (`watch=true`, `watch=True` or `watch=1`) as chunked JSON lines. Without a resourceVersion (or with
  "0") it starts with a synthetic ADDED per current object; with one it replays the event log after it. A
  resourceVersion older than the retained history gets an ERROR event with a 410 `Expired` Status (or,
  with `expired_as_http`, an HTTP 410), as an API server does after etcd compaction. An object that starts or
  stops matching a watch's label selector is ADDED or DELETED for it. `allowWatchBookmarks=true` watches get
  BOOKMARK events when the test calls `bookmark()`. `timeoutSeconds` ends a watch.

Custom resources: a plural in `crds` (a tests/fake_crd.py `FakeCRD`) gets the CRD's defaults, schema and CEL
validation on every write (422 `Invalid` with field messages), is stored with its keys in alphabetical order
(unstructured JSON, as the API server keeps custom resources), `as=Table` answers with its printer columns
(list, get and watch: kubectl get and get -w), and a `/status` subresource (RoutingPolicies): writes to the
object keep its status, writes to `/status` change only the status, and `metadata.generation` moves only
when the spec does. Leases (coordination.k8s.io/v1) are plain objects with the PUT resourceVersion check.
Gateway API Inference Extension InferencePools are served once their real CRD (`inference_pool_crd()`, vendored
from the project) is created, with its schema, defaults and CEL rules.

Beyond reads and writes (tests/fake_kube_admission.py has the details): service-account tokens
(`service_account_token`) whose requests RBAC authorizes from the stored Roles and bindings (403 with the API
server's message, kept in `denied`; the admin token, or no token when `token=None`, is not checked); with
`strict=True`, namespaces must exist and built-in objects are validated against Kubernetes' schemas
(fieldValidation=Strict: unknown fields are a 400) and CRDs structurally; `/openapi/v3` for kubectl; graceful
deletion (a pod on a node, or an object with finalizers, gets a deletionTimestamp; `delete_gracefully`), the
pod eviction subresource against PodDisruptionBudgets (429), Secrets' `stringData`, resource quantities
stored as strings, strategic merge patches without directives (as merge patches), watch lists
(`sendInitialEvents`, ending with the initial-events-end BOOKMARK), and `changed()` for in-process
controllers. Protobuf bodies get a 415 (typed clients such as `kubectl create namespace` send them).

The test drives it: `create`/`update`/`delete` objects (each bumps the cluster-wide resourceVersion, as
etcd's revision), `compact()` the history, `close_watches()` (cleanly or abruptly), `expire_watches()` (an
ERROR 410 on every open watch), `bookmark()`, and `stop()`/`start()` for an outage (connections refused on
the same port in between). Every request is logged (`requests`), and `wait_for_request` waits for one
without sleeping. `write_kubeconfig` points a client at it, with a bearer token the fake then requires.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import json
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from tests import fake_kube_admission as admission
from tests.fake_crd import FakeCRD, crd_problems

TRUE = ("true", "True", "1")
ADMIN = "kubernetes-admin"  # the user of requests with the admin token (or of any, without one): no RBAC
CREATED_AT = "2026-01-01T00:00:00Z"


@dataclass(frozen=True)
class Resource:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    singular: str
    namespaced: bool = True
    short_names: tuple[str, ...] = ()
    verbs: tuple[str, ...] = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
    status: bool = False  # a /status subresource: writes to the object keep its status, /status only status

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


def _r(group: str, version: str, plural: str, kind: str, *short: str, namespaced: bool = True,
       status: bool = False) -> Resource:
    return Resource(group, version, plural, kind, kind.lower(), namespaced=namespaced, short_names=short,
                    status=status)


# Every kind a Helm chart of ours renders, and what the controllers and kubelet of tests/cluster/ write.
BUILTIN_RESOURCES = (
    _r("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice"),
    _r("", "v1", "pods", "Pod", "po", status=True),
    _r("", "v1", "services", "Service", "svc", status=True),
    _r("", "v1", "namespaces", "Namespace", "ns", namespaced=False, status=True),
    _r("", "v1", "configmaps", "ConfigMap", "cm"),
    _r("", "v1", "secrets", "Secret"),
    _r("", "v1", "serviceaccounts", "ServiceAccount", "sa"),
    _r("", "v1", "events", "Event", "ev"),
    _r("apps", "v1", "deployments", "Deployment", "deploy", status=True),
    _r("apps", "v1", "statefulsets", "StatefulSet", "sts", status=True),
    _r("apps", "v1", "daemonsets", "DaemonSet", "ds", status=True),
    _r("apps", "v1", "replicasets", "ReplicaSet", "rs", status=True),
    _r("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget", "pdb", status=True),
    _r("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy", "netpol"),
    _r("networking.k8s.io", "v1", "ingresses", "Ingress", "ing", status=True),
    _r("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler", "hpa", status=True),
    _r("rbac.authorization.k8s.io", "v1", "roles", "Role"),
    _r("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
    _r("rbac.authorization.k8s.io", "v1", "clusterroles", "ClusterRole", namespaced=False),
    _r("rbac.authorization.k8s.io", "v1", "clusterrolebindings", "ClusterRoleBinding", namespaced=False),
    _r("coordination.k8s.io", "v1", "leases", "Lease"),
    _r("apiextensions.k8s.io", "v1", "customresourcedefinitions", "CustomResourceDefinition", "crd", "crds",
       namespaced=False, status=True),
)
ROUTING_POLICIES = _r("fleetroute.io", "v1alpha1", "routingpolicies", "RoutingPolicy", "rp", status=True)
# The default: RoutingPolicies are served without their CRD being created (set `crds[plural]` for its schema).
# A FakeKube(resources=BUILTIN_RESOURCES) serves them only once their CRD is created, as an API server does.
RESOURCES = (*BUILTIN_RESOURCES, ROUTING_POLICIES)
# Gateway API Inference Extension InferencePools are served once their CRD is created, as by an API server:
# `kube.create("customresourcedefinitions", inference_pool_crd())` (the real v1 CRD, vendored in tests/data/crds/,
# so every write is checked against its schema, defaults and CEL rules).
INFERENCE_POOL_CRD = Path(__file__).resolve().parent / "data" / "crds" / "inferencepool.yaml"


@dataclass(eq=False)  # each request is itself: `requests.index(r)` finds that one, not an equal earlier one
class Recorded:
    method: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in TRUE


@dataclass
class _Change:
    rv: int
    type: str  # ADDED, MODIFIED, DELETED
    resource: Resource
    old: dict[str, Any] | None
    new: dict[str, Any]


@dataclass(eq=False)
class _Watcher:
    resource: Resource
    namespace: str | None
    selector: Callable[[dict[str, str]], bool]
    bookmarks: bool
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)
    fields: Callable[[dict[str, Any]], bool] = lambda obj: True  # its fieldSelector


_CLOSE, _ABORT = object(), object()


# ---- label selectors (the API server's syntax) -------------------------------------------------------

_REQUIREMENT = re.compile(
    r"^\s*(?:(?P<not>!)\s*(?P<nkey>[^\s=!(),]+)"
    r"|(?P<key>[^\s=!(),]+)\s*(?:(?P<op>==|=|!=)\s*(?P<value>[^\s=!(),]*)"
    r"|\s+(?P<setop>in|notin)\s*\((?P<values>[^()]*)\))?)\s*$"
)


def parse_selector(text: str | None) -> Callable[[dict[str, str]], bool]:
    """A predicate over labels; raises ValueError on a selector the API server would refuse."""
    tests: list[Callable[[dict[str, str]], bool]] = []
    parts, depth, start = [], 0, 0
    text = text or ""
    for i, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    for part in parts:
        if not part.strip():
            if text.strip():
                raise ValueError(f"empty requirement in {text!r}")
            continue
        m = _REQUIREMENT.match(part)
        if m is None:
            raise ValueError(f"unable to parse requirement: {part!r}")
        if m["not"]:
            tests.append(lambda labels, k=m["nkey"]: k not in labels)
        elif m["op"]:
            # key!=value also matches objects without the key, as in Kubernetes
            tests.append(lambda labels, k=m["key"], v=m["value"], eq=m["op"] != "!=": (labels.get(k) == v) == eq)
        elif m["setop"]:
            values = {v.strip() for v in m["values"].split(",")}
            if m["setop"] == "in":
                tests.append(lambda labels, k=m["key"], vs=values: labels.get(k) in vs)
            else:
                tests.append(lambda labels, k=m["key"], vs=values: labels.get(k) not in vs)
        else:
            tests.append(lambda labels, k=m["key"]: k in labels)
    return lambda labels: all(t(labels) for t in tests)


def _field_selector(text: str | None) -> Callable[[dict[str, Any]], bool]:
    tests = []
    for part in (text or "").split(","):
        if not part.strip():
            continue
        key, op, value = re.match(r"^\s*([\w.]+)\s*(==|=|!=)\s*(.*?)\s*$", part).groups()  # type: ignore[union-attr]
        if key not in ("metadata.name", "metadata.namespace"):
            raise ValueError(f'field label not supported: {key}')
        attr = key.split(".")[1]
        tests.append(lambda obj, a=attr, v=value, eq=op != "!=": (obj["metadata"].get(a) == v) == eq)
    return lambda obj: all(t(obj) for t in tests)


# ---- the server --------------------------------------------------------------------------------------


class FakeKube:
    def __init__(self, *, token: str | None = "fake-token", git_version: str = "v1.37.0",
                 resources: tuple[Resource, ...] = RESOURCES, strict: bool = False, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.token = token  # None: requests without a service-account token act as cluster admin
        self.resources = list(resources)
        # strict: as an API server: objects go only into namespaces that exist, and built-in objects are
        # validated against Kubernetes' schemas (fieldValidation=Strict, kubectl apply's default, refuses
        # unknown fields). Off by default: the older tests write objects into namespaces they never create.
        self.strict = strict
        self.users: dict[str, str] = {}  # bearer token -> service-account user; RBAC decides what it may do
        self.denied: list[str] = []  # every RBAC refusal's message, for the tests to show
        self.git_version = git_version
        self.rv = 100
        self.compacted = self.rv  # history at or before this revision is gone: a watch from before it gets 410
        self.expired_as_http = False  # answer a too-old watch with HTTP 410 instead of an ERROR event
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, namespace, name) -> object
        self.history: list[_Change] = []
        self.requests: list[Recorded] = []
        self.watchers: list[_Watcher] = []
        self.host = host  # where it listens; port 0: a free one
        self.port = port
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._request_seen = asyncio.Event()
        self._batch: list[tuple[_Watcher, dict[str, Any]]] | None = None
        self.crds: dict[str, Any] = {}  # plural -> its CRD version (schema, printer columns): see fake_crd.py
        self._changed = asyncio.Event()

    # ---- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> FakeKube:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{self.host}:{self.port}"
        return self

    async def stop(self) -> None:
        """An outage: open watches are cut (abruptly) and the port refuses connections until `start()`."""
        self.close_watches(abrupt=True)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def write_kubeconfig(self, path: Path, *, namespace: str | None = None) -> Path:
        context: dict[str, Any] = {"cluster": "fake", "user": "fake"}
        if namespace is not None:
            context["namespace"] = namespace
        user = {"token": self.token} if self.token is not None else {}
        path.write_text(json.dumps({
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": user}],
            "contexts": [{"name": "fake", "context": context}],
            "current-context": "fake",
        }))
        return path

    def service_account_token(self, namespace: str, name: str) -> str:
        """A bearer token for a ServiceAccount (the TokenRequest API's job); RBAC applies to its requests."""
        token = f"sa-{namespace}-{name}-{uuid.uuid4().hex[:12]}"
        self.users[token] = f"system:serviceaccount:{namespace}:{name}"
        return token

    def write_service_account_kubeconfig(self, path: Path, *, namespace: str, token: str) -> Path:
        """What a pod's service account gives its processes: this API server, the token, the pod's namespace."""
        path.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "in-cluster", "cluster": {"server": self.url}}],
            "users": [{"name": "sa", "user": {"token": token}}],
            "contexts": [{"name": "in-cluster", "context": {"cluster": "in-cluster", "user": "sa",
                                                            "namespace": namespace}}],
            "current-context": "in-cluster",
        }))
        return path

    async def changed(self) -> None:
        """Return at the next write to any object (for in-process controllers: no polling)."""
        await self._changed.wait()

    # ---- what the test does to the cluster -----------------------------------------------------------

    def resource(self, plural: str) -> Resource:
        return next(r for r in self.resources if r.plural == plural)

    def list(self, plural: str, namespace: str | None = None, selector: str | None = None) -> list[dict[str, Any]]:
        """The objects of a kind (in one namespace, with a label selector), oldest first."""
        return self._matching(self.resource(plural), namespace, selector, None)

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((plural, namespace, name))

    def create(self, plural: str, obj: dict[str, Any], *, namespace: str = "default") -> dict[str, Any]:
        res = self.resource(plural)
        obj = copy.deepcopy(obj)
        if plural in self.crds:  # the schema's defaults, as on every write; stored as unstructured JSON
            self.crds[plural].default(obj)
            obj = self.crds[plural].stored(obj)
        if plural == "secrets":
            _secret_string_data(obj)
        if plural not in self.crds:
            _canonical_quantities(obj)
        meta = obj.setdefault("metadata", {})
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        ns = meta.get("namespace", namespace) if res.namespaced else ""
        key = (plural, ns, meta["name"])
        if key in self.objects:
            raise KeyError(f"{plural} {meta['name']!r} already exists")
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        if res.namespaced:
            meta["namespace"] = ns
        meta.setdefault("uid", str(uuid.uuid4()))
        meta.setdefault("creationTimestamp", CREATED_AT)
        meta["generation"] = 1
        if plural == "customresourcedefinitions":
            obj["status"] = _crd_status(obj)
        self._commit("ADDED", res, key, None, obj)
        if plural == "customresourcedefinitions":
            self._serve_crd(obj)
        return obj

    def update(self, plural: str, obj: dict[str, Any], *, namespace: str = "default") -> dict[str, Any]:
        res = self.resource(plural)
        obj = copy.deepcopy(obj)
        if plural in self.crds:
            self.crds[plural].default(obj)
            obj = self.crds[plural].stored(obj)
        if plural == "secrets":
            _secret_string_data(obj)
        if plural not in self.crds:
            _canonical_quantities(obj)
        meta = obj["metadata"]
        ns = meta.get("namespace", namespace) if res.namespaced else ""
        key = (plural, ns, meta["name"])
        old = self.objects[key]
        obj["apiVersion"], obj["kind"] = res.api_version, res.kind
        for kept in ("uid", "creationTimestamp", "namespace"):
            if kept in old["metadata"]:
                meta[kept] = old["metadata"][kept]
        changed_spec = {k: v for k, v in obj.items() if k not in ("metadata", "status")} != \
            {k: v for k, v in old.items() if k not in ("metadata", "status")}
        meta["generation"] = old["metadata"].get("generation", 1) + (1 if changed_spec else 0)
        self._commit("MODIFIED", res, key, old, obj)
        if plural == "customresourcedefinitions":
            self._serve_crd(obj)
        return obj

    def delete(self, plural: str, name: str, *, namespace: str = "default") -> dict[str, Any]:
        res = self.resource(plural)
        key = (plural, namespace if res.namespaced else "", name)
        old = self.objects[key]
        gone = copy.deepcopy(old)
        self._commit("DELETED", res, key, old, gone)
        if plural == "customresourcedefinitions":  # its resource and every object of it go with it
            plural_cr = old["spec"]["names"]["plural"]
            for cr_key in [k for k in self.objects if k[0] == plural_cr]:
                del self.objects[cr_key]
            self.resources = [r for r in self.resources if not (r.plural == plural_cr and r.group == old["spec"]["group"])]
            self.crds.pop(plural_cr, None)
        return gone

    def delete_gracefully(self, plural: str, name: str, *, namespace: str = "default",
                          grace_period: int | None = None) -> dict[str, Any]:
        """A DELETE as the API server handles it: a pod on a node (or an object with finalizers) is only marked
        (`deletionTimestamp`, and for a pod `deletionGracePeriodSeconds`: the DeleteOptions' or the pod's
        terminationGracePeriodSeconds, default 30); the kubelet removes the pod once its containers stopped
        (`delete`). A grace period of 0, or a pod no node runs, is removed at once."""
        res = self.resource(plural)
        key = (plural, namespace if res.namespaced else "", name)
        current = self.objects[key]
        meta = current["metadata"]
        if plural == "pods":
            grace = grace_period if grace_period is not None else \
                current.get("spec", {}).get("terminationGracePeriodSeconds", 30)
            phase = (current.get("status") or {}).get("phase")
            if grace == 0 or not current.get("spec", {}).get("nodeName") or phase in ("Succeeded", "Failed"):
                return self.delete(plural, name, namespace=namespace)
            if meta.get("deletionTimestamp") and meta.get("deletionGracePeriodSeconds", grace) <= grace:
                return current  # already terminating with at most this grace period
        elif not meta.get("finalizers"):
            return self.delete(plural, name, namespace=namespace)
        elif meta.get("deletionTimestamp"):
            return current
        marked = copy.deepcopy(current)
        marked["metadata"]["deletionTimestamp"] = _now()
        if plural == "pods":
            marked["metadata"]["deletionGracePeriodSeconds"] = grace
        self._commit("MODIFIED", res, key, current, marked)
        return marked

    def compact(self) -> None:
        """Forget the history (etcd compaction): watches from an older resourceVersion get 410 Gone."""
        self.compacted = self.rv
        self.history.clear()

    def bookmark(self) -> None:
        """Send a BOOKMARK with the current resourceVersion to every watch that allows bookmarks."""
        for w in self.watchers:
            if w.bookmarks:
                w.queue.put_nowait({"type": "BOOKMARK", "object": {
                    "kind": w.resource.kind, "apiVersion": w.resource.api_version,
                    "metadata": {"resourceVersion": str(self.rv)},
                }})

    def close_watches(self, *, abrupt: bool = False) -> int:
        """End every open watch: cleanly (the end of the chunked body) or by cutting the connection."""
        for w in self.watchers:
            w.queue.put_nowait(_ABORT if abrupt else _CLOSE)
        return len(self.watchers)

    def expire_watches(self) -> None:
        """Compact, then send every open watch an ERROR 410 and end it (its watch cache fell behind)."""
        self.compact()
        for w in self.watchers:
            w.queue.put_nowait({"type": "ERROR", "object": self._expired_status(self.compacted - 1)})
            w.queue.put_nowait(_CLOSE)

    @contextmanager
    def batch(self) -> Iterator[None]:
        """Changes made inside reach each watch in one write (one chunk), as a busy API server sends them."""
        self._batch = []
        try:
            yield
        finally:
            pending, self._batch = self._batch, None
            grouped: dict[_Watcher, list[dict[str, Any]]] = {}
            for watcher, event in pending:
                grouped.setdefault(watcher, []).append(event)
            for watcher, events in grouped.items():
                watcher.queue.put_nowait(events)

    async def wait_for_request(self, predicate: Callable[[Recorded], bool], *, after: int = 0) -> Recorded:
        """The first logged request (from index `after`) that satisfies `predicate`, waiting for it."""
        while True:
            seen = self._request_seen
            for recorded in self.requests[after:]:
                if predicate(recorded):
                    return recorded
            await seen.wait()

    def _commit(self, kind: str, res: Resource, key: tuple[str, str, str], old: dict[str, Any] | None,
                new: dict[str, Any]) -> None:
        self.rv += 1
        self._changed.set()
        self._changed = asyncio.Event()
        new["metadata"]["resourceVersion"] = str(self.rv)
        if kind == "DELETED":
            del self.objects[key]
        else:
            self.objects[key] = new
        change = _Change(self.rv, kind, res, copy.deepcopy(old), copy.deepcopy(new))
        self.history.append(change)
        for w in self.watchers:
            event = self._event_for(w, change)
            if event is None:
                continue
            if self._batch is not None:
                self._batch.append((w, event))
            else:
                w.queue.put_nowait(event)

    def _event_for(self, w: _Watcher, change: _Change) -> dict[str, Any] | None:
        if w.resource != change.resource:
            return None

        def matches(obj: dict[str, Any] | None) -> bool:
            if obj is None:
                return False
            meta = obj["metadata"]
            if w.namespace is not None and meta.get("namespace") != w.namespace:
                return False
            if not w.fields(obj):
                return False
            return w.selector(meta.get("labels") or {})

        before, after = matches(change.old), matches(change.new)
        if change.type == "DELETED":
            return {"type": "DELETED", "object": change.new} if before else None
        if change.type == "ADDED":
            return {"type": "ADDED", "object": change.new} if after else None
        if before and after:
            return {"type": "MODIFIED", "object": change.new}
        if after:
            return {"type": "ADDED", "object": change.new}
        if before:  # stopped matching: gone, for this watch (the old state at the new revision)
            assert change.old is not None
            gone = copy.deepcopy(change.old)
            gone["metadata"]["resourceVersion"] = str(change.rv)
            return {"type": "DELETED", "object": gone}
        return None

    # ---- HTTP ----------------------------------------------------------------------------------------

    def _authenticate(self, request: web.Request) -> str | None:
        """The user a request acts as: a service account's (RBAC applies), the admin, or None (401)."""
        header = request.headers.get("Authorization", "")
        bearer = header[7:] if header.lower().startswith("bearer ") else None
        if bearer is not None and bearer in self.users:
            return self.users[bearer]
        if self.token is None or bearer == self.token:
            return ADMIN
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(Recorded(request.method, request.path, dict(request.query), dict(request.headers)))
        seen, self._request_seen = self._request_seen, asyncio.Event()
        seen.set()
        user = self._authenticate(request)
        if user is None:
            return self._status(401, "Unauthorized", "Unauthorized")
        if request.can_read_body and "json" not in request.content_type and "yaml" not in request.content_type:
            # JSON bodies only. Typed clients (`kubectl create namespace`) send built-in kinds as protobuf, which
            # the fake cannot decode: they get the API server's answer to an unknown format (use kubectl apply,
            # which sends JSON).
            return self._status(415, "UnsupportedMediaType", 'the body of the request was in an unknown format - '
                                'accepted media types include: application/json, application/yaml, '
                                'application/merge-patch+json, application/strategic-merge-patch+json')
        path = request.path.rstrip("/") or "/"
        if path == "/version" and request.method == "GET":
            return web.json_response(self._version())
        if path == "/api" and request.method == "GET":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self.port}"}]})
        if path == "/apis" and request.method == "GET":
            return web.json_response(self._group_list())
        if path == "/openapi/v3" and request.method == "GET":
            return web.json_response(admission.openapi_root(self._group_versions()))
        parts = path.strip("/").split("/")
        if parts[:2] == ["openapi", "v3"] and request.method == "GET":
            group, version = ("", parts[3]) if parts[2:3] == ["api"] else (parts[3], parts[4])
            served = [r for r in self.resources if (r.group, r.version) == (group, version)]
            if not served:
                return self._status(404, "NotFound", "the server could not find the requested resource")
            return web.json_response(admission.openapi_group_version(group, version, served))
        if parts[0] == "api" and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[0] == "apis" and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return self._status(404, "NotFound", "the server could not find the requested resource")
        if not rest and request.method == "GET":
            resources = [r for r in self.resources if (r.group, r.version) == (group, version)]
            if not resources:
                return self._status(404, "NotFound", "the server could not find the requested resource")
            return web.json_response(self._resource_list(group, version, resources))
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        res = next((r for r in self.resources if (r.group, r.version, r.plural) == (group, version, rest[0])),
                   None) if rest else None
        subresource = rest[2] if len(rest) == 3 else None
        known_sub = subresource is None or (subresource == "status" and res is not None and res.status) or (
            subresource == "eviction" and res is not None and res.plural == "pods" and request.method == "POST")
        if res is None or len(rest) > 3 or not known_sub or (namespace is not None and not res.namespaced):
            return self._status(404, "NotFound", "the server could not find the requested resource")
        name = rest[1] if len(rest) >= 2 else None
        if user != ADMIN and (refusal := self._authorize(request, user, res, namespace, name, subresource)):
            self.denied.append(refusal)
            return self._status(403, "Forbidden", refusal)
        try:
            if name is None and request.method == "GET":
                if request.query.get("watch") in TRUE:
                    return await self._watch(request, res, namespace)
                if "as=Table" in request.headers.get("Accept", "") and res.plural in self.crds:
                    return web.json_response(self.crds[res.plural].table(
                        self._matching(res, namespace, request.query.get("labelSelector"), None), self.rv))
                return self._list(request, res, namespace)
            if name is None and request.method == "POST":
                return await self._create(request, res, namespace)
            if subresource == "eviction" and name is not None:
                return await self._evict(request, namespace or "", name)
            if name is not None:
                return await self._item(request, res, namespace or "", name, status=subresource == "status")
        except ValueError as exc:
            return self._status(400, "BadRequest", str(exc))
        return self._status(405, "MethodNotAllowed", f"the server does not allow this method on {res.plural}")

    def _authorize(self, request: web.Request, user: str, res: Resource, namespace: str | None,
                   name: str | None, subresource: str | None) -> str | None:
        method = request.method
        if name is None:
            verb = {"GET": "watch" if request.query.get("watch") in TRUE else "list", "POST": "create",
                    "DELETE": "deletecollection"}.get(method, method.lower())
        else:
            verb = {"GET": "get", "PUT": "update", "PATCH": "patch", "DELETE": "delete",
                    "POST": "create"}.get(method, method.lower())
        resource = f"{res.plural}/{subresource}" if subresource else res.plural
        return admission.authorize(self.objects, user, verb=verb, group=res.group, resource=resource,
                                   namespace=namespace, name=name)

    def _group_versions(self) -> list[tuple[str, str]]:
        return list(dict.fromkeys((r.group, r.version) for r in self.resources))

    def _list(self, request: web.Request, res: Resource, namespace: str | None) -> web.Response:
        items = []
        for obj in self._matching(res, namespace, request.query.get("labelSelector"),
                                  request.query.get("fieldSelector")):
            item = copy.deepcopy(obj)
            item.pop("kind", None)  # list items carry no kind/apiVersion, as the API server sends them
            item.pop("apiVersion", None)
            items.append(item)
        return web.json_response({"kind": f"{res.kind}List", "apiVersion": res.api_version,
                                  "metadata": {"resourceVersion": str(self.rv)}, "items": items})

    def _matching(self, res: Resource, namespace: str | None, labels: str | None,
                  fields: str | None) -> list[dict[str, Any]]:
        by_labels, by_fields = parse_selector(labels), _field_selector(fields)
        found = [obj for (plural, ns, _), obj in self.objects.items()
                 if plural == res.plural and (namespace is None or ns == namespace)
                 and by_labels(obj["metadata"].get("labels") or {}) and by_fields(obj)]
        return sorted(found, key=lambda o: int(o["metadata"]["resourceVersion"]))

    async def _watch(self, request: web.Request, res: Resource, namespace: str | None) -> web.StreamResponse:
        query = request.query
        crd = self.crds.get(res.plural) if "as=Table" in request.headers.get("Accept", "") else None

        def wrap(event: dict[str, Any]) -> dict[str, Any]:  # kubectl get -w: each object as a one-row Table
            if crd is None or event["type"] in ("ERROR", "BOOKMARK"):
                return event
            return {"type": event["type"], "object": crd.table([event["object"]], None)}

        watcher = _Watcher(res, namespace, parse_selector(query.get("labelSelector")),
                           query.get("allowWatchBookmarks") in TRUE, fields=_field_selector(query.get("fieldSelector")))
        since = query.get("resourceVersion")
        initial: list[dict[str, Any]] = []
        if query.get("sendInitialEvents") in TRUE:
            # A watch list (client-go's informers, `kubectl rollout status`): the current state as ADDED events,
            # then a BOOKMARK annotated `k8s.io/initial-events-end` at the current resourceVersion.
            initial = [{"type": "ADDED", "object": obj}
                       for obj in self._matching(res, namespace, query.get("labelSelector"),
                                                 query.get("fieldSelector"))]
            initial.append({"type": "BOOKMARK", "object": {
                "kind": res.kind, "apiVersion": res.api_version,
                "metadata": {"resourceVersion": str(self.rv), "annotations": {"k8s.io/initial-events-end": "true"}}}})
        elif since in (None, "", "0"):  # "start at most recent": the current state as ADDED events
            initial = [{"type": "ADDED", "object": obj}
                       for obj in self._matching(res, namespace, query.get("labelSelector"),
                                                 query.get("fieldSelector"))]
        elif int(since) < self.compacted:
            if self.expired_as_http:
                return self._status(410, "Expired", self._too_old(int(since)))
            initial = [{"type": "ERROR", "object": self._expired_status(int(since))}]
            watcher.queue.put_nowait(_CLOSE)
        else:
            initial = [e for c in self.history if c.rv > int(since) and (e := self._event_for(watcher, c))]
        self.watchers.append(watcher)  # no await since the replay was computed: no change can slip between
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        try:
            await response.prepare(request)
            if initial:
                await response.write(b"".join(_line(wrap(e)) for e in initial))
            async with asyncio.timeout(timeout):
                while True:
                    item = await watcher.queue.get()
                    if item is _CLOSE:
                        break
                    if item is _ABORT:
                        if request.transport is not None:  # else the client is already gone
                            request.transport.abort()
                        return response
                    events = item if isinstance(item, list) else [item]
                    await response.write(b"".join(_line(wrap(e)) for e in events))
        except TimeoutError:
            pass  # timeoutSeconds: the watch ends normally
        except ConnectionResetError:  # the client went away
            return response
        finally:
            self.watchers.remove(watcher)
        await response.write_eof()
        return response

    async def _create(self, request: web.Request, res: Resource, namespace: str | None) -> web.Response:
        body = await request.json()
        if self.strict and res.namespaced and ("namespaces", "", namespace or "") not in self.objects:
            return self._status(404, "NotFound", f'namespaces "{namespace}" not found')
        meta = body.setdefault("metadata", {})
        if res.namespaced and meta.get("namespace", namespace) != namespace:
            return self._status(400, "BadRequest", "the namespace of the provided object does not match the "
                                "namespace sent on the request")
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        name = meta.get("name")
        if not name:
            return self._status(422, "Invalid", f"{res.kind} is invalid: metadata.name: Required value")
        if (res.plural, namespace or "", name) in self.objects:
            return self._status(409, "AlreadyExists", f'{res.plural} "{name}" already exists')
        if res.status:
            body.pop("status", None)  # with a status subresource, create ignores status
        if (invalid := self._admit(request, res, body)) is not None:
            return invalid
        return web.json_response(self.create(res.plural, body, namespace=namespace or ""), status=201)

    async def _item(self, request: web.Request, res: Resource, namespace: str, name: str, *,
                    status: bool = False) -> web.Response:
        current = self.objects.get((res.plural, namespace, name))
        if current is None:
            return self._status(404, "NotFound", f'{res.plural} "{name}" not found')
        if request.method == "GET":
            if "as=Table" in request.headers.get("Accept", "") and res.plural in self.crds:
                return web.json_response(self.crds[res.plural].table([current], self.rv))
            return web.json_response(current)
        if request.method == "DELETE" and not status:
            options = await request.json() if request.can_read_body else {}
            grace = (options or {}).get("gracePeriodSeconds", request.query.get("gracePeriodSeconds"))
            return web.json_response(self.delete_gracefully(res.plural, name, namespace=namespace,
                                                            grace_period=None if grace is None else int(grace)))
        if request.method == "PUT":
            body = await request.json()
            wanted = body.get("metadata", {}).get("resourceVersion")
            if wanted and wanted != current["metadata"]["resourceVersion"]:
                return self._status(409, "Conflict", f'Operation cannot be fulfilled on {res.plural} "{name}": '
                                    "the object has been modified; please apply your changes to the latest version")
        elif request.method == "PATCH":
            patch = await request.json()
            if request.content_type == "application/strategic-merge-patch+json" and res.plural not in self.crds:
                # A strategic merge patch without directives merges maps as a merge patch does (what
                # `kubectl rollout restart`, `annotate` and `label` send); lists would merge by key.
                if directive := _first_directive(patch):
                    return self._status(415, "UnsupportedMediaType",
                                        f"the fake API server does not implement strategic-merge directive {directive}")
            elif request.content_type != "application/merge-patch+json":
                return self._status(415, "UnsupportedMediaType", f"{request.content_type} is not supported")
            body = _merge_patch(copy.deepcopy(current), patch)
        else:
            return self._status(405, "MethodNotAllowed", f"the server does not allow this method on {res.plural}")
        if res.status:  # the main resource ignores status; /status ignores all else
            if status:
                body = {**copy.deepcopy(current), "status": body.get("status")}
            elif "status" in current:
                body["status"] = copy.deepcopy(current["status"])
            else:
                body.pop("status", None)
        if (invalid := self._admit(request, res, body)) is not None:
            return invalid
        obj = self.update(res.plural, body, namespace=namespace)
        meta = obj["metadata"]
        if meta.get("deletionTimestamp") and not meta.get("finalizers") and res.plural != "pods":
            self.delete(res.plural, name, namespace=namespace)  # the last finalizer is gone
        return web.json_response(obj)

    def _admit(self, request: web.Request, res: Resource, obj: dict[str, Any]) -> web.Response | None:
        """Defaults, then schema and CEL validation of a custom resource, as the API server does (422); in
        strict mode, built-in objects against Kubernetes' schemas (unknown fields: 400 with fieldValidation=
        Strict), and a CRD's own schema the way the API server checks CRDs."""
        name = obj.get("metadata", {}).get("name", "")
        crd = self.crds.get(res.plural)
        if crd is not None:
            errors = crd.admit(obj)
            if not errors:
                return None
            return self._status(422, "Invalid", f'{res.kind}.{res.group} "{name}" is invalid: ' + ", ".join(errors))
        if not self.strict:
            return None
        unknown, invalid = admission.builtin_problems({**obj, "apiVersion": res.api_version, "kind": res.kind})
        if unknown and request.query.get("fieldValidation", "Strict") == "Strict":
            return self._status(400, "BadRequest", f'{res.kind} in version "{res.version}" cannot be handled as a '
                                f"{res.kind}: strict decoding error: " + ", ".join(unknown))
        if res.plural == "customresourcedefinitions" and not invalid:
            invalid = crd_problems(obj)
        if invalid:
            kind = f"{res.kind}.{res.group}" if res.group else res.kind
            return self._status(422, "Invalid", f'{kind} "{name}" is invalid: ' + ", ".join(invalid))
        return None

    async def _evict(self, request: web.Request, namespace: str, name: str) -> web.Response:
        """POST pods/<name>/eviction: a graceful delete that honours the PodDisruptionBudgets (429 when not)."""
        pod = self.objects.get(("pods", namespace, name))
        if pod is None:
            return self._status(404, "NotFound", f'pods "{name}" not found')
        body = await request.json() if request.can_read_body else {}
        grace = ((body or {}).get("deleteOptions") or {}).get("gracePeriodSeconds")
        if not pod["metadata"].get("deletionTimestamp"):
            labels = pod["metadata"].get("labels") or {}
            budgets = [pdb for pdb in self.list("poddisruptionbudgets", namespace)
                       if _selects(pdb["spec"].get("selector") or {}, labels)]
            if len(budgets) > 1:
                return self._status(500, "InternalError", "This pod has more than one PodDisruptionBudget, which "
                                    "the eviction subresource does not support.")
            for pdb in budgets:
                pods = [p for p in self.list("pods", namespace)
                        if _selects(pdb["spec"].get("selector") or {}, p["metadata"].get("labels") or {})]
                if refusal := admission.eviction_refusal(pdb, pods, pod, self._expected_pods(pod, len(pods))):
                    return web.json_response({
                        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                        "message": refusal, "reason": "TooManyRequests", "code": 429,
                        "details": {"causes": [{"reason": "DisruptionBudget", "message": refusal}]}}, status=429)
        self.delete_gracefully("pods", name, namespace=namespace, grace_period=grace)
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                                  "code": 201}, status=201)

    def _expected_pods(self, pod: dict[str, Any], found: int) -> int:
        """The replicas of the pod's controller (a Deployment, StatefulSet or ReplicaSet), else the pods found."""
        for ref in pod["metadata"].get("ownerReferences") or ():
            plural = {"Deployment": "deployments", "StatefulSet": "statefulsets", "ReplicaSet": "replicasets"}.get(
                ref.get("kind"))
            owner = self.objects.get((plural, pod["metadata"]["namespace"], ref.get("name"))) if plural else None
            if owner is not None:
                return int(owner["spec"].get("replicas", 1))
        return found

    def _serve_crd(self, crd: dict[str, Any]) -> None:
        """A created CustomResourceDefinition makes its resource servable, with its schema (fake_crd.py)."""
        spec, names = crd["spec"], crd["spec"]["names"]
        version = next(v for v in spec["versions"] if v.get("storage"))
        res = Resource(spec["group"], version["name"], names["plural"], names["kind"],
                       names.get("singular") or names["kind"].lower(), namespaced=spec.get("scope") == "Namespaced",
                       short_names=tuple(names.get("shortNames") or ()),
                       status="status" in (version.get("subresources") or {}))
        self.resources = [r for r in self.resources if (r.group, r.plural) != (res.group, res.plural)] + [res]
        self.crds[res.plural] = FakeCRD.from_object(crd)

    # ---- bodies --------------------------------------------------------------------------------------

    def _version(self) -> dict[str, str]:
        major, minor = self.git_version.lstrip("v").split(".")[:2]
        return {"major": major, "minor": minor, "emulationMajor": major, "emulationMinor": minor,
                "minCompatibilityMajor": major, "minCompatibilityMinor": str(int(minor) - 1),
                "gitVersion": self.git_version, "gitCommit": "0" * 40, "gitTreeState": "clean",
                "buildDate": CREATED_AT, "goVersion": "go1.25.0", "compiler": "gc", "platform": "linux/amd64"}

    def _group_list(self) -> dict[str, Any]:
        groups: dict[str, list[str]] = {}
        for r in self.resources:
            if r.group and r.version not in groups.setdefault(r.group, []):
                groups[r.group].append(r.version)
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
            {"name": g, "versions": [{"groupVersion": f"{g}/{v}", "version": v} for v in vs],
             "preferredVersion": {"groupVersion": f"{g}/{vs[0]}", "version": vs[0]}}
            for g, vs in groups.items()
        ]}

    def _resource_list(self, group: str, version: str, resources: list[Resource]) -> dict[str, Any]:
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version,
                "resources": [{"name": r.plural, "singularName": r.singular, "namespaced": r.namespaced,
                               "kind": r.kind, "verbs": list(r.verbs), "shortNames": list(r.short_names)}
                              for r in resources]}

    def _too_old(self, since: int) -> str:
        return f"too old resource version: {since} ({self.compacted})"

    def _expired_status(self, since: int) -> dict[str, Any]:
        return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                "message": self._too_old(since), "reason": "Expired", "code": 410}

    @staticmethod
    def _status(code: int, reason: str, message: str) -> web.Response:
        return web.json_response({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                                  "message": message, "reason": reason, "code": code}, status=code)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _crd_status(crd: dict[str, Any]) -> dict[str, Any]:
    """What the API server's CRD controllers write once the names are accepted and the resource is served."""
    condition = {"status": "True", "lastTransitionTime": _now()}
    return {"acceptedNames": crd["spec"]["names"], "storedVersions": [
        v["name"] for v in crd["spec"]["versions"] if v.get("storage")], "conditions": [
        {**condition, "type": "NamesAccepted", "reason": "NoConflicts", "message": "no conflicts found"},
        {**condition, "type": "Established", "reason": "InitialNamesAccepted",
         "message": "the initial names have been accepted"}]}


def _secret_string_data(secret: dict[str, Any]) -> None:
    """The API server stores a Secret's write-only `stringData` into `data`, base64-encoded."""
    for key, value in (secret.pop("stringData", None) or {}).items():
        secret.setdefault("data", {})[key] = base64.b64encode(str(value).encode()).decode()


def _quantity(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    return str(value) if float(value).is_integer() else f"{round(value * 1000)}m"


def _canonical_quantities(obj: Any) -> None:
    """Resource quantities as the API server stores them: strings (`nvidia.com/gpu: 1` comes back "1"), which
    typed clients (the official Python client's models) require."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if key in ("limits", "requests") and isinstance(value, dict):
                obj[key] = {k: _quantity(v) for k, v in value.items()}
            elif key == "sizeLimit":
                obj[key] = _quantity(value)
            else:
                _canonical_quantities(value)
    elif isinstance(obj, list):
        for value in obj:
            _canonical_quantities(value)


def _first_directive(patch: Any) -> str | None:
    if isinstance(patch, dict):
        for key, value in patch.items():
            if key.startswith("$"):
                return key
            if found := _first_directive(value):
                return found
    elif isinstance(patch, list):
        for value in patch:
            if found := _first_directive(value):
                return found
    return None


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels and matchExpressions) against labels; an empty selector selects all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if (op == "In" and labels.get(key) not in values) or (op == "NotIn" and labels.get(key) in values) or \
                (op == "Exists" and key not in labels) or (op == "DoesNotExist" and key in labels):
            return False
    return True


def _line(event: dict[str, Any]) -> bytes:
    return json.dumps(event, separators=(",", ":")).encode() + b"\n"


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return patch
    if not isinstance(target, dict):
        target = {}
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = _merge_patch(target.get(key), value)
    return target


# ---- objects as the controllers write them -----------------------------------------------------------


def endpoint_slice(
    name: str,
    *,
    service: str,
    endpoints: list[dict[str, Any]],
    port: int,
    port_name: str = "http",
    labels: dict[str, str] | None = None,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    """An EndpointSlice as the EndpointSlice controller writes it (the Service's labels copied on)."""
    return {
        "metadata": {
            "name": name,
            "labels": {"kubernetes.io/service-name": service,
                       "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io", **(labels or {})},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": service, "uid": str(uuid.uuid4()),
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP", "appProtocol": "http"}],
    }


def slice_endpoint(pod: str, address: str = "127.0.0.1", *, ready: bool = True, terminating: bool = False,
                   uid: str | None = None, namespace: str = "default") -> dict[str, Any]:
    """One endpoint of a slice: a Pod's address and conditions (a terminating pod is not ready; it stays
    `serving` while its readiness probe passes)."""
    return {
        "addresses": [address],
        "conditions": {"ready": ready and not terminating, "serving": ready, "terminating": terminating},
        "targetRef": {"kind": "Pod", "namespace": namespace, "name": pod, "uid": uid or f"uid-{pod}"},
        "nodeName": "node-1",
    }


def pod(name: str, *, annotations: dict[str, str] | None = None, labels: dict[str, str] | None = None,
        ip: str | None = "127.0.0.1", uid: str | None = None, ready: bool | None = None) -> dict[str, Any]:
    """A running Pod; `ready` adds the conditions the kubelet writes (None: none, as the older tests want), and
    `ip=None` is a pod not yet given an address (Pending)."""
    status: dict[str, Any] = {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]} if ip else {"phase": "Pending"}
    if ready is not None:
        flag = "True" if ready else "False"
        status["conditions"] = [{"type": t, "status": flag if t in ("Ready", "ContainersReady") else "True",
                                 "lastTransitionTime": CREATED_AT}
                                for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
    return {
        "metadata": {"name": name, "uid": uid or f"uid-{name}", "labels": labels or {},
                     "annotations": annotations or {}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:latest"}], "nodeName": "node-1"},
        "status": status,
    }


def inference_pool_crd() -> dict[str, Any]:
    """The Gateway API Inference Extension's InferencePool CRD (inference.networking.k8s.io/v1), as released."""
    return yaml.safe_load(INFERENCE_POOL_CRD.read_text())


def inference_pool(name: str, *, selector: dict[str, str], ports: list[int], epp: str = "epp", epp_port: int = 9002,
                   failure_mode: str | None = None) -> dict[str, Any]:
    """An InferencePool as a user writes it (the CRD's defaults fill in the rest)."""
    ref: dict[str, Any] = {"name": epp, "port": {"number": epp_port}}
    if failure_mode is not None:
        ref["failureMode"] = failure_mode
    return {"metadata": {"name": name}, "spec": {
        "selector": {"matchLabels": selector}, "targetPorts": [{"number": p} for p in ports],
        "endpointPickerRef": ref}}
