"""prefix-aware: send a request where its prompt prefix is probably still in the KV cache, unless that
endpoint is too busy; then load wins.

Intent: affinity for *content*, not for a key. Requests that share a prompt prefix (a system prompt, the
history of a multi-turn chat, a RAG context) are cheap on an engine that has already computed that
prefix's KV blocks (vLLM automatic prefix caching, SGLang's radix cache). The published gains of
cache-aware routers (SGLang router, llm-d, GKE Inference Gateway: 1.6-2.3x throughput, far lower TTFT)
come from this, and so do their failure modes: pure affinity piles a popular prefix onto one replica.

How a request is hashed (no tokenizer on the router): the prompt is rendered to text deterministically,
chat `messages` as `role` + content in order (so turn n+1 of a conversation starts with the exact text of
turn n) and completions `prompt` as itself, then cut into fixed `blockChars` blocks (256 chars is about 64
tokens of English). Block i's hash is `blake2b(hash(i-1) || block i)`, a chain, so one hash names a whole
prefix, as vLLM's block hashes do. Only full blocks are hashed (engines cache only full blocks) and at
most `maxBlocks` per request, so the work per pick is bounded (64 x 256 chars = 16 KiB of text).

The index: per endpoint, the block hashes this router has sent there, an LRU of at most
`maxBlocksPerEndpoint` entries (an approximation of the engine's cache: the engine evicts too, and we do
not see it). It lives in the pool state, so rebuilds keep it; the indices of endpoints that left the pool
are dropped once such endpoints outnumber the pool (`PrefixIndex.retain`).

Choice, per request:

    match(e)  = number of leading request blocks present in e's index
    load(e)   = cluster in-flight at e, scaled up by 1/weight while e ramps up (slow start)
    best      = argmax match, ties to the least loaded (then at random)
    guarded   = load(best) - min load > maxImbalance  or  load(best) >= maxInFlight
    match(best) == 0 -> power of two choices over load          (`prefix_miss`)
    guarded          -> power of two choices over load          (`load_guard`)
    otherwise        -> best                                    (`prefix_hit`)

The guard is what keeps affinity from making hotspots; a guarded request seeds its prefix on a second
endpoint, so a prefix that is hot enough to trip the guard ends up replicated and then shared by load.

The one deliberate mutation on the pick path: the picker records the chosen endpoint's block hashes in
the pool state's index (O(blocks): a dict insert or move-to-end each, then LRU pops). Style rule 1 says
pickers never mutate routing structures; this one is an observation of where traffic went, like the
`LoadView`'s in-flight counts, not a routing structure that a rebuild would replace. It is safe because
every pick runs synchronously on the one event loop thread (no await between read and write, so no
interleaving), and a stale or lost entry only costs one cache miss, never a wrong answer.

Not yet (issue 10, later parts): sharing the index across router replicas through Redis, checking it
against the engines' reported prefix-cache hit rate, sizing it from the engine's KV capacity, and
weighting by predicted request cost.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from router.model import EndpointView, RequestInfo
from router.policies.base import EventSink, LoadView, PolicyConfigError, reject_unknown


@dataclass(frozen=True)
class PrefixAwareConfig:
    block_chars: int = 256  # ~64 tokens of English at ~4 chars/token
    max_blocks: int = 64  # hashed per request: 16 KiB of prompt text at the default block size
    # 32768 blocks x ~64 tokens ~ 2M tokens: more than one 80 GB GPU holds for an 8B model (~0.5M tokens of
    # KV), so the router forgets a prefix no sooner than the engine does. ~5 MB per endpoint.
    max_blocks_per_endpoint: int = 32768
    max_imbalance: int = 8  # load(best) - min load above this: load wins
    max_in_flight: int | None = None  # load(best) at or above this: load wins; None: no absolute guard


# ---- hashing ----------------------------------------------------------------------------------------


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts: text as text, anything else (images) as JSON
        return "".join(
            p["text"] if isinstance(p, Mapping) and isinstance(p.get("text"), str) else _stable_json(p)
            for p in content
        )
    return _stable_json(content)


def _stable_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def _prompt_pieces(body: Mapping[str, Any]) -> Iterator[str]:
    """The prompt text in order, in pieces, so rendering can stop once enough is produced."""
    messages = body.get("messages")
    if isinstance(messages, list):
        for msg in messages:
            if not isinstance(msg, Mapping):
                yield _stable_json(msg)
                continue
            # Role and content with separators no ordinary text contains, so ("ab", "c") != ("a", "bc").
            yield f"\x1e{msg.get('role', '')}\x1f"
            yield _content_text(msg.get("content"))
        return
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        yield prompt
    elif isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        yield prompt[0]
    elif prompt is not None:  # token ids or a batch: their JSON still shares a prefix when they do
        yield _stable_json(prompt)


def block_hashes(body: Mapping[str, Any], block_chars: int, max_blocks: int) -> list[int]:
    """Chained hashes of the first full `block_chars`-sized blocks of the rendered prompt (at most
    `max_blocks`). Stable across processes (blake2b, not Python's salted `hash`)."""
    limit = block_chars * max_blocks
    parts: list[str] = []
    size = 0
    for piece in _prompt_pieces(body):
        parts.append(piece)
        size += len(piece)
        if size >= limit:
            break
    text = "".join(parts)[:limit]
    hashes: list[int] = []
    parent = b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        digest = hashlib.blake2b(parent + text[start:start + block_chars].encode("utf-8", "surrogatepass"),
                                 digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "big"))
        parent = digest
    return hashes


# ---- state ------------------------------------------------------------------------------------------


