"""A telemetry round without a full rebuild (Balancer.refresh_telemetry).

A round that changed only telemetry values makes a new snapshot, keeps the pickers of policies that read no
telemetry (least-connections, round-robin, consistent-hash) and rebuilds only the others', over the pools
the last rebuild admitted; a round that may change a pool's shape (a GPU fault reported, held, or ended)
rebuilds fully. A refresh touches only the endpoints that reported or went stale since the last round. The
property test runs the same random rounds (reports lost, reordered, stale, GPU faults, time passing) through a
balancer that refreshes (with the housekeeping tick, as the router runs it) and a twin that rebuilds fully every
round: the snapshots, pools, adaptive scores and picks must be the same after every round.
"""

from __future__ import annotations

import asyncio
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from router.config.settings import PolicySpec
from router.model import Endpoint, RequestInfo, Telemetry
from router.routing.balancer import Balancer
from router.routing.loads import LoadTracker
from router.routing.policies.registry import PolicyRegistry
from router.runtime.metrics import RouterMetrics
from router.telemetry.feed import MemoryStore, TelemetryFeed
from worker.protocol import EngineSample, GpuSample, TelemetryRecord

STALE_AFTER = 5.0


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_balancer(clock: Clock, n: int = 6) -> tuple[Balancer, RouterMetrics]:
    registry = PolicyRegistry()
    specs = []
    for name, strategy, model, params in (("lc", "least-connections", "a", {}), ("ad", "adaptive", "b", {}),
                                          ("ch", "consistent-hash", "c", {}), ("all", "adaptive", "d", {"choices": "all"})):
        policy = registry.get(strategy)
        assert policy is not None
        specs.append(PolicySpec(name=name, models=(model,), strategy=strategy, params=policy.parse(params)))
    metrics = RouterMetrics()
    balancer = Balancer(policies=specs, registry=registry, metrics=metrics, loads=LoadTracker(metrics),
                        stale_after=STALE_AFTER, rng=random.Random(1), clock=clock)
    # Every endpoint serves two or three of the models: pools overlap, as in a real fleet.
    balancer.set_endpoints([Endpoint(f"e{i}", f"http://e{i}", (("a", "b", "d"), ("b", "c"), ("a", "c", "d"))[i % 3])
                            for i in range(n)])
    return balancer, metrics


