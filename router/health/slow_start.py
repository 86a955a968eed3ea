"""Slow start: an endpoint that joins, recovers or is un-ejected ramps up instead of taking its full share
at once (a cold KV cache and CUDA graphs, or a GPU that just failed, should not be hit with a burst).

    factor(t) = max(minWeight, (t / window) ** (1 / aggression))      for t < window, then 1

as in Envoy's slow start (`aggression` 1.0 is linear; larger ramps faster early). Policies apply the factor:
round-robin and least-connections scale an endpoint's share by it, adaptive multiplies its score.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SlowStartSettings:
    enabled: bool = True
    window: float = 30.0
    aggression: float = 1.0
    min_weight: float = 0.1


class SlowStart:
    def __init__(self, settings: SlowStartSettings) -> None:
        self.settings = settings
        self._since: dict[str, float] = {}

    def begin(self, endpoint_id: str, now: float) -> None:
        """The endpoint (re)joined the pool now."""
        if self.settings.enabled:
            self._since[endpoint_id] = now

    def forget(self, endpoint_id: str) -> None:
        self._since.pop(endpoint_id, None)

    def factor(self, endpoint_id: str, now: float) -> float:
        since = self._since.get(endpoint_id)
        if since is None:
            return 1.0
        s = self.settings
        elapsed = now - since
        if elapsed >= s.window:
            del self._since[endpoint_id]
            return 1.0
        return max(s.min_weight, (max(elapsed, 0.0) / s.window) ** (1.0 / s.aggression))

    def ramping(self) -> bool:
        return bool(self._since)
