"""A fake Kubernetes API server for tests (aiohttp, 127.0.0.1, a free port), faithful where clients look.

It serves what the official `kubernetes` client (sync and `kubernetes.aio`) and kubectl need for the
resources it knows (EndpointSlices, Pods, Services, Namespaces; add more to `RESOURCES`):

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

The test drives it: `create`/`update`/`delete` objects (each bumps the cluster-wide resourceVersion, as
etcd's revision), `compact()` the history, `close_watches()` (cleanly or abruptly), `expire_watches()` (an
ERROR 410 on every open watch), `bookmark()`, and `stop()`/`start()` for an outage (connections refused on
the same port in between). Every request is logged (`requests`), and `wait_for_request` waits for one
without sleeping. `write_kubeconfig` points a client at it, with a bearer token the fake then requires.
"""

from __future__ import annotations

import asyncio
import copy
import json
import re
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

TRUE = ("true", "True", "1")
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

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


RESOURCES = (
    Resource("discovery.k8s.io", "v1", "endpointslices", "EndpointSlice", "endpointslice"),
    Resource("", "v1", "pods", "Pod", "pod", short_names=("po",)),
    Resource("", "v1", "services", "Service", "service", short_names=("svc",)),
    Resource("", "v1", "namespaces", "Namespace", "namespace", namespaced=False, short_names=("ns",)),
    Resource("coordination.k8s.io", "v1", "leases", "Lease", "lease"),
    Resource("fleetroute.io", "v1alpha1", "routingpolicies", "RoutingPolicy", "routingpolicy", short_names=("rp",)),
)
STATUS_SUBRESOURCE = {"routingpolicies"}  # PUT/PATCH .../status changes only status; the object's own, all else


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
    def __init__(self, *, token: str | None = "fake-token", git_version: str = "v1.37.0") -> None:
        self.token = token  # None: no authentication
        self.git_version = git_version
        self.rv = 100
        self.compacted = self.rv  # history at or before this revision is gone: a watch from before it gets 410
        self.expired_as_http = False  # answer a too-old watch with HTTP 410 instead of an ERROR event
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}  # (plural, namespace, name) -> object
        self.history: list[_Change] = []
        self.requests: list[Recorded] = []
        self.watchers: list[_Watcher] = []
        self.port = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._request_seen = asyncio.Event()
        self._batch: list[tuple[_Watcher, dict[str, Any]]] | None = None
        self.crds: dict[str, Any] = {}  # plural -> its CRD version (schema, printer columns): see fake_crd.py

    # ---- lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> FakeKube:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{self.port}"
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

    # ---- what the test does to the cluster -----------------------------------------------------------

    def resource(self, plural: str) -> Resource:
        return next(r for r in RESOURCES if r.plural == plural)

    def get(self, plural: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.objects.get((plural, namespace, name))

    def create(self, plural: str, obj: dict[str, Any], *, namespace: str = "default") -> dict[str, Any]:
        res = self.resource(plural)
        obj = copy.deepcopy(obj)
        if plural in self.crds:  # the schema's defaults, as on every write; stored as unstructured JSON
            self.crds[plural].default(obj)
            obj = self.crds[plural].stored(obj)
        meta = obj.setdefault("metadata", {})
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
        self._commit("ADDED", res, key, None, obj)
        return obj

    def update(self, plural: str, obj: dict[str, Any], *, namespace: str = "default") -> dict[str, Any]:
        res = self.resource(plural)
        obj = copy.deepcopy(obj)
        if plural in self.crds:
            self.crds[plural].default(obj)
            obj = self.crds[plural].stored(obj)
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
        return obj

    def delete(self, plural: str, name: str, *, namespace: str = "default") -> dict[str, Any]:
        res = self.resource(plural)
        key = (plural, namespace if res.namespaced else "", name)
        old = self.objects[key]
        gone = copy.deepcopy(old)
        self._commit("DELETED", res, key, old, gone)
        return gone

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

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests.append(Recorded(request.method, request.path, dict(request.query), dict(request.headers)))
        seen, self._request_seen = self._request_seen, asyncio.Event()
        seen.set()
        if self.token is not None and request.headers.get("Authorization", "").lower() != f"bearer {self.token}":
            return self._status(401, "Unauthorized", "Unauthorized")
        path = request.path.rstrip("/") or "/"
        if path == "/version" and request.method == "GET":
            return web.json_response(self._version())
        if path == "/api" and request.method == "GET":
            return web.json_response({"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
                {"clientCIDR": "0.0.0.0/0", "serverAddress": f"127.0.0.1:{self.port}"}]})
        if path == "/apis" and request.method == "GET":
            return web.json_response(self._group_list())
        parts = path.strip("/").split("/")
        if parts[0] == "api" and len(parts) >= 2:
            group, version, rest = "", parts[1], parts[2:]
        elif parts[0] == "apis" and len(parts) >= 3:
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return self._status(404, "NotFound", "the server could not find the requested resource")
        if not rest and request.method == "GET":
            resources = [r for r in RESOURCES if (r.group, r.version) == (group, version)]
            if not resources:
                return self._status(404, "NotFound", "the server could not find the requested resource")
            return web.json_response(self._resource_list(group, version, resources))
        namespace = None
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        res = next((r for r in RESOURCES if (r.group, r.version, r.plural) == (group, version, rest[0])), None) \
            if rest else None
        status = len(rest) == 3 and rest[2] == "status" and res is not None and res.plural in STATUS_SUBRESOURCE
        if res is None or (len(rest) > 2 and not status) or (namespace is not None and not res.namespaced):
            return self._status(404, "NotFound", "the server could not find the requested resource")
        name = rest[1] if len(rest) >= 2 else None
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
            if name is not None:
                return await self._item(request, res, namespace or "", name, status=status)
        except ValueError as exc:
            return self._status(400, "BadRequest", str(exc))
        return self._status(405, "MethodNotAllowed", f"the server does not allow this method on {res.plural}")

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
        if since in (None, "", "0"):  # "start at most recent": the current state as ADDED events
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
                        assert request.transport is not None
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
        name = body.get("metadata", {}).get("name")
        if not name:
            return self._status(422, "Invalid", f"{res.kind} is invalid: metadata.name: Required value")
        if (res.plural, namespace or "", name) in self.objects:
            return self._status(409, "AlreadyExists", f'{res.plural} "{name}" already exists')
        body.pop("status", None)  # with a status subresource, create ignores status
        if (invalid := self._admit(res, body)) is not None:
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
            return web.json_response(self.delete(res.plural, name, namespace=namespace))
        if request.method == "PUT":
            body = await request.json()
            wanted = body.get("metadata", {}).get("resourceVersion")
            if wanted and wanted != current["metadata"]["resourceVersion"]:
                return self._status(409, "Conflict", f'Operation cannot be fulfilled on {res.plural} "{name}": '
                                    "the object has been modified; please apply your changes to the latest version")
        elif request.method == "PATCH":
            if request.content_type != "application/merge-patch+json":
                return self._status(415, "UnsupportedMediaType", f"{request.content_type} is not supported")
            body = _merge_patch(copy.deepcopy(current), await request.json())
        else:
            return self._status(405, "MethodNotAllowed", f"the server does not allow this method on {res.plural}")
        if res.plural in STATUS_SUBRESOURCE:  # the main resource ignores status; /status ignores all else
            if status:
                body = {**copy.deepcopy(current), "status": body.get("status")}
            elif "status" in current:
                body["status"] = copy.deepcopy(current["status"])
            else:
                body.pop("status", None)
        if (invalid := self._admit(res, body)) is not None:
            return invalid
        return web.json_response(self.update(res.plural, body, namespace=namespace))

    def _admit(self, res: Resource, obj: dict[str, Any]) -> web.Response | None:
        """Defaults, then schema and CEL validation of a custom resource, as the API server does (422)."""
        crd = self.crds.get(res.plural)
        if crd is None:
            return None
        errors = crd.admit(obj)
        if not errors:
            return None
        name = obj.get("metadata", {}).get("name", "")
        return self._status(422, "Invalid", f'{res.kind}.{res.group} "{name}" is invalid: ' + ", ".join(errors))
        return self._status(405, "MethodNotAllowed", f"the server does not allow this method on {res.plural}")

    # ---- bodies --------------------------------------------------------------------------------------

    def _version(self) -> dict[str, str]:
        major, minor = self.git_version.lstrip("v").split(".")[:2]
        return {"major": major, "minor": minor, "emulationMajor": major, "emulationMinor": minor,
                "minCompatibilityMajor": major, "minCompatibilityMinor": str(int(minor) - 1),
                "gitVersion": self.git_version, "gitCommit": "0" * 40, "gitTreeState": "clean",
                "buildDate": CREATED_AT, "goVersion": "go1.25.0", "compiler": "gc", "platform": "linux/amd64"}

    def _group_list(self) -> dict[str, Any]:
        groups: dict[str, list[str]] = {}
        for r in RESOURCES:
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
        ip: str = "127.0.0.1", uid: str | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "uid": uid or f"uid-{name}", "labels": labels or {},
                     "annotations": annotations or {}},
        "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai:latest"}], "nodeName": "node-1"},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    }
