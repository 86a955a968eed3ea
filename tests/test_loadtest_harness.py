"""The load-test harness's parts: arrival processes, workloads, statistics, capacity and scenario files."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

import pytest

from loadtest import arrivals
from loadtest.client import PlannedRequest, Result
from loadtest.report import capacity, render_markdown
from loadtest.runner import build_plan
from loadtest.scenario import load_scenario, parse_scenario, with_gateway
from loadtest.stats import Slo, percentile, summarise
from loadtest.workload import (
    ChatWorkload,
    Priorities,
    SessionsWorkload,
    SharedPrefixWorkload,
    TraceWorkload,
    read_trace,
    token_text,
)
from router.config.settings import ConfigError
from worker.sim.tokenizer import render_chat, tokenize

DATA = Path(__file__).parent / "data" / "traces"
ROOT = Path(__file__).parent.parent
SCENARIOS = ROOT / "loadtest" / "scenarios"


# ---- arrivals -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("cv", [1.0, 3.0])
def test_gamma_arrivals_have_the_asked_rate_and_burstiness(cv: float) -> None:
    times = arrivals.gamma(50.0, cv, 400.0, random.Random(3))
    assert len(times) / 400.0 == pytest.approx(50.0, rel=0.1)
    assert arrivals.gap_cv(times) == pytest.approx(cv, rel=0.1)
    assert times == sorted(times) and all(0 <= t < 400 for t in times)


def test_the_same_seed_gives_the_same_arrivals_for_every_policy() -> None:
    assert arrivals.gamma(10, 2, 60, random.Random(5)) == arrivals.gamma(10, 2, 60, random.Random(5))
    assert arrivals.gamma(10, 2, 60, random.Random(5)) != arrivals.gamma(10, 2, 60, random.Random(6))


def test_a_rescaled_trace_keeps_its_burst_pattern_at_the_target_rate() -> None:
    trace = arrivals.gamma(2.0, 4.0, 3000.0, random.Random(1))  # a bursty "trace" at 2 req/s
    times = arrivals.rescaled(trace, 40.0, 100.0)
    assert len(times) / 100.0 == pytest.approx(40.0, rel=0.15)
    assert arrivals.gap_cv(times) == pytest.approx(arrivals.gap_cv(trace), rel=0.15)


def test_constant_arrivals_are_evenly_spaced() -> None:
    assert arrivals.constant(4.0, 1.0) == [0.0, 0.25, 0.5, 0.75]


@pytest.mark.parametrize(("call", "message"), [
    (lambda: arrivals.gamma(0, 1, 10, random.Random()), "rate must be > 0"),
    (lambda: arrivals.gamma(1, 0, 10, random.Random()), "cv must be > 0"),
    (lambda: arrivals.rescaled([1.0], 1, 10), "at least two arrivals"),
])
def test_bad_arrival_parameters_are_refused_with_a_reason(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()


# ---- workloads ------------------------------------------------------------------------------------------


def test_generated_text_has_exactly_the_planned_tokens_for_the_simulator() -> None:
    assert len(tokenize(token_text(random.Random(1), 777))) == 777
    plan = ChatWorkload(model="m").requests([0.0] * 20, random.Random(2))
    for p in plan:
        user = p.body["messages"][1]["content"]
        assert len(tokenize(user)) == p.prompt_tokens
        assert p.body["max_tokens"] == p.output_tokens


def test_sessions_resend_their_history_so_turns_share_a_growing_prefix() -> None:
    plan = SessionsWorkload(model="m", continue_p=0.9, think_time=0.5).requests([i * 0.1 for i in range(40)],
                                                                                 random.Random(4))
    by_session: dict[str, list[PlannedRequest]] = {}
    for p in plan:
        by_session.setdefault(p.headers["x-session-id"], []).append(p)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi
    for turns in multi:
        for earlier, later in zip(turns, turns[1:], strict=False):
            prefix = render_chat(earlier.body["messages"]).removesuffix("<|start_header_id|>assistant<|end_header_id|>\n\n")
            assert render_chat(later.body["messages"]).startswith(prefix)
            assert later.at - earlier.at >= 0.5  # the user read the answer first (think time)


def test_shared_prefix_groups_share_their_context_and_follow_the_skew() -> None:
    workload = SharedPrefixWorkload(model="m", groups=8, prefix_tokens=300, question_tokens=20, skew=1.0)
    plan = workload.requests([0.0] * 800, random.Random(1))
    contexts: dict[str, set[str]] = {}
    for p in plan:
        contexts.setdefault(p.headers["x-session-id"], set()).add(p.body["messages"][0]["content"])
    assert all(len(texts) == 1 for texts in contexts.values())  # one context per group
    assert len({next(iter(t)) for t in contexts.values()}) == len(contexts)  # and each group its own
    counts = statistics.multimode([p.headers["x-session-id"] for p in plan])
    assert counts == ["group-0"]  # Zipf: the first group is the most popular
    again = workload.requests([0.0] * 10, random.Random(9))  # same context text in another run
    assert again[0].body["messages"][0]["content"] in contexts[again[0].headers["x-session-id"]]


def test_azure_trace_replay_keeps_the_traces_lengths() -> None:
    records = read_trace(DATA / "splitwise_conv_head.csv")
    assert len(records) == 50 and records[0].prompt_tokens == 374 and records[0].output_tokens == 44
    plan = TraceWorkload(model="m", records=tuple(records)).requests([0.0] * 50, random.Random(1))
    for p, r in zip(plan, records, strict=True):
        assert len(tokenize(p.body["prompt"])) == r.prompt_tokens
        assert p.body["max_tokens"] == r.output_tokens and p.path == "/v1/completions"


def test_mooncake_hash_ids_become_shared_prompt_prefixes(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps(r) for r in [
        {"timestamp": 0, "input_length": 1300, "output_length": 10, "hash_ids": [0, 1, 2]},
        {"timestamp": 5, "input_length": 1400, "output_length": 10, "hash_ids": [0, 1, 7]},
        {"timestamp": 9, "input_length": 600, "output_length": 10, "hash_ids": [3, 4]},
    ]))
    workload = TraceWorkload(model="m", records=tuple(read_trace(trace)), length_scale=0.25)  # 128-token blocks
    a, b, c = (tokenize(p.body["prompt"]) for p in workload.requests([0.0, 1.0, 2.0], random.Random(1)))
    assert len(a) == 325 and len(b) == 350 and len(c) == 150  # lengths scaled too
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert shared == 256  # blocks 0 and 1: two 128-token blocks
    assert a[:128] != c[:128]  # different ids, different text
    assert workload.timestamps == [0.0, 0.005, 0.009]


def test_a_malformed_trace_is_refused_naming_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1}\n{"timestamp": 1}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not a Mooncake trace record"):
        read_trace(bad)


def test_mixed_priorities_follow_their_weights() -> None:
    plan = ChatWorkload(model="m").requests([0.0] * 2000, random.Random(1))
    mixed = Priorities({"high": 0.25, "low": 0.75}).apply(plan, random.Random(2))
    high = sum(p.headers["x-priority"] == "high" for p in mixed)
    assert high / len(mixed) == pytest.approx(0.25, abs=0.03)
    assert all(p.priority == p.headers["x-priority"] for p in mixed)


# ---- statistics ---------------------------------------------------------------------------------------


def result(at: float, ttft: float | None, e2e: float | None, gaps: list[float], error: str | None = None) -> Result:
    r = Result(PlannedRequest(at=at, path="/v1/completions", body={}), sent_at=at, ttft=ttft, e2e=e2e,
               output_tokens=len(gaps) + 1 if ttft is not None else 0, itl=gaps, error=error)
    return r


def test_percentiles_are_nearest_rank() -> None:
    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50, 99, 100)
    assert percentile([], 50) is None


def test_goodput_counts_only_requests_that_met_the_slo_inside_the_window() -> None:
    slo = Slo(ttft=0.5, itl=0.05)
    results = [
        result(0.0, 0.1, 1.0, [0.01] * 9),  # in the warm-up: not counted
        result(2.0, 0.1, 1.0, [0.01] * 9),  # meets
        result(3.0, 0.9, 2.0, [0.01] * 9),  # TTFT too slow
        result(4.0, 0.1, 5.0, [0.2] * 9),  # mean ITL too slow
        result(5.0, None, None, [], error="http_503"),
        result(11.0, 0.1, 1.0, [0.01] * 9),  # meets; the window ends at the last planned arrival
    ]
    s = summarise(results, offered_rate=0.5, slo=slo, warmup=1.0)
    assert s.sent == 5 and s.ok == 4 and s.errors == {"http_503": 1}
    assert s.duration == 10.0
    # The window's work took from 1 to 12 (the request arriving at 11 answers at 12): rates are over 11 s.
    assert s.span == 11.0
    assert s.goodput_rps == pytest.approx(2 / 11.0)
    assert s.slo_attainment == pytest.approx(2 / 5)
    # The window's four successes (the warm-up request is not the window's), whenever they ended.
    assert s.throughput_rps == pytest.approx(4 / 11.0)
    assert s.goodput_rps <= s.throughput_rps <= s.realised_rate


def test_a_short_run_with_long_answers_reports_what_was_served_not_a_fraction_of_it() -> None:
    # 10 requests in 2 s, each answered after 5 s: counting only answers that end before the last arrival
    # read 0 req/s; the run served 10 requests in 7 s.
    results = [result(i * 0.2, 0.1, 5.0, [0.01] * 9) for i in range(10)]
    s = summarise(results, offered_rate=5.0, slo=Slo(ttft=0.5, itl=0.05))
    assert s.span == pytest.approx(1.8 + 5.0)
    assert s.throughput_rps == pytest.approx(10 / 6.8) and s.goodput_rps == s.throughput_rps


def test_failed_requests_count_as_infinitely_slow_in_the_percentiles() -> None:
    # 95 fast successes and 5 failures: a P99 over the successes alone would read 0.1 s and reward a policy
    # that sheds its worst requests; counting the failures, the P99 is "failed" and the P50 unchanged.
    results = [result(float(i), 0.1, 1.0, [0.01]) for i in range(95)]
    results += [result(95.0 + i, None, None, [], error="http_429") for i in range(5)]
    s = summarise(results, offered_rate=1.0, slo=Slo(ttft=0.5, itl=0.05))
    assert s.ttft["p50"] == pytest.approx(0.1) and s.ttft["p99"] == float("inf")
    assert s.ttft["mean"] == pytest.approx(0.1)  # means stay over the successes
    assert capacity([(10.0, 0.2), (20.0, s.ttft["p99"])], slo_ttft=0.5) == capacity([(10.0, 0.2)], 0.5).__class__(
        10.0, None, False)


def test_closed_loop_windows_are_send_times_and_throughput_is_users_over_latency() -> None:
    # Two users, each sending its next request when the previous one (1 s) ends, for 20 s: about 2 req/s.
    results = []
    for user in range(2):
        for k in range(20):
            r = result(0.0, 0.1, 1.0, [0.01] * 5)
            r.sent_at = k * 1.0 + user * 0.5
            results.append(r)
    s = summarise(results, offered_rate=2, slo=Slo(ttft=0.5, itl=0.05), warmup=2.0, closed=True)
    assert s.duration == pytest.approx(19.5 - 2.0)
    assert s.throughput_rps == pytest.approx(2.0, rel=0.1)
    assert s.sent == len([r for r in results if r.sent_at >= 2.0])


def test_times_of_a_time_scaled_fleet_are_reported_in_simulated_seconds() -> None:
    scale = 20.0
    results = [result(i * scale, 0.1 * scale, 1.0 * scale, [0.01 * scale] * 5) for i in range(11)]
    s = summarise(results, offered_rate=1.0, slo=Slo(ttft=0.5, itl=0.05), scale=scale)
    assert s.ttft["p50"] == pytest.approx(0.1) and s.itl["p99"] == pytest.approx(0.01)
    assert s.goodput_rps == pytest.approx(11 / 11.0) and s.duration == pytest.approx(10.0)
    assert s.span == pytest.approx(11.0)  # simulated: the last answer ends 1 s after the last arrival


@pytest.mark.parametrize(("points", "expected"), [
    # The crossing is interpolated on log(P99): log 0.5 lies 0.465 of the way from log 0.3 to log 0.9.
    ([(10, 0.1), (20, 0.3), (30, 0.9)], (20, pytest.approx(24.65, abs=0.01), False)),
    ([(10, 0.1), (20, 0.2)], (20, None, True)),  # never fails inside the sweep
    ([(10, 0.8), (20, 0.9)], (None, None, False)),  # fails from the start
    ([(30, 0.9), (10, 0.1), (20, 0.9), (40, 0.2)], (10, pytest.approx(17.32, abs=0.01), False)),  # first failure
    ([(10, 0.1), (20, None)], (10, None, False)),  # nothing succeeded at 20
    ([(10, 0.1), (20, float("inf"))], (10, None, False)),  # failures reached the P99 at 20
    ([(10, 0.1), (20, 0.25), (30, 1.0)], (20, pytest.approx(25.0), False)),  # log(P99): halfway, 0.25 -> 1.0
])
def test_capacity_is_the_last_passing_rate_before_the_first_failure(points, expected) -> None:
    c = capacity(points, slo_ttft=0.5)
    assert (c.tested, c.interpolated, c.all_pass) == expected


# ---- scenarios ------------------------------------------------------------------------------------------


def minimal(**overrides):
    raw = {"fleet": {"replicas": [{"gpu": "h100", "count": 1}]}, "workload": {"kind": "chat"},
           "load": {"rates": [5], "requests": 10}, "policies": ["round-robin"]}
    raw.update(overrides)
    return raw


@pytest.mark.parametrize(("overrides", "message"), [
    ({"fleet": {"replicas": [{"gpu": "h200x"}]}}, "fleet.replicas[0].gpu: unknown GPU profile"),
    ({"fleet": {"replicas": [{"gpu": "h100"}], "faults": [{"replica": "a100-0", "slowdown": 2}]}},
     "fleet.faults[0].replica: no such replica 'a100-0'"),
    ({"workload": {"kind": "chat", "outputMedain": 5}}, "workload.outputMedain: unknown field"),
    ({"workload": {"kind": "trace", "trace": "nope.csv"}}, "workload.trace: trace file 'nope.csv' not found"),
    ({"load": {"rates": [5], "capacityFractions": [0.5], "requests": 3}}, "set exactly one of rates or capacityFractions"),
    ({"load": {"rates": [5]}}, "set exactly one of requests"),
    ({"policies": ["adaptive", "round-robbin"]}, "policies[1].strategy: must be one of"),
    ({"policies": [{"strategy": "adaptive", "adaptive": {"weights": {"gpu": "high"}}}]},
     "policies[0].adaptive.weights.gpu: must be a number"),
    ({"policies": ["adaptive", "adaptive"]}, "labels must be unique"),
    ({"arrivals": {"process": "trace"}}, "arrivals.process: trace arrivals need a trace workload"),
    ({"slo": {"ttft": "soon"}}, "slo.ttft: must be a positive duration"),
    ({"policies": [{"strategy": "adaptive", "gateway": "nginx"}]}, "policies[0].gateway: must be one of router, envoy"),
    ({"policies": [{"peer": "nginx:least_conn", "gateway": "envoy"}]}, "policies[0].gateway: unknown field for a peer"),
])
def test_a_bad_scenario_is_refused_naming_the_field(overrides, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_scenario(minimal(**overrides))
    assert message in str(exc.value)


def test_a_policy_runs_through_envoy_with_the_same_routing_config_as_through_the_router() -> None:
    scenario = parse_scenario(minimal(policies=["adaptive", {"strategy": "round-robin", "gateway": "envoy"},
                                                "nginx:least_conn"]))
    assert [(e.label, e.gateway) for e in scenario.policies] == [
        ("adaptive", "router"), ("round-robin via envoy", "envoy"), ("nginx:least_conn", "router")]
    assert "gateway" not in scenario.policies[1].config  # the router's parser would refuse it
    both = with_gateway(scenario.policies, "both")  # `fleetroute loadtest --gateway both`
    assert [(e.label, e.gateway) for e in both] == [
        ("adaptive", "router"), ("adaptive via envoy", "envoy"), ("round-robin via envoy", "envoy"),
        ("nginx:least_conn", "router")]
    assert both[0].config == both[1].config  # one routing config, two data paths
    assert with_gateway(scenario.policies, "router") == scenario.policies
    with pytest.raises(ConfigError, match="would share a label"):
        with_gateway(parse_scenario(minimal(policies=["adaptive", {"label": "adaptive via envoy"}])).policies,
                     "both")


def test_a_scenario_can_extend_another(tmp_path: Path) -> None:
    (tmp_path / "base.yaml").write_text(json.dumps(minimal(name="base", seed=4)))
    (tmp_path / "child.yaml").write_text("extends: base.yaml\nname: child\nfleet: {faults: [{replica: h100-0, slowdown: 3}]}\n")
    child = load_scenario(tmp_path / "child.yaml")
    assert (child.name, child.seed, child.fleet.replicas[0].gpu) == ("child", 4, "h100")
    assert child.fleet.faults[0].slowdown == 3
    (tmp_path / "loop.yaml").write_text("extends: loop.yaml\n")
    with pytest.raises(ConfigError, match="extends itself"):
        load_scenario(tmp_path / "loop.yaml")


# The shipped traces' first rows under the full traces' names: a clone without the workplace's shared/ (where
# loadtest/scenario.py finds the full files) still parses every scenario.
TRACE_HEADS = {"mooncake_conversation_trace.jsonl": "mooncake_conversation_head.jsonl",
               "vidur_splitwise_conv.csv": "splitwise_conv_head.csv"}


@pytest.mark.parametrize("path", sorted(SCENARIOS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_scenario_parses_and_its_points_differ_only_in_rate(
        path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Each point of a sweep replays the same arrival sequence at its own rate: twice the rate, the arrivals
    # at half the times (so a higher point never carries less load by chance). The requests are the same
    # too, except in multi-turn sessions: a user's think time does not shrink with the load, so at a higher
    # rate more arrivals open new sessions.
    for full, head in TRACE_HEADS.items():
        (tmp_path / full).write_bytes((ROOT / "tests" / "data" / "traces" / head).read_bytes())
    monkeypatch.setenv("FLEETROUTE_TRACE_DIR", str(tmp_path))
    scenario = load_scenario(path)
    slow, fast = build_plan(scenario, 10.0), build_plan(scenario, 20.0)
    assert slow and slow == build_plan(scenario, 10.0)
    n = min(len(slow), len(fast))
    assert [p.at for p in fast[:n]] == pytest.approx([p.at / 2 for p in slow[:n]])
    if scenario.workload.kind != "sessions":
        assert [p.body for p in fast[:n]] == [p.body for p in slow[:n]]


def test_the_report_names_every_policy_and_compares_with_round_robin() -> None:
    def run(policy: str, point: int, rate: float, p99: float) -> dict:
        summary = {"ttft": {"p50": p99 / 3, "p99": p99}, "itl": {"p50": 0.01, "p99": 0.02}, "e2e": {"p99": 1.0},
                   "goodput_rps": rate * 0.9, "slo_attainment": 0.9, "throughput_rps": rate,
                   "output_tokens_per_s": rate * 50, "errors": {}, "client_lateness_p99": 0.001}
        return {"policy": policy, "point": point, "offered_rate": rate, "summary": summary, "utilisation_cv": 0.1,
                "prefix_cache_hit_rate": 0.4, "preemptions": 0, "ttft": [0.1, 0.2], "timeline": [],
                "utilisation": {}}
    results = {
        "scenario": {"name": "t", "description": "", "fleet": {"replicas": [{"gpu": "h100", "count": 2}],
                     "time_scale": 10, "faults": [], "telemetry": "redis", "telemetry_interval": 1.0},
                     "workload": {"kind": "chat", "params": {}, "trace_path": None}, "arrivals": {"process": "poisson"},
                     "load": {"requests": 100, "warmup": 0, "fixed": 20}, "slo": {"ttft": 0.5, "itl": 0.05}},
        "machine": {"nproc": 2}, "modelled_capacity": 50.0,
        "points": [{"value": 10, "rate": 10.0}, {"value": 20, "rate": 20.0}, {"value": 30, "rate": 30.0}],
        "runs": [run("round-robin", 0, 10, 0.2), run("round-robin", 1, 20, 0.6), run("round-robin", 2, 30, 2.0),
                 run("adaptive", 0, 10, 0.1), run("adaptive", 1, 20, 0.2), run("adaptive", 2, 30, 0.8)],
    }
    text = render_markdown(results)
    rr = next(line for line in text.splitlines() if line.startswith("| round-robin |"))
    ad = next(line for line in text.splitlines() if line.startswith("| adaptive |"))
    # log(P99) interpolation: 0.2 -> 0.6 crosses 0.5 at 10 + 10 * log(2.5)/log(3) = 18.3; 0.2 -> 0.8 at
    # 20 + 10 * log(2.5)/log(4) = 26.6; the ratio 26.6/18.3 = 1.45.
    assert "10.0 (~18.3)" in rr and "1.00x" in rr
    assert "20.0 (~26.6)" in ad and "1.45x" in ad and "0.33x" in ad  # P99 at 20 req/s a third of round-robin's


def test_a_capacity_outside_the_sweep_is_not_turned_into_a_ratio() -> None:
    from loadtest.report import Capacity, _ratio

    passes_all, inside = Capacity(30.0, None, True), Capacity(20.0, 25.0, False)
    assert passes_all.text() == ">= 30.0" and passes_all.value is None
    assert _ratio(passes_all.value, inside.value) == "-" and _ratio(inside.value, inside.value) == "1.00x"


def test_a_sweep_can_stop_each_policy_past_its_capacity() -> None:
    # stopPastCapacity: a run that misses the SLO's P99 TTFT (or fails) rules out that policy's higher points.
    from loadtest.runner import RunRecord, _past_capacity

    def record(value: float, p99: float | None) -> RunRecord:
        return RunRecord(policy="round-robin", point=0, point_value=value, offered_rate=value * 100,
                         summary={"ttft": {"p99": p99}} if p99 is not None else {}, utilisation={},
                         utilisation_cv=0.0, timeline=[], prefix_cache_hit_rate=None, preemptions=0.0,
                         router_events={}, ttft=[], router_version="", wall_seconds=1.0, started_at="")
    values = [0.3, 0.6, 0.9]
    assert _past_capacity(record(0.3, 0.5), values, 1.0) == set()
    assert _past_capacity(record(0.3, 1.5), values, 1.0) == {("round-robin", 0.6), ("round-robin", 0.9)}
    assert _past_capacity(record(0.6, None), values, 1.0) == {("round-robin", 0.9)}
    load = {"rates": [5], "requests": 10}
    assert parse_scenario(minimal(load={**load, "stopPastCapacity": True})).load.stop_past_capacity
    assert not parse_scenario(minimal(load=load)).load.stop_past_capacity
    with pytest.raises(ConfigError, match="load.stopPastCapacity"):
        parse_scenario(minimal(load={**load, "stopPastCapacity": "maybe"}))


def test_extending_a_sweep_keeps_earlier_runs_and_skips_what_is_known() -> None:
    # A sweep whose top point every policy but round-robin passed is extended upwards: the earlier runs stay
    # (renumbered into the merged points), nothing done is rerun, and round-robin, past its capacity
    # already, is not run at the new, higher points.
    from loadtest.runner import RunRecord, ScenarioResults, _extend

    def record(policy: str, value: float, p99: float) -> dict:
        return {"policy": policy, "point": 0, "point_value": value, "offered_rate": value * 100,
                "summary": {"ttft": {"p99": p99}}, "utilisation": {}, "utilisation_cv": 0.0, "timeline": [],
                "prefix_cache_hit_rate": None, "preemptions": 0.0, "router_events": {}, "ttft": [],
                "router_version": "", "wall_seconds": 1.0, "started_at": ""}
    previous = {"points": [{"value": 0.3, "rate": 30.0}, {"value": 0.6, "rate": 60.0}],
                "runs": [record("round-robin", 0.3, 0.5), record("round-robin", 0.6, 2.0),
                         record("adaptive", 0.3, 0.2), record("adaptive", 0.6, 0.4)]}
    results = ScenarioResults(scenario={"slo": {"ttft": 1.0}}, machine={}, modelled_capacity=100.0,
                              points=[{"value": 0.9, "rate": 90.0}, {"value": 1.2, "rate": 120.0}])
    skip = _extend(results, previous)
    assert [p["value"] for p in results.points] == [0.3, 0.6, 0.9, 1.2]
    assert {(r.policy, r.point) for r in results.runs} == {("round-robin", 0), ("round-robin", 1),
                                                          ("adaptive", 0), ("adaptive", 1)}
    assert all(isinstance(r, RunRecord) for r in results.runs)
    assert ("round-robin", 0.9) in skip and ("round-robin", 1.2) in skip
    assert ("adaptive", 0.9) not in skip and ("adaptive", 0.6) in skip
