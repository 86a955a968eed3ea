"""The telemetry wire schema between worker agents and routers: the ONLY worker module the router imports.

One Redis hash per endpoint, written by that endpoint's agent every interval and read by every router:

    key      fleetroute:v1:telemetry:{endpoint_id}        (HSET, then PEXPIRE ttl)
    channel  fleetroute:v1:telemetry-updates              (PUBLISH endpoint_id after each write)

Fields (all strings, as Redis stores them; a signal the agent could not read is simply absent):

    schema            "1"; a reader that does not know the version ignores the record (and says so)
    endpoint_id       the endpoint this describes (the discovery id; the join key)
    reported_at       agent wall-clock time of the sample, Unix seconds: of its oldest part when the GPU part
                      came from the node agent (so a router never takes older GPU numbers for fresh ones)
    seq               increases by one per write (debugging, lost-update detection)
    interval          the agent's sampling interval, seconds
    gpu_source        nvml | dcgm | sim | none (nvml or dcgm through the node agent on Kubernetes)
    gpu_reported_at   when the GPU part was sampled, if by the node agent (its wall clock: the same node's)
    gpu_count         GPUs behind the endpoint, if the node agent read them (the gpu_* fields aggregate them)
    gpu_util          0..1, GPU busy fraction (NVML utilization.gpu, or GPM SM activity when available; from
                      dcgm-exporter its SM activity or engine activity when exported)
    gpu_util_kind     utilization | gpm_sm_activity | dcgm_sm_active | dcgm_gr_engine_active
    gpu_mem_util      0..1, GPU memory used / total (for vLLM ~0.9 from start-up: pre-allocated)
    gpu_mem_used_bytes, gpu_mem_total_bytes
    gpu_temperature_c, gpu_power_w
    gpu_throttle_reasons   NVML clocks-event reasons bit mask
    gpu_xid_errors    XID errors seen since the agent started
    gpu_ecc_uncorrected    volatile uncorrected ECC errors
    gpu_retired_pages      retired (or pending) pages
    gpu_lost          "1" when the GPU fell off the bus (NVML_ERROR_GPU_IS_LOST)
    engine_up         "1" if the engine's /metrics answered this interval
    kv_cache_usage    0..1 (vllm:kv_cache_usage_perc, formerly gpu_cache_usage_perc)
    num_waiting       vllm:num_requests_waiting
    num_running       vllm:num_requests_running
    prefix_cache_hit_rate  0..1, hits/queries over the last interval
    prefix_cache_queries_total, prefix_cache_hits_total
                      vllm:prefix_cache_{queries,hits}_total, tokens, cumulative (routers compute hit rates
                      over their own windows from them)
    preemptions_total vllm:num_preemptions_total
    kv_capacity_tokens  tokens the engine's KV cache holds (vllm:cache_config_info: kv_cache_size_tokens,
                      else num_gpu_blocks x block_size; summed over data-parallel engines). Optional: agents
                      before it simply leave it out, and readers that predate it ignore it.
    lora_running_adapters, lora_waiting_adapters
                      LoRA adapters with requests running / waiting, comma-separated (vllm:lora_requests_info,
                      its newest series); present only for an engine with --enable-lora, "" when none; at most
                      MAX_ADAPTERS names of at most MAX_ADAPTER_NAME characters (the only fields allowed to be
                      longer than 256 bytes: ADAPTER_FIELD_BYTES)
    max_lora          the engine's adapter slots (its max_lora label). Optional, as kv_capacity_tokens

The TTL is a few intervals, so a dead agent's record disappears by itself rather than lying. Routers also
judge age from `reported_at` and treat old records as unknown.

GPU records, from the node agent (`fleetroute node-agent`, one per GPU node) to the endpoint's sidecar agent,
which merges them into the telemetry record above (routers never read these keys):

    key      fleetroute:v1:gpu:{endpoint_id}              (DEL, HSET, PEXPIRE ttl in one MULTI per round)
    channel  fleetroute:v1:gpu-updates                    (PUBLISH the node's name after each round)

    schema, endpoint_id, reported_at, interval   as above, of the node agent's round
    source            nvml | dcgm
    node, namespace   where the endpoint's pod runs
    gpu_uuids         the pod's GPUs, comma-separated (GPU or MIG UUIDs)
    gpu_count and the gpu_* fields of the telemetry record, aggregated over the pod's GPUs (see
                      worker/node_sources.py: mean busy fraction, the fullest GPU's memory, any GPU lost...)

Each field has a range no real agent leaves (`LIMITS`; ratios in [0, 1], counts >= 0 and below absurd
bounds, numbers finite, `mem_used <= mem_total`): `out_of_range` names the first field outside it, and
routers refuse such a record whole (docs/telemetry.md, "Trust"). `FIELD_NAMES` lists every field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields

SCHEMA_VERSION = 1
KEY_PREFIX = "fleetroute:v1:telemetry:"
UPDATES_CHANNEL = "fleetroute:v1:telemetry-updates"


GPU_KEY_PREFIX = "fleetroute:v1:gpu:"
GPU_UPDATES_CHANNEL = "fleetroute:v1:gpu-updates"
GPU_RECORD_SOURCES = ("nvml", "dcgm")


def telemetry_key(endpoint_id: str) -> str:
    return KEY_PREFIX + endpoint_id


def gpu_key(endpoint_id: str) -> str:
    return GPU_KEY_PREFIX + endpoint_id


@dataclass(frozen=True)
class GpuSample:
    """One reading of one GPU, from NVML or the simulator. None = not supported or not readable."""

    util: float | None = None
    util_kind: str = "utilization"
    mem_used_bytes: int | None = None
    mem_total_bytes: int | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    throttle_reasons: int | None = None
    xid_errors: int | None = None
    ecc_uncorrected: int | None = None
    retired_pages: int | None = None
    lost: bool = False
    # Set only on readings that the node agent took for a whole endpoint: how many GPUs it aggregates, and
    # when it was read (wall clock), which is older than the record it is merged into.
    count: int | None = None
    reported_at: float | None = None

    @property
    def mem_util(self) -> float | None:
        if self.mem_used_bytes is None or not self.mem_total_bytes:
            return None
        return self.mem_used_bytes / self.mem_total_bytes


@dataclass(frozen=True)
class EngineSample:
    """One scrape of an engine's /metrics. None = the series was absent."""

    up: bool = False
    kv_cache_usage: float | None = None
    num_waiting: float | None = None
    num_running: float | None = None
    prefix_cache_queries: float | None = None
    prefix_cache_hits: float | None = None
    preemptions_total: float | None = None
    kv_capacity_tokens: int | None = None
    # LoRA (engines with --enable-lora only): adapters with requests running / waiting, and adapter slots.
    lora_running: tuple[str, ...] | None = None
    lora_waiting: tuple[str, ...] | None = None
    max_lora: int | None = None


