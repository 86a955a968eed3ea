"""The inverted prefix indexes and the indexed prefix-aware pick, against the straightforward scans they replace.

Seeded random fleets: endpoints record, merge and evict blocks (small LRU bounds, tuned factors), leave the
fleet, start sharing; random prompts drawn from a few shared trunks so that prefixes overlap. After every
step `PrefixIndex.holders(hashes)` must equal `matched(endpoint, hashes)` asked of every endpoint, and the
KV-event index's `matches(keys)` its `matched` per engine. Then the pick: with the pool's in-flight index
(a real `LoadTracker`), an unexplained longest-match pick takes the indexed path; an explained one (a
`DecisionTrace`) still scans. On copies of the same state, under random loads, guards and exclude sets, both
must name the same outcome (hit, miss, short, which guard) and choose an endpoint equally good by the scan's
own rule (the same match and load; ties are broken at random by both).
"""

from __future__ import annotations

import copy
import random
import tracemalloc
from contextlib import ExitStack
from typing import Any

import pytest

from router.model import Endpoint, EndpointView, RequestInfo
from router.routing.loads import LoadTracker
from router.routing.policies import prefix_aware
from router.routing.policies.base import DecisionTrace
from router.routing.policies.prefix_aware import PrefixAwarePolicy, prompt_blocks
from router.routing.prefix.index import PrefixIndex
from router.routing.prefix.kv_block_index import KVBlockIndex, chain_keys
from router.routing.prefix.kv_events import Cleared, Removed, Stored
from router.runtime.metrics import RouterMetrics

POLICY = PrefixAwarePolicy()
SEEDS = range(12)


def chains(rng: random.Random, trunks: int = 4, length: int = 12) -> list[list[int]]:
    """Prompts as chained block hashes: a few trunks, each prompt a trunk's first blocks then its own."""
    roots = [[rng.randrange(1 << 62) for _ in range(length)] for _ in range(trunks)]
    out = []
    for _ in range(24):
        trunk = rng.choice(roots)
        cut = rng.randrange(length + 1)
        out.append(trunk[:cut] + [rng.randrange(1 << 62) for _ in range(rng.randrange(0, 6))])
    return out


def scanned(index: PrefixIndex, hashes: list[int]) -> dict[str, int]:
    """What `holders` replaces: every endpoint asked in turn."""
    return {e: m for e in index.by_endpoint if (m := index.matched(e, hashes))}


@pytest.mark.parametrize("seed", SEEDS)
def test_holders_equal_the_per_endpoint_scan_through_records_merges_evictions_and_forgets(seed: int) -> None:
    rng = random.Random(seed)
    prompts = chains(rng)
    index = PrefixIndex()
    ids = [f"e{i}" for i in range(10)]
    for e in ids:
        index.set_base(e, rng.choice([8, 16, 64]), "config")
    for step in range(400):
        op = rng.random()
        e = rng.choice(ids)
        if op < 0.55:
            index.record(e, rng.choice(prompts))
        elif op < 0.75:
            index.merge(e, rng.choice(prompts))
        elif op < 0.82:
            index.set_factor(e, rng.choice([0.1, 0.5, 1.0]), "shrink")  # a lower bound evicts at once
        elif op < 0.90:
            index.forget_endpoints(frozenset(rng.sample(ids, rng.randrange(1, 3))))
        elif op < 0.92 and not index.shared:
            index.start_sharing()  # from here on `record` takes the outbox path
        for prompt in rng.sample(prompts, 4):
            expected = scanned(index, prompt)
            assert index.holders(prompt) == expected, f"step {step}"
            top = max(expected.values(), default=0)
            assert index.longest(prompt) == (top, {e for e, m in expected.items() if m == top}), f"step {step}"
    # The inverted table holds exactly the blocks the LRU sets hold, nothing left behind by evictions.
    held = {h for blocks in index.by_endpoint.values() for h in blocks}
    assert index.blocks_indexed() == len(held)
    index.forget_endpoints(frozenset(ids))
    assert index.blocks_indexed() == 0 and index.holders(prompts[0]) == {}


def test_holders_of_an_empty_prompt_or_an_unknown_block_are_empty() -> None:
    index = PrefixIndex()
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2])
    assert index.holders([]) == {}
    assert index.holders([9, 1]) == {}
    assert index.holders([1, 2, 3, 4]) == {"a": 3, "b": 2}


def test_the_inverted_table_adds_about_fifty_bytes_per_block_held_by_one_endpoint() -> None:
    """The memory the module docstring states: a block one endpoint holds costs its LRU entry (~85 bytes here,
    the int keys made beforehand) plus one inverted entry naming the endpoint (~47 bytes), no set."""
    prompts = [[(p << 20) + i for i in range(64)] for p in range(200)]
    index = PrefixIndex()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for p, hashes in enumerate(prompts):
            index.record(f"e{p % 50}", hashes)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    blocks = 200 * 64
    assert index.blocks_indexed() == blocks
    assert used / blocks < 85 + 47 + 25


# ---- the KV-event index ---------------------------------------------------------------------------------

BS = 4


