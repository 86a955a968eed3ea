"""Writing telemetry records to Redis, in the schema of `worker.protocol`.

Each publish replaces the endpoint's hash atomically (MULTI: DEL, HSET, PEXPIRE), so a signal the agent
can no longer read disappears instead of lingering, and the key expires by itself `ttl` after the last
write: a dead agent's data vanishes rather than misleading routers. Then a PUBLISH on the updates channel
tells routers to refresh early.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from worker.protocol import UPDATES_CHANNEL, TelemetryRecord, encode, telemetry_key


class RedisPublisher:
    def __init__(self, client: aioredis.Redis, *, ttl: float) -> None:
        self._client = client
        self._ttl_ms = max(1, int(ttl * 1000))

    async def publish(self, record: TelemetryRecord) -> None:
        key = telemetry_key(record.endpoint_id)
        async with self._client.pipeline(transaction=True) as pipe:
            pipe.delete(key)
            pipe.hset(key, mapping=encode(record))
            pipe.pexpire(key, self._ttl_ms)
            pipe.publish(UPDATES_CHANNEL, record.endpoint_id)
            await pipe.execute()
