"""Writing telemetry records to Redis, in the schema of `worker.protocol`.

Each publish replaces the endpoint's hash atomically (MULTI: DEL, HSET, PEXPIRE on the one key, so it
works on a Redis Cluster too), so a signal the agent can no longer read disappears instead of lingering,
and the key expires by itself `ttl` after the last write: a dead agent's data vanishes rather than
misleading routers. Then a PUBLISH on the updates channel tells routers to refresh early; it is a command
of its own because redis-py does not put PUBLISH in a cluster transaction (on a cluster, a PUBLISH reaches
subscribers on every node).
"""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from worker.protocol import UPDATES_CHANNEL, TelemetryRecord, encode, telemetry_key


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