@dataclass(frozen=True)
class TelemetryRecord:
    """What one agent publishes about one endpoint."""

    endpoint_id: str
    reported_at: float
    seq: int
    interval: float
    gpu_source: str
    gpu: GpuSample
    engine: EngineSample
    prefix_cache_hit_rate: float | None = None
    schema: int = SCHEMA_VERSION


class SchemaMismatch(ValueError):
    """The record was written by an agent with another schema version."""


_GPU_FIELDS = {f.name: f"gpu_{f.name}" for f in fields(GpuSample)}
_GPU_FIELDS["util_kind"] = "gpu_util_kind"
_GPU_FIELDS["lost"] = "gpu_lost"
_ENGINE_FIELDS = {
    "up": "engine_up",
    "kv_cache_usage": "kv_cache_usage",
    "num_waiting": "num_waiting",
    "num_running": "num_running",
    "prefix_cache_queries": "prefix_cache_queries_total",
    "prefix_cache_hits": "prefix_cache_hits_total",
    "preemptions_total": "preemptions_total",
    "kv_capacity_tokens": "kv_capacity_tokens",
    "lora_running": "lora_running_adapters",
    "lora_waiting": "lora_waiting_adapters",
    "max_lora": "max_lora",
}
_ADAPTER_FIELDS = {"lora_running", "lora_waiting"}
MAX_ADAPTERS = 64  # adapter names in one field (vLLM's max_loras is far below; a longer list is cut)
MAX_ADAPTER_NAME = 128  # characters; a longer name is left out of the list
ADAPTER_FIELD_BYTES = MAX_ADAPTERS * (MAX_ADAPTER_NAME + 1)  # the size a reader admits for an adapter field
ADAPTER_FIELD_NAMES = ("lora_running_adapters", "lora_waiting_adapters")
_INT_FIELDS = {"mem_used_bytes", "mem_total_bytes", "throttle_reasons", "xid_errors", "ecc_uncorrected",
               "retired_pages", "count"}


def _put(out: dict[str, str], key: str, value: object) -> None:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return  # unknown (a NaN gauge, say) is left out, never written as "nan"
    if isinstance(value, bool):
        out[key] = "1" if value else "0"
    else:
        out[key] = str(value)