@pytest.mark.parametrize("seed", SEEDS)
def test_kv_event_matches_equal_the_per_engine_scan(seed: int) -> None:
    rng = random.Random(seed)
    sequences = [[rng.randrange(50) for _ in range(BS * 8)] for _ in range(3)]
    sequences += [s[: BS * rng.randrange(1, 8)] + [rng.randrange(50) for _ in range(BS * 3)] for s in sequences]
    index = KVBlockIndex(max_blocks=20)
    engines = [f"g{i}" for i in range(6)]
    stored: dict[str, list[int]] = {e: [] for e in engines}
    counter = 0
    for _ in range(200):
        e = rng.choice(engines)
        op = rng.random()
        if op < 0.6:
            tokens = rng.choice(sequences)
            n = len(tokens) // BS
            hashes = list(range(counter, counter + n))
            counter += n
            index.apply(e, [Stored(hashes, None, tokens[: n * BS], BS, None)])
            stored[e] += hashes
        elif op < 0.85 and stored[e]:
            index.apply(e, [Removed(rng.sample(stored[e], min(3, len(stored[e]))))])
        elif op < 0.92:
            index.apply(e, [Cleared()])
        else:
            index.forget(e)
        for tokens in rng.sample(sequences, 3):
            keys = chain_keys(tokens, BS, 64)
            assert index.matches(keys) == {g: m for g in engines if (m := index.matched(g, keys))}


# ---- the pick ---------------------------------------------------------------------------------------------


def request(rng: random.Random, trunks: list[str]) -> RequestInfo:
    text = rng.choice(trunks)[: rng.randrange(0, 4096)] + "".join(rng.choice("xyz ") for _ in range(rng.randrange(600)))
    return RequestInfo(model="m", request_id="r", headers={}, body={"model": "m", "prompt": text})


GUARDS: list[dict[str, Any]] = [
    {},  # the default: maxImbalance 8
    {"maxImbalance": 1},
    {"maxInFlight": 3},
    {"maxLoadFactor": 1.25, "maxImbalance": None},
    {"maxImbalance": 2, "maxInFlight": 4, "maxLoadFactor": 1.5, "minMatchShare": 0.5},
    {"minMatchShare": 0.0},
]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("params", GUARDS, ids=[str(g) for g in GUARDS])
@pytest.mark.parametrize("whole_pool_check", [prefix_aware.WHOLE_POOL_CHECK, 0])
def test_the_indexed_pick_makes_the_scans_choice(seed: int, params: dict[str, Any], whole_pool_check: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # 0: the shortcut for a longest match held by the whole pool is tried on every pick (small pools too).
    monkeypatch.setattr(prefix_aware, "WHOLE_POOL_CHECK", whole_pool_check)
    rng = random.Random(seed)
    n = rng.choice([3, 8, 30])
    views = tuple(EndpointView(endpoint=Endpoint(f"e{i}", f"http://e{i}", ("m",))) for i in range(n))
    trunks = ["".join(rng.choice("abcdefgh ") for _ in range(4096)) for _ in range(4)]
    config = POLICY.parse(params)
    state = POLICY.new_state()
    loads = LoadTracker(RouterMetrics())
    loads.set_pools({"m": views})
    seen: list[str] = []
    picker = POLICY.build(views, config, state, random.Random(seed), seen.append)
    compared = indexed_hits = 0
    with ExitStack() as held:
        for _ in range(80):
            # Random loads: requests start (and stay in flight) at random endpoints.
            for _ in range(rng.randrange(3)):
                held.enter_context(loads.track(rng.choice(views).id))
            exclude = frozenset(rng.sample([v.id for v in views], rng.randrange(0, min(3, n))))
            req = request(rng, trunks)
            scan_state = copy.deepcopy(state)  # the scan records into its own copy
            scan_events: list[str] = []
            scan_picker = POLICY.build(views, config, scan_state, random.Random(seed), scan_events.append)
            trace = DecisionTrace()
            expected = scan_picker.pick(req, loads, exclude, trace)  # explained: the scan
            seen.clear()
            got = picker.pick(req, loads, exclude)  # unexplained, with the pool's load index: indexed
            assert (got is None) == (expected is None)
            if got is None:
                continue
            assert got.id not in exclude
            assert seen == scan_events, (seen, scan_events)
            hashes = prompt_blocks(req.body, config.block_chars, config.max_blocks)[0]
            load_of = {v.id: loads.cluster_in_flight(v.id) for v in views}
            if trace.reason == "prefix_hit":
                assert load_of[got.id] == load_of[expected.id]
                indexed_hits += 1
            else:  # a fallback: the least loaded, whatever it matched
                assert load_of[got.id] == min(load_of[v.id] for v in views if v.id not in exclude)
            # Both recorded the prompt at their choice; the scan's copy is dropped, the indexed pick's state goes on.
            assert scan_state.matched(expected.id, hashes) == len(hashes) == state.matched(got.id, hashes)
            compared += 1
    assert compared > 40
    assert indexed_hits or params.get("maxInFlight") == 3  # the random prompts do share prefixes


def test_an_explained_pick_or_other_replicas_load_keeps_the_scan() -> None:
    """The indexed path is taken only when it sees what the scan sees: with other replicas' requests in the
    pool (not in this router's load index) the pick scans, and still avoids their load."""
    views = tuple(EndpointView(endpoint=Endpoint(f"e{i}", f"http://e{i}", ("m",))) for i in range(3))
    loads = LoadTracker(RouterMetrics())
    loads.set_pools({"m": views})
    picker = POLICY.build(views, POLICY.parse({}), POLICY.new_state(), random.Random(0), lambda _: None)
    assert picker._indexed_pool(loads) is not None
    loads.others = {"e0": 5, "e1": 5}
    assert picker._indexed_pool(loads) is None
    req = RequestInfo(model="m", request_id="r", headers={}, body={"model": "m", "prompt": "hello"})
    assert picker.pick(req, loads, frozenset()).id == "e2"
