"""The one way the router and the agents reach Redis: a standalone server, a Sentinel-managed master, or a
Redis Cluster, with the password taken from the environment or a file (never from the config file).

Every client in the process comes from `connect`, so they all behave alike:

- binary replies (`decode_responses=False`): what Redis returns is untrusted, and each reader bounds a
  value's size before it decodes it (router/runtime/redis_input.py);
- RESP2 replies (`protocol=2`), one reply shape whatever the server speaks;
- short socket timeouts, and one immediate retry on a broken connection only (a pooled connection that a
  failover or an idle timeout closed: the retry reconnects, through the sentinels or the refreshed slot
  map), never on a timeout: every caller already treats a failed command as "Redis is unavailable this
  round" and goes on with what it has, so retrying a slow server would only make a request or a refresh
  wait longer.

Sentinel: redis-py's `Sentinel.master_for` asks the sentinels for the master's address on every new
connection, and a connection to a master that was demoted fails with a connection error; the caller's next
round then reaches the new master. Cluster: `RedisCluster` routes each command to the node owning its key's
slot. Keys that one command or one MULTI uses together carry a hash tag (`{...}`) so they share a slot
(router/routing/shared_loads.py); pipelines that span slots are non-transactional, and commands that redis-py does
not pipeline in cluster mode (TIME, PUBLISH) are sent on their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError
from redis.retry import Retry

RedisClient = aioredis.Redis | RedisCluster


def _retry() -> Retry:
    return Retry(NoBackoff(), 1, supported_errors=(ConnectionError,))


@dataclass(frozen=True)
class SentinelSettings:
    """`redis.sentinel`: the sentinels to ask, and which master they watch."""

    master_name: str
    addresses: tuple[tuple[str, int], ...]
    db: int = 0
    tls: bool = False
    password: str | None = field(default=None, repr=False)  # the sentinels' own (`requirepass` on a sentinel)


@dataclass(frozen=True)
class RedisSettings:
    url: str | None = None  # a standalone server, or any node of a cluster; None with sentinel or no Redis
    cluster: bool = False
    sentinel: SentinelSettings | None = None
    username: str | None = None  # an ACL user (Redis 6+); None: the default user
    password: str | None = field(default=None, repr=False)  # read from passwordEnv / passwordFile at start-up
    password_source: str | None = None  # where it came from ("$VAR", "file /path"), for humans

    @property
    def enabled(self) -> bool:
        return self.url is not None or self.sentinel is not None

    def describe(self) -> str:
        """Where Redis is, without secrets (for logs)."""
        if self.sentinel is not None:
            hosts = ",".join(f"{h}:{p}" for h, p in self.sentinel.addresses)
            return f"sentinel master {self.sentinel.master_name!r} via {hosts}"
        if self.url is None:
            return "none"
        from urllib.parse import urlsplit

        parts = urlsplit(self.url)
        where = parts.hostname or parts.path
        port = f":{parts.port}" if parts.port else ""
        return f"{'cluster' if self.cluster else parts.scheme} {where}{port}"


def connect(settings: RedisSettings, *, timeout: float) -> RedisClient:
    """A client for the configured Redis; `timeout` bounds each connect and each command's reply."""
    common: dict[str, Any] = dict(
        decode_responses=False, protocol=2, socket_timeout=timeout, socket_connect_timeout=timeout,
        retry=_retry(),
    )
    if settings.username is not None:
        common["username"] = settings.username
    if settings.password is not None:
        common["password"] = settings.password
    if settings.sentinel is not None:
        s = settings.sentinel
        sentinel_kwargs: dict[str, Any] = dict(socket_timeout=timeout, socket_connect_timeout=timeout,
                                               retry=_retry(), ssl=s.tls)
        if s.password is not None:
            sentinel_kwargs["password"] = s.password
        sentinel = Sentinel(list(s.addresses), sentinel_kwargs=sentinel_kwargs, db=s.db, ssl=s.tls, **common)
        return sentinel.master_for(s.master_name, redis_class=_SentinelMaster)
    assert settings.url is not None, "connect() needs redis.url or redis.sentinel"
    if settings.cluster:
        return RedisCluster.from_url(settings.url, **common)
    return aioredis.Redis.from_url(settings.url, **common)


class _SentinelMaster(aioredis.Redis):
    """The master client also owns its connections to the sentinels: closing it closes them."""

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        await super().aclose(close_connection_pool)
        manager = getattr(self.connection_pool, "sentinel_manager", None)
        for sentinel in getattr(manager, "sentinels", ()):
            await sentinel.aclose()