def encode(record: TelemetryRecord) -> dict[str, str]:
    """The Redis hash fields for a record (absent signals are left out)."""
    out: dict[str, str] = {}
    _put(out, "schema", record.schema)
    _put(out, "endpoint_id", record.endpoint_id)
    _put(out, "reported_at", repr(record.reported_at))
    _put(out, "seq", record.seq)
    _put(out, "interval", record.interval)
    _put(out, "gpu_source", record.gpu_source)
    _put(out, "prefix_cache_hit_rate", record.prefix_cache_hit_rate)
    _put_gpu(out, record.gpu)
    for name, value in asdict(record.engine).items():
        _put(out, _ENGINE_FIELDS[name], ",".join(value) if name in _ADAPTER_FIELDS and value is not None else value)
    return out


def _put_gpu(out: dict[str, str], gpu: GpuSample) -> None:
    for name, value in asdict(gpu).items():
        _put(out, _GPU_FIELDS[name], value)


def _float(raw: Mapping[str, str], key: str) -> float | None:
    value = raw.get(key)
    if value is None or value == "":
        return None
    return _finite(float(value), key)


def _finite(number: float, key: str) -> float:
    if not math.isfinite(number):  # NaN or inf would poison every comparison
        raise ValueError(f"{key} is not a finite number")
    return number


def decode(raw: Mapping[str, str]) -> TelemetryRecord:
    """A record from Redis hash fields. Raises SchemaMismatch for another version, ValueError if malformed."""
    schema = raw.get("schema")
    if schema != str(SCHEMA_VERSION):
        raise SchemaMismatch(f"telemetry schema {schema!r}, this router reads {SCHEMA_VERSION}")
    engine_kwargs: dict[str, object] = {}
    for name, key in _ENGINE_FIELDS.items():
        if name == "up":
            engine_kwargs[name] = raw.get(key) == "1"
        elif name in ("kv_capacity_tokens", "max_lora"):
            value = _float(raw, key)
            engine_kwargs[name] = int(value) if value is not None and value > 0 else None
        elif name in _ADAPTER_FIELDS:
            engine_kwargs[name] = _adapters(raw.get(key), key)
        else:
            engine_kwargs[name] = _float(raw, key)
    return TelemetryRecord(
        endpoint_id=raw["endpoint_id"],
        reported_at=_finite(float(raw["reported_at"]), "reported_at"),
        seq=int(raw.get("seq", "0")),
        interval=_finite(float(raw.get("interval", "1")), "interval"),
        gpu_source=raw.get("gpu_source", "none"),
        gpu=_decode_gpu(raw),
        engine=EngineSample(**engine_kwargs),  # type: ignore[arg-type]
        prefix_cache_hit_rate=_float(raw, "prefix_cache_hit_rate"),
    )


def _adapters(text: str | None, key: str) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(name for name in text.split(",") if name)
    if len(names) > MAX_ADAPTERS or any(len(name) > MAX_ADAPTER_NAME for name in names):
        raise ValueError(f"{key}: more than {MAX_ADAPTERS} adapter names, or one over {MAX_ADAPTER_NAME} characters")
    return names


