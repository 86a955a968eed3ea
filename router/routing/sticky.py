"""Session stickiness within a time window: a session keeps its endpoint while it keeps talking.

Multi-turn chat reuses the KV cache of earlier turns only if the next turn lands on the same engine, but a
pin that lasts forever fights load balancing (hot sessions destabilise a fleet). So a session key (header
`x-session-id` by default, the body's `user` as fallback) pins to an endpoint for `ttl` *since last use*;
the pin is left, and the session re-pinned by the policy, when the endpoint is gone, draining or holds more
than `maxLoadFactor` times the pool's mean load.

Pins live in a bounded local table (LRU) and, when Redis is configured, in Redis with the same TTL
(`fleetroute:v1:sticky:{policy}:{digest}`), so every router replica sends a session to the same
endpoint and a restarted replica picks its sessions up again. Redis is consulted only on a local miss,
with a short timeout; writes are fire-and-forget. When Redis fails, stickiness continues on the local
table (counted and logged once) and Redis is tried again after `retry_after`.

The session key is client input of any length (a `user` field may be megabytes). It is never stored:
`session_digest` keeps 16 bytes of BLAKE2b of at most its first 512 characters, the same on every replica
(no secret, no per-process seed), so a pin costs the same whatever the key, and neither the tables nor
Redis hold a client's identifier. Pins written before this format (keyed by the raw session) are simply not
found after an upgrade: their sessions are re-pinned once, and the old keys expire with their TTL.

A pin read from Redis is untrusted (router/runtime/redis_input.py): it is read with GETRANGE, so at most
MAX_PIN_BYTES + 1 bytes come back whatever the key holds, and `pinned_endpoint` admits it only as printable
UTF-8 of at most MAX_PIN_BYTES; a bad value (or a key of another type) is counted in
`fleetroute_redis_rejected_values_total{data="sticky_pin"}` and the session is pinned afresh, as if it had
no pin. A pin naming an endpoint that is not in the pool is "gone", like any stale pin.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from redis.exceptions import RedisError, ResponseError

from router.model import EndpointView, RequestInfo
from router.routing.policies.base import LoadView
from router.routing.policies.consistent_hash import HashKey
from router.runtime.metrics import RouterMetrics
from router.runtime.redis_client import RedisClient
from router.runtime.redis_input import Rejected, RejectionLog, text

log = logging.getLogger("fleetroute.sticky")

KEY_PREFIX = "fleetroute:v1:sticky:"
MAX_LOCAL_SESSIONS = 100_000
# Characters of a session key that count: longer than any id format in use (a UUID is 36, a JWT `sub` a few
# dozen), short enough that hashing costs nothing. Keys equal in their first 512 characters share a pin.
MAX_SESSION_CHARS = 512
_PERSON = b"fleetroute.sess"  # BLAKE2b personalisation: these digests are never confused with another's


def session_digest(session: str) -> str:
    """What a session is pinned under: 32 hex digits, identical on every replica for the same session."""
    data = session[:MAX_SESSION_CHARS].encode("utf-8", "surrogateescape")
    return hashlib.blake2b(data, digest_size=16, person=_PERSON).hexdigest()


MAX_PIN_BYTES = 253  # the longest endpoint id: a Kubernetes object name (DNS subdomain)


def pinned_endpoint(raw: bytes) -> str | None:
    """The endpoint id a pin read from Redis names (None: no pin); raises Rejected for a value no router
    wrote. `raw` comes from GETRANGE 0..MAX_PIN_BYTES, so a longer value shows as one byte too many."""
    if not raw:
        return None  # GETRANGE answers "" for a missing key
    return text(raw, max_bytes=MAX_PIN_BYTES, what="pinned endpoint id")


@dataclass(frozen=True)
class StickinessSettings:
    enabled: bool = False
    key: HashKey = HashKey("header", "x-session-id")
    fallback_key: HashKey | None = HashKey("body", "user")
    ttl: float = 600.0
    max_load_factor: float = 2.0

    def session(self, req: RequestInfo) -> str | None:
        """The request's session as the tables know it (`session_digest`), or None without a session key."""
        session = self.key.extract(req)
        if session is None and self.fallback_key is not None:
            session = self.fallback_key.extract(req)
        return session_digest(session) if session is not None else None


def within_load_bound(view: EndpointView, pool: tuple[EndpointView, ...], loads: LoadView, factor: float) -> bool:
    """True if the endpoint holds fewer than ceil(factor * (total + 1) / n) requests (cluster-wide)."""
    total = sum(loads.cluster_in_flight(v.id) for v in pool)
    bound = max(1, math.ceil(factor * (total + 1) / max(len(pool), 1)))
    return loads.cluster_in_flight(view.id) < bound


