"""Collecting one telemetry record for one endpoint: its GPU (through a `GpuSampler`) and its engine
(vLLM's `/metrics` over HTTP), joined into a `protocol.TelemetryRecord`.

Used by the agent sidecar (which publishes records to Redis) and by the router's embedded mode (which keeps
them in memory when no Redis is configured), so both read the same signals the same way. Nothing here
talks to NVML or Redis; a failing engine or GPU source never raises, it only leaves its signals unknown.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

import aiohttp

from router.config.redaction import redact_url
from worker.protocol import EngineSample, GpuSample, TelemetryRecord
from worker.vllm_metrics import parse_vllm_metrics

log = logging.getLogger("fleetroute.collect")

SIM_GPU_PATH = "/sim/gpu"


class GpuSampler(Protocol):
    async def sample(self) -> GpuSample: ...

    def close(self) -> None: ...


def gpu_sample_from_sim(payload: dict) -> GpuSample:
    """The simulator's `/sim/gpu` JSON (NVML-shaped: percent, bytes, mW) as a `GpuSample`."""
    return GpuSample(
        util=payload["utilization"]["gpu"] / 100.0,
        util_kind="utilization",
        mem_used_bytes=int(payload["memory"]["used"]),
        mem_total_bytes=int(payload["memory"]["total"]),
        temperature_c=float(payload["temperature"]["gpu"]),
        power_w=payload["power"]["usage"] / 1000.0,
        throttle_reasons=int(payload.get("clocks_throttle_reasons", 0)),
        xid_errors=int(payload.get("xid_errors", 0)),
        ecc_uncorrected=int(payload.get("ecc_errors", {}).get("volatile_uncorrected", 0)),
        retired_pages=int(payload.get("retired_pages", 0)),
    )


class SimGpuSampler:
    """Reads the simulated GPU of a `fleetroute sim` replica, the way `NvmlSampler` reads a real one."""

    def __init__(self, session: aiohttp.ClientSession, engine_url: str, timeout: float) -> None:
        self._session = session
        self._url = engine_url.rstrip("/") + SIM_GPU_PATH
        self._timeout = aiohttp.ClientTimeout(total=timeout)

    async def sample(self) -> GpuSample:
        try:
            async with self._session.get(self._url, timeout=self._timeout) as resp:
                resp.raise_for_status()
                return gpu_sample_from_sim(await resp.json())
        except (TimeoutError, aiohttp.ClientError, KeyError, TypeError, ValueError) as exc:
            log.debug("sim GPU sample failed", extra={"url": redact_url(self._url), "error": redact_url(repr(exc))})
            return GpuSample()

    def close(self) -> None:
        pass


class EngineCollector:
    """Builds successive records for one endpoint; keeps what it needs between samples (sequence number,
    the prefix-cache counters for a per-interval hit rate)."""

    def __init__(
        self,
        *,
        session: aiohttp.ClientSession,
        endpoint_id: str,
        engine_url: str,
        gpu: GpuSampler | None,
        gpu_source: str,
        interval: float,
        timeout: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.endpoint_id = endpoint_id
        self._session = session
        self._metrics_url = engine_url.rstrip("/") + "/metrics"
        self._gpu = gpu
        self._gpu_source = gpu_source if gpu is not None else "none"
        self._interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._clock = clock
        self._seq = 0
        self._prev_prefix: tuple[float, float] | None = None
        self.engine_failing = False

    async def _engine(self) -> EngineSample:
        try:
            async with self._session.get(self._metrics_url, timeout=self._timeout) as resp:
                resp.raise_for_status()
                sample = parse_vllm_metrics(await resp.text())
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            if not self.engine_failing:  # the first failure of a run, not every interval
                log.warning("engine metrics unreachable",
                            extra={"endpoint": self.endpoint_id, "url": redact_url(self._metrics_url),
                                   "error": redact_url(repr(exc))})
            self.engine_failing = True
            return EngineSample(up=False)
        if self.engine_failing:
            log.info("engine metrics recovered", extra={"endpoint": self.endpoint_id})
            self.engine_failing = False
        return sample

    def _hit_rate(self, engine: EngineSample) -> float | None:
        if engine.prefix_cache_queries is None or engine.prefix_cache_hits is None:
            return None
        prev, self._prev_prefix = self._prev_prefix, (engine.prefix_cache_queries, engine.prefix_cache_hits)
        if prev is None:
            return None
        queries = engine.prefix_cache_queries - prev[0]
        hits = engine.prefix_cache_hits - prev[1]
        if queries <= 0 or hits < 0:  # idle, or the engine restarted and its counters reset
            return None
        return min(1.0, hits / queries)

    async def collect(self) -> TelemetryRecord:
        if self._gpu is not None:
            gpu, engine = await asyncio.gather(self._gpu.sample(), self._engine())
        else:
            gpu, engine = GpuSample(), await self._engine()
        self._seq += 1
        return TelemetryRecord(
            endpoint_id=self.endpoint_id,
            reported_at=self._clock(),
            seq=self._seq,
            interval=self._interval,
            gpu_source=self._gpu_source,
            gpu=gpu,
            engine=engine,
            prefix_cache_hit_rate=self._hit_rate(engine),
        )