def _decode_gpu(raw: Mapping[str, str]) -> GpuSample:
    gpu_kwargs: dict[str, object] = {}
    for name, key in _GPU_FIELDS.items():
        if name == "util_kind":
            gpu_kwargs[name] = raw.get(key, "utilization")
        elif name == "lost":
            gpu_kwargs[name] = raw.get(key) == "1"
        else:
            value = _float(raw, key)
            gpu_kwargs[name] = int(value) if value is not None and name in _INT_FIELDS else value
    return GpuSample(**gpu_kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class GpuRecord:
    """What the node agent publishes about one endpoint's GPUs, for the endpoint's sidecar to merge."""

    endpoint_id: str
    reported_at: float
    interval: float
    source: str  # nvml | dcgm
    gpu: GpuSample  # aggregated over the pod's GPUs; gpu.count says how many
    node: str = ""
    namespace: str = ""
    gpu_uuids: tuple[str, ...] = ()
    schema: int = SCHEMA_VERSION


def encode_gpu_record(record: GpuRecord) -> dict[str, str]:
    out: dict[str, str] = {}
    _put(out, "schema", record.schema)
    _put(out, "endpoint_id", record.endpoint_id)
    _put(out, "reported_at", repr(record.reported_at))
    _put(out, "interval", record.interval)
    _put(out, "source", record.source)
    _put(out, "node", record.node)
    _put(out, "namespace", record.namespace)
    _put(out, "gpu_uuids", ",".join(record.gpu_uuids))
    _put_gpu(out, record.gpu)
    return out


def decode_gpu_record(raw: Mapping[str, str]) -> GpuRecord:
    """A GPU record from Redis hash fields. Raises SchemaMismatch for another version, ValueError (or
    KeyError) if malformed: an unknown source, a non-finite time or interval."""
    schema = raw.get("schema")
    if schema != str(SCHEMA_VERSION):
        raise SchemaMismatch(f"GPU record schema {schema!r}, this agent reads {SCHEMA_VERSION}")
    source = raw.get("source", "")
    if source not in GPU_RECORD_SOURCES:
        raise ValueError(f"GPU record source {source!r} is none of {', '.join(GPU_RECORD_SOURCES)}")
    reported_at, interval = _float(raw, "reported_at"), _float(raw, "interval")
    if reported_at is None or interval is None or interval <= 0:
        raise ValueError("GPU record without a finite reported_at and a positive interval")
    uuids = raw.get("gpu_uuids", "")
    return GpuRecord(
        endpoint_id=raw["endpoint_id"],
        reported_at=reported_at,
        interval=interval,
        source=source,
        gpu=_decode_gpu(raw),
        node=raw.get("node", ""),
        namespace=raw.get("namespace", ""),
        gpu_uuids=tuple(uuids.split(",")) if uuids else (),
    )


FIELD_NAMES: tuple[str, ...] = (
    "schema", "endpoint_id", "reported_at", "seq", "interval", "gpu_source", "prefix_cache_hit_rate",
    *_GPU_FIELDS.values(), *_ENGINE_FIELDS.values(),
)
GPU_SOURCES = ("nvml", "dcgm", "sim", "none")
GPU_UTIL_KINDS = ("utilization", "gpm_sm_activity", "dcgm_sm_active", "dcgm_gr_engine_active")

_RATIO = (0.0, 1.0)
_REQUESTS = (0.0, 1e6)  # requests waiting or running on one endpoint
_TOKENS = (0.0, 2.0**53)  # cumulative token counters (exact as floats up to here)
_EVENTS = (0, 2**32)  # error and page counts since the agent started
# (low, high) per field of the record, inclusive; a None value (signal not read) is always fine.
LIMITS: dict[str, tuple[float, float]] = {
    "reported_at": (1.0, 1e11),  # Unix seconds, after 1970 and before the year 5000
    "seq": (0, 2**63 - 1),
    "interval": (1e-3, 3600.0),
    "prefix_cache_hit_rate": _RATIO,
    "gpu.util": _RATIO,
    "gpu.mem_used_bytes": (0, 2**50),
    "gpu.mem_total_bytes": (1, 2**50),
    "gpu.temperature_c": (-60.0, 250.0),
    "gpu.power_w": (0.0, 1e5),
    "gpu.throttle_reasons": (0, 2**64 - 1),
    "gpu.xid_errors": _EVENTS,
    "gpu.ecc_uncorrected": _EVENTS,
    "gpu.retired_pages": _EVENTS,
    "gpu.count": (1, 1024),  # GPUs behind one endpoint (node agent)
    "gpu.reported_at": (1.0, 1e11),
    "engine.kv_cache_usage": _RATIO,
    "engine.num_waiting": _REQUESTS,
    "engine.num_running": _REQUESTS,
    "engine.prefix_cache_queries": _TOKENS,
    "engine.prefix_cache_hits": _TOKENS,
    "engine.preemptions_total": _TOKENS,
    "engine.kv_capacity_tokens": (1, 1e10),
    "engine.max_lora": (1, 1e4),
}


# (name, part, attribute, low, high), split once: the check runs for every record every refresh.
_CHECKS = [(name, *name.rpartition(".")[::2], low, high) for name, (low, high) in LIMITS.items()]


def out_of_range(record: TelemetryRecord) -> str | None:
    """The first field of `record` outside the schema's ranges, as "name value" (None: all within)."""
    parts = {"": record, "gpu": record.gpu, "engine": record.engine}
    for name, part, attr, low, high in _CHECKS:
        value = getattr(parts[part], attr)
        if value is not None and not low <= value <= high:  # NaN compares False: out of range too
            return f"{name} {value!r} not in [{low:g}, {high:g}]"
    gpu = record.gpu
    if gpu.mem_used_bytes is not None and gpu.mem_total_bytes and gpu.mem_used_bytes > gpu.mem_total_bytes:
        return f"gpu.mem_used_bytes {gpu.mem_used_bytes} > gpu.mem_total_bytes {gpu.mem_total_bytes}"
    if record.gpu_source not in GPU_SOURCES:
        return f"gpu_source {record.gpu_source[:32]!r} not one of {', '.join(GPU_SOURCES)}"
    if gpu.util_kind not in GPU_UTIL_KINDS:
        return f"gpu_util_kind {gpu.util_kind[:32]!r} not one of {', '.join(GPU_UTIL_KINDS)}"
    return None
