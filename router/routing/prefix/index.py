"""The prefix index: per endpoint, an approximate, bounded picture of which prompt blocks its KV cache holds.

What it stores: per endpoint, an LRU set of chained block hashes (router/routing/policies/prefix_aware.py says how
a prompt becomes hashes) that were routed there, by this router (`record`) or by other router replicas
(`merge`, fed from Redis by router/routing/prefix/sharing.py). It is an approximation of the engine's cache: the
engine evicts under its own memory pressure and the index never sees that, so each endpoint's LRU bound is
sized to what the engine can hold and corrected by comparison with the engine's own hit rate
(router/routing/prefix/tuning.py).

The bound of an endpoint is `effective = base x factor`, where `base` is the configured bound or, with
`maxBlocksPerEndpoint: auto`, the engine's KV capacity in router blocks (set at picker build from
telemetry), and `factor` in (0, 1] is the tuner's. Lowering a bound evicts at once, so memory follows it.

Memory: CPython's OrderedDict costs about 140 bytes per entry (the 64-bit int key included: measured with
tracemalloc), so 16384 blocks (an 8192-block x 128-token vLLM cache at ~64 tokens per router block) is
about 2.3 MB per endpoint, and the fallback bound of 32768 about 4.6 MB.

Each entry's value is a stamp: the upkeep clock (`now`, set by the background task; the picker reads no
clock) when the block was last announced to the other replicas. A block a router keeps routing is announced
again once its stamp is older than `refresh_after` (half the sharing TTL), so a replica warming up from the
shared stream sees every block still in use, without each hot block being re-sent on every request.

The inverted index (`_holders`: block hash -> the endpoint holding it, or a set of those when several do) is kept
in step with the LRU sets: an entry is added when a block enters an endpoint's set (`record`, `merge`) and
removed when it leaves (eviction, a lowered bound, `forget_endpoints`). So `holders(hashes)`, every endpoint's
leading match for a prompt, walks the prompt's blocks and narrows the set of endpoints still matching; it
costs the prompt's length times the endpoints holding its first blocks, not the pool's size (`longest`, what
a pick needs, usually less). Memory: one entry per distinct block, ~47 bytes while one endpoint holds it
(the entry is that endpoint's id), ~260 bytes when several do (a set), measured with tracemalloc; bounded by
the LRU sets it mirrors.

Safety of mutation on the request path: every pick runs synchronously on the event loop thread, so the
read (`matched`) and the write (`record`) of one pick never interleave with another's; a lost or stale
entry costs one cache miss, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Set
from dataclasses import dataclass
from typing import Any

FALLBACK_BLOCKS = 32768  # bound while an endpoint's KV capacity is unknown (see prefix_aware)
MIN_BLOCKS = 64  # sizing and tuning never go below this (a bound set explicitly lower is kept)
OUTBOX_LIMIT = 65536  # blocks waiting to be shared, per pool (~6 MB): beyond, new ones are dropped (counted)
CHANGES_KEPT = 256
PROBE_HOLDERS = 16  # `longest` checks a deep block's holders one by one up to this many (see there)


@dataclass(frozen=True, slots=True)
class BoundChange:
    """An endpoint's effective bound moved (a log line and a metric for the background task)."""

    endpoint_id: str
    old: int | None  # None: the endpoint had no bound yet
    new: int
    reason: str  # config | fallback | kv_capacity | shrink | grow


