"""Where the health inputs meet: for one policy's pool, which endpoints may take requests and at what weight.

`admit` is called at every snapshot build with the pool's views and returns the routable ones (weighted by
slow start) plus whether the pool is in panic. An endpoint is left out while it is actively unhealthy, its
GPU is faulty, it is ejected, or its breaker is open. If fewer than `panicThreshold` percent of the pool
remain, the pool panics and routes to all of its endpoints: sending traffic to suspect endpoints beats
failing every request (Envoy). `report` takes each request's outcome for the outlier detector and the
breaker; `acquire` hands out half-open probe slots; `eject` ejects at once for a verdict reached elsewhere
(a stalled engine).

When a build finds an endpoint newly out for a reason that dooms the requests waiting on it (`RELEASING`:
ejected, failing its health checks, a lost GPU), `on_excluded` is told, and the router takes those requests
off it (router/server/rescue.py). The other reasons leave them be: an open breaker or a throttling GPU still answers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from router.health.active import ActiveHealth, ActiveHealthSettings
from router.health.breaker import BreakerSettings, BreakerState, CircuitBreaker
from router.health.gpu import GpuHealth
from router.health.outlier import Ejection, OutlierDetector, OutlierSettings
from router.health.slow_start import SlowStart, SlowStartSettings
from router.model import EndpointView
from router.runtime.metrics import RouterMetrics

log = logging.getLogger("fleetroute.health")

# Exclusion reasons that release the requests waiting on the endpoint (see the module docstring).
RELEASING = frozenset({"ejected", "health_check", "gpu_lost"})


@dataclass(frozen=True)
class HealthSettings:
    active: ActiveHealthSettings = ActiveHealthSettings()
    outlier: OutlierSettings = OutlierSettings()
    breaker: BreakerSettings = BreakerSettings()
    slow_start: SlowStartSettings = SlowStartSettings()
    gpu: bool = True  # GPU faults reported by the agent make an endpoint unhealthy
    panic_threshold: int = 50  # percent of the pool that must be healthy; below it, route to all


class PoolHealth:
    def __init__(self, policy: str, settings: HealthSettings, metrics: RouterMetrics, gpu: GpuHealth,
                 on_excluded: Callable[[str, str, str], None] | None = None) -> None:
        self.policy = policy
        self.on_excluded = on_excluded  # (policy, endpoint, reason) when a build newly excludes for RELEASING
        self.settings = settings
        self.active = ActiveHealth(settings.active)
        self.outlier = OutlierDetector(settings.outlier)
        self.slow_start = SlowStart(settings.slow_start)
        self._gpu = gpu
        self._metrics = metrics
        self._breakers: dict[str, CircuitBreaker] = {}
        self._admitted: set[str] | None = None  # None until the first build: initial members don't ramp
        self.panicking: set[str] = set()  # models whose pool is in panic
        self._excluded: dict[str, str] = {}  # endpoint -> reason, as last exported
        self._breaker_seen: dict[str, BreakerState] = {}  # breaker states as last exported

    def breaker(self, endpoint_id: str) -> CircuitBreaker:
        breaker = self._breakers.get(endpoint_id)
        if breaker is None:
            breaker = self._breakers[endpoint_id] = CircuitBreaker(self.settings.breaker)
        return breaker

    def exclusion(self, endpoint_id: str, now: float) -> str | None:
        """Why an endpoint must not take requests now, or None."""
        if self.settings.active.enabled and not self.active.healthy(endpoint_id):
            return "health_check"
        if self.settings.gpu:
            fault = self._gpu.fault(endpoint_id, now)
            if fault is not None:
                return fault
        if self.outlier.ejected(endpoint_id, now):
            return "ejected"
        if self.settings.breaker.enabled and self.breaker(endpoint_id).current(now) is BreakerState.OPEN:
            return "breaker_open"
        return None

    def excluded_reason(self, endpoint_id: str) -> str | None:
        """Why the endpoint was left out of the pool at the last snapshot build (None: it was not)."""
        return self._excluded.get(endpoint_id)

    def admit(self, model: str, views: tuple[EndpointView, ...], now: float) -> tuple[EndpointView, ...]:
        self.outlier.expire(now)
        healthy = []
        breaker_codes = {BreakerState.CLOSED: 0, BreakerState.HALF_OPEN: 1, BreakerState.OPEN: 2}
        for view in views:
            reason = self.exclusion(view.id, now)
            previous = self._excluded.get(view.id)
            if previous != reason:
                if previous is not None:
                    self._metrics.excluded.remove(self.policy, view.id, previous)
                if reason is not None:
                    self._metrics.excluded.labels(self.policy, view.id, reason).set(1)
                    self._excluded[view.id] = reason
                    if reason in RELEASING and self.on_excluded is not None:
                        self.on_excluded(self.policy, view.id, reason)
                else:
                    self._excluded.pop(view.id, None)
            if self.settings.breaker.enabled:
                state = self.breaker(view.id).current(now)  # open -> half-open happens here, with time
                if self._breaker_seen.get(view.id, BreakerState.CLOSED) is not state:
                    self._breaker_seen[view.id] = state
                    self._metrics.breaker_transitions.labels(self.policy, view.id, state.value).inc()
                    log.warning("circuit breaker " + state.value.replace("_", "-"),
                                extra={"policy": self.policy, "endpoint": view.id})
                self._metrics.child(self._metrics.breaker_state, self.policy, view.id).set(breaker_codes[state])
            if reason is None:
                healthy.append(view)
        ids = {v.id for v in healthy}
        if self._admitted is not None:
            for endpoint_id in ids - self._admitted:
                self.slow_start.begin(endpoint_id, now)  # joined or came back: ramp up
        self._admitted = (self._admitted or set()) - {v.id for v in views} | ids
        if views and len(healthy) * 100 < self.settings.panic_threshold * len(views):
            if model not in self.panicking:
                log.warning("too few healthy endpoints: routing to all of them (panic mode)",
                            extra={"policy": self.policy, "model": model, "healthy": len(healthy),
                                   "endpoints": len(views)})
                self.panicking.add(model)
            self._metrics.panic.labels(self.policy, model).set(1)
            return views
        if model in self.panicking:
            self.panicking.discard(model)
            log.info("enough healthy endpoints again: panic mode over", extra={"policy": self.policy, "model": model})
        self._metrics.panic.labels(self.policy, model).set(0)
        out = []
        for view in healthy:
            factor = self.slow_start.factor(view.id, now)
            self._metrics.child(self._metrics.slow_start_weight, self.policy, view.id).set(factor)
            out.append(view if factor == 1.0 else replace(view, weight_factor=factor))
        return tuple(out)

    def acquire(self, endpoint_id: str, now: float) -> tuple[bool, bool]:
        """(allowed, is a half-open probe)."""
        if not self.settings.breaker.enabled:
            return True, False
        breaker = self.breaker(endpoint_id)
        probe = breaker.current(now) is BreakerState.HALF_OPEN
        return breaker.try_acquire(now), probe

    def report(self, endpoint_id: str, ok: bool, kind: str, now: float, pool_ids: frozenset[str], *,
               probe: bool) -> bool:
        """Count a request's outcome. True if the endpoint's routability changed (rebuild needed)."""
        changed = False
        if ok:
            self.outlier.success(endpoint_id)
        else:
            ejection = self.outlier.failure(endpoint_id, kind, now, pool_ids)
            if ejection is not None:
                changed = True
                self._ejected(ejection)
        if self.settings.breaker.enabled and self.breaker(endpoint_id).record(ok, now, probe=probe) is not None:
            changed = True  # the rebuild that follows counts and logs the transition
        return changed

    def eject(self, endpoint_id: str, reason: str, now: float, pool_ids: frozenset[str]) -> bool:
        """Eject the endpoint now (a verdict reached elsewhere), within the pool's cap. True if it was."""
        ejection = self.outlier.eject(endpoint_id, reason, now, pool_ids)
        if ejection is not None:
            self._ejected(ejection)
        return ejection is not None

    def _ejected(self, ejection: Ejection) -> None:
        self._metrics.ejections.labels(self.policy, ejection.endpoint_id, ejection.reason).inc()
        log.warning("endpoint ejected", extra={"policy": self.policy, "endpoint": ejection.endpoint_id,
                                               "reason": ejection.reason, "ejection_s": ejection.duration})

    def breaker_states(self, now: float) -> dict[str, str]:
        return {eid: b.current(now).value for eid, b in self._breakers.items()}

    def needs_ticks(self) -> bool:
        """True while time alone changes routability (ramps, ejections and open breakers expiring)."""
        return self.slow_start.ramping() or any(
            b.state is not BreakerState.CLOSED for b in self._breakers.values()
        ) or self.outlier.any_ejected()

    def forget(self, endpoint_id: str) -> None:
        """The endpoint left: its health state goes (its series go with the endpoint's: routing/departures.py)."""
        reason = self._excluded.pop(endpoint_id, None)
        if reason is not None:
            self._metrics.excluded.remove(self.policy, endpoint_id, reason)
        if self._admitted is not None:
            self._admitted.discard(endpoint_id)
        self.active.forget(endpoint_id)
        self.outlier.forget(endpoint_id)
        self.slow_start.forget(endpoint_id)
        self._breakers.pop(endpoint_id, None)
        self._breaker_seen.pop(endpoint_id, None)
