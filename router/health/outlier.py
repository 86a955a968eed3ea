"""Passive outlier detection: eject an endpoint that keeps failing real requests.

`consecutiveFailures` failures in a row (a 5xx answer, a refused or timed-out connection, no answer
within `firstByte`) eject the endpoint for `baseEjectionTime x n`, where n counts its ejections (capped at
`maxEjectionTime`); n decays by one for every `maxEjectionTime` without an ejection. At most
`maxEjectionPercent` of a pool is ejected at once, so a fleet-wide problem never ejects everything
(Envoy's outlier detection). A success resets the failure count.

`eject` ejects at once, for a verdict reached elsewhere (a stalled engine: router/health/stall.py), with the
same ejection times and cap; it acts whether or not `enabled` is set, which governs only counting failures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True)
class OutlierSettings:
    enabled: bool = True
    consecutive_failures: int = 5
    base_ejection_time: float = 30.0
    max_ejection_time: float = 300.0
    max_ejection_percent: int = 50


@dataclass
class _State:
    consecutive: int = 0
    ejections: int = 0
    ejected_until: float = 0.0
    last_ejection: float = -math.inf
    reason: str = ""


@dataclass
class Ejection:
    endpoint_id: str
    duration: float
    reason: str


@dataclass
class OutlierDetector:
    settings: OutlierSettings
    _states: dict[str, _State] = field(default_factory=dict)

    def _state(self, endpoint_id: str) -> _State:
        state = self._states.get(endpoint_id)
        if state is None:
            state = self._states[endpoint_id] = _State()
        return state

    def success(self, endpoint_id: str) -> None:
        state = self._states.get(endpoint_id)
        if state is not None:
            state.consecutive = 0

    def failure(self, endpoint_id: str, kind: str, now: float, pool_ids: frozenset[str]) -> Ejection | None:
        """Count a failure; returns the ejection it caused, if any."""
        s = self.settings
        if not s.enabled:
            return None
        state = self._state(endpoint_id)
        state.consecutive += 1
        if state.consecutive < s.consecutive_failures or state.ejected_until > now:
            return None
        return self._eject(endpoint_id, state, kind, now, pool_ids)

    def eject(self, endpoint_id: str, reason: str, now: float, pool_ids: frozenset[str]) -> Ejection | None:
        """Eject now, for `reason`, unless it is ejected already or the pool's cap forbids it."""
        state = self._state(endpoint_id)
        if state.ejected_until > now:
            return None
        return self._eject(endpoint_id, state, reason, now, pool_ids)

    def _eject(self, endpoint_id: str, state: _State, kind: str, now: float,
               pool_ids: frozenset[str]) -> Ejection | None:
        s = self.settings
        # The cap counts the endpoint's own pool (one model's endpoints), not every pool of the policy.
        ejected = sum(1 for eid in pool_ids if eid in self._states and self._states[eid].ejected_until > now)
        if (ejected + 1) * 100 > s.max_ejection_percent * max(len(pool_ids), 1):
            return None  # would eject too much of the pool: keep it, the breaker and panic mode still act
        quiet = now - state.last_ejection
        if math.isfinite(quiet):
            state.ejections = max(0, state.ejections - int(quiet // s.max_ejection_time))
        state.ejections += 1
        duration = min(s.base_ejection_time * state.ejections, s.max_ejection_time)
        state.ejected_until = now + duration
        state.last_ejection = now
        state.consecutive = 0
        state.reason = kind
        return Ejection(endpoint_id, duration, kind)

    def any_ejected(self) -> bool:
        """Is an ejection pending expiry (so time alone will change routability)? Checked against the last
        ejection times: an expired one is cleared here, so ticks stop once everything is back."""
        return any(st.ejected_until > 0 for st in self._states.values())

    def expire(self, now: float) -> None:
        for st in self._states.values():
            if 0 < st.ejected_until <= now:
                st.ejected_until = 0.0

    def ejected(self, endpoint_id: str, now: float) -> bool:
        state = self._states.get(endpoint_id)
        return state is not None and state.ejected_until > now

    def ejected_until(self, endpoint_id: str) -> float:
        state = self._states.get(endpoint_id)
        return state.ejected_until if state is not None else 0.0

    def ejection_reason(self, endpoint_id: str) -> str | None:
        """The kind of failure that tipped the endpoint's latest ejection (None: never ejected)."""
        state = self._states.get(endpoint_id)
        return (state.reason or None) if state is not None else None

    def forget(self, endpoint_id: str) -> None:
        self._states.pop(endpoint_id, None)
