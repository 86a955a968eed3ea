"""The composite strategy (filter -> score -> pick from configured scorers), and adaptive built on it."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from router.model import Telemetry
from router.routing.policies.base import DecisionTrace, PolicyConfigError
from router.routing.policies.prefix_aware import block_hashes
from tests.test_policies import REGISTRY, FixedLoads, build, req, tel, views


def chat(system: str, question: str = "q") -> dict:
    return {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


# ---- parsing ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("params", "field", "message"), [
    ({}, "scorers", "is required"),
    ({"scorers": {"gpu": 1, "vibes": 1}}, "scorers.vibes", "unknown scorer"),
    ({"scorers": {"gpu": "lots"}}, "scorers.gpu", "must be a number"),
    ({"scorers": {"gpu": 0, "load": 0}}, "scorers", "at least one weight must be positive"),
    ({"scorers": {"queue": {"weight": 1, "maxQueue": 0}}}, "scorers.queue.maxQueue", "must be between 1 and 1000000, got 0"),
    ({"scorers": {"memory": {"weight": 1, "signal": "num_waiting"}}}, "scorers.memory.signal", "must be one of"),
    ({"scorers": {"load": {"weight": 1, "signal": "gpu_util"}}}, "scorers.load.signal", "unknown field"),
    ({"scorers": {"load": 1}, "pick": "argmax"}, "pick", "must be one of least-load, best-score"),
    ({"scorers": {"load": 1}, "choices": 0}, "choices", "must be an integer from 1 to 4096 or all"),
    ({"scorers": {"load": 1}, "prefix": {"blockChars": 128}}, "prefix", "no prefix scorer is weighted"),
    ({"scorers": {"prefix": 1}, "prefix": {"maxImbalance": 3}}, "prefix.maxImbalance", "unknown parameter"),
    ({"scorers": {"load": 1}, "loadGuard": {"sigmaK": 0}}, "loadGuard.sigmaK", "must be a number > 0.0"),
    # YAML's .inf and .nan would otherwise reach the pick path (math.ceil(inf) fails every request).
    ({"scorers": {"load": 1}, "loadGuard": {"maxLoadFactor": float("inf")}}, "loadGuard.maxLoadFactor",
     "must be a number >= 1.0"),
    ({"scorers": {"load": 1}, "loadGuard": {"maxImbalance": float("inf")}}, "loadGuard.maxImbalance",
     "must be an integer"),
    ({"scorers": {"gpu": float("nan")}}, "scorers.gpu", "must be a number"),
])
def test_bad_parameters_name_the_field(params, field: str, message: str) -> None:
    with pytest.raises(PolicyConfigError) as exc:
        REGISTRY.get("composite").parse(params)
    assert exc.value.field == field and message in exc.value.message


def test_weights_are_normalised_and_zero_weights_dropped() -> None:
    config = REGISTRY.get("composite").parse({"scorers": {"gpu": 3, "queue": {"weight": 1, "maxQueue": 8}, "load": 0}})
    assert [(s.name, s.weight) for s in config.scorers] == [("gpu", 0.75), ("queue", 0.25)]
    assert config.scorers[1].max_queue == 8 and config.choices == 2 and config.pick == "least-load"


# ---- adaptive is composite -----------------------------------------------------------------------------


def test_adaptive_picks_exactly_as_the_composite_with_its_three_scorers() -> None:
    vs = views("a", "b", "c", "d", telemetry={"a": tel(0.9, 0.2, 3), "b": tel(0.3, 0.5, 0), "c": tel(0.5, 0.1, 9),
                                             "d": None})
    composite = {"scorers": {"gpu": 0.6, "memory": 0.3, "queue": 0.1}}
    for selection in ("least-load", "best-score"):
        a = build("adaptive", vs, {"selection": selection}, seed=4)
        c = build("composite", vs, {**composite, "pick": selection}, seed=4)
        loads = FixedLoads({"a": 1, "b": 7, "c": 2, "d": 4})
        assert [a.pick(req(), loads, frozenset()).id for _ in range(300)] == \
               [c.pick(req(), loads, frozenset()).id for _ in range(300)]


def test_least_load_lets_an_endpoint_hold_load_in_proportion_to_its_score() -> None:
    # Two endpoints, scores 0.8 and 0.4 (GPU scorer only), every request stays in flight, choices: all. Each
    # pick goes to the smaller (load + 1) / score, so loads grow as (la + 1) / 0.8 ~ (lb + 1) / 0.4: a holds
    # twice b's load plus one, at every step (a deterministic water-filling, no herding).
    vs = views("a", "b", telemetry={"a": tel(0.2), "b": tel(0.6)})
    picker = build("composite", vs, {"scorers": {"gpu": 1}, "choices": "all"})
    loads = FixedLoads({"a": 0, "b": 0})
    for _ in range(300):
        chosen = picker.pick(req(), loads, frozenset())
        loads.counts[chosen.id] += 1
    assert loads.counts["a"] + 1 == pytest.approx(2 * (loads.counts["b"] + 1), abs=2)


def test_best_score_with_stale_telemetry_herds_where_least_load_spreads() -> None:
    # The failure that moved adaptive to least-load: between two reports every request sees the same
    # telemetry. With best-score, a (idle at the last report) wins every pair it is in until its queue term
    # (0.1 of the score) offsets a 0.6 x 0.5 GPU gap, i.e. until 0.3 / 0.1 x 32 = 96 requests in flight.
    vs = views("a", "b", telemetry={"a": tel(0.0, 0.0, 0), "b": tel(0.5, 0.0, 0)})
    outcomes = {}
    for selection in ("best-score", "least-load"):
        picker = build("adaptive", vs, {"selection": selection})
        loads = FixedLoads({"a": 0, "b": 0})
        for _ in range(60):
            loads.counts[picker.pick(req(), loads, frozenset()).id] += 1
        outcomes[selection] = loads.counts["b"]
    assert outcomes["best-score"] == 0  # every one of 60 requests went to a
    # least-load: scores 1.0 vs 0.7, so b takes about 0.7 / 1.7 of them.
    assert outcomes["least-load"] == pytest.approx(60 * 0.7 / 1.7, abs=3)


# ---- scorers -------------------------------------------------------------------------------------------


def test_load_scorer_alone_is_least_connections() -> None:
    picker = build("composite", views("a", "b", "c"), {"scorers": {"load": 1}, "choices": "all"})
    loads = FixedLoads({"a": 5, "b": 2, "c": 9})
    assert {picker.pick(req(), loads, frozenset()).id for _ in range(50)} == {"b"}
    assert picker.pick(req(), loads, frozenset({"b"})).id == "a"


def test_unknown_telemetry_scores_the_mean_of_the_others_and_is_counted() -> None:
    events: list[str] = []
    vs = views("a", "b", "c", telemetry={"a": tel(0.2), "b": tel(0.6)})
    picker = build("composite", vs, {"scorers": {"gpu": 1}}, events=events)
    assert picker.score(vs[2], 0) == pytest.approx((picker.score(vs[0], 0) + picker.score(vs[1], 0)) / 2)
    only_c = build("composite", views("c"), {"scorers": {"gpu": 1}}, events=events)
    only_c.pick(req(), FixedLoads(), frozenset())
    assert events == ["telemetry_unknown"]


def test_slow_start_scales_the_score_down() -> None:
    from dataclasses import replace

    vs = views("a", "b", telemetry={"a": tel(0.2), "b": tel(0.2)})
    ramping = (vs[0], replace(vs[1], weight_factor=0.25))
    picker = build("composite", ramping, {"scorers": {"gpu": 1}, "choices": "all"})
    assert picker.score(ramping[1], 0) == pytest.approx(0.25 * picker.score(ramping[0], 0))
    counts = Counter(picker.pick(req(), FixedLoads({"a": 2, "b": 0}), frozenset()).id for _ in range(20))
    assert counts == {"a": 20}  # (2 + 1) / 0.8 < (0 + 1) / 0.2


def test_prefix_affinity_softens_with_load_instead_of_switching_off() -> None:
    # prefix 0.5 + load 0.5, choices: all. A prompt whose blocks are cached at a scores 0.5 more there.
    # least-load key: (load + 1) / score. With a idle, a wins; as a fills up its load score falls, so at some
    # load the others win: affinity is kept while it is cheap and given up gradually, no hard threshold.
    vs = views("a", "b", "c")
    policy = REGISTRY.get("composite")
    config = policy.parse({"scorers": {"prefix": 0.5, "load": 0.5}, "choices": "all",
                           "prefix": {"blockChars": 64, "maxBlocksPerEndpoint": 1000}})
    state = policy.new_state()
    picker = policy.build(vs, config, state, random.Random(1), lambda e: None)
    body = chat("s" * 640)
    state.record("a", block_hashes(body, 64, 64))
    wins = []
    for load_a in range(0, 12):
        loads = FixedLoads({"a": load_a, "b": 1, "c": 1})
        wins.append(picker.pick(req(body=body), loads, frozenset()).id)
        state.record("a", block_hashes(body, 64, 64))  # keep a the only holder of the prefix
        for other in ("b", "c"):
            state.forget_endpoints(frozenset({other}))
    assert wins[0] == "a" and wins[1] == "a"  # affinity under balance
    assert "a" not in wins[-4:]  # given up once a carries far more than the others
    assert wins.index(next(w for w in wins if w != "a")) > 1


def test_load_guard_filters_overloaded_endpoints_but_never_all() -> None:
    events: list[str] = []
    picker = build("composite", views("a", "b", "c"), {"scorers": {"prefix": 1}, "choices": "all",
                                                         "loadGuard": {"maxImbalance": 2}}, events=events)
    assert {picker.pick(req(), FixedLoads({"a": 9, "b": 0, "c": 1}), frozenset()).id for _ in range(20)} <= {"b", "c"}
    assert "guard_filtered" in events


# ---- explanations --------------------------------------------------------------------------------------


def test_the_trace_records_what_was_compared_and_matches_the_choice() -> None:
    vs = views("a", "b", "c", telemetry={"a": tel(0.1), "b": tel(0.5), "c": tel(0.9)})
    picker = build("composite", vs, {"scorers": {"gpu": 1}, "choices": 2}, seed=3)
    loads = FixedLoads({"a": 4, "b": 1, "c": 0})
    for _ in range(30):
        trace = DecisionTrace()
        chosen = picker.pick(req(), loads, frozenset(), trace)
        assert len(trace.sampled) == 2 and chosen.id in trace.sampled
        assert set(trace.candidates) == set(trace.sampled)
        assert min(trace.sampled, key=lambda i: trace.candidates[i]["key"]) == chosen.id
        assert trace.reason == "least_load_per_score"


def test_the_score_reads_the_configured_signals() -> None:
    t = Telemetry(reported_at=0.0, gpu_util=0.0, gpu_mem_util=0.9, kv_cache_usage=0.2, num_waiting=4, num_running=12)
    vs = views("a", telemetry={"a": t})
    picker = build("composite", vs, {"scorers": {"memory": {"weight": 1, "signal": "gpu_mem_util"},
                                                 "queue": {"weight": 1, "signal": "num_requests", "maxQueue": 32}}})
    assert picker.score(vs[0], 0) == pytest.approx(0.5 * 0.1 + 0.5 * (1 - 16 / 32))


def test_endpoint_weights_scale_the_load_each_endpoint_is_given() -> None:
    # Equal telemetry, weights 2 and 1 (an H100 beside an A100): least-load compares (load + 1) / weight,
    # so with every request left in flight the heavier endpoint holds about twice the load.
    from dataclasses import replace

    from router.model import EndpointView

    vs = views("big", "small", telemetry={"big": tel(0.5), "small": tel(0.5)})
    weighted = (replace(vs[0], endpoint=replace(vs[0].endpoint, weight=2.0)), vs[1])
    assert isinstance(weighted[0], EndpointView)
    picker = build("adaptive", weighted, {"choices": "all"})
    loads = FixedLoads({"big": 0, "small": 0})
    for _ in range(299):
        loads.counts[picker.pick(req(), loads, frozenset()).id] += 1
    assert loads.counts["big"] + 1 == pytest.approx(2 * (loads.counts["small"] + 1), abs=2)


def test_a_composite_policy_without_its_block_is_a_config_error_naming_the_field() -> None:
    from router.config.settings import ConfigError, parse_settings

    with pytest.raises(ConfigError, match=r"^policies\[0\]\.composite\.scorers: is required"):
        parse_settings({"endpoints": [{"id": "a", "url": "http://127.0.0.1:1", "models": ["m"]}],
                        "policies": [{"name": "mix", "strategy": "composite"}], "redis": {"url": None}})


@pytest.mark.parametrize("strategy", ["least-connections", "prefix-aware"])
def test_load_aware_strategies_compare_load_per_unit_of_endpoint_weight(strategy: str) -> None:
    # least-connections (and prefix-aware's load fallback) take (load + 1) / weight - 1: with weights 2 and 1
    # and every request left in flight, the heavier endpoint ends up holding about twice the load.
    from dataclasses import replace

    vs = views("big", "small")
    weighted = (replace(vs[0], endpoint=replace(vs[0].endpoint, weight=2.0)), vs[1])
    picker = build(strategy, weighted)
    loads = FixedLoads({"big": 0, "small": 0})
    for _ in range(299):
        loads.counts[picker.pick(req(), loads, frozenset()).id] += 1
    assert loads.counts["big"] + 1 == pytest.approx(2 * (loads.counts["small"] + 1), rel=0.1)
