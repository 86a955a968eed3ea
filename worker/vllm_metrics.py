"""Parsing an engine's Prometheus `/metrics` page (vLLM) into an `EngineSample`.

A pure wire-format module (no I/O), shared by the worker agent and the router's embedded collector; with
`protocol` it is the only worker code the router imports.

vLLM's series, across versions (V0 `vllm/engine/metrics.py`, V1 `vllm/v1/metrics/loggers.py`):

    vllm:num_requests_waiting          gauge    requests queued for admission
    vllm:num_requests_running          gauge    requests in the running batch
    vllm:kv_cache_usage_perc           gauge    KV-cache blocks in use, 0..1 (V1)
    vllm:gpu_cache_usage_perc          gauge    the same, V0 name (fallback)
    vllm:prefix_cache_queries_total    counter  tokens looked up in the prefix cache (V1)
    vllm:prefix_cache_hits_total       counter  of which found (V1)
    vllm:num_preemptions_total         counter  preemptions
    vllm:cache_config_info             gauge    1, with the cache configuration as labels: the KV capacity
                                                is `kv_cache_size_tokens` where present (vLLM 0.32), else
                                                `num_gpu_blocks` x `block_size` (label values may be "None")
    vllm:lora_requests_info            gauge    with --enable-lora: set to the current time under labels
                                                `max_lora`, `running_lora_adapters`, `waiting_lora_adapters`
                                                (comma-separated names); old label sets stay on the page, so
                                                the series with the largest value is the state now

Series carry labels (`model_name`, `engine` for data-parallel ranks): counts are summed across series,
the usage fraction is averaged. A family that is missing (older or newer vLLM, a renamed series) leaves its
signal None rather than failing the whole scrape. Only the lines of these families are handed to
prometheus-client's parser: a vLLM page is large (a histogram per latency) and scrapes must stay cheap.
"""

from __future__ import annotations

import itertools

from prometheus_client.parser import text_string_to_metric_families

from worker.protocol import MAX_ADAPTER_NAME, MAX_ADAPTERS, EngineSample

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
PREFIX_QUERIES = "vllm:prefix_cache_queries"
PREFIX_HITS = "vllm:prefix_cache_hits"
PREEMPTIONS = "vllm:num_preemptions"
CACHE_CONFIG = "vllm:cache_config_info"
LORA_INFO = "vllm:lora_requests_info"
_FAMILIES = (WAITING, RUNNING, *KV_USAGE, PREFIX_QUERIES, PREFIX_HITS, PREEMPTIONS, CACHE_CONFIG, LORA_INFO)
_SAMPLE_NAMES = {WAITING, RUNNING, *KV_USAGE, f"{PREFIX_QUERIES}_total", f"{PREFIX_HITS}_total",
                 f"{PREEMPTIONS}_total", CACHE_CONFIG, LORA_INFO}


def _relevant_lines(text: str) -> str:
    keep = []
    for line in text.splitlines():
        if line.startswith("# "):
            parts = line.split(" ", 3)
            if len(parts) > 2 and parts[2].removesuffix("_total") in _FAMILIES:
                keep.append(line)
        elif line.startswith(_FAMILIES):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in _SAMPLE_NAMES:
                keep.append(line)
    return "\n".join(keep) + "\n"


def _positive_int(labels: dict[str, str], name: str) -> int | None:
    try:
        value = int(labels.get(name, ""))
    except ValueError:  # "None", absent, or not a number
        return None
    return value if value > 0 else None


def kv_capacity_tokens(labels: dict[str, str]) -> int | None:
    """One engine's KV-cache capacity in tokens from its `cache_config_info` labels, or None if unknown."""
    tokens = _positive_int(labels, "kv_cache_size_tokens")
    if tokens is not None:
        return tokens
    blocks, block_size = _positive_int(labels, "num_gpu_blocks"), _positive_int(labels, "block_size")
    return blocks * block_size if blocks is not None and block_size is not None else None


def _adapters(text: str | None) -> tuple[str, ...]:
    """The names of a label's comma-separated list, bounded as the telemetry record carries them: names longer
    than MAX_ADAPTER_NAME left out, at most MAX_ADAPTERS kept (an engine with more is reported in part)."""
    names = (name for name in (text or "").split(",") if name and len(name) <= MAX_ADAPTER_NAME)
    return tuple(itertools.islice(names, MAX_ADAPTERS))


def parse_vllm_metrics(text: str) -> EngineSample:
    """An `EngineSample` from a metrics page; raises ValueError if the page is not Prometheus text."""
    values: dict[str, list[float]] = {}
    capacities: list[int | None] = []
    lora: tuple[float, dict[str, str]] | None = None  # the newest lora_requests_info series
    for family in text_string_to_metric_families(_relevant_lines(text)):
        for sample in family.samples:
            if sample.name == CACHE_CONFIG:
                capacities.append(kv_capacity_tokens(sample.labels))
            elif sample.name == LORA_INFO:
                if lora is None or sample.value > lora[0]:
                    lora = (sample.value, sample.labels)
            elif sample.name in _SAMPLE_NAMES:
                values.setdefault(sample.name.removesuffix("_total"), []).append(float(sample.value))

    def total(name: str) -> float | None:
        return sum(values[name]) if name in values else None

    kv = next((values[name] for name in KV_USAGE if name in values), None)
    known = [c for c in capacities if c is not None]
    return EngineSample(
        up=True,
        kv_cache_usage=sum(kv) / len(kv) if kv else None,
        num_waiting=total(WAITING),
        num_running=total(RUNNING),
        prefix_cache_queries=total(PREFIX_QUERIES),
        prefix_cache_hits=total(PREFIX_HITS),
        preemptions_total=total(PREEMPTIONS),
        # Data-parallel engines each have their own cache: the endpoint holds their sum. One rank with an
        # unreadable configuration makes the whole capacity unknown rather than understated.
        kv_capacity_tokens=sum(known) if known and len(known) == len(capacities) else None,
        lora_running=_adapters(lora[1].get("running_lora_adapters")) if lora else None,
        lora_waiting=_adapters(lora[1].get("waiting_lora_adapters")) if lora else None,
        max_lora=_positive_int(lora[1], "max_lora") if lora else None,
    )
