"""The least-load index (router/routing/policies/load_index.py) against the plain scan it replaces.

Property tests (hypothesis) on random fleets: capacity weights and slow-start factors, in-flight counts moved
through the real `LoadTracker` in random order, random exclude sets. After every step the index's choice
must be one the scan could have made (least scaled load, outside `exclude`), the number tied must be the
scan's, and the pool's total must be the sum. Then seeded shares: ties are broken uniformly, as the scan
does, and excluded endpoints never win. Finally the wiring: the balancer indexes its pools, so
least-connections and bounded consistent hashing read the index, and a rebuild or a pool change leaves no
stale index behind.
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from uhashring import HashRing

from router.config.settings import PolicySpec, parse_settings
from router.model import Endpoint, EndpointView, RequestInfo
from router.routing.balancer import Balancer
from router.routing.loads import LoadTracker
from router.routing.policies.base import DecisionTrace, _least, least_loaded, pool_index, scaled_load
from router.routing.policies.consistent_hash import MAX_BOUNDED_WALK, load_bound, ring_walk
from router.routing.policies.load_index import MAX_SCALES, LoadIndex
from router.routing.policies.registry import PolicyRegistry
from router.runtime.metrics import RouterMetrics
from router.server.app import build_context

PROPERTY = settings(max_examples=150, deadline=None, derandomize=True, database=None)

# Capacity scales that occur: plain, configured weights, slow-start ramps (and their products).
SCALES = st.sampled_from([1.0, 1.0, 1.0, 2.0, 0.5, 1.8, 0.1, 0.25 * 1.8])


def make_views(scales: list[float]) -> tuple[EndpointView, ...]:
    return tuple(EndpointView(endpoint=Endpoint(f"e{i}", f"http://e{i}", ("m",), weight=scale), weight_factor=1.0)
                 if i % 2 else
                 EndpointView(endpoint=Endpoint(f"e{i}", f"http://e{i}", ("m",)), weight_factor=scale)
                 for i, scale in enumerate(scales))


def scan(views: tuple[EndpointView, ...], loads: LoadTracker, exclude: frozenset[str]) -> tuple[float, set[str]]:
    """What the scan compares: the least scaled load outside `exclude`, and every endpoint at it."""
    choice, best = _least(views, exclude, random.Random(0), lambda v: scaled_load(v, loads.in_flight(v.id)))
    if choice is None:
        return -1.0, set()
    return scaled_load(choice, loads.in_flight(choice.id)), {v.id for v in best}


@PROPERTY
@given(
    scales=st.lists(SCALES, min_size=1, max_size=24),
    steps=st.lists(st.tuples(st.integers(0, 23), st.booleans()), max_size=120),
    exclude_picks=st.lists(st.integers(0, 23), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_the_index_picks_what_the_scan_could_pick_as_counts_move(scales, steps, exclude_picks, seed):
    views = make_views(scales)
    loads = LoadTracker(RouterMetrics())
    held: dict[str, list] = {v.id: [] for v in views}
    # Some load before the index exists (a rebuild indexes a pool that already carries requests).
    for i, _ in steps[: len(steps) // 3]:
        endpoint_id = views[i % len(views)].id
        track = loads.track(endpoint_id)
        track.__enter__()
        held[endpoint_id].append(track)
    loads.set_pools({"m": views})
    index = loads.load_index(views)
    assert index is not None and pool_index(loads, views) is index
    exclude = frozenset(views[i % len(views)].id for i in exclude_picks)
    rng = random.Random(seed)
    for i, start in steps[len(steps) // 3:]:
        endpoint_id = views[i % len(views)].id
        if start or not held[endpoint_id]:
            track = loads.track(endpoint_id)
            track.__enter__()
            held[endpoint_id].append(track)
        else:
            held[endpoint_id].pop().__exit__(None, None, None)
        for ex in (frozenset(), exclude):
            best_load, tied = scan(views, loads, ex)
            view, load, n = index.least(ex, rng)
            if not tied:
                assert view is None
                continue
            assert view is not None and view.id in tied and view.id not in ex
            assert load == best_load and n == len(tied)
            assert least_loaded(views, loads, ex, rng).id in tied  # the public entry point reads the index
        assert index.total == sum(loads.in_flight(v.id) for v in views)
    for tracks in held.values():
        for track in reversed(tracks):
            track.__exit__(None, None, None)
    assert index.total == 0


@PROPERTY
@given(counts=st.lists(st.integers(0, 6), min_size=1, max_size=30),
       others=st.dictionaries(st.sampled_from([f"e{i}" for i in range(40)]), st.integers(0, 9), max_size=10))
def test_the_pool_total_with_other_replicas_is_the_sum_the_bound_used_to_take(counts, others):
    views = make_views([1.0] * len(counts))
    loads = LoadTracker(RouterMetrics())
    tracks = []
    for view, count in zip(views, counts, strict=True):
        for _ in range(count):
            tracks.append(loads.track(view.id))
            tracks[-1].__enter__()
    loads.set_pools({"m": views})
    for shared in ({}, others, dict(others)):  # replaced whole at each sharing round (router/routing/shared_loads.py)
        loads.others = shared
        index = loads.load_index(views)
        assert index is not None
        assert index.cluster_total(loads.others) == sum(loads.cluster_in_flight(v.id) for v in views)
        unindexed = LoadTracker(RouterMetrics())
        unindexed.others = shared
        for view, count in zip(views, counts, strict=True):
            unindexed._counts[view.id] = count
        assert load_bound(views, loads, 1.25) == load_bound(views, unindexed, 1.25)
    for track in reversed(tracks):
        track.__exit__(None, None, None)


def test_ties_are_broken_uniformly_and_excluded_endpoints_never_win():
    # Eight idle endpoints, two of them excluded (a retry): each of the six others should win 1/6 of 60k
    # picks, as with the scan's rng.choice; 3% relative tolerance is ~6 standard deviations at 10k per id.
    views = make_views([1.0] * 8)
    loads = LoadTracker(RouterMetrics())
    loads.set_pools({"m": views})
    index = loads.load_index(views)
    assert index is not None
    exclude = frozenset({"e0", "e5"})
    rng = random.Random(7)
    wins = Counter(index.least(exclude, rng)[0].id for _ in range(60_000))
    assert set(wins) == {"e1", "e2", "e3", "e4", "e6", "e7"}
    for n in wins.values():
        assert abs(n / 60_000 - 1 / 6) < 0.03 / 6


def test_ties_across_capacity_scales_are_uniform_over_endpoints_not_scales():
    # Weight 2 with one request scales to (1+1)/2-1 = 0, as an idle plain endpoint: five plain idle ones and one
    # loaded weight-2 one tie, and each must win 1/6 (not 1/2 for the lone weight-2 one).
    views = (*make_views([1.0] * 6)[::2], *make_views([1.0] * 6)[1::2][:2],
             EndpointView(endpoint=Endpoint("big", "http://big", ("m",), weight=2.0)))
    loads = LoadTracker(RouterMetrics())
    with loads.track("big"):
        loads.set_pools({"m": views})
        index = loads.load_index(views)
        assert index is not None
        rng = random.Random(3)
        wins = Counter(index.least(frozenset(), rng)[0].id for _ in range(60_000))
    assert len(wins) == 6
    for n in wins.values():
        assert abs(n / 60_000 - 1 / 6) < 0.03 / 6


def test_a_pool_with_too_many_distinct_scales_is_scanned():
    views = make_views([1.0 / (k + 1) for k in range(MAX_SCALES + 1)])
    assert not LoadIndex.fits(views)
    loads = LoadTracker(RouterMetrics())
    loads.set_pools({"m": views})
    assert loads.load_index(views) is None
    assert least_loaded(views, loads, frozenset(), random.Random(1)) is not None  # the scan still answers


def test_only_the_exact_pool_tuple_finds_the_index():
    # A picker that filtered its candidates (prefix-aware's holders) must not read the whole pool's index.
    views = make_views([1.0] * 4)
    loads = LoadTracker(RouterMetrics())
    loads.set_pools({"m": views})
    assert loads.load_index(views) is not None
    assert loads.load_index(views[:2]) is None
    assert loads.load_index(tuple(views)) is loads.load_index(views)  # tuple() of a tuple is the same object
    assert loads.load_index(tuple(list(views))) is None


def balancer_with(strategy: str, params: dict, n: int) -> tuple[Balancer, LoadTracker, PolicySpec]:
    registry = PolicyRegistry()
    policy = registry.get(strategy)
    assert policy is not None
    spec = PolicySpec(name="p", models=("*",), strategy=strategy, params=policy.parse(params))
    loads = LoadTracker(RouterMetrics())
    balancer = Balancer(policies=[spec], registry=registry, metrics=RouterMetrics(), loads=loads, stale_after=5.0,
                        rng=random.Random(1))
    balancer.set_endpoints([Endpoint(f"e{i}", f"http://e{i}", ("m",)) for i in range(n)])
    return balancer, loads, spec


def test_least_connections_through_the_balancer_follows_live_counts():
    balancer, loads, _spec = balancer_with("least-connections", {}, 5)
    assert loads.load_index(balancer.candidates("m")) is not None
    req = RequestInfo(model="m", request_id="r", headers={}, body={})
    held = []
    for _ in range(14):  # each pick goes to a least-loaded endpoint, so the counts stay level: 3,3,3,3,2
        view = balancer.pick(req)
        assert view is not None
        assert loads.in_flight(view.id) == min(loads.in_flight(f"e{i}") for i in range(5))
        held.append(loads.track(view.id))
        held[-1].__enter__()
    assert sorted(loads.in_flight(f"e{i}") for i in range(5)) == [2, 3, 3, 3, 3]
    for track in held:
        track.__exit__(None, None, None)


def test_a_rebuild_reindexes_the_new_pool_and_drops_the_old_one():
    balancer, loads, _spec = balancer_with("least-connections", {}, 3)
    old = balancer.candidates("m")
    with loads.track("e1"):
        balancer.set_endpoints([Endpoint(f"e{i}", f"http://e{i}", ("m",)) for i in range(4)])
        new = balancer.candidates("m")
        assert loads.load_index(old) is None
        index = loads.load_index(new)
        assert index is not None and index.count("e1") == 1 and index.total == 1
    assert index.total == 0  # the request that started before the rebuild ends in the new index


def test_bounded_consistent_hashing_reads_the_pool_total_from_the_index():
    balancer, loads, _spec = balancer_with("consistent-hash", {"maxLoadFactor": 1.25}, 4)
    pool = balancer.candidates("m")
    req = RequestInfo(model="m", request_id="r", headers={"x-session-id": "s"}, body={})
    owner = balancer.pick(req)
    assert owner is not None
    # Fill the owner to the bound: the next request for its key must overflow to another endpoint.
    tracks = []
    while loads.in_flight(owner.id) < load_bound(pool, loads, 1.25):
        tracks.append(loads.track(owner.id))
        tracks[-1].__enter__()
    assert loads.load_index(pool).total == len(tracks)
    view = balancer.pick(req)
    assert view is not None and view.id != owner.id
    for track in tracks:
        track.__exit__(None, None, None)
    assert balancer.pick(req).id == owner.id


@PROPERTY
@given(n=st.integers(1, 40), key=st.text(min_size=1, max_size=12))
def test_the_ring_walk_visits_nodes_in_uhashrings_order_without_copying_the_ring(n, key):
    ring = HashRing(nodes=[f"e{i}" for i in range(n)])
    assert list(ring_walk(ring, key)) == list(ring.iterate_nodes(key))


def test_a_bounded_walk_past_many_full_endpoints_is_capped_and_takes_the_least_loaded():
    # 80 endpoints. The key's owner and the next 36 on its walk hold 10 requests (over the bound of 7), the 38th
    # holds 1 and is where an uncapped walk would stop; one endpoint further on is idle. Capped, the walk stops
    # after MAX_BOUNDED_WALK full ones and takes the least-loaded endpoint, the idle one, and the cap is counted.
    balancer, loads, spec = balancer_with("consistent-hash", {"maxLoadFactor": 1.25}, 80)
    pool = balancer.candidates("m")
    walk = list(ring_walk(pool_ring(balancer, spec), "k"))
    full, first_open, idle = walk[:37], walk[37], walk[60]
    tracks = []
    for view in pool:
        for _ in range(10 if view.id in full else 0 if view.id == idle else 1):
            tracks.append(loads.track(view.id))
            tracks[-1].__enter__()
    assert load_bound(pool, loads, 1.25) == 7  # ceil(1.25 * (370 + 42 + 1) / 80)
    req = RequestInfo(model="m", request_id="r", headers={"x-session-id": "k"}, body={})
    capped = balancer._metrics.policy_events.labels(spec.name, "load_bound_walk_capped")
    assert balancer.pick(req).id == idle
    assert capped._value.get() == 1
    assert first_open != idle  # where an uncapped walk would have stopped
    trace = DecisionTrace()  # an explained pick makes the same choice and says why
    assert balancer.pick(req, trace=trace).id == idle
    assert trace.reason == "load_bound_walk_capped" and trace.detail["walked"] == MAX_BOUNDED_WALK
    assert capped._value.get() == 2
    for track in tracks:
        track.__exit__(None, None, None)


def pool_ring(balancer: Balancer, spec: PolicySpec) -> HashRing:
    return balancer._pool_state[(spec.name, "m")].ring


async def test_an_endpoint_held_out_by_an_outcome_is_never_the_indexed_least_loaded_one():
    # The held-out endpoint is idle, so it is what the index ranks first; picks must still avoid it until the
    # coalesced rebuild, and after it (its pool, re-indexed without it).
    ctx = build_context(parse_settings({
        "endpoints": [{"id": f"gpu-{i}", "url": f"http://127.0.0.1:{9 + i}", "models": ["m"]} for i in range(4)],
        "policies": [{"name": "lc", "strategy": "least-connections",
                      "outlierDetection": {"consecutiveFailures": 1, "maxEjectionPercent": 100},
                      "panicThreshold": 0}],
        "telemetry": {"enabled": False}, "redis": {"url": None}}))
    balancer, loads = ctx.balancer, ctx.loads
    held = [loads.track(f"gpu-{i}") for i in (1, 2, 3)]
    for track in held:
        track.__enter__()
    assert loads.load_index(balancer.candidates("m")) is not None
    balancer.report_outcome(balancer.policy_for("m"), "m", "gpu-0", False, "connect", probe=False)
    req = RequestInfo(model="m", request_id="r", headers={}, body={})
    assert {balancer.pick(req).id for _ in range(20)} == {"gpu-1", "gpu-2", "gpu-3"}
    await asyncio.sleep(0)  # the coalesced rebuild of the pool
    pool = balancer.candidates("m")
    assert "gpu-0" not in {v.id for v in pool} and loads.load_index(pool) is not None
    assert {balancer.pick(req).id for _ in range(20)} == {"gpu-1", "gpu-2", "gpu-3"}
    for track in held:
        track.__exit__(None, None, None)
