"""Simulated GPU telemetry, derived from engine activity, shaped like what NVML reports.

What a real GPU under vLLM shows (and what the worker agent must cope with):
- utilisation: NVML's counter is the fraction of time *any* kernel ran, so it sits near 100% as soon as a
  single sequence decodes. We report the fraction of (simulated) time the engine spent in steps over the
  last sample window, which has exactly that property.
- memory: vLLM pre-allocates `gpu_memory_utilization` (0.9) of the card at start-up for weights and KV
  cache, so used memory is ~90% whether idle or full.
- power and temperature follow load: idle power plus a share of (TDP - idle) that grows with utilisation
  and batch fill; temperature relaxes towards 35 C + 45 C x load.

`GET /sim/gpu` serves one sample as JSON (field names follow NVML: utilization.gpu in percent, memory in
bytes, temperature in C, power in mW), which `fleetroute agent --gpu-source sim` reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker.sim.engine import EngineCore
from worker.sim.profiles import GpuProfile

GIB = 1024**3
GPU_MEMORY_UTILIZATION = 0.9


class SimulatedGpu:
    def __init__(self, *, profile: GpuProfile, engine: EngineCore, sim_clock: Callable[[], float], index: int = 0,
                 uuid: str = "GPU-00000000-0000-0000-0000-000000000000") -> None:
        self._profile = profile
        self._engine = engine
        self._clock = sim_clock
        self._index = index
        self._uuid = uuid
        self._last_time = sim_clock()
        self._last_busy = engine.busy_time
        self._utilisation = 0.0
        self._temperature = 35.0

    def sample(self) -> dict[str, Any]:
        now = self._clock()
        busy = self._engine.busy_time
        elapsed = now - self._last_time
        if elapsed > 0:
            self._utilisation = min(1.0, max(0.0, (busy - self._last_busy) / elapsed))
            # First-order thermal response with a ~20 s time constant.
            target = 35.0 + 45.0 * self._utilisation
            alpha = min(1.0, elapsed / 20.0)
            self._temperature += (target - self._temperature) * alpha
            self._last_time, self._last_busy = now, busy
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
