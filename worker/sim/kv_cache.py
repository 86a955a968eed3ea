"""The paged KV cache: a pool of fixed-size blocks with automatic prefix caching, as in vLLM.

Blocks hold `block_size` tokens of one sequence. A block that is *full of prompt tokens* gets a chained
hash, hash((parent block's hash, its token ids)), so equal hashes mean equal whole prefixes, not just
equal blocks (vLLM's `hash_block_tokens`). Python's hash of a tuple of ints is not salted per process,
so hashes are stable across runs.

Each block has a reference count. When a sequence frees its blocks, a hashed block whose count drops to
zero is not wiped: it joins an LRU of *evictable* blocks and stays findable by its hash until a fresh
block is needed and none is left, when the least recently freed is evicted (its hash forgotten). A
sequence frees its blocks last-to-first, so the tail of a prompt is evicted before its head, the part
most likely shared (vLLM's `free` does the same). A prefix hit takes the cached blocks (reviving
evictable ones) and skips that much prefill.

Evictable blocks count as free: usage, like vLLM's `kv_cache_usage_perc`, is the fraction of blocks
referenced by live sequences. Two sequences that computed the same block concurrently (both missed) keep
one registered copy; the other block stays unhashed and is recycled as fresh when freed.

KV events (vLLM's `BlockStored` / `BlockRemoved` / `AllBlocksCleared`): when `events` is a list, each
registration of new blocks appends ("stored", hashes, parent hash or None, token ids), each eviction of a
hashed block ("removed", [hash]) and `reset` ("cleared",); the server publishes them after each step
(worker/sim/kv_events.py).

No I/O and no clock: the engine calls this synchronously inside a step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class KVCache:
    __slots__ = ("num_blocks", "block_size", "prefix_caching", "events", "_ref", "_hash", "_by_hash", "_fresh",
                 "_evictable")

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"KV cache needs at least one block of one token (got {num_blocks} x {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.events: list[tuple[object, ...]] | None = None  # KV events since the last publish, when published
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}  # hash -> block id, for every registered block (live or evictable)
        self._fresh = list(range(num_blocks - 1, -1, -1))  # unhashed free blocks (a stack)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # hashed free blocks, least recent first

    @property
    def num_free(self) -> int:
        return len(self._fresh) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def block_hashes(self, tokens: Sequence[int]) -> list[int]:
        """Chained hashes of the full blocks of `tokens` (a trailing partial block has none)."""
        hashes: list[int] = []
        parent = 0
        bs = self.block_size
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = hash((parent, tuple(tokens[start : start + bs])))
            hashes.append(parent)
        return hashes

    def find_cached(self, hashes: Sequence[int]) -> list[int]:
        """The block ids of the longest cached prefix of `hashes` (live or evictable); touches nothing."""
        if not self.prefix_caching:
            return []
        found: list[int] = []
        for h in hashes:
            block = self._by_hash.get(h)
            if block is None:
                break
            found.append(block)
        return found

    def allocate(self, cached: Sequence[int], num_new: int) -> list[int] | None:
        """Take the `cached` blocks plus `num_new` fresh ones, or nothing (None) if they do not all fit.

        A cached block that is currently evictable is itself one of the free blocks, so reviving it leaves
        one fewer for the fresh ones.
        """
        revived = sum(1 for b in cached if self._ref[b] == 0)
        if num_new + revived > self.num_free:
            return None
        for b in cached:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
        return [*cached, *(self._take_fresh() for _ in range(num_new))]

    def grow(self, blocks: list[int]) -> bool:
        """Append one fresh block to a sequence's `blocks`; False (nothing changed) when none is free."""
        if not self.num_free:
            return False
        blocks.append(self._take_fresh())
        return True

    def register(self, blocks: Sequence[int], hashes: Sequence[int], start: int, end: int,
                 tokens: Sequence[int] = ()) -> None:
        """Make blocks[start:end], now computed, findable by hashes[start:end] (`tokens`: the sequence's token
        ids, for the stored event)."""
        if not self.prefix_caching:
            return
        run: list[int] = []  # consecutive newly registered blocks: one stored event, as vLLM sends
        for i in range(start, end):
            h = hashes[i]
            if h not in self._by_hash:
                self._by_hash[h] = blocks[i]
                self._hash[blocks[i]] = h
                run.append(i)
            elif run:
                self._stored(hashes, run, tokens)
                run = []
        if run:
            self._stored(hashes, run, tokens)

    def _stored(self, hashes: Sequence[int], run: list[int], tokens: Sequence[int]) -> None:
        if self.events is None:
            return
        bs = self.block_size
        first, last = run[0], run[-1]
        self.events.append(("stored", [hashes[i] for i in run], hashes[first - 1] if first else None,
                            list(tokens[first * bs:(last + 1) * bs])))

    def reset(self) -> bool:
        """vLLM's reset_prefix_cache: forget every cached block; refused (False) while sequences hold blocks."""
        if any(self._ref):
            return False
        self._by_hash.clear()
        self._hash = [None] * self.num_blocks
        self._evictable.clear()
        self._fresh = list(range(self.num_blocks - 1, -1, -1))
        if self.events is not None:
            self.events.append(("cleared",))
        return True

    def free(self, blocks: Sequence[int]) -> None:
        """Release one sequence's blocks, tail first (see the module docstring)."""
        for b in reversed(blocks):
            self._ref[b] -= 1
            if self._ref[b] == 0:
                if self._hash[b] is None:
                    self._fresh.append(b)
                else:
                    self._evictable[b] = None

    def _take_fresh(self) -> int:
        if self._fresh:
            b = self._fresh.pop()
        else:
            b, _ = self._evictable.popitem(last=False)
            del self._by_hash[self._hash[b]]  # type: ignore[index]
            if self.events is not None:
                self.events.append(("removed", [self._hash[b]]))
            self._hash[b] = None
        self._ref[b] = 1
        return b
