"""RoutingPolicy custom resources (`fleetroute.io/v1alpha1`), watched and applied live, with status.

**Watch.** The same reflector loop as router.kube.discovery.kubernetes, on the official client's asyncio API: list
the RoutingPolicies of one namespace, keep the list's resourceVersion, watch from it with bookmarks, resume a
dropped watch from the last resourceVersion, relist on 410 Gone. During an API-server outage the policies in
effect stay as they are (the last good set) and the failure is counted and logged once.

**Conversion.** Each object's spec goes through the config file's policy parser (router.kube.control.spec), with
`name` set to the object's name and `priority` taken out: a RoutingPolicy spec is exactly one `policies:`
entry, `preset` included (router/config/presets.py expands it inside the parser, so a preset-based spec and the
same file entry give the same PolicySpec). A spec the parser refuses (it passed the CRD schema but not the
router's checks: a preset's values the API server could not see) is not applied: the previous good version
of that policy stays in effect, or none if there never was one.

**Delegation.** A parsed spec is then checked against what `control.kubernetes` delegates
(router.kube.control.delegation): its models inside `allowedModels`, its priority at most `maxPriority`, and,
unless `overrideFilePolicies`, a name no file policy has. One that goes beyond is refused like an invalid
one (the previous good version stays), with its own reason. The name check depends on the file, so it is
made again on every config reload: a RoutingPolicy whose name the file takes is out of effect until the
file lets the name go.

**Merge.** With `overrideFilePolicies: false` (the default) the effective policy list is the file's
`policies:` in file order, then the accepted RoutingPolicies, higher `spec.priority` first and equal
priorities in name order: a model a file policy matches stays the file's. With `overrideFilePolicies: true`
the RoutingPolicies come first, and replace any file policy of the same name. The first policy whose
`models` match routes a request. A config reload (SIGHUP) replaces the file's part and keeps the
RoutingPolicies.

**Status.** Every replica computes the same outcome, but only the one holding the Lease `leaseName` writes
it, through the status subresource (a merge patch): `observedGeneration` and two conditions, `Accepted`
(reasons `Accepted`, `Invalid`, and the delegation's `ModelsNotDelegated`, `PriorityNotDelegated`,
`FilePolicyConflict`) and `Ready` (`Applied`, `PreviousGenerationInEffect`, `NotInEffect`). The
Lease follows client-go's leader election: a replica takes a Lease that is free or whose record has not
changed for `leaseDuration` (timed on its own clock), renews it every third of that, and frees it on
shutdown; a resourceVersion conflict means another replica won.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import aiohttp
from kubernetes.aio import client, config
from kubernetes.aio.client.exceptions import ApiException
from prometheus_client import Counter, Gauge

from router.config.settings import ConfigError, PolicySpec, Settings
from router.kube.control import KubernetesControlSettings
from router.kube.control.delegation import REASONS, Refusal, check, file_conflict
from router.kube.control.spec import policy_from_spec
from router.kube.discovery.kubernetes import _describe, _status_message, configure_client
from router.routing.aliases import cross_check
from router.runtime.progress import Progress

if TYPE_CHECKING:  # the serving layer hands the controller its context: named for checkers only
    from router.server.context import RouterContext

log = logging.getLogger("fleetroute.control")

GROUP, VERSION, PLURAL = "fleetroute.io", "v1alpha1", "routingpolicies"
REQUEST_TIMEOUT = 30.0
INVALID = "Invalid"  # the Accepted condition's reason for a spec the router's parser refuses


class Expired(Exception):
    """Our resourceVersion is older than the API server keeps (410 Gone): relist."""


@dataclass(frozen=True)
class Outcome:
    """What the router made of one generation of one RoutingPolicy."""

    generation: int
    accepted: bool
    message: str
    in_effect: int | None  # the generation routing now (this one, an earlier one, or none)
    reason: str = "Accepted"  # the Accepted condition's reason: Accepted, Invalid, or a delegation refusal


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _conditions(outcome: Outcome) -> list[dict[str, Any]]:
    g = outcome.generation
    if outcome.accepted:
        accepted = ("True", "Accepted", "the router accepted this spec")
        ready = ("True", "Applied", "routing with this generation")
    else:
        accepted = ("False", outcome.reason, outcome.message)
        if outcome.in_effect is not None:
            ready = ("False", "PreviousGenerationInEffect",
                     f"generation {outcome.in_effect} keeps routing until this spec is fixed")
        else:
            ready = ("False", "NotInEffect", "no accepted generation of this policy routes yet")
    return [{"type": kind, "status": status, "observedGeneration": g, "reason": reason, "message": message}
            for kind, (status, reason, message) in (("Accepted", accepted), ("Ready", ready))]


class RoutingPolicyController:
    def __init__(self, *, settings: KubernetesControlSettings, ctx: RouterContext,
                 install: Callable[[tuple[PolicySpec, ...]], None], rng: random.Random | None = None) -> None:
        """`install` makes a new set of policies the router's (router/server/app.py `install_policies`)."""
        self.settings = settings
        self._ctx = ctx
        self._install = install
        self._rng = rng or random.Random()
        self.identity = settings.holder()
        self.namespace = settings.namespace or "default"
        self.base: tuple[PolicySpec, ...] = ctx.settings.policies  # the file's policies
        self.objects: dict[str, dict[str, Any]] = {}  # name -> the latest object seen
        self.accepted: dict[str, tuple[int, int, PolicySpec]] = {}  # name -> (generation, priority, spec)
        self.outcomes: dict[str, Outcome] = {}
        self._parsed: dict[str, tuple[str, Outcome]] = {}  # name -> (spec text, outcome): parse once per spec
        self.resource_version: str | None = None
        self.synced = asyncio.Event()
        self.up = False
        self.leader = False
        self._failures = 0
        self._down_since: float | None = None
        self._lease_seen: tuple[str, float] | None = None  # (the Lease's resourceVersion, when we first saw it)
        self._status_dirty = asyncio.Event()
        self._progress = Progress()  # notified whenever something observable changed (see wait_for)
        self._api: client.ApiClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        r = ctx.metrics.registry
        self._reloads = Counter("fleetroute_routing_policy_reloads", "RoutingPolicy generations the router "
                                "applied or rejected (invalid: the previous good version kept)", ["result"],
                                registry=r)
        self._refusals = Counter("fleetroute_routing_policy_refusals", "RoutingPolicy generations the router did "
                                 "not apply, by the reason in their Accepted condition: Invalid (the router's "
                                 "parser refused the spec), ModelsNotDelegated, PriorityNotDelegated, "
                                 "FilePolicyConflict (beyond what control.kubernetes delegates)", ["reason"],
                                 registry=r)
        for reason in (INVALID, *REASONS):
            self._refusals.labels(reason)
        self._conflicts: set[str] = set()  # names whose file policy keeps them out of effect (logged once)
        self._errors = Counter("fleetroute_routing_policy_errors", "Failed Kubernetes API requests of the "
                               "RoutingPolicy watch and status writer, by kind (list, watch, lease, status)",
                               ["kind"], registry=r)
        self._holder = Gauge("fleetroute_routing_policy_lease_holder", "1 while this replica holds the Lease "
                             "that makes it the RoutingPolicy status writer", registry=r)
        self._up = Gauge("fleetroute_routing_policy_up", "1 while the RoutingPolicy watch is in sync", registry=r)
        self._holder.set(0)
        self._up.set(0)

    # ---- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        configuration = client.Configuration()
        loader = await self._load_config(configuration)
        self._api = client.ApiClient(configuration)
        self._api.user_agent = f"fleetroute/{self.identity}"
        self._tasks = [asyncio.create_task(self._reflect(), name="control-routing-policies-watch")]
        if self.settings.status:
            self._tasks.append(asyncio.create_task(self._status_writer(), name="control-routing-policies-status"))
        if loader is not None:
            self._tasks.append(asyncio.create_task(config.refresh_token(loader, configuration),
                                                   name="control-kubernetes-token"))
        log.info("watching RoutingPolicies", extra={
            "namespace": self.namespace, "identity": self.identity, "allowed_models": list(s.allowed_models),
            "max_priority": s.max_priority, "override_file_policies": s.override_file_policies})
        if not s.allowed_models:
            log.warning("control.kubernetes.allowedModels is empty: RoutingPolicies are watched, but none is "
                        "applied (each is refused with ModelsNotDelegated)")
        self._warn_if_shadowed(self.base)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self.leader:
            await self._release()
        if self._api is not None:
            await self._api.close()
            self._api = None

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Return once `predicate()` holds, re-checking after each event, apply, status write or Lease change."""
        await self._progress.wait_for(predicate)

    def _notify(self) -> None:
        self._progress.notify()

    async def _load_config(self, configuration: client.Configuration) -> Any:
        s = self.settings
        loader, namespace = await configure_client(configuration, kubeconfig=s.kubeconfig, context=s.context,
                                                   where="control.kubernetes.kubeconfig")
        if s.namespace is None:
            self.namespace = namespace
        return loader

    # ---- merge and apply ----------------------------------------------------------------------------

    def effective(self, base: tuple[PolicySpec, ...]) -> tuple[PolicySpec, ...]:
        names = {spec.name for spec in base}
        ordered = sorted(((name, value) for name, value in self.accepted.items()
                          if file_conflict(name, names, self.settings) is None),
                         key=lambda item: (-item[1][1], item[0]))
        live = tuple(spec for _, (_, _, spec) in ordered)
        if not self.settings.override_file_policies:
            return base + live
        return live + tuple(spec for spec in base if spec.name not in self.accepted)

    def rebase(self, new: Settings) -> Settings:
        """A config reload: its policies are the new base; the RoutingPolicies stay merged with them, and the
        names the file now takes (or gives up) are judged again."""
        self.base = new.policies
        self._warn_if_shadowed(new.policies)
        self._note_conflicts()
        self._status_dirty.set()
        return replace(new, policies=self.effective(new.policies))

    def outcome(self, name: str) -> Outcome:
        """The outcome of `name`'s latest generation, with the file's claim on its name as it stands now."""
        outcome = self.outcomes[name]
        refusal = file_conflict(name, {spec.name for spec in self.base}, self.settings)
        if refusal is None:
            return outcome
        return Outcome(outcome.generation, False, refusal.message, None, refusal.reason)

    def _note_conflicts(self) -> None:
        """Log and count each RoutingPolicy that a file policy's name keeps out of effect, once per conflict."""
        names = {spec.name for spec in self.base}
        now = {name for name in self.outcomes if file_conflict(name, names, self.settings) is not None}
        for name in sorted(now - self._conflicts):
            refusal = file_conflict(name, names, self.settings)
            assert refusal is not None
            self._refused(name, self.outcomes[name].generation, refusal)
        for name in sorted(self._conflicts - now):
            log.info("RoutingPolicy no longer conflicts with a file policy", extra={"policy": name})
        self._conflicts = now

    def _warn_if_shadowed(self, base: tuple[PolicySpec, ...]) -> None:
        if self.settings.override_file_policies:
            return
        for spec in base:
            if "*" in spec.models:
                log.warning("a file policy matches every model and is matched before RoutingPolicies, which "
                            "therefore route nothing (control.kubernetes.overrideFilePolicies: true puts them "
                            "first)", extra={"policy": spec.name})

    def _refused(self, name: str, generation: int, refusal: Refusal) -> None:
        self._refusals.labels(refusal.reason).inc()
        log.warning("RoutingPolicy refused: beyond what control.kubernetes delegates", extra={
            "policy": name, "generation": generation, "reason": refusal.reason, "error": refusal.message})

    def _apply(self) -> None:
        ctx = self._ctx
        policies = self.effective(self.base)
        if policies == ctx.settings.policies:
            return
        self._install(policies)
        log.info("routing policies applied", extra={"policies": [p.name for p in policies],
                                                    "presets": {p.name: p.preset for p in policies if p.preset},
                                                    "aliases": ctx.balancer.aliases.describe()})

    def _judge(self, name: str, obj: dict[str, Any]) -> None:
        """Parse one object's spec (once per spec), keep it if good, record the outcome."""
        meta = obj.get("metadata") or {}
        generation = int(meta.get("generation") or 1)
        spec = dict(obj.get("spec") or {})
        text = json.dumps(spec, sort_keys=True)
        cached = self._parsed.get(name)
        if cached is not None and cached[0] == text:
            if cached[1].generation != generation:  # (a status-only write never changes the generation)
                self.outcomes[name] = replace(self.outcomes[name], generation=generation)
            return
        previous = self.accepted.get(name)
        in_effect = previous[0] if previous else None
        try:
            priority, parsed = policy_from_spec(name, spec, self._ctx.registry)
            self._check_alias_targets(parsed)
        except ConfigError as exc:
            outcome = Outcome(generation, False, str(exc), in_effect, INVALID)
            self._reloads.labels("rejected").inc()
            self._refusals.labels(INVALID).inc()
            log.warning("RoutingPolicy rejected; the previous good version stays in effect" if previous else
                        "RoutingPolicy rejected", extra={"policy": name, "generation": generation,
                                                         "error": str(exc)})
        else:
            refusal = check(parsed, priority, self.settings)
            if refusal is not None:
                outcome = Outcome(generation, False, refusal.message, in_effect, refusal.reason)
                self._reloads.labels("rejected").inc()
                self._refused(name, generation, refusal)
            else:
                self.accepted[name] = (generation, priority, parsed)
                outcome = Outcome(generation, True, "", generation)
                self._reloads.labels("applied").inc()
                log.info("RoutingPolicy accepted", extra={"policy": name, "generation": generation,
                                                          "strategy": parsed.strategy, "preset": parsed.preset,
                                                          "models": list(parsed.models)})
        self._parsed[name] = (text, outcome)
        self.outcomes[name] = outcome
        self._conflicts.discard(name)  # a new generation: a conflict with the file is logged and counted again

    def _check_alias_targets(self, policy: PolicySpec) -> None:
        """Where the router knows every endpoint (static ones, no discovery), an alias target no endpoint serves
        is refused as the config file's would be (routing/aliases.py): Invalid, with the parser's kind of message."""
        settings = self._ctx.settings
        if not policy.aliases or settings.discovery.kubernetes is not None:
            return
        served = {m for ep in settings.endpoints for m in ep.models}
        problem = cross_check(((f"spec.aliases[{j}]", a) for j, a in enumerate(policy.aliases)), served)
        if problem is not None:
            raise ConfigError(*problem)

    def _forget(self, name: str) -> None:
        self.objects.pop(name, None)
        self.outcomes.pop(name, None)
        self._parsed.pop(name, None)
        self._conflicts.discard(name)
        if self.accepted.pop(name, None) is not None:
            log.info("RoutingPolicy deleted", extra={"policy": name})

    def _changed(self) -> None:
        self._note_conflicts()
        self._apply()
        self._status_dirty.set()
        self._notify()

    # ---- list and watch -----------------------------------------------------------------------------

    async def _reflect(self) -> None:
        assert self._api is not None
        api = client.CustomObjectsApi(self._api)
        while True:
            try:
                if self.resource_version is None:
                    await self._list(api)
                if await self._watch(api) == 0:
                    await asyncio.sleep(self._backoff(1))
            except Expired:
                log.info("RoutingPolicy watch expired (410 Gone); relisting")
                self.resource_version = None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the policies in effect, count it, back off, retry
                self._failed("list" if self.resource_version is None else "watch", exc)
                await asyncio.sleep(self._backoff(self._failures))

    async def _list(self, api: client.CustomObjectsApi) -> None:
        page = await api.list_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL,
                                                       label_selector=self.settings.label_selector,
                                                       _request_timeout=REQUEST_TIMEOUT)
        objects = {o["metadata"]["name"]: o for o in page.get("items") or ()}
        for gone in set(self.objects) - set(objects):
            self._forget(gone)
        for name, obj in objects.items():
            self.objects[name] = obj
            self._judge(name, obj)
        self.resource_version = (page.get("metadata") or {}).get("resourceVersion")
        self._recovered()
        self._changed()
        self.synced.set()

    async def _watch(self, api: client.CustomObjectsApi) -> int:
        response = await api.list_namespaced_custom_object_without_preload_content(
            GROUP, VERSION, self.namespace, PLURAL, watch=True, allow_watch_bookmarks=True,
            resource_version=self.resource_version, label_selector=self.settings.label_selector,
            timeout_seconds=int(self.settings.watch_timeout),
            _request_timeout=float(self.settings.watch_timeout + 30),
        )
        if response.status != 200:
            body = await response.text()
            response.release()
            if response.status == 410:
                raise Expired
            raise ApiException(status=response.status, reason=_status_message(body) or response.reason)
        self._recovered()
        events = 0
        try:
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                events += 1
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise Expired
                    raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                name = (obj.get("metadata") or {}).get("name")
                if kind in ("ADDED", "MODIFIED") and name:
                    self.objects[name] = obj
                    self._judge(name, obj)
                    self._changed()
                elif kind == "DELETED" and name:
                    self._forget(name)
                    self._changed()
                if rv:
                    self.resource_version = rv
                self._notify()
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, ConnectionResetError) as exc:
            log.debug("RoutingPolicy watch dropped; resuming", extra={"error": _describe(exc)})
        finally:
            response.release()
        return events

    def _failed(self, kind: str, exc: BaseException) -> None:
        self._errors.labels(kind).inc()
        self._failures += 1
        self.up = False
        self._up.set(0)
        if self._down_since is None:
            self._down_since = asyncio.get_running_loop().time()
            hint = "" if not (isinstance(exc, ApiException) and exc.status == 404) else (
                " (404: is the RoutingPolicy CRD installed? Install manifests/crd/, or turn RoutingPolicies off: "
                "no control.kubernetes block, in the chart routingPolicyControl.enabled: false)")
            log.warning("kubernetes API request failed; keeping the routing policies in effect and retrying" + hint,
                        extra={"kind": kind, "error": _describe(exc)})
        self._notify()

    def _recovered(self) -> None:
        self._failures = 0
        if self._down_since is not None:
            log.info("kubernetes API reachable again (RoutingPolicies)")
            self._down_since = None
        if not self.up:
            self.up = True
            self._up.set(1)
            self._notify()

    def _backoff(self, failures: int) -> float:
        s = self.settings
        return min(s.max_backoff, s.initial_backoff * 2 ** max(failures - 1, 0)) * self._rng.uniform(0.5, 1.0)

    # ---- the Lease and status -----------------------------------------------------------------------

    async def _status_writer(self) -> None:
        renew = self.settings.lease_duration / 3
        while True:
            try:
                await self._take_lease()
                if self.leader:
                    self._status_dirty.clear()
                    await self._write_statuses()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._errors.labels("lease").inc()
                self._set_leader(False)
                log.debug("lease or status write failed", extra={"error": _describe(exc)})
            try:
                await asyncio.wait_for(self._status_dirty.wait(), renew)
            except TimeoutError:
                pass

    def _set_leader(self, leader: bool) -> None:
        if leader != self.leader:
            self.leader = leader
            self._holder.set(1 if leader else 0)
            log.info("holding the RoutingPolicy status Lease" if leader else "not the RoutingPolicy status writer",
                     extra={"lease": self.settings.lease_name, "identity": self.identity})
            self._notify()

    async def _take_lease(self) -> None:
        assert self._api is not None
        api = client.CoordinationV1Api(self._api)
        s = self.settings
        now = _now()
        duration = max(int(s.lease_duration), 1)
        response = await api.read_namespaced_lease_without_preload_content(s.lease_name, self.namespace,
                                                                           _request_timeout=REQUEST_TIMEOUT)
        body = await response.text()
        if response.status == 404:
            lease = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                     "metadata": {"name": s.lease_name, "namespace": self.namespace},
                     "spec": {"holderIdentity": self.identity, "leaseDurationSeconds": duration,
                              "acquireTime": now, "renewTime": now, "leaseTransitions": 0}}
            created = await api.create_namespaced_lease_without_preload_content(
                self.namespace, lease, _request_timeout=REQUEST_TIMEOUT)
            await created.read()
            self._set_leader(created.status == 201 or created.status == 200)
            return
        if response.status != 200:
            raise ApiException(status=response.status, reason=_status_message(body))
        lease = json.loads(body)
        spec = lease.setdefault("spec", {})
        holder = spec.get("holderIdentity") or ""
        rv = lease["metadata"]["resourceVersion"]
        clock = asyncio.get_running_loop().time()
        if self._lease_seen is None or self._lease_seen[0] != rv:
            self._lease_seen = (rv, clock)
        held_for = spec.get("leaseDurationSeconds") or duration
        expired = clock - self._lease_seen[1] >= held_for
        if holder and holder != self.identity and not expired:
            self._set_leader(False)
            return
        if holder != self.identity:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if holder else 0)
        spec.update(holderIdentity=self.identity, leaseDurationSeconds=duration, renewTime=now)
        updated = await api.replace_namespaced_lease_without_preload_content(
            s.lease_name, self.namespace, lease, _request_timeout=REQUEST_TIMEOUT)
        text = await updated.text()
        if updated.status == 409:  # another replica renewed or took it first
            self._set_leader(False)
            return
        if updated.status != 200:
            raise ApiException(status=updated.status, reason=_status_message(text))
        self._lease_seen = (json.loads(text)["metadata"]["resourceVersion"], clock)
        self._set_leader(True)

    async def _release(self) -> None:
        """Free the Lease on shutdown, so another replica takes over at its next try (client-go's
        ReleaseOnCancel)."""
        assert self._api is not None
        api = client.CoordinationV1Api(self._api)
        try:
            response = await api.read_namespaced_lease_without_preload_content(
                self.settings.lease_name, self.namespace, _request_timeout=5.0)
            lease = json.loads(await response.text())
            if response.status == 200 and lease.get("spec", {}).get("holderIdentity") == self.identity:
                lease["spec"].update(holderIdentity=None, leaseDurationSeconds=1)
                freed = await api.replace_namespaced_lease_without_preload_content(
                    self.settings.lease_name, self.namespace, lease, _request_timeout=5.0)
                await freed.read()
        except Exception as exc:  # shutting down: the Lease expires on its own
            log.debug("could not release the Lease", extra={"error": _describe(exc)})
        self._set_leader(False)

    async def _write_statuses(self) -> None:
        assert self._api is not None
        api = client.CustomObjectsApi(self._api)
        for name in list(self.outcomes):
            outcome = self.outcome(name)
            obj = self.objects.get(name)
            if obj is None:
                continue
            current = obj.get("status") or {}
            old = {c.get("type"): c for c in current.get("conditions") or ()}
            wanted = _conditions(outcome)
            same = current.get("observedGeneration") == outcome.generation and all(
                {k: old.get(c["type"], {}).get(k) for k in c} == c for c in wanted)
            if same:
                continue
            now = _now()
            for c in wanted:
                before = old.get(c["type"])
                keep = before is not None and before.get("status") == c["status"]
                c["lastTransitionTime"] = before.get("lastTransitionTime", now) if keep and before else now
            patch = {"status": {"observedGeneration": outcome.generation, "conditions": wanted}}
            try:
                written = await api.patch_namespaced_custom_object_status(
                    GROUP, VERSION, self.namespace, PLURAL, name, patch,
                    _content_type="application/merge-patch+json", _request_timeout=REQUEST_TIMEOUT)
            except ApiException as exc:
                if exc.status == 404:
                    continue  # deleted meanwhile
                self._errors.labels("status").inc()
                raise
            if isinstance(written, dict) and name in self.objects:
                self.objects[name] = written
            log.info("RoutingPolicy status written", extra={"policy": name, "generation": outcome.generation,
                                                            "accepted": outcome.accepted})
        self._notify()