class PrefixIndex:
    """Per endpoint, an LRU set of block hashes routed there. Kept by the balancer across rebuilds."""

    __slots__ = ("by_endpoint",)

    def __init__(self) -> None:
        self.by_endpoint: dict[str, OrderedDict[int, None]] = {}

    def retain(self, endpoint_ids: set[str]) -> None:
        """Bound the index to the pool. An endpoint missing from one build is often only ejected or
        draining for a while and comes back with its cache warm, so its index is kept; only when absent
        endpoints outnumber the pool (pods replaced under new names) are theirs dropped."""
        if len(self.by_endpoint) <= 2 * len(endpoint_ids) + 4:
            return
        for gone in [e for e in self.by_endpoint if e not in endpoint_ids]:
            del self.by_endpoint[gone]

    def matched(self, endpoint_id: str, hashes: list[int]) -> int:
        blocks = self.by_endpoint.get(endpoint_id)
        if not blocks:
            return 0
        n = 0
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def record(self, endpoint_id: str, hashes: list[int], bound: int) -> None:
        blocks = self.by_endpoint.get(endpoint_id)
        if blocks is None:
            blocks = self.by_endpoint[endpoint_id] = OrderedDict()
        # Deepest block first, so the prefix's root ends up most recent and LRU evicts leaves before the
        # blocks they hang from (a chain missing its root could never match anyway).
        for h in reversed(hashes):
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        while len(blocks) > bound:
            blocks.popitem(last=False)

    def size(self, endpoint_id: str) -> int:
        return len(self.by_endpoint.get(endpoint_id, ()))


# ---- picker -----------------------------------------------------------------------------------------


def _load(view: EndpointView, loads: LoadView) -> float:
    load = float(loads.cluster_in_flight(view.id))
    if view.weight_factor < 1.0:  # slow start: a ramping endpoint counts as more loaded (as base.least_loaded)
        load = (load + 1) / view.weight_factor - 1
    return load


class PrefixAwarePicker:
    __slots__ = ("_views", "_index", "_config", "_rng", "_events")

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

    def pick(self, req: RequestInfo, loads: LoadView, exclude: frozenset[str]) -> EndpointView | None:
        candidates = [v for v in self._views if v.id not in exclude] if exclude else list(self._views)
        if not candidates:
            return None
        c = self._config
        hashes = block_hashes(req.body, c.block_chars, c.max_blocks)
        load = {v.id: _load(v, loads) for v in candidates}
        best: list[EndpointView] = []
        best_match, best_load = 0, 0.0
        for view in candidates:
            m = self._index.matched(view.id, hashes) if hashes else 0
            if m == 0 or m < best_match:
                continue
            if m > best_match or load[view.id] < best_load:
                best, best_match, best_load = [view], m, load[view.id]
            elif load[view.id] == best_load:
                best.append(view)
        if not best:
            self._events("prefix_miss")
            choice = self._two_choices(candidates, load)
        elif best_load - min(load.values()) > c.max_imbalance or (
            c.max_in_flight is not None and best_load >= c.max_in_flight
        ):
            self._events("load_guard")
            choice = self._two_choices(candidates, load)
        else:
            self._events("prefix_hit")
            choice = best[0] if len(best) == 1 else self._rng.choice(best)
        if hashes:
            self._index.record(choice.id, hashes, c.max_blocks_per_endpoint)
        return choice

    def _two_choices(self, candidates: list[EndpointView], load: dict[str, float]) -> EndpointView:
        """Power of two choices over load (Mitzenmacher; Envoy least_request): near least-loaded without
        every router replica herding onto the same argmax."""
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)  # random order, so an exact tie goes either way
        return b if load[b.id] < load[a.id] else a


# ---- policy -----------------------------------------------------------------------------------------


def _integer(params: Mapping[str, Any], field: str, default: int | None, *, minimum: int,
             maximum: int | None = None, nullable: bool = False) -> int | None:
    value = params.get(field, default)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        null = " or null" if nullable else ""
        raise PolicyConfigError(field, f"must be an integer{null}, got {value!r}")
    if value < minimum or (maximum is not None and value > maximum):
        bounds = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise PolicyConfigError(field, f"must be {bounds}, got {value!r}")
    return value


class PrefixAwarePolicy:
    name = "prefix-aware"
    config_key = "prefixAware"

    def parse(self, params: Mapping[str, Any]) -> PrefixAwareConfig:
        reject_unknown(params, {"blockChars", "maxBlocks", "maxBlocksPerEndpoint", "maxImbalance", "maxInFlight"})
        d = PrefixAwareConfig()
        block_chars = _integer(params, "blockChars", d.block_chars, minimum=16, maximum=65536)
        max_blocks = _integer(params, "maxBlocks", d.max_blocks, minimum=1, maximum=4096)
        per_endpoint = _integer(params, "maxBlocksPerEndpoint", d.max_blocks_per_endpoint, minimum=1,
                                maximum=10_000_000)
        imbalance = _integer(params, "maxImbalance", d.max_imbalance, minimum=0)
        in_flight = _integer(params, "maxInFlight", d.max_in_flight, minimum=1, nullable=True)
        assert block_chars is not None and max_blocks is not None and per_endpoint is not None
        assert imbalance is not None
        return PrefixAwareConfig(block_chars=block_chars, max_blocks=max_blocks,
                                 max_blocks_per_endpoint=per_endpoint, max_imbalance=imbalance,
                                 max_in_flight=in_flight)

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
        state.retain({v.id for v in views})
        return PrefixAwarePicker(views, state, config, rng, events)