class StickyTable:
    """Session -> endpoint pins for one policy, local with an optional Redis copy."""

    def __init__(
        self,
        *,
        policy: str,
        settings: StickinessSettings,
        metrics: RouterMetrics,
        redis: RedisClient | None = None,
        retry_after: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy
        self.settings = settings
        self._metrics = metrics
        self._redis = redis
        self._retry_after = retry_after
        self._clock = clock
        # session digest -> (endpoint, last use, last Redis write)
        self._local: OrderedDict[str, tuple[str, float, float]] = OrderedDict()
        self._redis_down_until = 0.0
        self._tasks: set[asyncio.Task[None]] = set()
        self._rejected = RejectionLog(what="session pin", logger=log,
                                      count=lambda reason: metrics.redis_rejected.labels("sticky_pin", reason).inc())

    def _redis_key(self, session: str) -> str:
        return f"{KEY_PREFIX}{self.policy}:{session}"

    def _redis_usable(self) -> bool:
        return self._redis is not None and self._clock() >= self._redis_down_until

    def _redis_failed(self, exc: BaseException) -> None:
        self._metrics.sticky_store_errors.inc()
        if self._clock() >= self._redis_down_until:
            log.warning("sticky sessions: redis unavailable, continuing with this router's own pins",
                        extra={"policy": self.policy, "error": f"{type(exc).__name__}: {exc}"})
        self._redis_down_until = self._clock() + self._retry_after

    async def lookup(self, session: str) -> str | None:
        now = self._clock()
        entry = self._local.get(session)
        if entry is not None:
            if now - entry[1] <= self.settings.ttl:
                return entry[0]
            del self._local[session]
        if not self._redis_usable():
            return None
        try:
            assert self._redis is not None
            raw = await self._redis.getrange(self._redis_key(session), 0, MAX_PIN_BYTES)
            endpoint = pinned_endpoint(raw)
        except Rejected as exc:
            self._rejected(exc, policy=self.policy)
            return None
        except ResponseError as exc:
            if str(exc).startswith("WRONGTYPE"):  # garbage under our key, not a Redis outage
                self._rejected(Rejected("wrong_type", f"the key is not a string ({exc})"), policy=self.policy)
            else:
                self._redis_failed(exc)
            return None
        except (RedisError, OSError) as exc:
            self._redis_failed(exc)
            return None
        if endpoint is not None:
            self._remember(session, endpoint, now, written=now)
        return endpoint

    def pin(self, session: str, endpoint_id: str) -> None:
        """Record (or refresh) the session's endpoint. The Redis copy is written in the background when the
        pin changes, and refreshed at most every ttl/4 while it does not (one write per request would do)."""
        now = self._clock()
        previous = self._local.get(session)
        written = previous[2] if previous is not None and previous[0] == endpoint_id else -math.inf
        if now - written > self.settings.ttl / 4 and self._redis_usable():
            written = now
            task = asyncio.get_running_loop().create_task(self._write(session, endpoint_id))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        self._remember(session, endpoint_id, now, written)

    def _remember(self, session: str, endpoint_id: str, now: float, written: float) -> None:
        self._local[session] = (endpoint_id, now, written)
        self._local.move_to_end(session)
        while len(self._local) > MAX_LOCAL_SESSIONS:
            self._local.popitem(last=False)

    async def _write(self, session: str, endpoint_id: str) -> None:
        try:
            assert self._redis is not None
            await self._redis.set(self._redis_key(session), endpoint_id, px=int(self.settings.ttl * 1000))
        except (RedisError, OSError) as exc:
            self._redis_failed(exc)

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Drop the local pins to endpoints that left (one pass over the table, as `sweep` makes every
        interval). Their sessions are pinned again by the policy at their next request; a Redis copy still
        naming a departed endpoint is found `gone` and replaced the same way."""
        for session in [s for s, entry in self._local.items() if entry[0] in gone]:
            del self._local[session]

    def sweep(self) -> dict[str, int]:
        """Forget expired pins; return live pins per endpoint (for the metric)."""
        now = self._clock()
        counts: dict[str, int] = {}
        for session, (endpoint, used, _) in list(self._local.items()):
            if now - used > self.settings.ttl:
                del self._local[session]
            else:
                counts[endpoint] = counts.get(endpoint, 0) + 1
        return counts

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
