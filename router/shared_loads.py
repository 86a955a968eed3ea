"""In-flight counts shared between router replicas through Redis, so load bounds hold fleet-wide.

Each replica writes its own in-flight count per endpoint every interval to a hash that expires after a
few intervals (`fleetroute:v1:loads:{replica}`), and registers itself in a sorted set scored by its last
write time (`fleetroute:v1:replicas`). It then reads every live replica's hash and keeps the sum of the
*others'* counts in `LoadTracker.others`; pickers add their own exact, live counts to it
(`cluster_in_flight`). Nothing here is on the request path: a replica that crashes simply stops renewing,
and its counts expire. If Redis fails, `others` is cleared (each replica falls back to its own counts),
counted and logged once, and the next interval tries again.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.loads import LoadTracker
from router.metrics import RouterMetrics

log = logging.getLogger("fleetroute.shared_loads")

LOADS_PREFIX = "fleetroute:v1:loads:"
REPLICAS_KEY = "fleetroute:v1:replicas"


def replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class SharedLoads:
    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        loads: LoadTracker,
        metrics: RouterMetrics,
        interval: float,
        replica: str | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._loads = loads
        self._metrics = metrics
        self._ttl = 3 * interval
        self.replica = replica or replica_id()
        self._wall = wall_clock
        self._down = False

    async def exchange(self) -> None:
        """Publish this replica's counts and read the others'. Never raises for Redis trouble."""
        now = self._wall()
        key = LOADS_PREFIX + self.replica
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                counts = self._loads.snapshot()
                if counts:
                    pipe.hset(key, mapping={k: str(v) for k, v in counts.items()})
                    pipe.pexpire(key, int(self._ttl * 1000))
                pipe.zadd(REPLICAS_KEY, {self.replica: now})
                pipe.zremrangebyscore(REPLICAS_KEY, "-inf", now - self._ttl)
                pipe.zrange(REPLICAS_KEY, 0, -1)
                replicas = (await pipe.execute())[-1]
            others = [r for r in replicas if r != self.replica]
            async with self._redis.pipeline(transaction=False) as pipe:
                for other in others:
                    pipe.hgetall(LOADS_PREFIX + other)
                hashes = await pipe.execute() if others else []
        except (RedisError, OSError) as exc:
            self._metrics.shared_state_errors.inc()
            if not self._down:
                log.warning("shared load counts unavailable; load bounds use this router's counts only",
                            extra={"error": f"{type(exc).__name__}: {exc}"})
            self._down = True
            self._loads.others = {}
            return
        if self._down:
            log.info("shared load counts available again")
            self._down = False
        total: dict[str, int] = {}
        for fields in hashes:
            for endpoint, value in fields.items():
                if value.isdigit():  # another replica's garbage must not stop this one
                    total[endpoint] = total.get(endpoint, 0) + int(value)
        self._loads.others = total
        self._metrics.router_replicas.set(len(others) + 1)
