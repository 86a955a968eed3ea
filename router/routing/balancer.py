"""The balancer owns the current routing snapshot and one picker per model, and rebuilds them on change.

Inputs arrive from discovery (`set_endpoints`), telemetry (`report_telemetry`, then `refresh_telemetry` once
per round: a new snapshot without a full rebuild when only telemetry values changed) and operators
(`set_state`). Each marks the snapshot dirty and schedules one rebuild on the event loop; a burst of updates
(every endpoint's scrape landing in the same interval) collapses into a single rebuild (Finagle).
A rebuild makes a new immutable `Snapshot`, judges telemetry age (stale reports become unknown), then asks
each model's policy to build a new picker and swaps the references. `pick` only reads them: it never
awaits and never rebuilds on the request path.

State that must outlive a rebuild (round-robin cursor, hash ring) is kept per (policy, model) pool.

Endpoints that leave are handed to `departures` (router/routing/departures.py), which has every owner of
per-endpoint state forget them, this balancer included (`forget_endpoints`).
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from router.config.settings import PolicySpec, default_policy
from router.health.gpu import GpuHealth
from router.health.pool import PoolHealth
from router.model import Endpoint, EndpointState, EndpointView, RequestInfo, Snapshot, Telemetry
from router.routing.aliases import AliasTable
from router.routing.departures import Departures
from router.routing.loads import LoadTracker
from router.routing.policies import lora_affinity
from router.routing.policies.base import MAX_LISTED, DecisionTrace, Picker
from router.routing.policies.registry import PolicyRegistry
from router.routing.sticky import within_load_bound
from router.runtime.metrics import RouterMetrics

log = logging.getLogger("fleetroute.balancer")

# Telemetry values an explanation shows per candidate (those the built-in strategies read).
TELEMETRY_FACTS = ("gpu_util", "gpu_mem_util", "kv_cache_usage", "num_waiting", "num_running")


class Balancer:
    def __init__(
        self,
        *,
        policies: Iterable[PolicySpec],
        registry: PolicyRegistry,
        metrics: RouterMetrics,
        loads: LoadTracker,
        stale_after: float,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._policies = tuple(policies)
        self.aliases = AliasTable.of(self._policies)  # model aliases of the policies in effect (aliases.py)
        self._registry = registry
        self._fallback = default_policy(registry)
        # Health state per policy (its settings are per policy); GPU faults are per endpoint, shared.
        self.gpu_health = GpuHealth(stale_after=stale_after)
        self.health: dict[str, PoolHealth] = {
            spec.name: PoolHealth(spec.name, spec.health, metrics, self.gpu_health, self._excluded)
            for spec in (*self._policies, self._fallback)
        }
        # Told (policy, endpoint, reason) when a rebuild newly excludes an endpoint for a reason that dooms the
        # requests waiting there (router/health/pool.py RELEASING): the router takes them off (router/server/rescue.py).
        self.on_excluded: Callable[[str, str, str], None] | None = None
        self._metrics = metrics
        self.loads = loads
        self._stale_after = stale_after
        self._rng = rng or random.Random()
        self._clock = clock
        self._endpoints: dict[str, Endpoint] = {}
        self._telemetry: dict[str, Telemetry] = {}
        self._states: dict[str, EndpointState] = {}  # operators' drains (admin API)
        self._source_states: dict[str, EndpointState] = {}  # discovery's (Kubernetes: terminating, not ready)
        self._aged: set[str] = set()  # endpoints with a telemetry_age series, removed when they leave
        # What the next telemetry round must look at, so that it costs what changed, not the fleet: the endpoints
        # reported since the last round, and a heap of (reported_at, id) with one entry per endpoint whose report
        # has not gone stale yet (`_timed`), so that reports going stale (a lost agent) are found in order of age
        # without looking at the others. An entry may be older than its endpoint's report: when it comes up, it
        # is moved to the report's time (`_changed_views`).
        self._reported: set[str] = set()
        self._expiry: list[tuple[float, str]] = []
        self._timed: set[str] = set()
        self._unknown = 0  # views without usable telemetry in the current snapshot
        self._pool_pos: dict[str, dict[str, int]] = {}  # per model: endpoint id -> its index in the pool
        self._pool_state: dict[tuple[str, str], Any] = {}
        self._pickers: dict[str, tuple[PolicySpec, Picker]] = {}
        self._pools: dict[str, tuple[EndpointView, ...]] = {}  # routable endpoints per model
        self._pool_ids: dict[str, frozenset[str]] = {}  # all serving endpoints per model (healthy or not)
        self._decision_children: dict[tuple[str, str], Any] = {}
        self.snapshot = Snapshot.of(0, ())
        self._models: frozenset[str] = frozenset()
        self._rebuild_scheduled = False
        self._gpu_changed = False  # a report changed an endpoint's GPU fault since the last full rebuild
        self._gpu_faulty = False  # the last full rebuild saw a GPU fault (its end must rebuild too)
        # Ejected or tripped by a request's outcome since the last build of their pools: left out of every
        # pick at once, until the coalesced rebuild of those pools (`_rebuild_pools`) leaves them out for good.
        self._held_out: set[str] = set()
        self._dirty_models: set[str] = set()
        self.on_rebuild: Callable[[], None] | None = None  # after each swap (admission re-checks capacity)
        # Frees the state of endpoints that leave. Alone, the balancer is the only owner it tells; the router
        # lists all of them (RouterContext.endpoint_state_owners).
        self.departures = Departures(loads=loads, metrics=metrics, is_member=self.is_member,
                                     owners=lambda: (self,))

    # ---- inputs -------------------------------------------------------------------------------------

    def set_endpoints(self, endpoints: Iterable[Endpoint], states: Mapping[str, EndpointState] | None = None) -> None:
        """Replace the endpoint set. `states` is the source's own view per endpoint (absent: serving): a
        Kubernetes endpoint that is terminating or not ready is kept, draining, so its in-flight requests
        finish. An endpoint takes new requests only while both its source and the operator let it."""
        previous = self._endpoints
        self._endpoints = {ep.id: ep for ep in endpoints}
        self._source_states = {k: v for k, v in (states or {}).items() if v is not EndpointState.SERVING}
        # An id that now has another URL is a new incarnation (a StatefulSet pod recreated on a new IP): its
        # telemetry, health and drain state belonged to the old one.
        moved = frozenset(i for i, ep in self._endpoints.items() if i in previous and previous[i].url != ep.url)
        gone = frozenset(previous.keys() - self._endpoints.keys())
        if gone or moved:
            self.departures.left(gone, moved)
            self.rebuild()  # now: no picker may choose an endpoint whose state was just freed
        else:
            self.schedule_rebuild()

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Routing state of endpoints that left (or came back as a new incarnation): telemetry, drains, GPU
        and policy health, and what picker pool states keep per endpoint (prefix index, hash ring)."""
        for endpoint_id in gone:
            self._telemetry.pop(endpoint_id, None)
            self._states.pop(endpoint_id, None)
            self.gpu_health.forget(endpoint_id)
            for pool in self.health.values():
                pool.forget(endpoint_id)
            if endpoint_id in self._aged:  # its age is the old incarnation's: not shown until the new one reports
                self._aged.discard(endpoint_id)
                self._metrics.telemetry_age.remove(endpoint_id)
        self._decision_children = {k: v for k, v in self._decision_children.items() if k[1] not in gone}
        self._reported -= gone
        if not self._timed.isdisjoint(gone):  # departures are rare, and rebuild anyway: O(heap) is fine
            self._timed -= gone
            self._expiry = [entry for entry in self._expiry if entry[1] not in gone]
            heapq.heapify(self._expiry)
        for state in self._pool_state.values():
            forget: Callable[[frozenset[str]], None] | None = getattr(state, "forget_endpoints", None)
            if forget is not None:  # a policy's pool state that keeps per-endpoint data (policies/base.py)
                forget(gone)

    def is_member(self, endpoint_id: str) -> bool:
        """Is the endpoint in the endpoint set now (serving or draining)?"""
        return endpoint_id in self._endpoints

    def report_telemetry(self, endpoint_id: str, telemetry: Telemetry) -> None:
        """Take a load report, applied at the next `refresh_telemetry`. One older than the report already held
        (delivered out of order) is dropped: the newer one says more about the endpoint now."""
        if endpoint_id in self._endpoints:
            held = self._telemetry.get(endpoint_id)
            if held is not None and telemetry.reported_at < held.reported_at:
                self._metrics.telemetry_out_of_order.inc()
                return
            self._telemetry[endpoint_id] = telemetry
            self._reported.add(endpoint_id)
            if endpoint_id not in self._timed:
                self._timed.add(endpoint_id)
                heapq.heappush(self._expiry, (telemetry.reported_at, endpoint_id))
            now = self._clock()
            before = self.gpu_health.fault(endpoint_id, now)
            self.gpu_health.observe(endpoint_id, telemetry, now)
            if self.gpu_health.fault(endpoint_id, now) != before:
                self._gpu_changed = True  # the next telemetry round rebuilds: health reads GPU faults

    def set_state(self, endpoint_id: str, state: EndpointState) -> bool:
        if endpoint_id not in self._endpoints:
            return False
        if self._states.get(endpoint_id, EndpointState.SERVING) is not state:
            self._states[endpoint_id] = state
            log.info("endpoint state changed", extra={"endpoint": endpoint_id, "state": state.value})
            self.rebuild()  # an operator's drain takes effect before the admin call returns
        return True

    def set_policies(self, policies: Iterable[PolicySpec]) -> None:
        """Swap the policy set live. Health state is kept for policies whose health settings did not change,
        picker state (round-robin cursor, hash ring) for policies whose strategy and parameters did not."""
        old = {spec.name: spec for spec in self._policies}
        self._policies = tuple(policies)
        self.aliases = AliasTable.of(self._policies)
        health: dict[str, PoolHealth] = {}
        for spec in (*self._policies, self._fallback):
            previous = old.get(spec.name, self._fallback if spec is self._fallback else None)
            pool = self.health.get(spec.name)
            same = pool is not None and previous is not None and previous.health == spec.health
            health[spec.name] = pool if same else PoolHealth(spec.name, spec.health, self._metrics, self.gpu_health,
                                                             self._excluded)
        self.health = health
        current = {spec.name: spec for spec in self._policies}
        self._pool_state = {
            key: state for key, state in self._pool_state.items()
            if key[0] in current and key[0] in old
            and (current[key[0]].strategy, current[key[0]].params) == (old[key[0]].strategy, old[key[0]].params)
        }
        self.rebuild()

    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints.values())

    def endpoint(self, endpoint_id: str) -> Endpoint | None:
        return self._endpoints.get(endpoint_id)

    def _state(self, endpoint_id: str) -> EndpointState:
        operator = self._states.get(endpoint_id, EndpointState.SERVING)
        return operator if operator is not EndpointState.SERVING else self._source_states.get(endpoint_id, operator)

    # ---- rebuild ------------------------------------------------------------------------------------

    def schedule_rebuild(self) -> None:
        """Rebuild soon, once, however many updates arrive before then."""
        if self._rebuild_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self.rebuild()
            return
        self._rebuild_scheduled = True
        loop.call_soon(self.rebuild)

    def refresh_telemetry(self) -> None:
        """After a telemetry round: a full `rebuild` if the round may have changed any pool's shape (a GPU fault
        reported, held or cleared: GPU health reads telemetry; or a rebuild already pending), else a refresh.

        A refresh touches only the endpoints whose view changed: those that reported since the last round and
        those whose last report went stale meanwhile (found in age order in `_expiry`, not by looking at every
        endpoint). No pool's membership or weights change: routability changes only with health, drains and
        membership, each of which rebuilds itself (time alone: `tick`). The new snapshot shares every unchanged
        view (`Snapshot.patched`); a pool that holds a changed endpoint gets the new view at its position, at the
        slow-start weight of its last build; its picker is refreshed only if its policy reads telemetry
        (`reads_telemetry`), through the policy's `refresh` hook where it has one (adaptive: the changed
        endpoints' scores) and a build over the patched pool where not. Telemetry-age gauges are set for the
        changed endpoints only. No health admission, no per-endpoint health metrics: at 1,000 endpoints a
        rebuild costs 18-23 ms, a refresh of a quarter of them well under 1 ms (docs/results/refresh/)."""
        now = self._clock()
        if self._rebuild_scheduled or self._gpu_changed or self._gpu_faulty or self.gpu_health.any_fault(now):
            self.rebuild()
            return
        changed = self._changed_views(now)
        self._metrics.refreshes.inc()
        if not changed:
            return
        self._metrics.refreshed_endpoints.inc(len(changed))
        snapshot = self.snapshot.patched(self.snapshot.version + 1, changed)
        touched: dict[str, dict[str, EndpointView]] = {}  # model -> its pool's changed views
        for endpoint_id, view in changed.items():
            for model in view.endpoint.models:
                positions = self._pool_pos.get(model)
                if positions is not None and endpoint_id in positions:
                    touched.setdefault(model, {})[endpoint_id] = view
        pickers, pools = dict(self._pickers), dict(self._pools)
        repointed: dict[str, tuple[tuple[EndpointView, ...], dict[str, EndpointView]]] = {}
        for model, fresh in touched.items():
            spec, picker = self._pickers[model]
            policy = self._registry.get(spec.strategy)
            assert policy is not None, spec.strategy
            if not getattr(policy, "reads_telemetry", True):
                continue  # its picker, pool and load index stay: none of them reads telemetry
            old_pool, positions = self._pools[model], self._pool_pos[model]
            pool_list = list(old_pool)
            for endpoint_id, view in fresh.items():
                i = positions[endpoint_id]
                factor = old_pool[i].weight_factor  # the slow-start weight of the pool's last build
                if factor != 1.0:
                    view = EndpointView(view.endpoint, view.telemetry, view.state, factor)
                pool_list[i] = view
                fresh[endpoint_id] = pool_list[i]
            pool = tuple(pool_list)
            pools[model] = pool
            repointed[model] = (pool, fresh)
            refresh = getattr(policy, "refresh", None)
            refreshed = refresh(picker, pool, fresh) if refresh is not None else None
            self._metrics.picker_refreshes.labels(spec.strategy, "patched" if refreshed is not None else "built").inc()
            pickers[model] = (spec, refreshed if refreshed is not None
                              else self._build_picker(policy, spec, model, pool))
        self.snapshot = snapshot
        self._pickers, self._pools = pickers, pools
        self.loads.repoint(repointed)
        self._metrics.telemetry_unknown.set(self._unknown)
        if self.on_rebuild is not None:
            self.on_rebuild()

    def _changed_views(self, now: float) -> dict[str, EndpointView]:
        """The views that differ from the snapshot's now: endpoints that reported since the last round, and
        those whose report went stale since (an endpoint's heap entry comes up once its age passes `stale_after`;
        if the endpoint reported since, the entry moves to that report's time instead)."""
        candidates = self._reported
        self._reported = set()
        expiry, stale_after = self._expiry, self._stale_after
        while expiry and now - expiry[0][0] > stale_after:  # `_views`' own test, to the last bit
            reported_at, endpoint_id = heapq.heappop(expiry)
            held = self._telemetry.get(endpoint_id)
            if held is not None and held.reported_at > reported_at:
                heapq.heappush(expiry, (held.reported_at, endpoint_id))  # reported since: due later (or next)
                continue
            self._timed.discard(endpoint_id)
            if held is not None:
                candidates.add(endpoint_id)
        changed: dict[str, EndpointView] = {}
        by_id = self.snapshot.by_id
        for endpoint_id in candidates:
            old = by_id.get(endpoint_id)
            telemetry = self._telemetry.get(endpoint_id)
            if old is None or telemetry is None:
                continue  # it left (a rebuild follows), or it was forgotten
            age = now - telemetry.reported_at
            self._metrics.child(self._metrics.telemetry_age, endpoint_id).set(max(age, 0.0))
            self._aged.add(endpoint_id)
            usable = None if age > stale_after else telemetry
            if usable is old.telemetry:
                continue
            self._unknown += (usable is None) - (old.telemetry is None)
            # Made directly: dataclasses.replace costs several times more, and this runs per report.
            changed[endpoint_id] = EndpointView(old.endpoint, usable, old.state, old.weight_factor)
        return changed

    def _views(self, now: float) -> tuple[tuple[EndpointView, ...], int]:
        """Every endpoint's view now: its telemetry (None when stale or missing; ages exported) and state."""
        views = []
        unknown = 0
        for ep in self._endpoints.values():
            telemetry = self._telemetry.get(ep.id)
            if telemetry is not None:
                age = now - telemetry.reported_at
                self._metrics.child(self._metrics.telemetry_age, ep.id).set(max(age, 0.0))
                self._aged.add(ep.id)
                if age > self._stale_after:
                    telemetry = None
            if telemetry is None:
                unknown += 1
            views.append(
                EndpointView(endpoint=ep, telemetry=telemetry, state=self._state(ep.id))
            )
        return tuple(views), unknown

    def rebuild(self) -> None:
        self._rebuild_scheduled = False
        self._gpu_changed = False
        now = self._clock()
        self._gpu_faulty = self.gpu_health.any_fault(now)  # then the next telemetry round rebuilds too
        views, unknown = self._views(now)
        self._reported.clear()  # the new snapshot holds every report: the next refresh starts from here
        snapshot = Snapshot.of(self.snapshot.version + 1, views)
        pickers: dict[str, tuple[PolicySpec, Picker]] = {}
        pools: dict[str, tuple[EndpointView, ...]] = {}
        pool_ids: dict[str, frozenset[str]] = {}
        for model in snapshot.models():
            pool_ids[model], pools[model], pickers[model] = self._build_pool(snapshot, model, now)
        self.snapshot = snapshot
        self._pickers = pickers
        self._pools = pools
        self._pool_ids = pool_ids
        self._pool_pos = {m: {v.id: i for i, v in enumerate(p)} for m, p in pools.items()}
        self.loads.set_pools(pools)
        self._models = frozenset(snapshot.models())
        self._held_out.clear()
        self._dirty_models.clear()
        self._metrics.rebuilds.inc()
        self._unknown = unknown
        self._metrics.telemetry_unknown.set(unknown)
        for state in EndpointState:
            self._metrics.endpoints.labels(state.value).set(sum(1 for v in views if v.state is state))
        if self.on_rebuild is not None:
            self.on_rebuild()

    def _build_pool(self, snapshot: Snapshot, model: str, now: float
                    ) -> tuple[frozenset[str], tuple[EndpointView, ...], tuple[PolicySpec, Picker]]:
        """One model's pool: its serving endpoints, the routable ones (health), and the picker over them."""
        spec = self.policy_for(model)
        serving = snapshot.serving(model)
        pool = self.health[spec.name].admit(model, serving, now)
        policy = self._registry.get(spec.strategy)
        assert policy is not None, spec.strategy  # validated with the config
        return frozenset(v.id for v in serving), pool, (spec, self._build_picker(policy, spec, model, pool))

    def _build_picker(self, policy: Any, spec: PolicySpec, model: str, pool: tuple[EndpointView, ...]) -> Picker:
        state_key = (spec.name, model)
        if state_key not in self._pool_state:
            self._pool_state[state_key] = policy.new_state()
        events = self._metrics.policy_events.labels  # bound once per pool, not per event
        return policy.build(pool, spec.params, self._pool_state[state_key], self._rng,
                            lambda event, _name=spec.name, _events=events: _events(_name, event).inc())

    def _rebuild_pools(self) -> None:
        """The coalesced rebuild after request outcomes changed health: only the pools they touched."""
        if not self._dirty_models:
            return  # a full rebuild ran in between
        now = self._clock()
        pickers, pools, pool_ids = dict(self._pickers), dict(self._pools), dict(self._pool_ids)
        for model in self._dirty_models:
            if model in self._models:
                pool_ids[model], pools[model], pickers[model] = self._build_pool(self.snapshot, model, now)
        self._pickers, self._pools, self._pool_ids = pickers, pools, pool_ids
        for model in self._dirty_models:
            if model in pools:
                self._pool_pos[model] = {v.id: i for i, v in enumerate(pools[model])}
        self.loads.set_pools({m: pools[m] for m in self._dirty_models if m in pools}, replace=False)
        self._dirty_models.clear()
        self._held_out.clear()
        self._metrics.rebuilds.inc()
        if self.on_rebuild is not None:
            self.on_rebuild()

    # ---- request path ---------------------------------------------------------------------------------

    def models(self) -> tuple[str, ...]:
        return self.snapshot.models()

    def serves(self, model: str) -> bool:
        return model in self._models

    def candidates(self, model: str) -> tuple[EndpointView, ...]:
        """What the model's picker chooses from now: serving and healthy endpoints (all, in panic mode)."""
        pool = self._pools.get(model, ())
        if self._held_out:
            return tuple(v for v in pool if v.id not in self._held_out)
        return pool

    def policy_for(self, model: str) -> PolicySpec:
        """The first configured policy whose `models` patterns match; the built-in default otherwise."""
        for spec in self._policies:
            if spec.matches(model):
                return spec
        return self._fallback

    # ---- health ---------------------------------------------------------------------------------------

    def acquire(self, spec: PolicySpec, endpoint_id: str) -> tuple[bool, bool]:
        """May a request go to the endpoint (its breaker's half-open probe slots)? (allowed, is a probe)"""
        pool = self.health.get(spec.name)
        return pool.acquire(endpoint_id, self._clock()) if pool is not None else (True, False)

    def report_outcome(self, spec: PolicySpec, model: str, endpoint_id: str, ok: bool, kind: str, *,
                       probe: bool) -> None:
        pool = self.health.get(spec.name)  # None if a reload removed the policy while the request ran
        if pool is None or endpoint_id not in self._endpoints:
            return
        pool_ids = self._pool_ids.get(model, frozenset())
        now = self._clock()
        if pool.report(endpoint_id, ok, kind, now, pool_ids, probe=probe):
            self._health_changed(spec, endpoint_id, now)

    def _health_changed(self, spec: PolicySpec, endpoint_id: str, now: float) -> None:
        """An outcome ejected the endpoint or moved its breaker. The request that reported it does not pay for
        a rebuild (17-21 ms at 1,000 endpoints, once per ejection in a correlated outage): an endpoint now
        excluded is held out of every pick at once, and the pools of the policy that hold it are rebuilt
        soon, once for however many outcomes arrive before then."""
        models = {m for m in self._endpoints[endpoint_id].models if m in self._pickers
                  and self._pickers[m][0].name == spec.name}
        if not models:
            return
        health = self.health[spec.name]
        if health.exclusion(endpoint_id, now) is not None and all(
                self._may_hold_out(health, m, endpoint_id) for m in models):
            self._held_out.add(endpoint_id)
        self._dirty_models |= models
        try:
            asyncio.get_running_loop().call_soon(self._rebuild_pools)
        except RuntimeError:
            self._rebuild_pools()

    def _may_hold_out(self, health: PoolHealth, model: str, endpoint_id: str) -> bool:
        """Would the model's pool, without the endpoint, stay out of panic mode? (If not, the rebuild's panic
        rule decides what is routable, as for any other exclusion.)"""
        if model in health.panicking:
            return False
        left = sum(1 for v in self._pools.get(model, ()) if v.id != endpoint_id and v.id not in self._held_out)
        return left > 0 and left * 100 >= health.settings.panic_threshold * len(self._pool_ids.get(model, ()))

    def _excluded(self, policy: str, endpoint_id: str, reason: str) -> None:
        if self.on_excluded is not None:
            self.on_excluded(policy, endpoint_id, reason)

    def eject(self, endpoint_id: str, reason: str) -> list[str]:
        """Eject the endpoint now from every policy's pool it is in (a verdict reached outside the request path:
        a stalled engine), each within its pool's `maxEjectionPercent`. Returns the policies that ejected it."""
        endpoint = self._endpoints.get(endpoint_id)
        if endpoint is None:
            return []
        now = self._clock()
        ejected = []
        for name, pool in self.health.items():
            models = [m for m in endpoint.models if self.policy_for(m).name == name]
            if not models:
                continue
            pool_ids = frozenset().union(*(self._pool_ids.get(m, frozenset()) for m in models))
            if pool.eject(endpoint_id, reason, now, pool_ids | {endpoint_id}):
                ejected.append(name)
        if ejected:
            self.rebuild()  # the next pick already leaves it out
        return ejected

    def peers(self, endpoint_id: str) -> frozenset[str]:
        """The serving endpoints that share a model with this one (itself included)."""
        endpoint = self._endpoints.get(endpoint_id)
        if endpoint is None:
            return frozenset()
        return frozenset().union(*(self._pool_ids.get(m, frozenset()) for m in endpoint.models))

    def release_probe(self, spec: PolicySpec, endpoint_id: str) -> None:
        pool = self.health.get(spec.name)
        if pool is not None and endpoint_id in self._endpoints:  # one that left has no breaker any more
            pool.breaker(endpoint_id).release()

    def health_report(self, endpoint_id: str) -> dict[str, dict[str, object]]:
        """Per policy: why the endpoint is excluded (or null), its breaker state and slow-start weight."""
        now = self._clock()
        return {
            name: {
                "excluded": pool.exclusion(endpoint_id, now),
                "breaker": pool.breaker(endpoint_id).current(now).value if pool.settings.breaker.enabled else None,
                "slow_start_weight": round(pool.slow_start.factor(endpoint_id, now), 3),
                "health_check_error": pool.active.last_error(endpoint_id) or None,
            }
            for name, pool in self.health.items()
            if endpoint_id in self._endpoints
            and any(self.policy_for(m).name == name for m in self._endpoints[endpoint_id].models)
        }

    def has_alternative(self, model: str, exclude: frozenset[str]) -> bool:
        """Is there an endpoint for the model outside `exclude` (something a retry could go to)?"""
        return any(v.id not in exclude and v.id not in self._held_out for v in self._pools.get(model, ()))

    def tick(self) -> None:
        """Rebuild if time alone changes routability (slow-start ramps, ejections and breakers expiring)."""
        if any(pool.needs_ticks() for pool in self.health.values()):
            self.rebuild()

    def pool_states(self) -> list[tuple[PolicySpec, str, Any]]:
        """(policy, model, picker state) of every pool the last rebuild built: background tasks that keep a
        policy's state (prefix-index sharing and tuning) find it here."""
        return [(spec, model, self._pool_state[(spec.name, model)])
                for model, (spec, _picker) in self._pickers.items() if (spec.name, model) in self._pool_state]

    def endpoints_for_policy(self, name: str) -> list[Endpoint]:
        """Endpoints serving at least one model routed by the named policy (what its health checks probe)."""
        return [ep for ep in self._endpoints.values() if any(self.policy_for(m).name == name for m in ep.models)]

    def sticky_candidate(self, model: str, endpoint_id: str, max_load_factor: float) -> tuple[EndpointView | None, str]:
        """The pinned endpoint if it may still take the session's request, else None and why not:
        `gone` (removed, draining or unhealthy) or `overloaded` (over the load bound)."""
        pool = self._pools.get(model, ())
        view = next((v for v in pool if v.id == endpoint_id), None)
        if view is None or endpoint_id in self._held_out:
            return None, "gone"
        if not within_load_bound(view, pool, self.loads, max_load_factor):
            return None, "overloaded"
        return view, "hit"

    def observe(self, req: RequestInfo, view: EndpointView) -> None:
        """A request goes to `view` without a pick (its session's pin): pickers that learn where traffic
        goes (a prefix index) hear of it too, or every later turn of a pinned session would be invisible."""
        entry = self._pickers.get(req.model)
        observe = getattr(entry[1], "observe", None) if entry is not None else None
        if observe is not None:
            observe(req, view)

    def pick(
        self, req: RequestInfo, exclude: frozenset[str] = frozenset(), trace: DecisionTrace | None = None
    ) -> EndpointView | None:
        """The model's policy's choice outside `exclude`. With a `trace` (an explained request only) the
        picker records what it compared and `annotate` adds the facts around it; without, neither runs."""
        entry = self._pickers.get(req.model)
        if entry is None:
            return None
        spec, picker = entry
        if self._held_out:
            exclude = exclude | self._held_out
        tiers = None
        if spec.lora is not None:
            exclude, tiers = self._lora_affinity(req.model, spec.lora, exclude)
        if trace is None:
            view = picker.pick(req, self.loads, exclude)
        else:
            view = picker.pick(req, self.loads, exclude, trace)
            self.annotate(req.model, trace, exclude)
            for endpoint_id, where in (tiers or {}).items():
                trace.candidates.setdefault(endpoint_id, {})["lora"] = where
        if view is not None:
            key = (spec.name, view.id)
            child = self._decision_children.get(key)
            if child is None:
                child = self._decision_children[key] = self._metrics.decisions.labels(spec.name, spec.strategy, view.id)
            child.inc()
            if tiers is not None:
                self._metrics.lora_picks.labels(spec.name, tiers.get(view.id, lora_affinity.UNKNOWN)).inc()
        return view

    def _lora_affinity(self, model: str, settings: lora_affinity.LoraAffinity,
                       exclude: frozenset[str]) -> tuple[frozenset[str], dict[str, str]]:
        """`exclude` plus the candidates LoRA affinity leaves out for a request naming adapter `model`, and each
        candidate's tier (router/routing/policies/lora_affinity.py); the latest telemetry, not the pool's build."""
        by_id = self.snapshot.by_id
        candidates = [(view.id, (by_id.get(view.id) or view).telemetry)
                      for view in self._pools.get(model, ()) if view.id not in exclude]
        out, tiers = lora_affinity.keep_out(candidates, model, settings, self.loads.in_flight)
        return (exclude | out if out else exclude), tiers

    # ---- explanations (router/server/explain.py): read only, and only for requests that are explained ------------

    def annotate(self, model: str, trace: DecisionTrace, exclude: frozenset[str] = frozenset()) -> None:
        """Per candidate of the model's pool (outside `exclude`), the facts every strategy is subject to:
        local in-flight count, slow-start weight, breaker state, and the telemetry the picker saw (its age and
        values; `stale` with the age of the last report when it was too old to use, `none` when there is
        none), plus the health problem of an endpoint routable only because the pool is in panic. Values the
        picker noted itself are never overwritten."""
        entry = self._pickers.get(model)
        if entry is None:
            return
        health = self.health.get(entry[0].name)
        breakers = health is not None and health.settings.breaker.enabled
        panic = health is not None and model in health.panicking
        now = self._clock()
        for view in self._pools.get(model, ()):
            if view.id in exclude:
                continue
            facts = trace.candidates.setdefault(view.id, {})
            facts.setdefault("in_flight", self.loads.in_flight(view.id))
            facts.setdefault("slow_start_weight", view.weight_factor)
            if view.endpoint.weight != 1.0:
                facts.setdefault("capacity_weight", view.endpoint.weight)
            if breakers:
                assert health is not None
                facts.setdefault("breaker", health.breaker(view.id).current(now).value)
            if panic and health is not None and (problem := health.excluded_reason(view.id)) is not None:
                facts.setdefault("health", problem)
            current = self.snapshot.by_id.get(view.id)  # a kept pool's views hold the telemetry of its build
            t = current.telemetry if current is not None else view.telemetry
            if t is None:
                last = self._telemetry.get(view.id)
                facts.setdefault("telemetry", "stale" if last is not None else "none")
                if last is not None:
                    facts.setdefault("telemetry_age_s", now - last.reported_at)
                continue
            facts.setdefault("telemetry_age_s", now - t.reported_at)
            for name in TELEMETRY_FACTS:
                value = getattr(t, name)
                if value is not None:
                    facts.setdefault(name, value)

    def pool_report(self, model: str) -> dict[str, Any]:
        """The model's pool as the picker saw it: how many endpoints were routable, which serving ones were
        left out and why (draining, or the health reason at the last build), and whether it is in panic."""
        entry = self._pickers.get(model)
        spec = entry[0] if entry is not None else self.policy_for(model)
        health = self.health.get(spec.name)
        routable = {v.id for v in self._pools.get(model, ())}
        left_out: dict[str, str] = {}
        more = 0  # beyond MAX_LISTED: counted, not listed (an explanation stays bounded on a big fleet)
        for view in self.snapshot.views:
            if model not in view.endpoint.models or view.id in routable:
                continue
            if len(left_out) >= MAX_LISTED:
                more += 1
            elif view.state is not EndpointState.SERVING:
                left_out[view.id] = view.state.value
            else:
                reason = health.excluded_reason(view.id) if health is not None else None
                left_out[view.id] = reason or "unhealthy"
        report = {"routable": len(routable), "left_out": left_out,
                  "panic": health is not None and model in health.panicking}
        if more:
            report["left_out_more"] = more
        return report
