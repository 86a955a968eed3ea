"""Sharing the prefix-aware index between router replicas through Redis: one stream per pool, with a TTL.

Why: each replica's index only knows where *its* traffic went. With n replicas behind a Service, a
conversation's turns land on different replicas, and each would send them by load instead of to the engine
that holds the prefix. Sharing gives every replica the fleet's placements, and each index then also sees
the traffic that makes its engine evict (prefix_index's LRU models the whole engine, not 1/n of it).

Key layout (one Redis stream per (policy, model) pool and block size; routers with another `blockChars`
hash differently, so they use another stream):

    fleetroute:v1:prefix:{policy}:{model}:{blockChars}       stream, PEXPIRE ttl after each write
      entry  router       the writing replica's id (readers skip their own entries)
             e:{endpoint} the block hashes routed to that endpoint since the last flush, 8 bytes each
                          (little-endian uint64), oldest first; at most ENTRY_HASHES per entry

A round (every ~250 ms, in the background; pickers only append to the index's outbox):

    1. pipeline: TIME; per pool with queued blocks, XADD one entry (the oldest ENTRY_HASHES blocks) and
       PEXPIRE the stream to the TTL (a stream nobody writes to disappears)
    2. pipeline: XTRIM MINID (server time - ttl) and XTRIM MAXLEN maxStreamEntries for the streams just
       written (exact trimming: entries older than the TTL are gone after each write); then one XREAD of
       every pool's stream from its cursor, COUNT READ_COUNT entries each

Ids are assigned by the Redis server, so the TTL is judged on one clock (the server's), never on the
replicas' skewed wall clocks. A replica meeting a pool for the first time (start-up, or a policy whose
parameters changed) reads from `server time - ttl`: it warms up from the last TTL of everyone's traffic, a
bounded amount (MAXLEN) applied MERGE_BUDGET hashes per round. Entries older than the TTL when read (after
an outage, say) are skipped and counted as expired; blocks for endpoints this router does not know are
ignored (a bound on what garbage in the stream can cost).

Memory: Redis holds at most maxStreamEntries x (ENTRY_HASHES x 8 B + ~100 B) per pool (8192 entries: 64 MiB
worst case; a replica flushing 4 times a second with 50 new blocks per flush writes ~1.6 KB/s). Each
router's outbox holds at most OUTBOX_LIMIT hashes per pool; beyond that new blocks are not queued (counted
as dropped), so an outage costs bounded memory. Received blocks go into the same LRU as the router's own, so
the index bound covers both.

Failure: a Redis error fails the round only (counted, logged once per outage, `fleetroute_prefix_sharing_up`
0); queued blocks stay queued, the next try is delayed by an exponential backoff up to MAX_BACKOFF, and
routing goes on with the local index. When Redis answers again the queued blocks are published and the
cursors resume (entries trimmed meanwhile are simply missed).
"""

from __future__ import annotations

import logging
import struct
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.metrics import RouterMetrics
from router.policies.prefix_index import PrefixIndex

log = logging.getLogger("fleetroute.prefix_sharing")

STREAM_PREFIX = "fleetroute:v1:prefix:"
ENTRY_HASHES = 1024  # blocks per stream entry (8 KiB): one entry per pool per round
READ_COUNT = 32  # stream entries read per pool per round
MERGE_BUDGET = 32768  # received blocks applied per round, all pools together (~10 ms of CPU)
MAX_BACKOFF = 5.0
ROUTER_FIELD = b"router"
ENDPOINT_FIELD = b"e:"


def stream_key(policy: str, model: str, block_chars: int) -> str:
    return f"{STREAM_PREFIX}{policy}:{model}:{block_chars}"


def pack(hashes: list[int]) -> bytes:
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack(data: bytes) -> list[int] | None:
    if len(data) % 8:
        return None
    return list(struct.unpack(f"<{len(data) // 8}Q", data))


@dataclass(frozen=True)
class SharedPool:
    """One pool's index and where it is shared."""

    key: str
    index: PrefixIndex
    ttl: float
    max_entries: int
    endpoints: Container[str]  # blocks for other endpoints are ignored (checked as they arrive)


@dataclass
class _Cursor:
    index: PrefixIndex  # the state it belongs to: a new state (parameters changed) warms up afresh
    last_id: bytes | None = None  # None: start from server time - ttl
    learned: int = 0
    caught_up: bool = False


def _stream_entries(reply: Any) -> dict[bytes, list[tuple[bytes, dict[bytes, bytes]]]]:
    """XREAD's RESP2 reply, [[key, [(id, fields), ...]], ...], as {key: [(id, fields), ...]}."""
    return {key: list(entries) for key, entries in reply or ()}


def _ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


