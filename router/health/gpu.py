"""GPU health from the agent's telemetry: a GPU that is lost, throttling for heat, or has just reported new
XID or uncorrectable ECC errors is unhealthy. XID/ECC counters are cumulative, so a *rise* marks the
endpoint unhealthy for `hold` seconds; a lost GPU or thermal throttling lasts as long as it is reported, and
no longer than the report is fresh (`stale_after`): if the agent dies, its last word is not kept forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from router.model import Telemetry

# NVML clocks-event reasons that mean the GPU slows itself down for heat.
THERMAL_REASONS = 0x20 | 0x40  # SwThermalSlowdown | HwThermalSlowdown


@dataclass
class _Seen:
    xid: int | None = None
    ecc: int | None = None
    fault_until: float = 0.0
    fault: str = ""


class GpuHealth:
    def __init__(self, hold: float = 60.0, stale_after: float = 5.0) -> None:
        self.hold = hold
        self.stale_after = stale_after
        self._seen: dict[str, _Seen] = {}
        self._current: dict[str, tuple[str, float]] = {}  # endpoint -> (fault, time of the report)
        self._hold_until = 0.0  # the latest end of an XID/ECC hold (never lowered: it only costs rebuilds)

    def observe(self, endpoint_id: str, t: Telemetry, now: float) -> None:
        seen = self._seen.setdefault(endpoint_id, _Seen())
        for name, value in (("xid", t.gpu_xid_errors), ("ecc", t.gpu_ecc_uncorrected)):
            previous = getattr(seen, name)
            if value is not None and previous is not None and value > previous:
                seen.fault_until, seen.fault = now + self.hold, f"{name}_errors"
                self._hold_until = max(self._hold_until, seen.fault_until)
            if value is not None:
                setattr(seen, name, value)
        if t.gpu_lost:
            self._current[endpoint_id] = ("gpu_lost", t.reported_at)
        elif t.gpu_throttle_reasons is not None and t.gpu_throttle_reasons & THERMAL_REASONS:
            self._current[endpoint_id] = ("thermal_throttling", t.reported_at)
        else:
            self._current.pop(endpoint_id, None)

    def fault(self, endpoint_id: str, now: float) -> str | None:
        current = self._current.get(endpoint_id)
        if current is not None and now - current[1] <= self.stale_after:
            return current[0]
        seen = self._seen.get(endpoint_id)
        if seen is not None and seen.fault_until > now:
            return seen.fault
        return None

    def any_fault(self, now: float) -> bool:
        """Is any endpoint's GPU faulty now? Costs the number of faults reported, not of endpoints. (A fault ends
        with time, so the balancer rebuilds fully while one lasts and once after.)"""
        return self._hold_until > now or any(now - at <= self.stale_after for _fault, at in self._current.values())

    def forget(self, endpoint_id: str) -> None:
        self._seen.pop(endpoint_id, None)
        self._current.pop(endpoint_id, None)
