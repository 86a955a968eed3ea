"""In-flight counts shared between router replicas through Redis, so load bounds hold fleet-wide.

Each replica writes its own in-flight count per endpoint every interval to a hash that expires after a
few intervals (`fleetroute:v1:{loads}:r:<replica>`), and registers itself in a sorted set scored by its last
write time (`fleetroute:v1:{loads}:replicas`). It then reads every live replica's hash and keeps the sum of
the *others'* counts in `LoadTracker.others`; pickers add their own exact, live counts to it
(`cluster_in_flight`). Nothing here is on the request path: a replica that crashes simply stops renewing,
and its counts expire. If Redis fails, `others` is cleared (each replica falls back to its own counts),
counted and logged once, and the next interval tries again.

The write is one MULTI over two keys, so both carry the hash tag `{loads}` and share a Redis Cluster slot.

What other replicas wrote is untrusted (router/runtime/redis_input.py): the replica list is read newest first and
at most MAX_REPLICAS long (`live_replicas`); a replica's hash (HGETALL: it holds only the endpoints with
requests in flight, so it is small) is dropped whole beyond MAX_ENDPOINTS fields, counts for endpoints this
router does not route to are ignored, and each count must be a decimal in [0, MAX_IN_FLIGHT]
(`replica_counts`); anything else is counted in
`fleetroute_redis_rejected_values_total{data="in_flight"|"replica"}` and dropped.
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence

from redis.exceptions import RedisError, ResponseError

from router.routing.loads import LoadTracker
from router.runtime.metrics import RouterMetrics
from router.runtime.redis_client import RedisClient
from router.runtime.redis_input import MAX_CLOCK_SKEW, Rejected, RejectionLog, bounded_int, text

log = logging.getLogger("fleetroute.shared_loads")

LOADS_PREFIX = "fleetroute:v1:{loads}:r:"
REPLICAS_KEY = "fleetroute:v1:{loads}:replicas"
MAX_REPLICAS = 256  # replicas read per round (the most recently seen first)
MAX_IN_FLIGHT = 1_000_000  # one replica's requests in flight to one endpoint
MAX_ENDPOINTS = 100_000  # endpoints in one replica's hash
MAX_REPLICA_ID_BYTES = 256


def replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _wrong_type(result: object) -> bool:
    return isinstance(result, ResponseError) and str(result).startswith("WRONGTYPE")


def live_replicas(members: Sequence[bytes], *, reject: Callable[[Rejected], None]) -> list[str]:
    """The replica ids from the replica set, each printable UTF-8 of bounded size (they become key names)."""
    out = []
    for member in members:
        try:
            out.append(text(member, max_bytes=MAX_REPLICA_ID_BYTES, what="replica id"))
        except Rejected as exc:
            reject(exc)
    return out


def replica_counts(fields: Mapping[bytes, bytes] | ResponseError, known: Collection[str], *,
                   reject: Callable[[Rejected], None]) -> dict[str, int]:
    """One replica's in-flight counts for the `known` endpoints: each a decimal in [0, MAX_IN_FLIGHT], the
    rest dropped. A 4,000-digit count would otherwise overflow the load bound's float arithmetic on the
    request path, and a 5,000-digit one make int() raise in every round."""
    if isinstance(fields, ResponseError):
        reject(Rejected("wrong_type", f"the key is not a hash ({fields})"))
        return {}
    if len(fields) > MAX_ENDPOINTS:
        reject(Rejected("oversize", f"{len(fields)} endpoints, at most {MAX_ENDPOINTS} expected"))
        return {}
    counts: dict[str, int] = {}
    for name, raw in fields.items():
        endpoint = name.decode("utf-8", "replace")
        if endpoint not in known:
            continue  # another pool's endpoint, or garbage: nothing this router would ask about
        try:
            counts[endpoint] = bounded_int(raw, high=MAX_IN_FLIGHT, what=f"in-flight count for {endpoint}")
        except Rejected as exc:
            reject(exc)
    return counts


class SharedLoads:
    def __init__(
        self,
        *,
        redis: RedisClient,
        loads: LoadTracker,
        metrics: RouterMetrics,
        interval: float,
        endpoints: Callable[[], list[str]],
        replica: str | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._loads = loads
        self._metrics = metrics
        self._endpoints = endpoints
        self._ttl = 3 * interval
        self.replica = replica or replica_id()
        self._wall = wall_clock
        self._down = False
        self._replica_rejected = RejectionLog(
            what="router replica id", logger=log,
            count=lambda reason: metrics.redis_rejected.labels("replica", reason).inc())
        self._count_rejected = RejectionLog(
            what="in-flight count", logger=log,
            count=lambda reason: metrics.redis_rejected.labels("in_flight", reason).inc())

    async def exchange(self) -> None:
        """Publish this replica's counts and read the others'. Never raises for Redis trouble."""
        now = self._wall()
        key = LOADS_PREFIX + self.replica
        known = set(self._endpoints())
        try:
            async with self._redis.pipeline(transaction=True) as pipe:
                pipe.delete(key)
                counts = self._loads.snapshot()
                if counts:
                    pipe.hset(key, mapping={k: str(v) for k, v in counts.items()})
                    pipe.pexpire(key, int(self._ttl * 1000))
                pipe.zadd(REPLICAS_KEY, {self.replica: now})
                pipe.zremrangebyscore(REPLICAS_KEY, "-inf", now - self._ttl)
                # Newest first and bounded: a set stuffed with made-up replicas costs one bounded read.
                pipe.zrange(REPLICAS_KEY, now + MAX_CLOCK_SKEW, now - self._ttl, desc=True, byscore=True,
                            offset=0, num=MAX_REPLICAS)
                results = await pipe.execute(raise_on_error=False)
            for result in results:
                if isinstance(result, BaseException) and not _wrong_type(result):
                    raise result
            members = results[-1]
            if _wrong_type(members):
                # Only the replica set can be of another type (this replica's hash was just deleted): it
                # holds garbage, and every replica re-registers within an interval, so it is dropped.
                self._replica_rejected(Rejected("wrong_type", "the replica set is not a sorted set"))
                await self._redis.delete(REPLICAS_KEY)
                members = []
            replicas = live_replicas(members, reject=self._replica_rejected)
            others = [r for r in replicas if r != self.replica]
            hashes: list[dict[bytes, bytes] | ResponseError] = []
            if others:
                async with self._redis.pipeline(transaction=False) as pipe:
                    for other in others:
                        pipe.hgetall(LOADS_PREFIX + other)
                    hashes = await pipe.execute(raise_on_error=False)
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
        for values in hashes:
            for endpoint, count in replica_counts(values, known, reject=self._count_rejected).items():
                total[endpoint] = total.get(endpoint, 0) + count
        self._loads.others = total
        self._metrics.router_replicas.set(len(others) + 1)