class PrefixSharing:
    def __init__(
        self,
        *,
        redis: aioredis.Redis,
        router_id: str,
        metrics: RouterMetrics,
        base_delay: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis  # binary (decode_responses=False): hashes travel packed
        self.router_id = router_id
        self._router = router_id.encode()
        self._metrics = metrics
        self._base_delay = base_delay
        self._clock = clock
        self._cursors: dict[str, _Cursor] = {}
        self._failures = 0
        self._retry_at = 0.0
        self.up: bool | None = None  # None until the first exchange

    async def exchange(self, pools: Iterable[SharedPool]) -> None:
        """Publish each pool's queued blocks and apply the other replicas' new ones. Never raises for Redis
        trouble; skips the round while backing off after a failure."""
        pools = list(pools)
        for pool in pools:
            if not pool.index.shared:
                pool.index.start_sharing(refresh_after=pool.ttl / 2)
            dropped = pool.index.take_dropped()
            if dropped:
                self._metrics.prefix_shared_blocks.labels("dropped").inc(dropped)
        live = {pool.key for pool in pools}
        self._cursors = {k: c for k, c in self._cursors.items() if k in live}
        if not pools or self._clock() < self._retry_at:
            return
        batches = [(pool, pool.index.pending(ENTRY_HASHES)) for pool in pools]
        written = [(pool, batch) for pool, batch in batches if batch]
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.time()
                for pool, batch in written:
                    fields: dict[bytes, bytes] = {ROUTER_FIELD: self._router}
                    for endpoint_id, hashes in batch.items():
                        fields[ENDPOINT_FIELD + endpoint_id.encode()] = pack(hashes)
                    pipe.xadd(pool.key, fields)  # type: ignore[arg-type]
                    pipe.pexpire(pool.key, int(pool.ttl * 1000))
                first = await pipe.execute()
            seconds, micros = first[0]
            server_ms = int(seconds) * 1000 + int(micros) // 1000
            async with self._redis.pipeline(transaction=False) as pipe:
                for pool, _batch in written:
                    pipe.xtrim(pool.key, minid=f"{server_ms - int(pool.ttl * 1000)}-0", approximate=False)
                    pipe.xtrim(pool.key, maxlen=pool.max_entries, approximate=False)
                streams = {pool.key: self._cursor(pool, server_ms) for pool in pools}
                pipe.xread(streams, count=READ_COUNT)  # type: ignore[arg-type]
                reply = (await pipe.execute())[-1]
        except (RedisError, OSError) as exc:
            # The batch stays queued. If only the second pipeline failed, the entry is in Redis already and
            # is sent again next time: a duplicate costs a second merge of the same blocks, nothing more.
            self._failed(exc)
            return
        published = 0
        for pool, batch in written:
            pool.index.sent(batch)
            published += sum(len(h) for h in batch.values())
        if published:
            self._metrics.prefix_shared_blocks.labels("published").inc(published)
        if self.up is not True:
            if self.up is False:
                log.info("prefix index sharing through Redis works again",
                         extra={"router_id": self.router_id, "failures": self._failures})
            self.up = True
            self._failures = 0
            self._metrics.prefix_sharing_up.set(1)
        self._apply(pools, _stream_entries(reply), server_ms)

    def _cursor(self, pool: SharedPool, server_ms: int) -> bytes:
        cursor = self._cursors.get(pool.key)
        if cursor is None or cursor.index is not pool.index:
            cursor = self._cursors[pool.key] = _Cursor(pool.index)
        if cursor.last_id is None:
            cursor.last_id = f"{max(0, server_ms - int(pool.ttl * 1000))}-0".encode()
        return cursor.last_id

    def _apply(self, pools: list[SharedPool], entries: dict[bytes, list[tuple[bytes, dict[bytes, bytes]]]],
               server_ms: int) -> None:
        budget = MERGE_BUDGET
        counts = {"received": 0, "expired": 0, "ignored": 0}
        for pool in pools:
            cursor = self._cursors[pool.key]
            got = entries.get(pool.key.encode(), [])
            cutoff = server_ms - int(pool.ttl * 1000)
            done = 0
            for entry_id, fields in got:
                if budget <= 0:
                    break
                done += 1
                cursor.last_id = entry_id
                if fields.get(ROUTER_FIELD) == self._router:
                    continue
                for name, value in fields.items():
                    if not name.startswith(ENDPOINT_FIELD):
                        continue
                    hashes = unpack(value)
                    if hashes is None:
                        counts["ignored"] += 1
                        continue
                    endpoint_id = name[len(ENDPOINT_FIELD):].decode("utf-8", "replace")
                    if _ms(entry_id) < cutoff:
                        counts["expired"] += len(hashes)
                    elif endpoint_id not in pool.endpoints:
                        counts["ignored"] += len(hashes)
                    else:
                        pool.index.merge(endpoint_id, hashes)
                        cursor.learned += len(hashes)
                        counts["received"] += len(hashes)
                        budget -= len(hashes)
            if not cursor.caught_up and done == len(got) and len(got) < READ_COUNT:
                cursor.caught_up = True
                log.info("prefix index caught up with the shared stream",
                         extra={"stream": pool.key, "learned_blocks": cursor.learned, "router_id": self.router_id})
        for outcome, n in counts.items():
            if n:
                self._metrics.prefix_shared_blocks.labels(outcome).inc(n)

    def _failed(self, exc: BaseException) -> None:
        self._metrics.prefix_sharing_errors.inc()
        self._metrics.prefix_sharing_up.set(0)
        self._failures += 1
        delay = min(MAX_BACKOFF, self._base_delay * 2 ** min(self._failures, 16))
        self._retry_at = self._clock() + delay
        if self.up is not False:
            log.warning("prefix index sharing through Redis failed; routing on this router's index, retrying "
                        "with backoff", extra={"error": f"{type(exc).__name__}: {exc}", "router_id": self.router_id})
        self.up = False