def count(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_round_of_new_values_refreshes_without_a_rebuild_and_keeps_telemetry_blind_pickers():
    clock = Clock()
    balancer, metrics = make_balancer(clock)
    kept = {m: balancer._pickers[m][1] for m in ("a", "c")}
    pool_a = balancer.candidates("a")
    index_a = balancer.loads.load_index(pool_a)
    adaptive_before = balancer._pickers["b"][1]
    rebuilds, version = count(metrics, "fleetroute_snapshot_rebuilds_total"), balancer.snapshot.version
    for i in range(6):
        balancer.report_telemetry(f"e{i}", Telemetry(reported_at=clock.now, gpu_util=i / 10, kv_cache_usage=0.5))
    balancer.refresh_telemetry()
    assert count(metrics, "fleetroute_snapshot_rebuilds_total") == rebuilds
    assert count(metrics, "fleetroute_snapshot_refreshes_total") == 1
    assert balancer.snapshot.version == version + 1
    assert balancer.snapshot.by_id["e1"].telemetry.gpu_util == 0.1
    for model, picker in kept.items():  # least-connections and consistent-hash: untouched, index and all
        assert balancer._pickers[model][1] is picker
    assert balancer.candidates("a") is pool_a and balancer.loads.load_index(pool_a) is index_a
    # adaptive reads telemetry: a new picker over the same endpoints, with the new values
    assert balancer._pickers["b"][1] is not adaptive_before
    assert [v.id for v in balancer.candidates("b")] == [v.id for v in balancer.snapshot.views
                                                          if "b" in v.endpoint.models]
    assert all(v.telemetry is not None for v in balancer.candidates("b"))
    assert balancer.loads.load_index(balancer.candidates("b")) is not None  # rebound to the new tuple


def test_an_explanation_shows_the_rounds_telemetry_for_a_kept_pool():
    clock = Clock()
    balancer, _metrics = make_balancer(clock)
    balancer.report_telemetry("e0", Telemetry(reported_at=clock.now, gpu_util=0.75))
    balancer.refresh_telemetry()
    from router.routing.policies.base import DecisionTrace
    trace = DecisionTrace()
    balancer.pick(RequestInfo(model="a", request_id="r", headers={}, body={}), trace=trace)
    assert trace.candidates["e0"]["gpu_util"] == 0.75  # from the snapshot, not the kept pool's older view


def test_a_gpu_fault_rebuilds_fully_and_so_does_its_end():
    clock = Clock()
    balancer, metrics = make_balancer(clock)
    rebuilds = count(metrics, "fleetroute_snapshot_rebuilds_total")
    balancer.report_telemetry("e0", Telemetry(reported_at=clock.now, gpu_lost=True))
    balancer.refresh_telemetry()
    assert count(metrics, "fleetroute_snapshot_rebuilds_total") == rebuilds + 1
    assert "e0" not in {v.id for v in balancer.candidates("a")}
    # No further report: the fault's last word goes stale, and the round after that re-admits it.
    clock.now += STALE_AFTER + 1
    balancer.refresh_telemetry()
    assert "e0" in {v.id for v in balancer.candidates("a")}
    assert count(metrics, "fleetroute_snapshot_rebuilds_total") == rebuilds + 2
    # Calm again: the next round is a refresh.
    clock.now += 1
    balancer.refresh_telemetry()
    assert count(metrics, "fleetroute_snapshot_rebuilds_total") == rebuilds + 2


def test_a_report_that_clears_a_fault_rebuilds():
    clock = Clock()
    balancer, _metrics = make_balancer(clock)
    balancer.report_telemetry("e3", Telemetry(reported_at=clock.now, gpu_lost=True))
    balancer.refresh_telemetry()
    assert "e3" not in {v.id for v in balancer.candidates("a")}
    clock.now += 1
    balancer.report_telemetry("e3", Telemetry(reported_at=clock.now))
    balancer.refresh_telemetry()
    assert "e3" in {v.id for v in balancer.candidates("a")}


ROUND = st.tuples(
    st.floats(0.0, 4.0),  # time passing before the round
    st.lists(st.tuples(st.integers(0, 8), st.floats(0.0, 8.0), st.booleans(), st.booleans(), st.floats(0, 1)),
             max_size=10),  # reports: (endpoint, age when received, delivered (else lost), gpu lost, gpu_util)
)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(rounds=st.lists(ROUND, min_size=1, max_size=12))
def test_refreshing_rounds_route_as_full_rebuilds_would_with_lost_and_reordered_reports(rounds):
    clock = Clock()
    refreshed, _m1 = make_balancer(clock, n=9)
    rebuilt, _m2 = make_balancer(clock, n=9)
    for elapsed, reports in rounds:
        clock.now += elapsed
        for i, age, delivered, lost, util in reports:
            if not delivered:
                continue  # lost on the way: neither balancer hears of it
            # `age` may make this report older than one already received: reordered delivery.
            t = Telemetry(reported_at=clock.now - age, gpu_util=util, gpu_lost=lost and util > 0.8,
                          num_waiting=float(int(util * 40)) if i % 2 else None, kv_cache_usage=1 - util if lost else None)
            refreshed.report_telemetry(f"e{i}", t)
            rebuilt.report_telemetry(f"e{i}", t)
        refreshed.refresh_telemetry()
        refreshed.tick()  # the housekeeping task's, every telemetry interval
        rebuilt.rebuild()
        assert refreshed.snapshot.views == rebuilt.snapshot.views
        for model in ("a", "b", "c", "d"):
            mine, theirs = refreshed.candidates(model), rebuilt.candidates(model)
            assert [(v.id, v.weight_factor) for v in mine] == [(v.id, v.weight_factor) for v in theirs]
            if model in ("b", "d"):  # adaptive's picker is built from these views: same telemetry too
                assert mine == theirs
                scores = [(refreshed._pickers[model][1].score(v, 2.0), rebuilt._pickers[model][1].score(v, 2.0))
                          for v in mine]
                assert all(a == b for a, b in scores)
                for k in range(3):
                    refreshed._rng.seed(k)
                    rebuilt._rng.seed(k)
                    req = RequestInfo(model=model, request_id=str(k), headers={}, body={})
                    assert refreshed.pick(req) == rebuilt.pick(req)


def test_a_round_touches_only_the_endpoints_that_reported():
    clock = Clock()
    balancer, metrics = make_balancer(clock, n=9)
    for i in range(9):
        balancer.report_telemetry(f"e{i}", Telemetry(reported_at=clock.now, gpu_util=0.5))
    balancer.refresh_telemetry()
    before = balancer.snapshot
    pool_b = balancer.candidates("b")
    updated = count(metrics, "fleetroute_snapshot_refreshed_endpoints_total")
    clock.now += 1
    balancer.report_telemetry("e1", Telemetry(reported_at=clock.now, gpu_util=0.9))
    balancer.refresh_telemetry()
    after = balancer.snapshot
    assert count(metrics, "fleetroute_snapshot_refreshed_endpoints_total") == updated + 1
    assert after.by_id["e1"].telemetry.gpu_util == 0.9 and before.by_id["e1"].telemetry.gpu_util == 0.5
    assert all(after.by_id[v.id] is v for v in before.views if v.id != "e1")  # shared, not rebuilt
    assert [v.id for v in balancer.candidates("b")] == [v.id for v in pool_b]
    assert balancer.candidates("b")[[v.id for v in pool_b].index("e1")].telemetry.gpu_util == 0.9
    assert count(metrics, "fleetroute_picker_refreshes_total", strategy="adaptive", how="patched") >= 1
    # The reporter's age gauge moved; the others' kept the value of their last report (1 s ago at this round).
    assert age(metrics, "e1") == 0.0 and age(metrics, "e2") == 0.0
    # A round with nothing new changes nothing, not even the snapshot.
    balancer.refresh_telemetry()
    assert balancer.snapshot is after


def test_a_report_older_than_the_held_one_is_dropped():
    clock = Clock()
    balancer, metrics = make_balancer(clock)
    balancer.report_telemetry("e0", Telemetry(reported_at=clock.now, gpu_util=0.2))
    balancer.report_telemetry("e0", Telemetry(reported_at=clock.now - 1, gpu_util=0.9))  # delivered late
    balancer.refresh_telemetry()
    assert balancer.snapshot.by_id["e0"].telemetry.gpu_util == 0.2
    assert count(metrics, "fleetroute_telemetry_out_of_order_total") == 1


def test_a_lost_agents_report_goes_stale_without_another_round_looking_at_every_endpoint():
    clock = Clock()
    balancer, metrics = make_balancer(clock, n=9)
    for i in range(9):
        balancer.report_telemetry(f"e{i}", Telemetry(reported_at=clock.now - (3.0 if i == 4 else 0.0), gpu_util=0.5))
    balancer.refresh_telemetry()
    assert count(metrics, "fleetroute_telemetry_unknown_endpoints") == 0
    clock.now += STALE_AFTER - 1  # e4's report is now past staleAfter, the others' not
    balancer.refresh_telemetry()
    assert balancer.snapshot.by_id["e4"].telemetry is None
    assert all(balancer.snapshot.by_id[f"e{i}"].telemetry is not None for i in range(9) if i != 4)
    assert count(metrics, "fleetroute_telemetry_unknown_endpoints") == 1
    assert age(metrics, "e4") == STALE_AFTER + 2
    assert all(v.telemetry is None for v in balancer.candidates("b") if v.id == "e4")


def age(metrics: RouterMetrics, endpoint: str) -> float | None:
    return metrics.registry.get_sample_value("fleetroute_telemetry_age_seconds", {"endpoint": endpoint})


def test_the_feed_hands_on_a_record_read_again_unchanged_only_once():
    clock = Clock()
    balancer, metrics = make_balancer(clock, n=3)
    store = MemoryStore()
    feed = TelemetryFeed(store=store, balancer=balancer, metrics=metrics, wall_clock=lambda: 1000.0 + clock.now,
                         mono_clock=clock)

    def publish(endpoint: str, util: float) -> None:
        store.put(TelemetryRecord(endpoint, 1000.0 + clock.now, 1, 1.0, "sim", GpuSample(util=util),
                                  EngineSample(up=True, num_waiting=2.0)))

    for i in range(3):
        publish(f"e{i}", 0.5)
    asyncio.run(feed.refresh())
    assert count(metrics, "fleetroute_snapshot_refreshed_endpoints_total") == 3
    clock.now += 1
    publish("e1", 0.7)
    asyncio.run(feed.refresh())  # the embedded store reads every record: two of them unchanged
    assert count(metrics, "fleetroute_snapshot_refreshed_endpoints_total") == 4
    assert balancer.snapshot.by_id["e1"].telemetry.gpu_util == 0.7
