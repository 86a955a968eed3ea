"""The precise prefix index: which engine holds which KV block, as the engines themselves report it.

vLLM (and the simulator) publish KV-cache events (router/routing/prefix/kv_events.py decodes them): `BlockStored`
carries the engine's hashes of a run of new full blocks, the hash of the block they hang from, their token ids and the
block size; `BlockRemoved` names evicted hashes; `AllBlocksCleared` empties the cache. This module turns them
into an inverted index, block key -> engines holding it, that a pick reads.

Block keys. The engine's own hashes cannot be recomputed here: vLLM seeds its chain with a random
`NONE_HASH` unless PYTHONHASHSEED is set, and hashes with sha256/CBOR or Python's `hash`, as configured. So
the index keys a block by *its token ids*, chained like the engine's: key(b) = blake2b-8(key(parent) ||
token ids of b), the root's parent being empty. A `BlockStored` gives the token ids and the parent's engine
hash; the engine-hash -> key table of that engine turns the parent into its key. A request's token ids give
the same keys, so equal keys mean equal whole token prefixes, whatever the engine's hash function. Blocks
whose hash depended on more than tokens (a LoRA adapter, multimodal inputs, a cache salt: `lora_name` or
`extra_keys` set) get those mixed into the key, so they never match a plain prompt (they would not hit in the
engine either). A stored block whose parent this index never saw (it subscribed mid-stream, or the parent's
event was lost) cannot be keyed and is counted as an orphan.

What matches exactly: requests whose token ids the router knows, i.e. a completions `prompt` given as token
ids, or a text prompt with a tokenizer configured (`kvEvents.tokenizer`, the model's `tokenizer.json`).
Chat messages would need the model's chat template as well; they, and any request without a tokenizer, use
the approximate index (router/routing/prefix/index.py), as do engines that publish nothing or whose stream
is being resynchronised.

State per engine: the last sequence number, its block size, the engine-hash -> key table (insertion order:
the oldest go first when the cap is reached) and whether it is `precise` now. The subscriber
(router/routing/prefix/kv_events.py) decides that: an engine is precise while its stream is unbroken since the engine
started (sequence 0) or since a resync's warm-up passed; after a gap its blocks are dropped and the
approximate index answers for it until the warm-up has passed.

Memory: ~480 bytes per block held, measured (docs/results/kv-ingest.json; a dict slot with a 32-byte sha256
key and an int, plus a set entry in the inverted table); the cap per engine (`maxBlocksPerEndpoint`, 262144 by
default: a 16-token-block engine holding 4M tokens) bounds it at ~125 MB per engine, usually far less (an H100
with 8B weights holds ~30k 16-token blocks: ~14 MB).

No I/O and no clock: the subscriber applies events on the event loop thread; picks read between them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from router.routing.prefix.index import leading_matches

DEFAULT_MAX_BLOCKS = 262144
MAX_TOKENIZE_CHARS = 64 * 1024  # a pick tokenizes at most this much prompt text (its first blocks)
ROOT = b""


def block_key(parent: bytes, tokens: Iterable[int], extra: bytes = b"") -> bytes:
    """The key of one block: its tokens chained on its parent's key (see the module docstring)."""
    ids = list(tokens)
    return hashlib.blake2b(parent + struct.pack(f"<{len(ids)}q", *ids) + extra, digest_size=8).digest()


def chain_keys(token_ids: list[int], block_size: int, max_blocks: int) -> list[bytes]:
    """The keys of the first full blocks of a token sequence (a trailing partial block has none)."""
    keys: list[bytes] = []
    parent = ROOT
    for start in range(0, min(len(token_ids), block_size * max_blocks) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


def request_token_ids(body: Mapping[str, Any], tokenize: Callable[[str], list[int]] | None) -> list[int] | None:
    """The token ids the engine will see for a request, when the router can know them: a completions prompt
    of token ids, or a text prompt with a tokenizer. None otherwise (chat messages, no tokenizer)."""
    if "messages" in body:
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, str) and tokenize is not None:
        ids = tokenize(prompt[:MAX_TOKENIZE_CHARS])
        # A cut text may end mid-token: keep only what the cut cannot have changed.
        return ids[:-1] if len(prompt) > MAX_TOKENIZE_CHARS else ids
    return None


@dataclass
class EngineBlocks:
    """One engine's blocks as its events told them."""

    block_size: int | None = None
    last_seq: int | None = None
    precise: bool = False  # set by the subscriber: the index matches this engine's cache now
    keys: dict[Any, bytes] = field(default_factory=dict)  # engine hash -> key, oldest first
    held: dict[bytes, int] = field(default_factory=dict)  # key -> how many of the engine's hashes map to it
    orphans: int = 0


@dataclass(frozen=True, slots=True)
class Applied:
    """What one batch did, for the subscriber's metrics."""

    stored: int = 0
    removed: int = 0
    cleared: int = 0
    orphans: int = 0
    evicted: int = 0


