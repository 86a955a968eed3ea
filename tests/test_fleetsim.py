"""The virtual-time policy lab: the router's real pickers over simulated engines, telemetry at its ticks."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from loadtest import arrivals
from loadtest.fleetsim import simulate
from loadtest.stats import percentile
from loadtest.workload import ChatWorkload

FLEET = [("h100-0", "h100"), ("a100-80g-0", "a100-80g"), ("a100-80g-1", "a100-80g")]


def plan(rate: float, n: int, *, process: str = "poisson"):
    rng = random.Random(3)
    times = arrivals.constant(rate, n / rate) if process == "constant" else arrivals.poisson(rate, 2 * n / rate, rng)
    return ChatWorkload(model="m", output_median=40, output_max=80).requests(times[:n], rng)


def p99(outcomes) -> float:
    return percentile([o.ttft for o in outcomes if o.ttft is not None], 99)


def test_every_request_is_routed_and_completed_even_one_arriving_at_time_zero() -> None:
    requests = plan(20.0, 60, process="constant")
    assert requests[0].at == 0.0
    outcomes = simulate(requests, FLEET, strategy="round-robin")
    assert [o.planned for o in outcomes] == requests
    assert all(o.ttft is not None and o.e2e is not None and o.e2e >= o.ttft for o in outcomes)
    assert {o.endpoint for o in outcomes} == {rid for rid, _ in FLEET}


def test_load_aware_routing_beats_round_robin_on_a_heterogeneous_fleet_near_saturation() -> None:
    # One H100 and two A100s (about 1.8x slower each): round-robin gives each a third, so the A100s saturate
    # first; least-connections sends the H100 more because it finishes sooner. The lab must show that.
    requests = plan(90.0, 900)
    rr = simulate(requests, FLEET, strategy="round-robin", seed=1)
    lc = simulate(requests, FLEET, strategy="least-connections", seed=1)
    assert p99(lc) < 0.7 * p99(rr)
    h100_share = sum(o.endpoint == "h100-0" for o in lc) / len(lc)
    assert h100_share > 0.4  # well above round-robin's third


def test_endpoint_weights_reach_the_pickers() -> None:
    requests = plan(60.0, 400)
    weighted = simulate(requests, FLEET, strategy="least-connections", weights={"h100-0": 3.0}, seed=1)
    plain = simulate(requests, FLEET, strategy="least-connections", seed=1)
    share = {name: sum(o.endpoint == "h100-0" for o in run) / len(run) for name, run in
             (("weighted", weighted), ("plain", plain))}
    assert share["weighted"] > share["plain"]


def test_an_unknown_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'fastest'"):
        simulate(plan(10.0, 5), FLEET, strategy="fastest")


# ---- KV events: the precise prefix index on engine truth ----------------------------------------------


def shared_prefix_plan(n: int = 200, rate: float = 40.0):
    from loadtest.workload import SharedPrefixWorkload

    rng = random.Random(5)
    times = arrivals.poisson(rate, 2 * n / rate, rng)[:n]
    return SharedPrefixWorkload(model="m", groups=12, prefix_tokens=1500, question_tokens=64, output_tokens=16,
                                skew=0.6).requests(times, rng)


def test_the_precise_index_holds_exactly_the_blocks_each_engine_caches_under_the_routers_keys() -> None:
    from loadtest.fleetsim import KVEventFeed, prompt_tokens
    from router.routing.prefix.kv_block_index import chain_keys

    feed = KVEventFeed()
    requests = shared_prefix_plan()
    events: Counter[str] = Counter()
    outcomes = simulate(requests, FLEET, strategy="prefix-aware", params={"index": "precise"}, seed=1,
                        kv_events=feed, policy_events=events)
    assert all(o.ttft is not None for o in outcomes) and feed.batches > 0
    # Every pick matched every candidate on the engines' events, none on the approximate guess.
    assert events["index_precise"] == len(requests) and events["index_approximate"] == 0
    for rid, replica in feed.replicas.items():
        kv = replica.engine.kv_cache
        assert feed.index.size(rid) > 0 and feed.index.block_size(rid) == kv.block_size
        for planned in requests[:40]:
            tokens = prompt_tokens(planned)
            truth = len(kv.find_cached(kv.block_hashes(tokens)))
            keys = chain_keys(tokens, kv.block_size, 4096)
            assert feed.index.matched(rid, keys) == truth, (rid, planned.body["messages"][0]["content"][:20])


def test_precise_routing_hits_the_engines_cache_at_least_as_often_as_the_approximate_guess() -> None:
    from loadtest.fleetsim import KVEventFeed

    requests = shared_prefix_plan(400, 60.0)

    def hit_rate(params):
        outcomes = simulate(requests, FLEET, strategy="prefix-aware", params=params, seed=2, kv_events=KVEventFeed())
        return sum(o.cached_tokens for o in outcomes) / sum(o.prompt_tokens for o in outcomes)

    approximate, precise = hit_rate({}), hit_rate({"index": "precise"})
    assert precise > 0.5 and precise >= approximate - 0.02
