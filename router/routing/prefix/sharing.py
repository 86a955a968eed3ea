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

    1. TIME (on its own: redis-py does not pipeline it to a Redis Cluster)
    2. one pipeline: per pool with queued blocks, XADD one entry (the oldest ENTRY_HASHES blocks), PEXPIRE
       the stream to the TTL (a stream nobody writes to disappears), XTRIM MINID (server time - ttl) and
       XTRIM MAXLEN maxStreamEntries (exact trimming: entries older than the TTL are gone after each write);
       then per pool one XREAD from its cursor, COUNT READ_COUNT entries. Each command names one stream,
       so on a Redis Cluster the pipeline is split by node and no hash tag is needed.

Ids are assigned by the Redis server, so the TTL is judged on one clock (the server's), never on the
replicas' skewed wall clocks. A replica meeting a pool for the first time (start-up, or a policy whose
parameters changed) reads from `server time - ttl`: it warms up from the last TTL of everyone's traffic, a
bounded amount (MAXLEN) applied MERGE_BUDGET hashes per round. Entries older than the TTL when read (after
an outage, say) are skipped and counted as expired; blocks for endpoints this router does not know are
ignored (a bound on what garbage in the stream can cost).

Entries are untrusted (router/runtime/redis_input.py): `entry_blocks` admits one only if it is at most
MAX_ENTRY_BYTES with at most ENTRY_HASHES blocks in whole 8-byte hashes, names printable endpoint ids, and
its id is not dated past the server's time by more than FUTURE_ALLOWANCE; anything else is counted in
`fleetroute_redis_rejected_values_total{data="prefix_entry"}` and skipped without being unpacked. The merge
budget is in bytes of entries looked at (an oversize entry costs the cap), so one huge entry cannot stall
the event loop. A future-dated entry poisons its stream (Redis gives every later entry an id after it, so
none would ever expire): the stream is deleted, and the replicas start it afresh; so is a key of another
type where a stream belongs (only routers write these keys, and the stream is a cache they rebuild).

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

from redis.exceptions import RedisError, ResponseError

from router.routing.prefix.index import PrefixIndex
from router.runtime.metrics import RouterMetrics
from router.runtime.redis_client import RedisClient
from router.runtime.redis_input import Rejected, RejectionLog, text

log = logging.getLogger("fleetroute.prefix_sharing")

STREAM_PREFIX = "fleetroute:v1:prefix:"
ENTRY_HASHES = 1024  # blocks per stream entry (8 KiB): one entry per pool per round
READ_COUNT = 32  # stream entries read per pool per round
MERGE_BUDGET = 32768 * 8  # bytes of entries looked at per round, all pools together (~10 ms of CPU)
MAX_ENTRY_BYTES = ENTRY_HASHES * 8 + 16 * 1024  # the blocks, plus room for endpoint ids and the router id
MAX_ENDPOINT_ID_BYTES = 253
# Ids are judged against TIME, which on a cluster may come from another node than the stream's: a minute
# covers nodes whose clocks are not synchronised; an id further ahead was given by a writer, not the server.
FUTURE_ALLOWANCE_MS = 60_000
MAX_BACKOFF = 5.0
ROUTER_FIELD = b"router"
ENDPOINT_FIELD = b"e:"


def stream_key(policy: str, model: str, block_chars: int) -> str:
    return f"{STREAM_PREFIX}{policy}:{model}:{block_chars}"


def pack(hashes: list[int]) -> bytes:
    return struct.pack(f"<{len(hashes)}Q", *hashes)


def unpack(data: bytes) -> list[int]:
    return list(struct.unpack(f"<{len(data) // 8}Q", data))


@dataclass(frozen=True)
class Entry:
    """One admitted stream entry."""

    ms: int  # when the server added it (the id's milliseconds)
    router: bytes | None  # the writer's id
    blocks: dict[str, list[int]]  # endpoint id -> block hashes, oldest first


def entry_size(fields: dict[bytes, bytes]) -> int:
    return sum(len(name) + len(value) for name, value in fields.items())


def entry_blocks(entry_id: bytes, fields: dict[bytes, bytes], *, server_ms: int) -> Entry:
    """The one way a shared-index entry enters the router: size and block count within what a router
    writes (checked before anything is unpacked), whole 8-byte hashes, printable endpoint ids, and an id
    not dated in the future. Raises Rejected."""
    ms = _ms(entry_id)
    if ms > server_ms + FUTURE_ALLOWANCE_MS:
        raise Rejected("future", f"entry {entry_id[:40]!r} is dated {(ms - server_ms) / 1000:.0f}s ahead of the server")
    size = entry_size(fields)
    if size > MAX_ENTRY_BYTES:
        raise Rejected("oversize", f"entry is {size} bytes, at most {MAX_ENTRY_BYTES} expected")
    blocks: dict[str, list[int]] = {}
    count = 0
    for name, value in fields.items():
        if not name.startswith(ENDPOINT_FIELD):
            continue
        if len(value) % 8:
            raise Rejected("malformed", f"{len(value)} bytes of block hashes, not a multiple of 8")
        count += len(value) // 8
        if count > ENTRY_HASHES:
            raise Rejected("oversize", f"entry has more than {ENTRY_HASHES} blocks")
        endpoint = text(name[len(ENDPOINT_FIELD):], max_bytes=MAX_ENDPOINT_ID_BYTES, what="endpoint id")
        blocks[endpoint] = unpack(value)
    return Entry(ms=ms, router=fields.get(ROUTER_FIELD), blocks=blocks)


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


def _stream_entries(reply: Any) -> list[tuple[bytes, dict[bytes, bytes]]]:
    """One stream's entries from XREAD's RESP2 reply, [[key, [(id, fields), ...]]] (empty: nothing new)."""
    return [entry for _key, entries in reply or () for entry in entries]