class KVBlockIndex:
    """Block key -> engines holding it, fed by KV events. One per router, shared by every pool."""

    __slots__ = ("engines", "holders", "max_blocks", "tokenize")

    def __init__(self, *, max_blocks: int = DEFAULT_MAX_BLOCKS,
                 tokenize: Callable[[str], list[int]] | None = None) -> None:
        self.engines: dict[str, EngineBlocks] = {}
        self.holders: dict[bytes, set[str]] = {}
        self.max_blocks = max_blocks
        self.tokenize = tokenize

    # ---- the request path ------------------------------------------------------------------------------

    def is_precise(self, endpoint_id: str) -> bool:
        engine = self.engines.get(endpoint_id)
        return engine is not None and engine.precise

    def block_size(self, endpoint_id: str) -> int | None:
        engine = self.engines.get(endpoint_id)
        return engine.block_size if engine is not None else None

    def matched(self, endpoint_id: str, keys: list[bytes]) -> int:
        """How many leading blocks of `keys` the engine holds."""
        n = 0
        for key in keys:
            holders = self.holders.get(key)
            if holders is None or endpoint_id not in holders:
                break
            n += 1
        return n

    def matches(self, keys: list[bytes]) -> dict[str, int]:
        """Every engine holding at least the first of `keys`, with how many leading blocks it holds (`matched`
        for each at once): a walk of the inverted table narrowing the engines still matching, so its cost is
        the prompt's length times those engines, not the number of engines."""
        return leading_matches(self.holders.get(key) for key in keys)

    def size(self, endpoint_id: str) -> int:
        engine = self.engines.get(endpoint_id)
        return len(engine.keys) if engine is not None else 0

    # ---- events (the subscriber) -----------------------------------------------------------------------

    def engine(self, endpoint_id: str) -> EngineBlocks:
        engine = self.engines.get(endpoint_id)
        if engine is None:
            engine = self.engines[endpoint_id] = EngineBlocks()
        return engine

    def apply(self, endpoint_id: str, events: list[Any]) -> Applied:
        """Apply one batch's decoded events (prefix/kv_events.py `Stored`, `Removed`, `Cleared`) in order."""
        engine = self.engine(endpoint_id)
        stored = removed = cleared = orphans = evicted = 0
        for event in events:
            kind = event.kind
            if kind == "stored":
                s, o, e = self._store(endpoint_id, engine, event)
                stored += s
                orphans += o
                evicted += e
            elif kind == "removed":
                for h in event.block_hashes:
                    if self._drop(endpoint_id, engine, h):
                        removed += 1
            else:
                self.clear(endpoint_id)
                cleared += 1
        return Applied(stored, removed, cleared, orphans, evicted)

    def _store(self, endpoint_id: str, engine: EngineBlocks, event: Any) -> tuple[int, int, int]:
        size = event.block_size
        engine.block_size = size
        if event.parent_block_hash is None:
            parent: bytes | None = ROOT
        else:
            parent = engine.keys.get(event.parent_block_hash)
        tokens = event.token_ids
        stored = orphans = evicted = 0
        for i, h in enumerate(event.block_hashes):
            block_tokens = tokens[i * size:(i + 1) * size]
            if parent is None or len(block_tokens) != size:
                orphans += 1
                engine.orphans += 1
                continue
            extra = event.extras[i] if event.extras is not None and i < len(event.extras) else b""
            key = block_key(parent, block_tokens, extra)
            old = engine.keys.get(h)
            if old is not None:
                if old == key:
                    parent = key
                    continue
                self._drop(endpoint_id, engine, h)
            engine.keys[h] = key
            count = engine.held.get(key, 0)
            engine.held[key] = count + 1
            if count == 0:
                self.holders.setdefault(key, set()).add(endpoint_id)
            stored += 1
            parent = key
            while len(engine.keys) > self.max_blocks:
                self._drop(endpoint_id, engine, next(iter(engine.keys)))
                evicted += 1
        return stored, orphans, evicted

    def _drop(self, endpoint_id: str, engine: EngineBlocks, engine_hash: Any) -> bool:
        key = engine.keys.pop(engine_hash, None)
        if key is None:
            return False
        count = engine.held[key] - 1
        if count:
            engine.held[key] = count
            return True
        del engine.held[key]
        holders = self.holders.get(key)
        if holders is not None:
            holders.discard(endpoint_id)
            if not holders:
                del self.holders[key]
        return True

    def clear(self, endpoint_id: str) -> int:
        """Forget every block of the engine (AllBlocksCleared, a restart, a resync); returns how many."""
        engine = self.engines.get(endpoint_id)
        if engine is None:
            return 0
        n = len(engine.keys)
        for key in engine.held:
            holders = self.holders.get(key)
            if holders is not None:
                holders.discard(endpoint_id)
                if not holders:
                    del self.holders[key]
        engine.keys.clear()
        engine.held.clear()
        return n

    def forget(self, endpoint_id: str) -> None:
        """The endpoint left the fleet (or its subscription ended)."""
        self.clear(endpoint_id)
        self.engines.pop(endpoint_id, None)
