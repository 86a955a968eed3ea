"""The simulated engine's `/metrics`, in vLLM's own names, types and labels (V1 engine, vLLM 0.8-0.11).

Gauges and counters that mirror engine state are read from the engine at scrape time (a custom collector),
so a scrape always sees the current step; latency histograms are observed as requests progress. Labels are
vLLM's: `model_name` and `engine` (the data-parallel rank, always "0" here). Buckets are vLLM's. Times are
in *simulated* seconds, as a real engine on that GPU would report them.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from worker.sim.engine import EngineConfig, EngineCore

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)


LORA_INFO_SERIES = 32  # label sets of vllm:lora_requests_info kept (vLLM keeps every one it ever set)


class _EngineStateCollector(Collector):
    def __init__(self, engine: EngineCore, config: EngineConfig, model: str, gpu_memory_utilization: float) -> None:
        self._engine = engine
        self._max_loras = config.max_loras
        # vLLM sets a gauge to the current time under labels naming the adapters running and waiting, so the
        # page holds one series per combination seen, and the newest (the largest value) is the state now.
        self._lora_info: dict[tuple[str, str, str], float] = {}
        self._labels = ["model_name", "engine"]
        self._values = [model, "0"]
        # A subset of the labels of vLLM 0.32 (tests/data/vllm_metrics_*.txt has ~35), spelt as vLLM does
        # ("True", "None"); kv_cache_size_tokens is what routers size their prefix index from.
        self._cache_info = {
            "block_size": str(config.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "engine": "0",
            "gpu_memory_utilization": str(gpu_memory_utilization),
            "kv_cache_size_tokens": str(engine.num_gpu_blocks * config.block_size),
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(engine.num_gpu_blocks),
            "num_gpu_blocks_override": "None",
        }

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=self._labels)
        g.add_metric(self._values, value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=self._labels)
        c.add_metric(self._values, value)
        return c

    def collect(self) -> Iterator[Metric]:
        e = self._engine
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.", e.num_running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", e.num_waiting)
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", e.kv_usage)
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            e.prefix_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            e.prefix_hits)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                            e.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", e.prompt_tokens_total)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.",
                            e.generation_tokens_total)
        info = GaugeMetricFamily("vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
                                 labels=list(self._cache_info))
        info.add_metric(list(self._cache_info.values()), 1.0)
        yield info
        if self._max_loras:
            yield self._lora_requests_info()

    def _lora_requests_info(self) -> GaugeMetricFamily:
        running, waiting = self._engine.lora_requests()
        labels = (str(self._max_loras), ",".join(waiting), ",".join(running))
        self._lora_info.pop(labels, None)
        self._lora_info[labels] = time.time()
        while len(self._lora_info) > LORA_INFO_SERIES:
            del self._lora_info[next(iter(self._lora_info))]
        g = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests.",
                              labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        for values, at in self._lora_info.items():
            g.add_metric(list(values), at)
        return g


class SimMetrics:
    def __init__(self, engine: EngineCore, config: EngineConfig, model: str, *,
                 gpu_memory_utilization: float = 0.9) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineStateCollector(engine, config, model, gpu_memory_utilization))
        labels = ["model_name", "engine"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=self.registry).labels(model, "0")
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=self.registry).labels(model, "0")
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=self.registry).labels(model, "0")
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               [*labels, "finished_reason"], registry=self.registry).labels(model, "0", "length")

    def render(self) -> bytes:
        return generate_latest(self.registry)
