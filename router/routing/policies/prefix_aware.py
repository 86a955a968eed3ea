"""prefix-aware: send a request where its prompt prefix is probably still in the KV cache, unless that
endpoint is too busy; then load wins.

Intent: affinity for *content*, not for a key. Requests that share a prompt prefix (a system prompt, the
history of a multi-turn chat, a RAG context) are cheap on an engine that has already computed that
prefix's KV blocks (vLLM automatic prefix caching, SGLang's radix cache). The published gains of
cache-aware routers (SGLang router, llm-d, GKE Inference Gateway: 1.6-2.3x throughput, far lower TTFT)
come from this, and so do their failure modes: pure affinity piles a popular prefix onto one replica.

How a request is hashed (no tokenizer on the router): the prompt is rendered to text deterministically
(router/routing/prefix/prompt.py), chat `messages` as `role` + content in order (so turn n+1 of a conversation
starts with the exact text of turn n) and completions `prompt` as itself, then cut into fixed `blockChars` blocks (256
chars is about 64 tokens of English). Block i's hash is `blake2b(hash(i-1) || block i)`, a chain, so one
hash names a whole prefix, as vLLM's block hashes do. Only full blocks are hashed (engines cache only full
blocks) and at most `maxBlocks` per request, so the work per pick is bounded (64 x 256 chars = 16 KiB).

The index (router/routing/prefix/index.py): per endpoint, an LRU of the block hashes routed there, by this
router and, through Redis, by the other replicas (router/routing/prefix/sharing.py). Its bound per endpoint is the
engine's KV capacity in router blocks (`maxBlocksPerEndpoint: auto`, from `vllm:cache_config_info` via
telemetry; 32768 while unknown), or a configured number, times the tuner's factor
(router/routing/prefix/tuning.py), which shrinks it when the index claims more hits than the engine
reports. It lives in the pool state, so rebuilds keep it.

Choice, per request:

    match(e)  = number of leading request blocks present in e's index
    load(e)   = cluster in-flight at e, scaled up by 1/weight while e ramps up (slow start)
    best      = argmax match, ties to the least loaded (then at random)
    match(best) == 0                        -> least loaded             (`prefix_miss`)
    match(best) < minMatchShare x blocks    -> least loaded             (`prefix_short`)
    a guard trips                           -> least loaded             (`load_guard_<guard>`)
    otherwise                               -> best                     (`prefix_hit`)

That is `selection: longest-match` (the default). `selection: least-prefill` instead sends the request where
its first token is expected soonest, so a cached prefix is worth exactly the prefill it saves:

    uncached(e) = prompt tokens - match(e) x blockTokens   (match(e) counts only from minMatchShare up)
    wait(e)     = (pending(e) + uncached(e)) / speed(e)
    choice      = argmin wait, ties to the least loaded (then at random)

`pending(e)` is the prefill this router has sent to e that has not produced a first token yet and `speed(e)`
e's measured prefill speed in tokens/s (router/routing/prefill.py; before e is measured, the measured ones' mean per
unit of capacity weight times e's weight), times its slow-start factor. No threshold decides between
affinity and load: a hit saves its prefix's prefill, and a queue of other prompts' prefill costs the same
tokens. Guards, when
configured, leave out the endpoints whose load trips them (all of them tripping leaves out none); with
least-prefill none is configured by default, since its wait already weighs the queue.

"Least loaded" is least-connections' choice over `load(e)`, ties at random. `minMatchShare` (0.2) keeps a
match that saves little prefill from outweighing load: one block of a short system prompt that every engine
caches anyway is not worth queueing behind the few endpoints this router has already sent it to.

The guards, each optional, checked in this order (the first that trips names the event):

    in_flight    load(best) >= maxInFlight
    imbalance    load(best) - min load > maxImbalance
    load_factor  load(best) >= max(1, ceil(maxLoadFactor x (sum load + 1) / n))  (bounded loads, as in
                 consistentHash and stickiness: best may hold at most factor x the mean after this request)
    sigma        load(best) > mean load + sigmaK x stddev load

The guards keep affinity from making hotspots; a guarded request seeds its prefix on a second endpoint, so
a prefix that is hot enough to trip a guard ends up replicated and then shared by load.

The one deliberate mutation on the pick path: the picker records the chosen endpoint's block hashes in
the pool state's index (and, when shared, in its outbox for the background task), and adds to the
endpoint's estimated-hit counters. Style rule 1 says pickers never mutate routing structures; this is an
observation of where traffic went, like the `LoadView`'s in-flight counts, not a routing structure a rebuild
would replace. Pickers never do I/O and read no clock: Redis and tuning run in the background.

Cost per pick: O(prompt pieces) rendering, O(blocks) hashing, O(blocks x holders) matching (the index's
inverted table: only the endpoints holding the prompt's first blocks are visited), O(blocks) recording. An
unexplained longest-match pick reads the least loaded and the guards' minimum, count and sum from the
pool's in-flight index (router/routing/policies/load_index.py), so nothing in it scans the pool
(`_indexed_pool` says when that index sees exactly the loads compared here); otherwise, and for
least-prefill (each candidate's own queued prefill and speed), one pass over the candidates (a lighter one,
`_least_prefill_quick`, for unexplained picks with no guard and the approximate index).
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from router.config.durations import parse_duration
from router.model import EndpointView, RequestInfo
from router.routing.policies.base import (
    DecisionTrace,
    EventSink,
    Explained,
    LoadView,
    PolicyConfigError,
    Sentence,
    capacity_scale,
    fmt,
    integer_param,
    listed,
    number_param,
    pool_index,
    reject_unknown,
    scaled_load,
)
from router.routing.policies.load_index import LoadIndex
from router.routing.prefix.index import FALLBACK_BLOCKS, MIN_BLOCKS, PrefixIndex
from router.routing.prefix.kv_block_index import KVBlockIndex, chain_keys, request_token_ids
from router.routing.prefix.prompt import prompt_length, prompt_pieces
from router.routing.prefix.tuning import TuningConfig

CHARS_PER_TOKEN = 4  # English text in Llama-3-class BPE vocabularies; sizing only, so a rough figure
SELECTIONS = ("longest-match", "least-prefill")
INDEXES = ("approximate", "precise")
# More holders of a prompt's longest match than this: first ask whether the whole pool holds it (one set
# intersection) before comparing the holders' loads one by one.
WHOLE_POOL_CHECK = 32
MAX_AUTO_BLOCKS = 1 << 20  # ~150 MB per endpoint: the most `auto` sizes an index to, whatever the engine says


@dataclass(frozen=True)
class SharingConfig:
    """Sharing the index with the other router replicas through Redis (only when Redis is configured)."""

    enabled: bool = True
    # How long a shared entry lives (Redis stream trimming, and the warm-up horizon of a new replica). A busy
    # engine turns its cache over in about capacity / new-token rate: 436k tokens at 1-8k new tokens/s is
    # 1-7 minutes, so after 10 minutes an entry is mostly gone from any engine doing work; an idle engine
    # keeps it longer, but then a replica missing it costs at most one miss per prefix.
    ttl: float = 600.0
    max_stream_entries: int = 8192  # per pool: at most 8192 x 8 KiB = 64 MiB in Redis, usually far less


@dataclass(frozen=True)
class PrefixAwareConfig:
    block_chars: int = 256  # ~64 tokens of English at ~4 chars/token
    max_blocks: int = 64  # hashed per request: 16 KiB of prompt text at the default block size
    # "auto": the engine's KV capacity (telemetry) in router blocks; an integer fixes the bound.
    max_blocks_per_endpoint: int | str = "auto"
    # The best match must cover this share of the request's hashed blocks to count: below it, load wins. In
    # the policy lab (docs/benchmarks.md, "No sharing") 0.2 kept up with least-connections where prompts share
    # only a short system prompt (P99 TTFT 630 vs 604 ms at 0.9 load; any match at all, 0: 661 ms) and kept
    # the multi-turn and shared-context gains, whose matches cover most of the prompt.
    min_match_share: float = 0.2
    max_imbalance: int | None = 8  # load(best) - min load above this: load wins
    max_in_flight: int | None = None  # load(best) at or above this: load wins
    max_load_factor: float | None = None  # load(best) above factor x the mean (bounded loads): load wins
    sigma_k: float | None = None  # load(best) above mean + k x stddev: load wins
    # longest-match: the longest cached prefix unless a guard trips; least-prefill: the soonest expected first
    # token (queued and uncached prefill over measured speed).
    selection: str = "longest-match"
    # approximate: where this router (and its peers) sent each prefix; precise: what each engine's KV events
    # say it holds (router/routing/prefix/kv_events.py), the approximate index answering for engines without events.
    index: str = "approximate"
    sharing: SharingConfig = field(default_factory=SharingConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)

    @property
    def block_tokens(self) -> float:
        return self.block_chars / CHARS_PER_TOKEN


# ---- hashing ----------------------------------------------------------------------------------------


def prompt_blocks(body: Mapping[str, Any], block_chars: int, max_blocks: int) -> tuple[list[int], int]:
    """Chained hashes of the first full `block_chars`-sized blocks of the rendered prompt (at most
    `max_blocks`), and the length of the whole prompt's text in chars. Stable across processes (blake2b,
    not Python's salted `hash`). Rendering stops once the blocks are covered; the rest is only measured
    (router/routing/prefix/prompt.py `prompt_length`), so a huge prompt or a multi-megabyte image part costs no
    rendering."""
    limit = block_chars * max_blocks
    parts: list[str] = []
    rendered = 0
    for piece in prompt_pieces(body):
        parts.append(piece)
        rendered += len(piece)
        if rendered >= limit:
            break
    text = "".join(parts)[:limit]
    size = max(rendered, prompt_length(body)) if rendered >= limit else rendered
    hashes: list[int] = []
    parent = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        digest = hashlib.blake2b(parent + text[start:start + block_chars].encode("utf-8", "surrogatepass"),
                                 digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        parent = digest
    return hashes, size


def block_hashes(body: Mapping[str, Any], block_chars: int, max_blocks: int) -> list[int]:
    return prompt_blocks(body, block_chars, max_blocks)[0]


# ---- sizing -----------------------------------------------------------------------------------------


def size_index(index: PrefixIndex, views: tuple[EndpointView, ...], config: PrefixAwareConfig) -> None:
    """Each endpoint's base bound: configured, or its engine's KV capacity in router blocks. A capacity that
    is unknown now (stale telemetry) keeps the last one known; never known gives the fallback."""
    for view in views:
        if isinstance(config.max_blocks_per_endpoint, int):
            index.set_base(view.id, config.max_blocks_per_endpoint, "config")
            continue
        capacity = view.telemetry.kv_capacity_tokens if view.telemetry is not None else None
        if capacity is not None:
            blocks = min(MAX_AUTO_BLOCKS, max(MIN_BLOCKS, int(capacity / config.block_tokens)))
            index.set_base(view.id, blocks, "kv_capacity")
        elif not index.has_base(view.id):
            index.set_base(view.id, FALLBACK_BLOCKS, "fallback")


# ---- picker -----------------------------------------------------------------------------------------


def _load(view: EndpointView, loads: LoadView) -> float:
    return scaled_load(view, float(loads.cluster_in_flight(view.id)))  # per unit of capacity, as least_loaded


class GuardSettings(Protocol):
    """The load guards, as prefix-aware's config and composite's `loadGuard` both carry them."""

    max_in_flight: int | None
    max_imbalance: int | None
    max_load_factor: float | None
    sigma_k: float | None


@dataclass(frozen=True, slots=True)
class GuardLimits:
    """The guards' thresholds for one pick's loads, computed once (a composite filter tests every candidate
    against the same ones)."""

    in_flight: float | None
    imbalance_over: float | None  # min load + maxImbalance
    load_factor: float | None
    sigma: float | None

    @classmethod
    def of(cls, load: Mapping[str, float], c: GuardSettings) -> GuardLimits:
        n = len(load)
        total = sum(load.values())
        sigma = None
        if c.sigma_k is not None:
            mean = total / n
            sigma = mean + c.sigma_k * math.sqrt(sum((x - mean) ** 2 for x in load.values()) / n)
        return cls.of_stats(n, total, min(load.values()), c, sigma=sigma)

    @classmethod
    def of_stats(cls, n: int, total: float, least: float, c: GuardSettings, *,
                 sigma: float | None = None) -> GuardLimits:
        """The limits from the loads' count, sum and minimum (what an indexed pick knows without a scan);
        `sigma` (mean + sigmaK x stddev) only when the caller computed it."""
        return cls(
            in_flight=c.max_in_flight,
            imbalance_over=least + c.max_imbalance if c.max_imbalance is not None else None,
            load_factor=max(1, math.ceil(c.max_load_factor * (total + 1) / n)) if c.max_load_factor is not None
            else None,
            sigma=sigma,
        )

    def tripped(self, value: float) -> str | None:
        """The first guard a load of `value` trips (its event name), or None."""
        if self.in_flight is not None and value >= self.in_flight:
            return "load_guard_in_flight"
        if self.imbalance_over is not None and value > self.imbalance_over:
            return "load_guard_imbalance"
        if self.load_factor is not None and value >= self.load_factor:
            return "load_guard_load_factor"
        if self.sigma is not None and value > self.sigma:
            return "load_guard_sigma"
        return None


def tripped_guard(best_load: float, load: Mapping[str, float], config: GuardSettings) -> str | None:
    """The first load guard the best match trips (its event name), or None: affinity holds."""
    c = config
    if c.max_in_flight is None and c.max_imbalance is None and c.max_load_factor is None and c.sigma_k is None:
        return None
    return GuardLimits.of(load, c).tripped(best_load)


def guard_report(best_load: float, load: Mapping[str, float], config: PrefixAwareConfig) -> dict[str, dict[str, Any]]:
    """For an explanation: each configured guard's value for the best match, its limit and whether it trips,
    by the formulas of `tripped_guard` (which the pick path keeps lean; tests hold the two together). The
    first guard that trips, in this order, is the one `tripped_guard` names."""
    c = config
    out: dict[str, dict[str, Any]] = {}
    if c.max_in_flight is not None:
        out["in_flight"] = {"value": best_load, "limit": c.max_in_flight, "tripped": best_load >= c.max_in_flight}
    if c.max_imbalance is not None:
        spread = best_load - min(load.values())
        out["imbalance"] = {"value": spread, "limit": c.max_imbalance, "tripped": spread > c.max_imbalance}
    n = len(load)
    total = sum(load.values())
    if c.max_load_factor is not None:
        limit = max(1, math.ceil(c.max_load_factor * (total + 1) / n))
        out["load_factor"] = {"value": best_load, "limit": limit, "tripped": best_load >= limit}
    if c.sigma_k is not None:
        mean = total / n
        sigma = math.sqrt(sum((x - mean) ** 2 for x in load.values()) / n)
        limit_sigma = mean + c.sigma_k * sigma
        out["sigma"] = {"value": best_load, "limit": limit_sigma, "tripped": best_load > limit_sigma}
    return out


def uncached_tokens(prompt_chars: int, matched: int, blocks: int, config: PrefixAwareConfig) -> float:
    """The prompt tokens an endpoint holding `matched` of the request's `blocks` hashed blocks still has to
    compute, as least-prefill counts them: a match under minMatchShare saves nothing."""
    counted = matched if matched >= config.min_match_share * blocks else 0
    return max(0.0, prompt_chars / CHARS_PER_TOKEN - counted * config.block_tokens)


def remember(index: PrefixIndex, endpoint_id: str, hashes: list[int], prompt_chars: int, matched: int,
             block_chars: int) -> None:
    """What a prefix index learns from a request sent to an endpoint: the share of its prompt the index said
    was cached there (for the tuner's estimate), then its blocks, now cached there."""
    if prompt_chars:
        index.observe(endpoint_id, min(matched * block_chars, prompt_chars), prompt_chars)
    if hashes:
        index.record(endpoint_id, hashes)


class Matcher:
    """One pick's match counts, in the approximate index's blocks (`prompt_blocks`), so every selection rule and
    guard reads them alike. With `index: precise`, an engine whose KV events are complete answers from the
    KV-event index on the request's token ids (when the router knows them: router/routing/prefix/kv_block_index.py);
    its matched tokens become the same share of the prompt in router blocks. Every other engine, and every
    request whose token ids are unknown, answers from the approximate index."""

    __slots__ = ("_index", "_hashes", "_prompt_chars", "_block_chars", "_engine", "_tokens", "_keys", "_table",
                 "sources")

    MAX_KEYS = 4096  # engine blocks keyed per pick: 64k tokens at vLLM's GPU block size of 16

    def __init__(self, index: PrefixIndex, hashes: list[int], prompt_chars: int, body: Mapping[str, Any],
                 config: PrefixAwareConfig) -> None:
        self._index = index
        self._hashes = hashes
        self._prompt_chars = prompt_chars
        self._block_chars = config.block_chars
        engine = index.engine_blocks if config.index == "precise" else None
        self._engine: KVBlockIndex | None = engine
        self._tokens = request_token_ids(body, engine.tokenize) if engine is not None and hashes else None
        self._keys: dict[int, dict[str, int]] = {}  # engine block size -> the KV-event index's holders of the prompt
        self._table: dict[str, int] | None = None  # the approximate index's holders of the prompt, when first asked
        self.sources: dict[str, str] = {}  # endpoint -> events | approximate (only with index: precise)

    def approximate(self) -> dict[str, int]:
        """The approximate index's match of every endpoint holding the prompt's first block (one walk of the
        inverted index; an endpoint absent matches nothing)."""
        table = self._table
        if table is None:
            table = self._table = self._index.holders(self._hashes) if self._hashes else {}
        return table

    def __call__(self, endpoint_id: str) -> int:
        if not self._hashes:
            return 0
        engine = self._engine
        if engine is None:
            return self.approximate().get(endpoint_id, 0)
        tokens = self._tokens
        if tokens and engine.is_precise(endpoint_id):
            self.sources[endpoint_id] = "events"
            size = engine.block_size(endpoint_id)
            if size is None:  # complete events, none stored yet: it holds nothing
                return 0
            held = self._keys.get(size)
            if held is None:
                held = self._keys[size] = engine.matches(chain_keys(tokens, size, self.MAX_KEYS))
            share = held.get(endpoint_id, 0) * size / len(tokens)
            return min(len(self._hashes), int(share * self._prompt_chars / self._block_chars))
        self.sources[endpoint_id] = "approximate"
        return self.approximate().get(endpoint_id, 0)

    def event(self) -> str | None:
        """index_precise when every candidate matched on events, index_approximate when any did not."""
        if self._engine is None:
            return None
        return "index_precise" if self.sources and all(s == "events" for s in self.sources.values()) \
            else "index_approximate"

    def explain(self, trace: DecisionTrace) -> None:
        for endpoint_id, source in self.sources.items():
            trace.note(endpoint_id, index=source)
        if self._engine is not None:
            trace.detail["index"] = "precise"
            trace.detail["token_ids_known"] = self._tokens is not None


class PrefixAwarePicker:
    __slots__ = ("_views", "_index", "_config", "_rng", "_events", "_by_id", "_ids", "_unit_scale")

    def __init__(
        self,
        views: tuple[EndpointView, ...],
        index: PrefixIndex,
        config: PrefixAwareConfig,
        rng: random.Random,
        events: EventSink,
    ) -> None:
        self._views = views
        self._index = index
        self._config = config
        self._rng = rng
        self._events = events
        self._by_id = {v.id: v for v in views}
        self._ids = frozenset(self._by_id)
        self._unit_scale = all(capacity_scale(v) == 1.0 for v in views)

    def pick(
        self, req: RequestInfo, loads: LoadView, exclude: frozenset[str], trace: DecisionTrace | None = None
    ) -> EndpointView | None:
        if trace is None and self._config.selection == "longest-match":
            pool = self._indexed_pool(loads)
            if pool is not None:
                return self._pick_indexed(req, loads, exclude, pool)
        candidates = [v for v in self._views if v.id not in exclude] if exclude else list(self._views)
        if not candidates:
            return None
        c = self._config
        index = self._index
        hashes, prompt_chars = prompt_blocks(req.body, c.block_chars, c.max_blocks)
        match = Matcher(index, hashes, prompt_chars, req.body, c)
        if c.selection == "least-prefill" and trace is None and not self._guarded() and match.event() is None:
            return self._least_prefill_quick(req, loads, candidates, hashes, prompt_chars, match)
        load = {v.id: _load(v, loads) for v in candidates}
        if c.selection == "least-prefill":
            return self._least_prefill(req, loads, candidates, hashes, prompt_chars, load, trace, match)
        best: list[EndpointView] = []
        best_match, best_load = 0, 0.0
        if hashes:
            for view in candidates:
                m = match(view.id)
                if trace is not None:
                    trace.note(view.id, match_blocks=m)
                if m == 0 or m < best_match:
                    continue
                if m > best_match or load[view.id] < best_load:
                    best, best_match, best_load = [view], m, load[view.id]
                elif load[view.id] == best_load:
                    best.append(view)
        if trace is not None:
            for view in candidates:
                trace.note(view.id, cluster_in_flight=loads.cluster_in_flight(view.id), load=load[view.id])
            trace.detail.update(blocks_hashed=len(hashes), block_chars=c.block_chars, prompt_chars=prompt_chars,
                                best_match_blocks=best_match, best=listed(v.id for v in best))
        if not best or best_match < c.min_match_share * len(hashes):
            reason = "prefix_short" if best else "prefix_miss"
            self._events(reason)
            choice = self._least_loaded(candidates, load, trace)
            matched = match(choice.id) if best else 0
            if trace is not None:
                trace.reason = reason
                trace.detail["min_match_share"] = c.min_match_share
        else:
            guard = tripped_guard(best_load, load, c)
            if guard is not None:
                self._events(guard)
                choice = self._least_loaded(candidates, load, trace)
                matched = best_match if choice in best else match(choice.id)
                if trace is not None:
                    trace.reason = guard
            else:
                self._events("prefix_hit")
                choice = best[0] if len(best) == 1 else self._rng.choice(best)
                matched = best_match
                if trace is not None:
                    trace.reason = "prefix_hit"
            if trace is not None:
                trace.detail["guards"] = guard_report(best_load, load, c)
        self._index_event(match, trace)
        remember(index, choice.id, hashes, prompt_chars, matched, c.block_chars)
        return choice

    def _indexed_pool(self, loads: LoadView) -> LoadIndex | None:
        """The pool's in-flight index when an unexplained longest-match pick can use it instead of scanning:
        the loads it orders are the loads this policy compares (no other replica holds requests in the pool:
        their counts are not in it), and every configured guard's limit follows from the count, sum and minimum
        of the loads (not sigmaK's standard deviation; maxLoadFactor's sum only at unit capacity scales, where
        a load is its in-flight count). Otherwise None: the pick scans."""
        c = self._config
        if c.sigma_k is not None or (c.max_load_factor is not None and not self._unit_scale):
            return None
        if c.index == "precise" and self._index.engine_blocks is not None:
            return None  # which engines answer from events is per endpoint: the scan (Matcher) decides
        if len(self._by_id) != len(self._views):
            return None
        pool = pool_index(loads, self._views)
        if pool is None:
            return None
        others = getattr(loads, "others", None)
        if others is None or pool.cluster_total(others) != pool.total:
            return None
        return pool

    def _pick_indexed(self, req: RequestInfo, loads: LoadView, exclude: frozenset[str],
                      pool: LoadIndex) -> EndpointView | None:
        """`pick` (longest-match) without a scan of the pool: the endpoints holding the prompt's longest match come
        from the inverted prefix index, the least loaded and the guards' minimum and sum from the pool's
        in-flight index. The same choice as the scan (ties broken at random, by other draws)."""
        c = self._config
        by_id = self._by_id
        closed = [e for e in exclude if e in by_id] if exclude else []
        n = len(by_id) - len(closed)
        if n <= 0:
            return None
        hashes, prompt_chars = prompt_blocks(req.body, c.block_chars, c.max_blocks)
        index = self._index
        # Usually the endpoints holding the longest match are candidates: only they are compared. When none
        # is (excluded, or not serving now), every holder's match is needed.
        depth, deepest = index.longest(hashes) if hashes else (0, frozenset())
        least: EndpointView | None = None
        least_load = 0.0
        if len(deepest) > WHOLE_POOL_CHECK and len(self._ids & deepest) - sum(e in deepest for e in closed) == n:
            # Every candidate holds the longest match (a system prompt the whole pool has seen): the best of them
            # is the least loaded candidate, ties at random, as the scan would tie them.
            least, least_load, _ = pool.least(exclude, self._rng)
            best, best_match, best_load = [least] if least is not None else [], depth, least_load
        else:
            best, best_match, best_load = self._best([(e, depth) for e in deepest], loads, exclude)
        if deepest and not best:
            best, best_match, best_load = self._best(index.holders(hashes).items(), loads, exclude)
        choice: EndpointView | None
        if not best or best_match < c.min_match_share * len(hashes):
            self._events("prefix_short" if best else "prefix_miss")
            choice = pool.least(exclude, self._rng)[0]
        else:
            guard = None
            if c.max_in_flight is not None or c.max_imbalance is not None or c.max_load_factor is not None:
                if least is None:
                    least, least_load, _ = pool.least(exclude, self._rng)
                total = float(pool.total - sum(pool.count(e) for e in closed)) if c.max_load_factor is not None \
                    else 0.0
                guard = GuardLimits.of_stats(n, total, least_load, c).tripped(best_load)
            if guard is not None:
                self._events(guard)
                choice = least
            else:
                self._events("prefix_hit")
                choice = best[0] if len(best) == 1 else self._rng.choice(best)
        assert choice is not None  # n > 0 endpoints outside `exclude`, so the index has one
        matched = best_match if choice in best else index.matched(choice.id, hashes)
        remember(index, choice.id, hashes, prompt_chars, matched, c.block_chars)
        return choice

    def _best(self, matches: Iterable[tuple[str, int]], loads: LoadView,
              exclude: frozenset[str]) -> tuple[list[EndpointView], int, float]:
        """Among (endpoint, match) pairs, the candidates of the longest match, ties to the least load: the scan's
        `best`, its match and load."""
        by_id = self._by_id
        best: list[EndpointView] = []
        best_match, best_load = 0, 0.0
        for endpoint_id, m in matches:
            view = by_id.get(endpoint_id)
            if view is None or m < best_match or endpoint_id in exclude:
                continue
            load = _load(view, loads)
            if m > best_match or load < best_load:
                best, best_match, best_load = [view], m, load
            elif load == best_load:
                best.append(view)
        return best, best_match, best_load

    def _index_event(self, match: Matcher, trace: DecisionTrace | None) -> None:
        event = match.event()
        if event is not None:
            self._events(event)
        if trace is not None:
            match.explain(trace)

    def _least_prefill(
        self, req: RequestInfo, loads: LoadView, candidates: list[EndpointView], hashes: list[int],
        prompt_chars: int, load: dict[str, float], trace: DecisionTrace | None, match: Matcher,
    ) -> EndpointView:
        """`selection: least-prefill`: the candidate where the request's first token is expected soonest."""
        c = self._config
        index = self._index
        tokens = prompt_chars / CHARS_PER_TOKEN
        guarded: dict[str, str | None] | None = None
        allowed = {v.id for v in candidates}
        if c.max_in_flight is not None or c.max_imbalance is not None or c.max_load_factor is not None \
                or c.sigma_k is not None:
            limits = GuardLimits.of(load, c)
            guarded = {v.id: limits.tripped(load[v.id]) for v in candidates}
            allowed = {i for i, tripped in guarded.items() if tripped is None} or allowed
        measured = {v.id: loads.prefill_speed(v.id) for v in candidates}
        # An unmeasured endpoint counts at the measured ones' mean speed per unit of capacity weight.
        known = [x / v.endpoint.weight for v in candidates if (x := measured[v.id])]
        default = sum(known) / len(known) if known else 1.0
        shortest = c.min_match_share * len(hashes)
        raw: dict[str, int] = {}
        best: list[EndpointView] = []
        best_key = (math.inf, math.inf)
        for view in candidates:
            m = raw[view.id] = match(view.id)
            if trace is not None:
                trace.note(view.id, match_blocks=m)
            if view.id not in allowed:
                continue
            uncached = uncached_tokens(prompt_chars, m, len(hashes), c)
            speed = (measured[view.id] or default * view.endpoint.weight) * view.weight_factor
            pending = loads.pending_prefill(view.id)
            wait = (pending + uncached) / speed if speed > 0.0 else math.inf
            if trace is not None:
                trace.note(view.id, uncached_tokens=round(uncached, 1), pending_prefill=round(pending, 1),
                           prefill_speed=round(measured[view.id], 1) if measured[view.id] else None,
                           speed_used=round(speed, 1), expected_wait_ms=round(wait * 1000, 3))
            key = (wait, load[view.id])
            if key < best_key:
                best, best_key = [view], key
            elif key == best_key:
                best.append(view)
        choice = best[0] if len(best) == 1 else self._rng.choice(best)
        top = max(raw.values())
        matched = raw[choice.id] if raw[choice.id] >= shortest else 0
        # Endpoints holding the longest match, when it counts.
        holders = [v.id for v in candidates if raw[v.id] == top] if top and top >= shortest else []
        if matched:
            event = "prefix_hit"
        elif holders and guarded is not None and all(i not in allowed for i in holders):
            event = guarded[holders[0]] or "prefix_outweighed"  # a guard left every holder out
        elif holders:
            event = "prefix_outweighed"
        else:
            event = "prefix_short" if top else "prefix_miss"
        self._events(event)
        req.note.prefill_tokens = uncached_tokens(prompt_chars, matched, len(hashes), c)
        if trace is not None:
            for view in candidates:
                trace.note(view.id, cluster_in_flight=loads.cluster_in_flight(view.id), load=load[view.id])
                if guarded is not None and view.id not in allowed:
                    trace.note(view.id, guard=guarded[view.id])
            trace.reason = "least_prefill"
            trace.detail.update(selection="least-prefill", event=event, blocks_hashed=len(hashes),
                                block_chars=c.block_chars, prompt_chars=prompt_chars, prompt_tokens=round(tokens, 1),
                                best_match_blocks=top, min_match_share=c.min_match_share,
                                default_speed=round(default, 1) if known else None)
            if len(best) > 1:
                trace.detail["tied"] = len(best)
                trace.detail["tied_with"] = listed(v.id for v in best)
        self._index_event(match, trace)
        remember(index, choice.id, hashes, prompt_chars, raw[choice.id], c.block_chars)
        return choice

    def _guarded(self) -> bool:
        c = self._config
        return c.max_in_flight is not None or c.max_imbalance is not None or c.max_load_factor is not None \
            or c.sigma_k is not None

    def _least_prefill_quick(
        self, req: RequestInfo, loads: LoadView, candidates: list[EndpointView], hashes: list[int],
        prompt_chars: int, match: Matcher,
    ) -> EndpointView:
        """`_least_prefill` for an unexplained pick with no guard and the approximate index: the same choice, the
        same random draw and event, with less work per candidate (the holders' matches read once from the
        inverted index, every non-holder's uncached tokens computed once, a load read only for a candidate that
        ties or beats the best wait). Still one pass over the candidates; tests/test_least_prefill_quick.py
        checks it against the explained pick on seeded random fleets."""
        c = self._config
        held = match.approximate()
        blocks = len(hashes)
        speed_of = loads.prefill_speed
        measured = {v.id: x for v in candidates if (x := speed_of(v.id))}
        known = [measured[v.id] / v.endpoint.weight for v in candidates if v.id in measured]
        default = sum(known) / len(known) if known else 1.0
        full = uncached_tokens(prompt_chars, 0, blocks, c)
        pending_of = loads.pending_prefill
        best: list[EndpointView] = []
        best_wait, best_load = math.inf, math.inf
        for view in candidates:
            m = held.get(view.id, 0) if held else 0
            uncached = uncached_tokens(prompt_chars, m, blocks, c) if m else full
            speed = (measured.get(view.id) or default * view.endpoint.weight) * view.weight_factor
            wait = (pending_of(view.id) + uncached) / speed if speed > 0.0 else math.inf
            if wait > best_wait:
                continue
            load = _load(view, loads)
            if wait < best_wait or load < best_load:
                best, best_wait, best_load = [view], wait, load
            elif load == best_load:
                best.append(view)
        choice = best[0] if len(best) == 1 else self._rng.choice(best)
        open_ids = {v.id for v in candidates} if len(held) > 0 else set()
        top = max((m for e, m in held.items() if e in open_ids), default=0)
        shortest = c.min_match_share * blocks
        chosen = held.get(choice.id, 0)
        matched = chosen if chosen >= shortest else 0
        if matched:
            event = "prefix_hit"
        elif top and top >= shortest:
            event = "prefix_outweighed"
        else:
            event = "prefix_short" if top else "prefix_miss"
        self._events(event)
        req.note.prefill_tokens = uncached_tokens(prompt_chars, matched, blocks, c)
        remember(self._index, choice.id, hashes, prompt_chars, chosen, c.block_chars)
        return choice

    def observe(self, req: RequestInfo, view: EndpointView) -> None:
        """A request went to `view` without a pick (a session's pinned endpoint): its blocks are there now."""
        c = self._config
        hashes, prompt_chars = prompt_blocks(req.body, c.block_chars, c.max_blocks)
        matched = Matcher(self._index, hashes, prompt_chars, req.body, c)(view.id)
        if c.selection == "least-prefill":
            req.note.prefill_tokens = uncached_tokens(prompt_chars, matched, len(hashes), c)
        remember(self._index, view.id, hashes, prompt_chars, matched, c.block_chars)

    def _least_loaded(
        self, candidates: list[EndpointView], load: dict[str, float], trace: DecisionTrace | None
    ) -> EndpointView:
        """The least loaded candidate, ties at random: least-connections' choice, so that with nothing worth
        matching this strategy loses nothing to it. (Power of two choices was the first fallback: in the policy
        lab the prefix-heavy scenario's P99 TTFT was 1,111 ms with it and 778 ms with this, because it
        scattered the guarded requests of a hot prefix over random replicas instead of growing its copies on
        the idlest ones.)"""
        least = min(load[v.id] for v in candidates)
        tied = [v for v in candidates if load[v.id] == least]
        choice = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        if trace is not None:
            trace.detail["fallback"] = "least_loaded"
            if len(tied) > 1:  # broken at random, as least_loaded's explanation says it
                trace.detail["tied"] = len(tied)
                trace.detail["tied_with"] = listed(v.id for v in tied)
        return choice


# ---- parsing ----------------------------------------------------------------------------------------


def _duration(params: Mapping[str, Any], field: str, default: float, *, minimum: float, where: str) -> float:
    value = params.get(field, default)
    seconds = parse_duration(value)
    if seconds is None or seconds < minimum:
        raise PolicyConfigError(where + field, f"must be a duration of at least {minimum:g}s (like 10m, 30s or "
                                               f"500ms), got {value!r}")
    return seconds


def _boolean(params: Mapping[str, Any], field: str, default: bool, *, where: str) -> bool:
    value = params.get(field, default)
    if not isinstance(value, bool):
        raise PolicyConfigError(where + field, f"must be true or false, got {value!r}")
    return value


def _block(params: Mapping[str, Any], field: str, known: set[str]) -> Mapping[str, Any]:
    block = params.get(field)
    if block is None:
        return {}
    if not isinstance(block, Mapping):
        raise PolicyConfigError(field, f"must be a mapping, got {block!r}")
    try:
        reject_unknown(block, known)
    except PolicyConfigError as exc:
        raise PolicyConfigError(f"{field}.{exc.field}", exc.message) from None
    return block


def _sharing(params: Mapping[str, Any]) -> SharingConfig:
    block = _block(params, "sharing", {"enabled", "ttl", "maxStreamEntries"})
    d = SharingConfig()
    entries = integer_param(block, "maxStreamEntries", d.max_stream_entries, minimum=16, maximum=1_000_000,
                       where="sharing.")
    assert entries is not None
    return SharingConfig(enabled=_boolean(block, "enabled", d.enabled, where="sharing."),
                         ttl=_duration(block, "ttl", d.ttl, minimum=1.0, where="sharing."),
                         max_stream_entries=entries)


def _tuning(params: Mapping[str, Any]) -> TuningConfig:
    block = _block(params, "tuning", {"enabled", "window", "tolerance"})
    d = TuningConfig()
    tolerance = number_param(block, "tolerance", d.tolerance, minimum=0.0, exclusive=True, maximum=1.0, where="tuning.")
    assert tolerance is not None
    return TuningConfig(enabled=_boolean(block, "enabled", d.enabled, where="tuning."),
                        window=_duration(block, "window", d.window, minimum=0.1, where="tuning."),
                        tolerance=tolerance)


def _bound(params: Mapping[str, Any]) -> int | str:
    value = params.get("maxBlocksPerEndpoint", "auto")
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 10_000_000:
        raise PolicyConfigError("maxBlocksPerEndpoint",
                                f"must be auto or an integer between 1 and 10000000, got {value!r}")
    return value


def _prefix_miss(e: Explained) -> str:
    d = e.detail
    why = (f"no endpoint holds the prompt's first block ({d.get('blocks_hashed')} hashed)" if d.get("blocks_hashed")
           else "the prompt is shorter than one block, nothing to match")
    return why + f"; the least loaded ({fmt(e.chosen.get('load'))})"


def _least_prefill(e: Explained) -> str:
    d, mine = e.detail, e.chosen
    return (f"the soonest expected first token of {e.candidates} candidates: ({fmt(mine.get('pending_prefill'))} "
            f"tokens queued + {fmt(mine.get('uncached_tokens'))} uncached, {mine.get('match_blocks')} of "
            f"{d.get('blocks_hashed')} blocks cached) / {fmt(mine.get('speed_used'))} tokens/s = "
            f"{fmt(mine.get('expected_wait_ms'))} ms ({d.get('event')})"
            + (f", a tie of {d['tied']} broken by load, then at random" if d.get("tied") else ""))


def _load_guard(e: Explained, name: str) -> str:
    d = e.detail
    guard = d.get("guards", {}).get(name, {})
    return (f"the best prefix match ({', '.join(d.get('best', []))}, {d.get('best_match_blocks')} blocks) "
            f"tripped the {name} guard ({fmt(guard.get('value'))} against a limit of {fmt(guard.get('limit'))}); "
            f"the least loaded ({fmt(e.chosen.get('load'))})")


REASONS: dict[str, Sentence] = {
    "prefix_hit": lambda e: (f"longest cached prefix ({e.chosen.get('match_blocks')} of "
                             f"{e.detail.get('blocks_hashed')} blocks) and no load guard tripped"),
    "prefix_miss": _prefix_miss,
    "prefix_short": lambda e: (
        f"the longest cached prefix ({e.detail.get('best_match_blocks')} of {e.detail.get('blocks_hashed')} "
        f"blocks) is under minMatchShare ({fmt(e.detail.get('min_match_share'))}) of the prompt; "
        f"the least loaded ({fmt(e.chosen.get('load'))})"),
    "least_prefill": _least_prefill,
    **{f"load_guard_{name}": lambda e, name=name: _load_guard(e, name)
       for name in ("in_flight", "imbalance", "load_factor", "sigma")},  # GuardLimits.tripped's names
}


class PrefixAwarePolicy:
    name = "prefix-aware"
    config_key = "prefixAware"
    reasons = REASONS

    def parse(self, params: Mapping[str, Any]) -> PrefixAwareConfig:
        reject_unknown(params, {"blockChars", "maxBlocks", "maxBlocksPerEndpoint", "minMatchShare", "maxImbalance",
                                "maxInFlight", "maxLoadFactor", "sigmaK", "selection", "index", "sharing", "tuning"})
        d = PrefixAwareConfig()
        selection = params.get("selection", d.selection)
        if selection not in SELECTIONS:
            raise PolicyConfigError("selection", f"must be one of {', '.join(SELECTIONS)}, got {selection!r}")
        index = params.get("index", d.index)
        if index not in INDEXES:
            raise PolicyConfigError("index", f"must be one of {', '.join(INDEXES)}, got {index!r}")
        # least-prefill's wait already weighs the queue: no imbalance guard unless one is asked for
        imbalance_default = d.max_imbalance if selection == "longest-match" else None
        block_chars = integer_param(params, "blockChars", d.block_chars, minimum=16, maximum=65536)
        max_blocks = integer_param(params, "maxBlocks", d.max_blocks, minimum=1, maximum=4096)
        min_share = number_param(params, "minMatchShare", d.min_match_share, minimum=0.0, maximum=1.0)
        assert block_chars is not None and max_blocks is not None and min_share is not None
        return PrefixAwareConfig(
            block_chars=block_chars,
            max_blocks=max_blocks,
            max_blocks_per_endpoint=_bound(params),
            min_match_share=min_share,
            max_imbalance=integer_param(params, "maxImbalance", imbalance_default, minimum=0, nullable=True),
            max_in_flight=integer_param(params, "maxInFlight", d.max_in_flight, minimum=1, nullable=True),
            max_load_factor=number_param(params, "maxLoadFactor", d.max_load_factor, minimum=1.0, nullable=True),
            sigma_k=number_param(params, "sigmaK", d.sigma_k, minimum=0.0, exclusive=True, nullable=True),
            selection=selection,
            index=index,
            sharing=_sharing(params),
            tuning=_tuning(params),
        )

    def new_state(self) -> PrefixIndex:
        return PrefixIndex()

    def build(
        self,
        views: tuple[EndpointView, ...],
        config: PrefixAwareConfig,
        state: PrefixIndex,
        rng: random.Random,
        events: EventSink,
    ) -> PrefixAwarePicker:
        size_index(state, views, config)
        return PrefixAwarePicker(views, state, config, rng, events)
