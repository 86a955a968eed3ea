"""Writing telemetry records to Redis, in the schema of `worker.protocol`.

Each publish replaces the endpoint's hash atomically (MULTI: DEL, HSET, PEXPIRE on the one key, so it
works on a Redis Cluster too), so a signal the agent can no longer read disappears instead of lingering,
and the key expires by itself `ttl` after the last write: a dead agent's data vanishes rather than
misleading routers. Then a PUBLISH on the updates channel tells routers to refresh early; it is a command
of its own because redis-py does not put PUBLISH in a cluster transaction (on a cluster, a PUBLISH reaches
subscribers on every node).

The node agent writes its GPU records the same way, one MULTI per endpoint (an endpoint's key is replaced
atomically; keys of different endpoints may live on different Redis Cluster slots, so no transaction spans
two of them). An endpoint whose pod left the node has its record deleted at once rather than left to expire.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from worker.protocol import (
    GPU_UPDATES_CHANNEL,
    UPDATES_CHANNEL,
    GpuRecord,
    TelemetryRecord,
    encode,
    encode_gpu_record,
    gpu_key,
    telemetry_key,
)


class RedisPublisher:
    def __init__(self, client: aioredis.Redis | RedisCluster, *, ttl: float) -> None:
        self._client = client
        self._ttl_ms = max(1, int(ttl * 1000))

    async def publish(self, record: TelemetryRecord) -> None:
        key = telemetry_key(record.endpoint_id)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=encode(record))
            pipe.pexpire(key, self._ttl_ms)
            await pipe.execute()
        await self._client.publish(UPDATES_CHANNEL, record.endpoint_id)


class GpuRecordPublisher:
    """The node agent's writes: every round, the GPU record of each endpoint on the node."""

    def __init__(self, client: aioredis.Redis | RedisCluster, *, ttl: float, node: str) -> None:
        self._client = client
        self._ttl_ms = max(1, int(ttl * 1000))
        self._node = node

    async def _replace(self, record: GpuRecord) -> None:
        key = gpu_key(record.endpoint_id)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=encode_gpu_record(record))
            pipe.pexpire(key, self._ttl_ms)
            await pipe.execute()

    async def publish(self, records: Iterable[GpuRecord], gone: Iterable[str] = ()) -> None:
        """Replace these endpoints' records, delete those of endpoints that left, announce the round."""
        await asyncio.gather(*(self._replace(record) for record in records),
                             *(self._client.delete(gpu_key(endpoint_id)) for endpoint_id in gone))
        await self._client.publish(GPU_UPDATES_CHANNEL, self._node)