def _ms(entry_id: bytes) -> int:
    return int(entry_id.split(b"-", 1)[0])


class PrefixSharing:
    def __init__(
        self,
        *,
        redis: RedisClient,
        router_id: str,
        metrics: RouterMetrics,
        base_delay: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis  # binary, as every client (router/runtime/redis_client.py): hashes travel packed
        self.router_id = router_id
        self._router = router_id.encode()
        self._metrics = metrics
        self._base_delay = base_delay
        self._clock = clock
        self._cursors: dict[str, _Cursor] = {}
        self._failures = 0
        self._retry_at = 0.0
        self.up: bool | None = None  # None until the first exchange
        self._rejected = RejectionLog(what="prefix stream entry", logger=log,
                                      count=lambda reason: metrics.redis_rejected.labels("prefix_entry", reason).inc())

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
            seconds, micros = await self._redis.time()
            server_ms = int(seconds) * 1000 + int(micros) // 1000
            streams = {pool.key: self._cursor(pool, server_ms) for pool in pools}
            async with self._redis.pipeline(transaction=False) as pipe:
                for pool, batch in written:
                    fields: dict[bytes, bytes] = {ROUTER_FIELD: self._router}
                    for endpoint_id, hashes in batch.items():
                        fields[ENDPOINT_FIELD + endpoint_id.encode()] = pack(hashes)
                    pipe.xadd(pool.key, fields)  # type: ignore[arg-type]
                    pipe.pexpire(pool.key, int(pool.ttl * 1000))
                    pipe.xtrim(pool.key, minid=f"{server_ms - int(pool.ttl * 1000)}-0", approximate=False)
                    pipe.xtrim(pool.key, maxlen=pool.max_entries, approximate=False)
                for key, cursor in streams.items():
                    pipe.xread({key: cursor}, count=READ_COUNT)
                # A stream key holding another type answers WRONGTYPE for that pool alone.
                replies = await pipe.execute(raise_on_error=False)
            for reply in replies:
                if isinstance(reply, BaseException) and not isinstance(reply, ResponseError):
                    raise reply
        except (RedisError, OSError) as exc:
            # The batch stays queued. If the entry reached Redis before the failure, it is sent again next
            # time: a duplicate costs a second merge of the same blocks, nothing more.
            self._failed(exc)
            return
        published = 0
        broken: list[str] = []  # keys of another type, or poisoned streams: deleted below
        for i, (pool, batch) in enumerate(written):
            added = replies[4 * i]
            if isinstance(added, ResponseError):
                self._rejected(Rejected("wrong_type", f"the key is not a stream ({added})"), stream=pool.key)
                broken.append(pool.key)
                continue  # stays queued, sent next round to the stream that replaces the garbage
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
        read = replies[4 * len(written):]
        broken += self._apply(pools, dict(zip(streams, read, strict=True)), server_ms)
        for key in dict.fromkeys(broken):
            try:
                await self._redis.delete(key)
            except (RedisError, OSError) as exc:
                self._failed(exc)
                return

    def _cursor(self, pool: SharedPool, server_ms: int) -> bytes:
        cursor = self._cursors.get(pool.key)
        if cursor is None or cursor.index is not pool.index:
            cursor = self._cursors[pool.key] = _Cursor(pool.index)
        if cursor.last_id is None:
            cursor.last_id = f"{max(0, server_ms - int(pool.ttl * 1000))}-0".encode()
        return cursor.last_id

    def _apply(self, pools: list[SharedPool], replies: dict[str, Any], server_ms: int) -> list[str]:
        """Merge what each pool's XREAD returned, within the round's byte budget; returns the streams to
        delete: keys of another type, and streams a future-dated entry poisoned."""
        budget = MERGE_BUDGET
        counts = {"received": 0, "expired": 0, "ignored": 0}
        poisoned: list[str] = []
        for pool in pools:
            cursor = self._cursors[pool.key]
            reply = replies[pool.key]
            if isinstance(reply, ResponseError):
                self._rejected(Rejected("wrong_type", f"the key is not a stream ({reply})"), stream=pool.key)
                poisoned.append(pool.key)
                continue
            got = _stream_entries(reply)
            cutoff = server_ms - int(pool.ttl * 1000)
            done = 0
            for entry_id, fields in got:
                if budget <= 0:
                    break
                done += 1
                budget -= min(entry_size(fields), MAX_ENTRY_BYTES)
                try:
                    entry = entry_blocks(entry_id, fields, server_ms=server_ms)
                except Rejected as exc:
                    self._rejected(exc, stream=pool.key)
                    if exc.reason == "future":
                        poisoned.append(pool.key)
                        cursor.last_id = None  # start afresh from server time - ttl
                        break
                    cursor.last_id = entry_id
                    continue
                cursor.last_id = entry_id
                if entry.router == self._router:
                    continue
                for endpoint_id, hashes in entry.blocks.items():
                    if entry.ms < cutoff:
                        counts["expired"] += len(hashes)
                    elif endpoint_id not in pool.endpoints:
                        counts["ignored"] += len(hashes)
                    else:
                        pool.index.merge(endpoint_id, hashes)
                        cursor.learned += len(hashes)
                        counts["received"] += len(hashes)
            if not cursor.caught_up and done == len(got) and len(got) < READ_COUNT and pool.key not in poisoned:
                cursor.caught_up = True
                log.info("prefix index caught up with the shared stream",
                         extra={"stream": pool.key, "learned_blocks": cursor.learned, "router_id": self.router_id})
        for outcome, n in counts.items():
            if n:
                self._metrics.prefix_shared_blocks.labels(outcome).inc(n)
        return poisoned

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
