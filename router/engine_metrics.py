"""Load telemetry from the engines' own Prometheus `/metrics` (vLLM).

The router scrapes each endpoint every `interval` and keeps the newest `Telemetry` per endpoint. vLLM's
series (checked against vLLM 0.6-0.11 `vllm/engine/metrics.py` and `vllm/v1/metrics/loggers.py`):

    vllm:num_requests_waiting   gauge  requests queued for admission          -> Telemetry.queue_depth
    vllm:num_requests_running   gauge  requests in the running batch          -> Telemetry.running
    vllm:kv_cache_usage_perc    gauge  KV-cache blocks in use, 0..1 (v1)      -> Telemetry.mem_util
    vllm:gpu_cache_usage_perc   gauge  the same, older name (v0)              -> fallback for mem_util

Series carry labels (`model_name`, `engine` for data-parallel ranks): counts are summed across series,
the usage fraction is averaged. The engine does not know GPU utilisation, so `gpu_util` stays unknown
here; the worker agent (NVML through Redis) supplies it.

A vLLM `/metrics` page is large (histograms for every latency); only the lines of the families above are
handed to prometheus-client's parser, which keeps a scrape cheap on a busy router.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import RouterMetrics
from router.model import Endpoint, Telemetry
from router.settings import EngineMetricsSettings

log = logging.getLogger("fleetroute.telemetry")

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_WANTED = (WAITING, RUNNING, *KV_USAGE)


def _relevant_lines(text: str) -> str:
    keep = []
    for line in text.splitlines():
        if line.startswith("# "):
            parts = line.split(" ", 3)
            if len(parts) > 2 and parts[2] in _WANTED:
                keep.append(line)
        elif line.startswith(_WANTED):
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_engine_metrics(text: str, *, now: float) -> Telemetry:
    """A `Telemetry` from a vLLM metrics page; signals the page lacks stay None."""
    sums: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(_relevant_lines(text)):
        for sample in family.samples:
            if sample.name in _WANTED:
                sums.setdefault(sample.name, []).append(float(sample.value))
    kv = next((sums[name] for name in KV_USAGE if name in sums), None)
    return Telemetry(
        reported_at=now,
        mem_util=sum(kv) / len(kv) if kv else None,
        queue_depth=sum(sums[WAITING]) if WAITING in sums else None,
        running=sum(sums[RUNNING]) if RUNNING in sums else None,
        source="engine-metrics",
    )


class EngineMetricsScraper:
    """Polls every endpoint's /metrics concurrently and reports each parsed `Telemetry`."""

    def __init__(
        self,
        *,
        settings: EngineMetricsSettings,
        session: aiohttp.ClientSession,
        endpoints: Callable[[], Sequence[Endpoint]],
        on_report: Callable[[str, Telemetry], None],
        metrics: RouterMetrics,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._session = session
        self._endpoints = endpoints
        self._on_report = on_report
        self._metrics = metrics
        self._clock = clock
        self._failing: set[str] = set()

    async def scrape_all(self) -> None:
        endpoints = list(self._endpoints())
        if endpoints:
            await asyncio.gather(*(self._scrape(ep) for ep in endpoints))

    async def _scrape(self, endpoint: Endpoint) -> None:
        timeout = aiohttp.ClientTimeout(total=self._settings.timeout)
        try:
            async with self._session.get(f"{endpoint.url}/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                text = await resp.text()
            telemetry = parse_engine_metrics(text, now=self._clock())
        except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
            self._metrics.scrape_errors.labels(endpoint.id).inc()
            if endpoint.id not in self._failing:  # log the first failure of a run, not every interval
                self._failing.add(endpoint.id)
                log.warning(
                    "engine metrics scrape failed",
                    extra={"endpoint": endpoint.id, "error": f"{type(exc).__name__}: {exc}"},
                )
            return
        if endpoint.id in self._failing:
            self._failing.discard(endpoint.id)
            log.info("engine metrics scrape recovered", extra={"endpoint": endpoint.id})
        self._on_report(endpoint.id, telemetry)
