"""The KV block pool and its prefix cache, driven directly (the engine tests cover it through scheduling)."""

from __future__ import annotations

import pytest

from worker.sim.kv_cache import KVCache


def cache(blocks: int = 8, prefix_caching: bool = True) -> KVCache:
    return KVCache(blocks, 4, prefix_caching)


def test_block_hashes_are_chained_so_equal_blocks_after_different_prefixes_differ() -> None:
    kv = cache()
    a = kv.block_hashes([1, 2, 3, 4, 9, 9, 9, 9, 5])
    b = kv.block_hashes([0, 2, 3, 4, 9, 9, 9, 9])
    assert len(a) == 2  # the trailing partial block has no hash
    assert a[1] != b[1]
    assert kv.block_hashes([1, 2, 3, 4, 9, 9, 9, 9]) == a  # deterministic


def test_allocate_takes_fresh_blocks_and_refuses_what_does_not_fit() -> None:
    kv = cache(4)
    blocks = kv.allocate([], 3)
    assert blocks is not None and len(set(blocks)) == 3
    assert kv.usage == 0.75
    assert kv.allocate([], 2) is None
    assert kv.num_free == 1  # a refused allocation takes nothing
    kv.free(blocks)
    assert kv.usage == 0.0


def test_freed_registered_blocks_stay_findable_until_evicted_least_recent_first() -> None:
    kv = cache(4)
    tokens = list(range(12))
    hashes = kv.block_hashes(tokens)
    blocks = kv.allocate([], 3)
    assert blocks is not None
    kv.register(blocks, hashes, 0, 3)
    kv.free(blocks)
    assert kv.num_free == 4 and kv.find_cached(hashes) == blocks  # evictable, still cached

    other = kv.allocate([], 2)  # one fresh block, then the LRU victim: the prompt's *last* block
    assert other is not None
    assert kv.find_cached(hashes) == blocks[:2]
    kv.grow(other)  # the next victim is the middle block
    assert kv.find_cached(hashes) == blocks[:1]


def test_a_hit_on_an_evictable_block_revives_it_and_counts_against_the_free_pool() -> None:
    kv = cache(2)
    hashes = kv.block_hashes(list(range(4)))
    first = kv.allocate([], 1)
    assert first is not None
    kv.register(first, hashes, 0, 1)
    kv.free(first)
    assert kv.allocate(first, 2) is None  # the revived block is one of the two free ones
    shared = kv.allocate(first, 1)
    assert shared is not None and shared[0] == first[0]
    assert kv.usage == 1.0
    assert kv.allocate(first, 0) == first  # a live block can be shared by a second sequence
    kv.free(shared)
    assert kv.usage == 0.5  # still referenced once


def test_a_duplicate_block_is_not_registered_twice_and_is_recycled_as_fresh() -> None:
    kv = cache(4)
    hashes = kv.block_hashes(list(range(4)))
    a, b = kv.allocate([], 1), kv.allocate([], 1)
    assert a is not None and b is not None
    kv.register(a, hashes, 0, 1)
    kv.register(b, hashes, 0, 1)
    assert kv.find_cached(hashes) == a
    kv.free(b)
    kv.free(a)
    assert kv.find_cached(hashes) == a


def test_grow_fails_without_changing_anything_when_the_pool_is_full() -> None:
    kv = cache(1)
    blocks = kv.allocate([], 1)
    assert blocks is not None
    assert kv.grow(blocks) is False and len(blocks) == 1


def test_without_prefix_caching_nothing_is_found() -> None:
    kv = cache(prefix_caching=False)
    hashes = kv.block_hashes(list(range(8)))
    blocks = kv.allocate([], 2)
    assert blocks is not None
    kv.register(blocks, hashes, 0, 2)
    assert kv.find_cached(hashes) == []


def test_an_empty_pool_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        KVCache(0, 16)
