"""Simulated GPU telemetry, derived from engine activity, shaped like what NVML reports.

What a real GPU under vLLM shows (and what the worker agent must cope with):
- utilisation: NVML's counter is the fraction of time *any* kernel ran over its last sample period (1/6 s to
  1 s, fixed by the driver), so it sits near 100% as soon as a single sequence decodes. We report the
  fraction of (simulated) time the engine spent in steps over the trailing `UTILISATION_WINDOW`, which has
  exactly that property. Like NVML's, the window does not depend on who reads or how often: an agent and a
  load-test harness reading the same GPU see the same number.
- memory: vLLM pre-allocates `gpu_memory_utilization` (0.9) of the card at start-up for weights and KV
  cache, so used memory is ~90% whether idle or full.
- power and temperature follow load: idle power plus a share of (TDP - idle) that grows with utilisation
  and batch fill; temperature relaxes towards 35 C + 45 C x load.

`GET /sim/gpu` serves one sample as JSON (field names follow NVML: utilization.gpu in percent, memory in
bytes, temperature in C, power in mW), which `fleetroute agent --gpu-source sim` reads.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from worker.sim.engine import EngineCore
from worker.sim.profiles import GpuProfile

GIB = 1024**3
GPU_MEMORY_UTILIZATION = 0.9
UTILISATION_WINDOW = 1.0  # simulated seconds: NVML's longest sample period


class BusyWindow:
    """When the GPU computed, as intervals of simulated time: the busy fraction of exactly the last `window`
    seconds, whoever asks and however often, and the total busy time (a slowed step counts its whole, slowed
    length: that is how long the GPU was busy with it)."""

    def __init__(self, start: float, window: float = UTILISATION_WINDOW) -> None:
        self._start = start
        self._window = window
        self._intervals: deque[tuple[float, float]] = deque()
        self.total = 0.0

    def busy(self, start: float, duration: float) -> None:
        """One engine step ran from `start` for `duration` simulated seconds."""
        intervals = self._intervals
        while intervals and intervals[0][1] <= start - self._window:  # bounded even if nobody reads
            intervals.popleft()
        intervals.append((start, start + duration))
        self.total += duration

    def total_at(self, now: float) -> float:
        """Busy seconds up to `now`: a step still running counts only the part already done (a step of
        200 ms counted whole when it starts would make a short sampling window read over 100%)."""
        ahead = sum(end - max(begin, now) for begin, end in self._intervals if end > now)
        return self.total - ahead

    def fraction(self, now: float) -> float:
        since = max(self._start, now - self._window)
        intervals = self._intervals
        while intervals and intervals[0][1] <= since:
            intervals.popleft()
        if now <= since:
            return 0.0
        covered = sum(max(0.0, min(end, now) - max(begin, since)) for begin, end in intervals)
        return min(1.0, covered / (now - since))


class SimulatedGpu:
    def __init__(self, *, profile: GpuProfile, engine: EngineCore, sim_clock: Callable[[], float], index: int = 0,
                 uuid: str = "GPU-00000000-0000-0000-0000-000000000000") -> None:
        self._profile = profile
        self._engine = engine
        self._clock = sim_clock
        self._index = index
        self._uuid = uuid
        self.busy = BusyWindow(sim_clock())  # the engine loop reports every step here
        self._utilisation = 0.0
        self._temperature = 35.0
        self._last_time = sim_clock()

    def sample(self) -> dict[str, Any]:
        now = self._clock()
        busy = self.busy.total_at(now)
        self._utilisation = self.busy.fraction(now)
        elapsed = now - self._last_time
        if elapsed > 0:
            # First-order thermal response with a ~20 s time constant.
            target = 35.0 + 45.0 * self._utilisation
            alpha = min(1.0, elapsed / 20.0)
            self._temperature += (target - self._temperature) * alpha
            self._last_time = now
        p = self._profile
        fill = min(1.0, self._engine.num_running / 64)
        power_w = p.idle_watts + (p.tdp_watts - p.idle_watts) * self._utilisation * (0.6 + 0.4 * fill)
        total = int(p.memory_total_gib * GIB)
        used = int(total * GPU_MEMORY_UTILIZATION)
        return {
            "index": self._index,
            "name": f"Simulated {p.name.upper()}",
            "uuid": self._uuid,
            "utilization": {"gpu": round(self._utilisation * 100), "memory": round(self._utilisation * 60)},
            "memory": {"total": total, "used": used, "free": total - used},
            "temperature": {"gpu": round(self._temperature)},
            "power": {"usage": int(power_w * 1000), "limit": int(p.tdp_watts * 1000)},
            "clocks_throttle_reasons": 0,
            "xid_errors": 0,
            "ecc_errors": {"volatile_uncorrected": 0},
            "retired_pages": 0,
            "kv_cache_usage": self._engine.kv_usage,
            "busy_seconds_total": busy,
            "sim_time": now,
        }