class PrefixIndex:
    """Per endpoint, an LRU set of block hashes routed there. Kept by the balancer across rebuilds."""

    __slots__ = ("by_endpoint", "_holders", "engine_blocks", "now", "refresh_after", "tuning", "changes", "_base",
                 "_factor", "_bound", "_estimate", "_outbox", "_outbox_size", "_dropped")

    def __init__(self) -> None:
        self.by_endpoint: dict[str, OrderedDict[int, float]] = {}
        self._holders: dict[int, str | set[str]] = {}  # block hash -> who holds it (the module docstring)
        # The router's KV-event index (router/routing/prefix/kv_block_index.py), set by the upkeep task when KV events
        # are configured: `index: precise` matches on it for the engines that publish.
        self.engine_blocks: Any = None
        self.now = 0.0  # the upkeep clock; stamps compare against it
        self.refresh_after = 300.0
        self.tuning: dict[str, object] = {}  # per endpoint, owned by prefix_tuning
        self.changes: deque[BoundChange] = deque(maxlen=CHANGES_KEPT)
        self._base: dict[str, int] = {}
        self._factor: dict[str, float] = {}
        self._bound: dict[str, int] = {}
        self._estimate: dict[str, list[float]] = {}  # per endpoint: [requests, matched chars, prompt chars]
        self._outbox: dict[str, dict[int, None]] | None = None  # None: not shared (no Redis)
        self._outbox_size = 0
        self._dropped = 0

    # ---- the request path (pickers, scorers) -----------------------------------------------------------

    def matched(self, endpoint_id: str, hashes: list[int]) -> int:
        """How many leading blocks of `hashes` the endpoint's index holds."""
        blocks = self.by_endpoint.get(endpoint_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def holders(self, hashes: list[int]) -> dict[str, int]:
        """Every endpoint holding at least the first of `hashes`, with how many leading blocks it holds (what
        `matched` says for it; endpoints absent hold none). Cost: the blocks walked times the endpoints still
        matching at each, never the number of endpoints indexed."""
        table = self._holders
        return leading_matches(table.get(h) for h in hashes)

    def longest(self, hashes: list[int]) -> tuple[int, frozenset[str] | set[str]]:
        """The longest leading match of `hashes` any endpoint holds, and the endpoints holding it (0 and none
        when no endpoint holds the first block). Only set intersections, in C, as the prompt's blocks are
        walked; the result must not be mutated (it may be the index's own set)."""
        table = self._holders
        # A chain's deep blocks usually have few holders, and those hold the whole chain: probe from the deepest
        # block anyone holds, checking its few holders' matches, before intersecting from the root (where a
        # shared system prompt's blocks may be held by the whole pool).
        for k in range(len(hashes) - 1, -1, -1):
            held = table.get(hashes[k])
            if held is None:
                continue
            group = (held,) if isinstance(held, str) else held
            if len(group) > PROBE_HOLDERS:
                break
            found = {e for e in group if self.matched(e, hashes) > k}
            if found:
                return k + 1, found
        live: frozenset[str] | set[str] = frozenset()
        n = 0
        for h in hashes:
            held = table.get(h)
            if held is None:
                break
            if isinstance(held, str):
                if n and held not in live:
                    break
                live = frozenset((held,))
            elif n:
                nxt = live & held
                if not nxt:
                    break
                live = nxt
            else:
                live = held  # read only, never changed here
            n += 1
        return n, live

    def blocks_indexed(self) -> int:
        """Distinct blocks in the inverted index (the `fleetroute_prefix_index_distinct_blocks` gauge)."""
        return len(self._holders)

    def _hold(self, endpoint_id: str, h: int) -> None:
        held = self._holders.get(h)
        if held is None:
            self._holders[h] = endpoint_id
        elif isinstance(held, str):
            if held != endpoint_id:
                self._holders[h] = {held, endpoint_id}
        else:
            held.add(endpoint_id)

    def _release(self, endpoint_id: str, h: int) -> None:
        held = self._holders.get(h)
        if held is None:
            return
        if isinstance(held, str):
            if held == endpoint_id:
                del self._holders[h]
            return
        held.discard(endpoint_id)
        if len(held) == 1:
            self._holders[h] = next(iter(held))  # back to the compact form

    def record(self, endpoint_id: str, hashes: list[int]) -> None:
        """The request with these block hashes was routed to the endpoint: insert or refresh them (and queue
        them for the other replicas when shared), then evict beyond the bound."""
        blocks = self.by_endpoint.get(endpoint_id)
        if blocks is None:
            blocks = self.by_endpoint[endpoint_id] = OrderedDict()
        now = self.now
        outbox = self._outbox
        # Deepest block first, so the prefix's root ends up most recent and LRU evicts leaves before the
        # blocks they hang from (a chain missing its root could never match anyway).
        if outbox is None:
            for h in reversed(hashes):
                if h in blocks:
                    blocks.move_to_end(h)
                else:
                    blocks[h] = now
                    self._hold(endpoint_id, h)
        else:
            stale = now - self.refresh_after
            queue = outbox.get(endpoint_id)
            if queue is None:
                queue = outbox[endpoint_id] = {}
            for h in reversed(hashes):
                stamp = blocks.get(h)
                if stamp is not None:
                    blocks.move_to_end(h)
                    if stamp > stale:
                        continue  # announced recently enough
                else:
                    self._hold(endpoint_id, h)
                blocks[h] = now
                if h not in queue:
                    if self._outbox_size < OUTBOX_LIMIT:
                        queue[h] = None
                        self._outbox_size += 1
                    else:
                        self._dropped += 1
        self._evict(endpoint_id, blocks)

    def observe(self, endpoint_id: str, matched_chars: int, prompt_chars: int) -> None:
        """A request went to the endpoint with `matched_chars` of its `prompt_chars` found in the index (the
        estimated hit rate the tuner compares with the engine's)."""
        acc = self._estimate.get(endpoint_id)
        if acc is None:
            acc = self._estimate[endpoint_id] = [0.0, 0.0, 0.0]
        acc[0] += 1
        acc[1] += matched_chars
        acc[2] += prompt_chars

    # ---- background (upkeep, sharing, tuning) --------------------------------------------------------

    def merge(self, endpoint_id: str, hashes: list[int]) -> None:
        """Blocks another replica routed to the endpoint, oldest first: inserted as most recent, not queued
        again (no echo), stamped now (they were just announced)."""
        blocks = self.by_endpoint.get(endpoint_id)
        if blocks is None:
            blocks = self.by_endpoint[endpoint_id] = OrderedDict()
        now = self.now
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                self._hold(endpoint_id, h)
            blocks[h] = now
        self._evict(endpoint_id, blocks)

    def estimate(self, endpoint_id: str) -> tuple[float, float, float]:
        """Cumulative (requests, matched chars, prompt chars) routed to the endpoint."""
        acc = self._estimate.get(endpoint_id)
        return (acc[0], acc[1], acc[2]) if acc is not None else (0.0, 0.0, 0.0)

    def bound(self, endpoint_id: str) -> int:
        return self._bound.get(endpoint_id, FALLBACK_BLOCKS)

    def factor(self, endpoint_id: str) -> float:
        return self._factor.get(endpoint_id, 1.0)

    def has_base(self, endpoint_id: str) -> bool:
        return endpoint_id in self._base

    def set_base(self, endpoint_id: str, blocks: int, reason: str) -> None:
        """The bound before tuning: configured, the fallback, or the engine's KV capacity in blocks."""
        if self._base.get(endpoint_id) != blocks:
            self._base[endpoint_id] = blocks
            self._apply(endpoint_id, reason)

    def set_factor(self, endpoint_id: str, factor: float, reason: str) -> None:
        """The tuner's multiplier of the base bound, in (0, 1]."""
        if self._factor.get(endpoint_id, 1.0) != factor:
            self._factor[endpoint_id] = factor
            self._apply(endpoint_id, reason)

    def _apply(self, endpoint_id: str, reason: str) -> None:
        base = self._base.get(endpoint_id, FALLBACK_BLOCKS)
        factor = self._factor.get(endpoint_id, 1.0)
        new = base if factor >= 1.0 else max(min(base, MIN_BLOCKS), int(base * factor))
        old = self._bound.get(endpoint_id)
        if old == new:
            return
        self._bound[endpoint_id] = new
        self.changes.append(BoundChange(endpoint_id, old, new, reason))
        blocks = self.by_endpoint.get(endpoint_id)
        if blocks is not None:
            self._evict(endpoint_id, blocks)

    def _evict(self, endpoint_id: str, blocks: OrderedDict[int, float]) -> None:
        bound = self._bound.get(endpoint_id, FALLBACK_BLOCKS)
        while len(blocks) > bound:
            self._release(endpoint_id, blocks.popitem(last=False)[0])

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Endpoints that left the fleet (the balancer tells every pool state): their blocks, bounds, tuning
        windows, estimates and queued announcements go. One only ejected or draining is still a member and keeps
        its index: it comes back with its cache warm."""
        for endpoint_id in gone:
            for h in self.by_endpoint.get(endpoint_id, ()):
                self._release(endpoint_id, h)
        for table in (self.by_endpoint, self._base, self._factor, self._bound, self._estimate, self.tuning):
            for endpoint_id in gone:
                table.pop(endpoint_id, None)
        if self._outbox is not None:
            for endpoint_id in gone:
                self._outbox_size -= len(self._outbox.pop(endpoint_id, ()))

    def size(self, endpoint_id: str) -> int:
        return len(self.by_endpoint.get(endpoint_id, ()))

    # ---- sharing ----------------------------------------------------------------------------------------

    @property
    def shared(self) -> bool:
        return self._outbox is not None

    def start_sharing(self, refresh_after: float = 300.0) -> None:
        """From now on, recorded blocks are queued for the other replicas (called by the sharing task)."""
        self.refresh_after = refresh_after
        if self._outbox is None:
            self._outbox = {}
            # What the index learnt before sharing started (the picks before the first background round) is
            # announced too, its most recent blocks first in line for the limit.
            share = OUTBOX_LIMIT // max(1, len(self.by_endpoint))
            for endpoint_id, blocks in self.by_endpoint.items():
                recent = list(blocks)[-share:]
                self._outbox[endpoint_id] = dict.fromkeys(recent)
                self._outbox_size += len(recent)

    def pending(self, limit: int) -> dict[str, list[int]]:
        """Up to `limit` queued blocks, oldest first per endpoint (left queued until `sent`)."""
        out: dict[str, list[int]] = {}
        if not self._outbox:
            return out
        room = limit
        for endpoint_id, queue in self._outbox.items():
            if room <= 0:
                break
            if not queue:
                continue
            taken: list[int] = []
            for h in queue:
                taken.append(h)
                if len(taken) >= room:
                    break
            out[endpoint_id] = taken
            room -= len(taken)
        return out

    def sent(self, batch: dict[str, list[int]]) -> None:
        """The batch from `pending` reached Redis: unqueue it."""
        if self._outbox is None:
            return
        for endpoint_id, hashes in batch.items():
            queue = self._outbox.get(endpoint_id)
            if queue is None:
                continue
            for h in hashes:
                if h in queue:
                    del queue[h]
                    self._outbox_size -= 1
            if not queue:
                del self._outbox[endpoint_id]

    def take_dropped(self) -> int:
        """Blocks not queued since the last call because the outbox was full."""
        dropped, self._dropped = self._dropped, 0
        return dropped

    @property
    def queued(self) -> int:
        return self._outbox_size


def leading_matches(held_per_block: Iterable[str | Set[str] | None]) -> dict[str, int]:
    """Given the holders of a prompt's blocks in order (one endpoint id, a set of them, or None for a block
    nobody holds), how many leading blocks each endpoint holding the first one holds: a walk narrowing the
    endpoints still matching, so it costs the blocks walked times those endpoints. Shared by the approximate
    index and the KV-event one."""
    out: dict[str, int] = {}
    live: set[str] = set()
    n = 0
    for held in held_per_block:
        if held is None:
            break
        group = {held} if isinstance(held, str) else held
        nxt = set(group) if not n else live & group
        if n and len(nxt) < len(live):
            for endpoint_id in live - nxt:
                out[endpoint_id] = n
        live = nxt
        if not live:
            return out
        n += 1
    for endpoint_id in live:
        out[endpoint_id] = n
    return out
