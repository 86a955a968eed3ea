"""Decision traces of the pickers: the explanation's chosen endpoint and reason match the actual pick.

Each case builds a picker over a hand-built pool, picks once with a `DecisionTrace`, and checks two things:
the reason is the one the situation calls for, and `justify` can re-derive the chosen endpoint from what the
trace says was compared (the least load among the noted loads, the ring owner, the best prefix match, the
better of the sampled pair...). A seeded property test then checks, over many random pools, that a traced
pick chooses exactly what an untraced pick with the same seed and state chooses, and is always justified.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from router.model import Endpoint, EndpointView, RequestCost, RequestInfo
from router.routing.policies.base import DecisionTrace
from router.routing.policies.prefix_aware import guard_report, tripped_guard
from router.routing.policies.registry import PolicyRegistry
from router.server.explain import Attempt, summarise

REGISTRY = PolicyRegistry()
MODEL = "m"
LONG = "You are a careful assistant. " * 40  # 1,160 chars: four 256-char blocks


class Loads:
    """A LoadView with fixed numbers: local in-flight (also the cluster's), in-flight cost in tokens, and
    pending prefill with measured speeds (least-prefill)."""

    def __init__(self, counts: dict[str, int] | None = None, costs: dict[str, float] | None = None,
                 mean_cost: float = 0.0, pending: dict[str, float] | None = None,
                 speeds: dict[str, float | None] | None = None) -> None:
        self.counts = counts or {}
        self.costs = costs or {}
        self.mean_cost = mean_cost
        self.pending = pending or {}
        self.speeds = speeds or {}

    def pending_prefill(self, endpoint_id: str) -> float:
        return self.pending.get(endpoint_id, 0.0)

    def prefill_speed(self, endpoint_id: str) -> float | None:
        return self.speeds.get(endpoint_id)

    def in_flight(self, endpoint_id: str) -> int:
        return self.counts.get(endpoint_id, 0)

    def cluster_in_flight(self, endpoint_id: str) -> int:
        return self.counts.get(endpoint_id, 0)

    def in_flight_cost(self, endpoint_id: str) -> float:
        return self.costs.get(endpoint_id, 0.0)

    def mean_request_cost(self) -> float:
        return self.mean_cost


def pool(*ids: str, weights: dict[str, float] | None = None) -> tuple[EndpointView, ...]:
    weights = weights or {}
    return tuple(EndpointView(Endpoint(i, f"http://{i}", (MODEL,)), weight_factor=weights.get(i, 1.0)) for i in ids)


def request(headers: dict[str, str] | None = None, prompt: str = "hi", cost: float | None = None) -> RequestInfo:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
    estimate = RequestCost(prompt_tokens=10, output_tokens=cost - 10, total=cost) if cost is not None else None
    return RequestInfo(model=MODEL, request_id="r", headers=headers or {}, body=body, cost=estimate)


def build(strategy: str, views: tuple[EndpointView, ...], params: dict[str, Any] | None = None, *, seed: int = 1,
          state: Any = None) -> Any:
    policy = REGISTRY.get(strategy)
    assert policy is not None
    return policy.build(views, policy.parse(params or {}), state if state is not None else policy.new_state(),
                        random.Random(seed), lambda _event: None)


def _least(trace: DecisionTrace, chosen: str) -> None:
    loads = {i: c["load"] for i, c in trace.candidates.items() if "load" in c}
    assert loads[chosen] == min(loads.values()), loads
    tied = [i for i, v in loads.items() if v == loads[chosen]]
    assert trace.detail.get("tied", 1) == len(tied)
    assert set(trace.detail.get("tied_with", [chosen])) <= set(tied)


def justify(trace: DecisionTrace, chosen: str, exclude: frozenset[str] = frozenset()) -> None:
    """The trace, read the way the docs tell an operator to read it, leads to the chosen endpoint."""
    reason, detail = trace.reason, trace.detail
    assert not exclude & set(trace.candidates), "an excluded endpoint was compared"
    assert chosen in trace.candidates
    if reason in ("least_loaded", "hash_key_missing", "all_at_bound"):
        _least(trace, chosen)
    elif reason == "rotation":
        assert trace.candidates[chosen]["position"] == detail["position"]
        assert trace.candidates[chosen].get("turn") is None
    elif reason == "rotation_all_ramping":
        assert all(c["turn"] == "declined_slow_start" for c in trace.candidates.values())
    elif reason == "ring":
        assert detail["owner"] == chosen and trace.candidates[chosen]["ring_step"] == 0
        if "bound" in detail:
            assert trace.candidates[chosen]["cluster_in_flight"] < detail["bound"]
    elif reason == "ring_walk":
        assert detail["owner"] in exclude and detail["owner"] != chosen
        assert trace.candidates[chosen]["ring_step"] == detail["walked"] > 0
    elif reason == "load_bound_overflow":
        owner = trace.candidates[detail["owner"]]
        assert owner["at_bound"] and owner["cluster_in_flight"] >= detail["bound"]
        assert trace.candidates[chosen]["cluster_in_flight"] < detail["bound"]
        steps = [c for c in trace.candidates.values() if c.get("at_bound")]
        assert all(c["ring_step"] < trace.candidates[chosen]["ring_step"] for c in steps)  # the first under it
    elif reason == "prefix_hit":
        matches = {i: c.get("match_blocks", 0) for i, c in trace.candidates.items()}
        assert matches[chosen] == max(matches.values()) == detail["best_match_blocks"] > 0
        assert chosen in detail["best"]
        assert not any(g["tripped"] for g in detail["guards"].values())
    elif reason == "prefix_miss":
        assert detail["best_match_blocks"] == 0
        _least(trace, chosen)
    elif reason == "prefix_short":
        assert 0 < detail["best_match_blocks"] < detail["min_match_share"] * detail["blocks_hashed"]
        _least(trace, chosen)
    elif reason == "least_prefill":  # the least expected wait among the endpoints no guard left out
        waits = {i: c["expected_wait_ms"] for i, c in trace.candidates.items() if "guard" not in c}
        assert waits[chosen] == min(waits.values())
        # a hit exactly when the estimate counts some of the chosen endpoint's prompt as cached
        assert (detail["event"] == "prefix_hit") == (trace.candidates[chosen]["uncached_tokens"] < detail["prompt_tokens"])
    elif reason in ("least_load_per_score", "best_score"):  # adaptive, composite: the least key of the sample
        keys = {i: trace.candidates[i]["key"] for i in trace.sampled}
        assert keys[chosen] == min(keys.values())
        assert set(detail.get("filtered_by_guard", ())).isdisjoint(trace.sampled)
    elif reason.startswith("load_guard_"):
        tripped = [name for name, g in detail["guards"].items() if g["tripped"]]
        assert tripped and "load_guard_" + tripped[0] == reason  # the first guard that trips names it
        _least(trace, chosen)
    else:
        raise AssertionError(f"unexpected reason {reason!r}")


def traced_pick(picker: Any, req: RequestInfo, loads: Loads, exclude: frozenset[str]) -> tuple[str, DecisionTrace]:
    trace = DecisionTrace()
    view = picker.pick(req, loads, exclude, trace)
    assert view is not None
    justify(trace, view.id, exclude)
    return view.id, trace


SESSION = {"x-session-id": "user-42"}


@pytest.mark.parametrize(
    "strategy, params, views, loads, exclude, headers, reason, chosen",
    [
        pytest.param("round-robin", {}, pool("a", "b", "c"), Loads(), set(), {}, "rotation", None,
                     id="round-robin takes the next in turn"),
        pytest.param("round-robin", {}, pool("a", "b", "c"), Loads(), {"a", "b"}, {}, "rotation", "c",
                     id="round-robin on retry skips the excluded"),
        pytest.param("round-robin", {}, pool("a", "b", weights={"a": 1e-9, "b": 1e-9}), Loads(), set(), {},
                     "rotation_all_ramping", None, id="round-robin with every endpoint ramping takes one anyway"),
        pytest.param("least-connections", {}, pool("a", "b", "c"), Loads({"a": 3, "b": 1, "c": 2}), set(), {},
                     "least_loaded", "b", id="least-connections takes the fewest in flight"),
        pytest.param("least-connections", {}, pool("a", "b", "c"), Loads({"a": 1}), set(), {},
                     "least_loaded", None, id="least-connections lists a tie it broke at random"),
        pytest.param("least-connections", {}, pool("a", "b", weights={"b": 0.25}), Loads({"a": 3, "b": 1}), set(), {},
                     "least_loaded", "a", id="least-connections counts a ramping endpoint as more loaded"),
        pytest.param("least-connections", {}, pool("a", "b", "c"), Loads({"a": 3, "b": 1, "c": 2}), {"b"}, {},
                     "least_loaded", "c", id="least-connections on retry skips the excluded"),
        pytest.param("least-connections", {"loadUnit": "tokens"}, pool("a", "b"),
                     Loads({"a": 1, "b": 5}, costs={"a": 30000.0, "b": 2000.0}), set(), {},
                     "least_loaded", "b", id="least-connections in tokens weighs the work in flight"),
        pytest.param("consistent-hash", {}, pool("a", "b", "c"), Loads(), set(), SESSION, "ring", None,
                     id="consistent-hash sends the key to its ring owner"),
        pytest.param("consistent-hash", {}, pool("a", "b", "c"), Loads({"a": 2, "c": 1}), set(), {},
                     "hash_key_missing", "b", id="consistent-hash without a key falls back to least loaded"),
        pytest.param("consistent-hash", {"maxLoadFactor": 1.25}, pool("a", "b", "c"), Loads(), set(), SESSION,
                     "ring", None, id="bounded consistent-hash keeps the owner under the bound"),
        pytest.param("prefix-aware", {}, pool("a", "b", "c"), Loads({"a": 2}), set(), {}, "prefix_miss", None,
                     id="prefix-aware with a cold prefix takes the better of two"),
    ],
)
def test_trace_names_the_reason_and_justifies_the_pick(
    strategy: str, params: dict[str, Any], views: tuple[EndpointView, ...], loads: Loads, exclude: set[str],
    headers: dict[str, str], reason: str, chosen: str | None,
) -> None:
    picker = build(strategy, views, params)
    got, trace = traced_pick(picker, request(headers, prompt=LONG, cost=500.0), loads, frozenset(exclude))
    assert trace.reason == reason
    if chosen is not None:
        assert got == chosen


def test_a_short_prompt_hashes_no_block() -> None:
    _, trace = traced_pick(build("prefix-aware", pool("a", "b")), request(prompt="hi"), Loads(), frozenset())
    assert trace.reason == "prefix_miss" and trace.detail["blocks_hashed"] == 0


def test_tokens_trace_says_where_the_request_cost_came_from() -> None:
    picker = build("least-connections", pool("a", "b"), {"loadUnit": "tokens"})
    _, with_estimate = traced_pick(picker, request(cost=800.0), Loads(costs={"a": 10.0}), frozenset())
    assert with_estimate.detail["request_cost_source"] == "estimate"
    assert with_estimate.detail["request_cost_tokens"] == 800.0 and with_estimate.detail["load_unit"] == "tokens"
    assert with_estimate.candidates["a"]["in_flight_cost"] == 10.0
    _, without = traced_pick(picker, request(), Loads(mean_cost=300.0), frozenset())
    assert without.detail["request_cost_source"] == "mean_request_cost" and without.detail["request_cost_tokens"] == 300


def test_ring_walk_when_the_owner_failed() -> None:
    picker = build("consistent-hash", pool("a", "b", "c"))
    owner, first = traced_pick(picker, request(SESSION), Loads(), frozenset())
    assert first.reason == "ring" and first.detail["key"] == "header:x-session-id" and first.detail["key_present"]
    assert "user-42" not in repr(first.detail)  # the key's ring position is shown, never the key itself
    got, retry = traced_pick(picker, request(SESSION), Loads(), frozenset({owner}))
    assert retry.reason == "ring_walk" and got != owner and retry.detail["owner"] == owner


def test_bounded_hashing_overflow_and_all_at_bound() -> None:
    picker = build("consistent-hash", pool("a", "b", "c"), {"maxLoadFactor": 1.25})
    owner, _ = traced_pick(picker, request(SESSION), Loads(), frozenset())
    # The owner holds 6 of 6 in flight: bound = ceil(1.25 * 7 / 3) = 3, so the key spills to the next.
    got, trace = traced_pick(picker, request(SESSION), Loads({owner: 6}), frozenset())
    assert trace.reason == "load_bound_overflow" and got != owner
    assert trace.detail["bound"] == 3 and trace.detail["total_in_flight"] == 6
    # Everyone left is at the bound (the third excluded after failing): least loaded decides.
    others = sorted({"a", "b", "c"} - {owner})
    loads = Loads({owner: 3, others[0]: 3})  # bound = ceil(1.25 * 7 / 3) = 3
    got, trace = traced_pick(picker, request(SESSION), loads, frozenset({others[1]}))
    assert trace.reason == "all_at_bound" and trace.detail["fallback"] == "least_loaded"


def test_prefix_hit_then_load_guard() -> None:
    views = pool("a", "b", "c")
    policy = REGISTRY.get("prefix-aware")
    index = policy.new_state()
    picker = build("prefix-aware", views, state=index)
    seeded, _ = traced_pick(picker, request(prompt=LONG), Loads(), frozenset({"a", "c"}))  # the prefix lands on b
    assert seeded == "b"
    got, hit = traced_pick(picker, request(prompt=LONG + "turn two"), Loads({"a": 1}), frozenset())
    assert hit.reason == "prefix_hit" and got == "b"
    assert hit.candidates["b"]["match_blocks"] == 4 and hit.candidates["a"]["match_blocks"] == 0
    assert hit.detail["guards"]["imbalance"] == {"value": 0.0, "limit": 8, "tripped": False}
    # b now holds 12 requests and a none: 12 - 0 > maxImbalance 8, so load wins over the cached prefix.
    got, guarded = traced_pick(picker, request(prompt=LONG), Loads({"b": 12}), frozenset())
    assert guarded.reason == "load_guard_imbalance"
    assert "tripped the imbalance guard (12 against a limit of 8)" in summarise(Attempt(got, guarded, {}, {}))
    assert guarded.detail["guards"]["imbalance"] == {"value": 12.0, "limit": 8, "tripped": True}
    # The fallback is least-connections' choice: the least loaded, here a tie of a and c.
    assert got in {"a", "c"} and guarded.detail["fallback"] == "least_loaded"
    assert guarded.detail["tied"] == 2 and sorted(guarded.detail["tied_with"]) == ["a", "c"]
    # A match too short to count: LONG's four blocks (b holds them, and now the guarded pick's choice too)
    # then a new tail. 4 of 12 hashed blocks (0.33) clears the default minMatchShare 0.2; 4 of 40 (0.1) does
    # not, and the least loaded (c) takes it.
    got, kept = traced_pick(picker, request(prompt=LONG + "x" * 8 * 256), Loads({"a": 1, "c": 1}), frozenset())
    assert kept.reason == "prefix_hit" and got == "b"
    got, short = traced_pick(picker, request(prompt=LONG + "y" * 36 * 256), Loads({"a": 1, "b": 1}), frozenset())
    assert short.reason == "prefix_short" and got == "c"
    assert short.detail["best_match_blocks"] == 4 and short.detail["blocks_hashed"] == 40
    assert "(4 of 40 blocks) is under minMatchShare (0.2)" in summarise(Attempt(got, short, {}, {}))
    # The prefix's owner excluded on a retry: the others hold nothing of it.
    got, retry = traced_pick(picker, request(prompt=LONG), Loads(), frozenset({"b"}))
    assert got != "b" and "b" not in retry.candidates


@pytest.mark.parametrize(
    "params",
    [{"maxInFlight": 5}, {"maxImbalance": None, "maxLoadFactor": 1.5}, {"maxImbalance": None, "sigmaK": 1.0},
     {"maxInFlight": 50, "maxImbalance": 3, "maxLoadFactor": 2.0, "sigmaK": 0.5}],
    ids=["in_flight", "load_factor", "sigma", "all four"],
)
def test_guard_report_agrees_with_the_guard_the_pick_path_checks(params: dict[str, Any]) -> None:
    config = REGISTRY.get("prefix-aware").parse(params)
    rng = random.Random(5)
    for _ in range(2000):
        load = {f"e{i}": float(rng.randrange(0, 20)) for i in range(rng.randrange(1, 6))}
        best = rng.choice(list(load.values()))
        tripped = [name for name, g in guard_report(best, load, config).items() if g["tripped"]]
        expected = tripped_guard(best, load, config)
        assert (("load_guard_" + tripped[0]) if tripped else None) == expected


STRATEGIES = [
    ("round-robin", {}),
    ("least-connections", {}),
    ("least-connections", {"loadUnit": "tokens"}),
    ("consistent-hash", {}),
    ("consistent-hash", {"maxLoadFactor": 1.25}),
    ("prefix-aware", {}),
    ("prefix-aware", {"maxInFlight": 6, "maxLoadFactor": 1.5, "sigmaK": 1.0}),
    ("prefix-aware", {"selection": "least-prefill"}),
    ("prefix-aware", {"selection": "least-prefill", "maxInFlight": 6}),
    ("adaptive", {}),
    ("adaptive", {"selection": "best-score", "choices": "all", "loadUnit": "tokens"}),
    ("composite", {"scorers": {"prefix": 0.5, "load": 0.3, "gpu": 0.2}, "loadGuard": {"maxImbalance": 4}}),
]


@pytest.mark.parametrize("strategy, params", STRATEGIES, ids=[f"{s} {p}" if p else s for s, p in STRATEGIES])
def test_a_traced_pick_chooses_what_an_untraced_one_does_and_explains_it(strategy: str, params: dict[str, Any]) -> None:
    """Over random pools, loads, ramping endpoints and exclusions: tracing never changes the choice (same
    seed, same state), and every explanation justifies its choice."""
    rng = random.Random(11)
    policy = REGISTRY.get(strategy)
    ids = [f"gpu-{i}" for i in range(6)]
    states = (policy.new_state(), policy.new_state())
    prompts = [LONG[: rng.randrange(0, len(LONG))] + str(i % 3) for i in range(8)]
    reasons = set()
    for round_ in range(300):
        weights = {i: rng.choice((1.0, 1.0, 1.0, 0.5, 0.1)) for i in ids}
        views = pool(*ids, weights=weights)
        loads = Loads({i: rng.randrange(0, 10) for i in ids}, costs={i: rng.uniform(0, 5000) for i in ids},
                      mean_cost=400.0, pending={i: rng.choice((0.0, rng.uniform(0, 600))) for i in ids},
                      speeds={i: rng.choice((None, rng.uniform(500, 5000))) for i in ids})
        exclude = frozenset(rng.sample(ids, rng.randrange(0, 3)))
        headers = {"x-session-id": f"s{rng.randrange(0, 20)}"} if rng.random() < 0.8 else {}
        req = request(headers, prompt=rng.choice(prompts), cost=rng.choice((None, 300.0)))
        plain = build(strategy, views, params, seed=round_, state=states[0]).pick(req, loads, exclude)
        trace = DecisionTrace()
        traced = build(strategy, views, params, seed=round_, state=states[1]).pick(req, loads, exclude, trace)
        assert plain is not None and traced is not None and traced.id == plain.id
        justify(trace, traced.id, exclude)
        reasons.add(trace.detail.get("event", trace.reason))  # least-prefill: one reason, its event varies
        sentence = summarise(Attempt(traced.id, trace, {}, {}))
        assert sentence != trace.reason and "None" not in sentence, (trace.reason, sentence)  # a real sentence
    if strategy in ("consistent-hash", "prefix-aware"):
        assert len(reasons) >= 2, reasons  # the random walk went down more than one path
