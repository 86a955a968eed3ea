"""The sidecar's half of GPU telemetry on Kubernetes (`fleetroute agent --gpu-source node`).

The node agent (worker/node_agent.py) writes each endpoint's GPU record to Redis; the endpoint's sidecar
reads it every interval, beside its scrape of the engine, and merges it into the telemetry record it
publishes. Routers keep reading one hash per endpoint and need not know where the GPU numbers came from.

Ages. The merged record's `reported_at` is the older of the engine scrape and the GPU reading, and the
GPU reading's own time travels as `gpu_reported_at`, so no router takes an old GPU number for a fresh one.
A GPU record older than three of the node agent's intervals (as old as its TTL allows) is not merged at
all: the record then carries fresh engine signals and no GPU ones (`gpu_source` none) instead of making
the whole record look old.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError

from worker.protocol import GpuRecord, SchemaMismatch, TelemetryRecord, decode_gpu_record, gpu_key

log = logging.getLogger("fleetroute.agent")

STALE_INTERVALS = 3
# A GPU record holds about twenty short fields; anything far larger was not written by a node agent.
MAX_FIELDS = 64
MAX_VALUE_BYTES = 256


def _texts(raw: Mapping[bytes | str, bytes | str]) -> dict[str, str]:
    """The record's fields as text, sizes checked before anything is decoded (Redis is shared: whoever can
    write it could put anything under the key). Raises ValueError."""
    if len(raw) > MAX_FIELDS:
        raise ValueError(f"the record has {len(raw)} fields, at most {MAX_FIELDS} expected")
    out = {}
    for name, value in raw.items():
        if len(name) > MAX_VALUE_BYTES or len(value) > MAX_VALUE_BYTES:
            raise ValueError(f"a field or value longer than {MAX_VALUE_BYTES} bytes")
        out[name.decode() if isinstance(name, bytes) else name] = value.decode() if isinstance(value, bytes) else value
    return out


class NodeGpuReader:
    """Reads one endpoint's GPU record; None when there is none that is usable (logged once per cause)."""

    def __init__(self, client: aioredis.Redis | RedisCluster, endpoint_id: str,
                 clock: Callable[[], float] = time.time) -> None:
        self._client = client
        self.endpoint_id = endpoint_id
        self._key = gpu_key(endpoint_id)
        self._clock = clock
        self._missing: str | None = None  # why the last read gave nothing, if it did (and was logged)
        self._absent_reads = 0  # reads in a row that found no record

    def _nothing(self, why: str, message: str, **extra: object) -> None:
        if self._missing != why:
            log.warning(message, extra={"endpoint": self.endpoint_id, **extra})
        self._missing = why

    async def read(self) -> GpuRecord | None:
        try:
            raw = await self._client.hgetall(self._key)
        except (RedisError, OSError):
            return None  # the publish of the same round fails too, and the agent says so once
        if not raw:
            # A new pod's first record comes with the node agent's next round: no warning for that.
            self._absent_reads += 1
            if self._absent_reads >= STALE_INTERVALS:
                self._nothing("absent", "no GPU record from the node agent; publishing engine-only telemetry (is "
                              "`fleetroute node-agent` running on this node, watching this pod's namespace?)")
            return None
        self._absent_reads = 0
        try:
            record = decode_gpu_record(_texts(raw))
            if record.endpoint_id != self.endpoint_id:
                raise ValueError(f"the record under this endpoint's key names endpoint {record.endpoint_id!r}")
        except (SchemaMismatch, KeyError, ValueError) as exc:  # UnicodeDecodeError is a ValueError
            self._nothing("malformed", "unusable GPU record from the node agent; publishing engine-only telemetry",
                          error=str(exc))
            return None
        age = self._clock() - record.reported_at
        if age > STALE_INTERVALS * record.interval:
            self._nothing("stale", "the node agent's GPU record is stale; publishing engine-only telemetry",
                          age_s=round(age, 3), node=record.node)
            return None
        if self._missing is not None:
            log.info("GPU record from the node agent again", extra={"endpoint": self.endpoint_id, "node": record.node,
                                                                   "source": record.source})
            self._missing = None
        return record


def merge(record: TelemetryRecord, gpu: GpuRecord | None) -> TelemetryRecord:
    """The sidecar's record with the node agent's GPU reading in it (unchanged when there is none)."""
    if gpu is None:
        return record
    return replace(
        record,
        reported_at=min(record.reported_at, gpu.reported_at),
        gpu_source=gpu.source,
        gpu=replace(gpu.gpu, reported_at=gpu.reported_at),
    )
