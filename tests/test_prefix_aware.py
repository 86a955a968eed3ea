"""prefix-aware: block hashing, the bounded index and its LRU order, sizing from the engine's KV capacity,
the load guards, least-prefill's expected waits, seeded simulations with stated bounds (affinity under
balance, abandoned under imbalance, least-prefill against longest-match on a fleet of two speeds), parsing,
and end-to-end runs (chat and completions, prefill booked and timed) through a real router and fake engines."""

from __future__ import annotations

import asyncio
import random
import statistics
from collections import Counter
from typing import Any

import pytest

from router.model import Endpoint, EndpointView, RequestInfo, Telemetry
from router.routing.policies.base import DecisionTrace, PolicyConfigError
from router.routing.policies.prefix_aware import PrefixAwarePolicy, block_hashes, prompt_blocks
from router.routing.prefix.index import FALLBACK_BLOCKS, OUTBOX_LIMIT, PrefixIndex
from tests.conftest import MODEL as E2E_MODEL
from worker.vllm_metrics import parse_vllm_metrics

POLICY = PrefixAwarePolicy()
MODEL = "m"
BLOCK = 256


class Loads:
    """In-flight counts a test sets or a simulation moves; least-prefill also reads pending prefill and speeds."""

    def __init__(self, counts: dict[str, int] | None = None, pending: dict[str, float] | None = None,
                 speeds: dict[str, float] | None = None) -> None:
        self.counts: Counter[str] = Counter(counts or {})
        self.pending = pending or {}
        self.speeds = speeds or {}

    def in_flight(self, endpoint_id: str) -> int:
        return self.counts[endpoint_id]

    def cluster_in_flight(self, endpoint_id: str) -> int:
        return self.counts[endpoint_id]

    def pending_prefill(self, endpoint_id: str) -> float:
        return self.pending.get(endpoint_id, 0.0)

    def prefill_speed(self, endpoint_id: str) -> float | None:
        return self.speeds.get(endpoint_id)


def views(*ids: str, weights: dict[str, float] | None = None,
          capacity: dict[str, int | None] | None = None) -> tuple[EndpointView, ...]:
    weights, capacity = weights or {}, capacity or {}
    return tuple(
        EndpointView(Endpoint(i, f"http://{i}", (MODEL,)), weight_factor=weights.get(i, 1.0),
                     telemetry=Telemetry(reported_at=0.0, kv_capacity_tokens=capacity[i]) if i in capacity else None)
        for i in ids
    )


def seeded_index(bound: int = 1000) -> PrefixIndex:
    index = PrefixIndex()
    for endpoint in "abcd":
        index.set_base(endpoint, bound, "config")
    return index


def chat(*contents: str, system: str = "") -> RequestInfo:
    messages = [{"role": "system", "content": system}] if system else []
    roles = ("user", "assistant")
    messages += [{"role": roles[i % 2], "content": c} for i, c in enumerate(contents)]
    return RequestInfo(model=MODEL, request_id="r", headers={}, body={"model": MODEL, "messages": messages})


def text(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    words = "route gpu token cache batch queue model request latency prefix stream engine".split()
    out = ""
    while len(out) < chars:
        out += rng.choice(words) + " "
    return out[:chars]


def build(vs: tuple[EndpointView, ...], params: dict[str, Any] | None = None, *, seed: int = 1,
          events: list[str] | None = None, state: PrefixIndex | None = None) -> Any:
    sink = events.append if events is not None else (lambda _e: None)
    return POLICY.build(vs, POLICY.parse(params or {}), state if state is not None else POLICY.new_state(),
                        random.Random(seed), sink)


# ---- hashing ----------------------------------------------------------------------------------------


def test_block_hashes_are_chained_and_only_cover_full_blocks() -> None:
    system = text(1, 3 * BLOCK)
    short = block_hashes(chat("hi", system=system).body, BLOCK, 64)
    longer = block_hashes(chat("hi", "hello there", "more " * 200, system=system).body, BLOCK, 64)
    assert len(short) == 3  # 3 blocks of system prompt + a few chars of headers and "hi": not a 4th full block
    assert longer[:3] == short  # a later turn starts with the earlier turn's blocks
    assert len(longer) > 3
    other = block_hashes(chat("hi", system=text(2, 3 * BLOCK)).body, BLOCK, 64)
    assert not set(other) & set(short)  # a different first block changes every later hash (the chain)


def test_block_hashes_are_capped_and_stable() -> None:
    body = {"model": MODEL, "prompt": "x" * (BLOCK * 100)}
    hashes = block_hashes(body, BLOCK, 64)
    assert len(hashes) == 64
    assert hashes == block_hashes(dict(body), BLOCK, 64)  # deterministic (blake2b, not the salted hash())
    assert block_hashes({"model": MODEL}, BLOCK, 64) == []
    assert block_hashes({"prompt": ["y" * BLOCK]}, BLOCK, 64) == block_hashes({"prompt": "y" * BLOCK}, BLOCK, 64)


def test_role_boundaries_matter() -> None:
    a = {"messages": [{"role": "user", "content": "ab" * BLOCK}, {"role": "user", "content": "c" * BLOCK}]}
    b = {"messages": [{"role": "user", "content": "ab" * BLOCK + "c" * BLOCK}]}
    assert block_hashes(a, BLOCK, 64)[:2] == block_hashes(b, BLOCK, 64)[:2]  # same text up to the boundary
    assert block_hashes(a, BLOCK, 64) != block_hashes(b, BLOCK, 64)


def test_prompt_length_counts_the_whole_prompt_not_only_the_hashed_blocks() -> None:
    body = {"model": MODEL, "prompt": "x" * (BLOCK * 100 + 10)}
    hashes, chars = prompt_blocks(body, BLOCK, 64)
    assert (len(hashes), chars) == (64, BLOCK * 100 + 10)  # the estimate's denominator is the whole prompt
    messages = chat("q" * 300, system="s" * 500).body
    assert prompt_blocks(messages, BLOCK, 1)[1] == len("\x1esystem\x1f" + "s" * 500 + "\x1euser\x1f" + "q" * 300)


# ---- table-driven picks -----------------------------------------------------------------------------

SYSTEM_A = text(10, 4 * BLOCK)
SYSTEM_B = text(11, 4 * BLOCK)


@pytest.mark.parametrize(
    "seeded, loads, params, exclude, allowed, event",
    [
        pytest.param({"b": SYSTEM_A}, {}, {}, set(), {"b"}, "prefix_hit",
                     id="the endpoint holding the prefix wins on an idle pool"),
        pytest.param({"b": SYSTEM_A}, {"b": 8, "a": 0}, {}, set(), {"b"}, "prefix_hit",
                     id="affinity holds up to maxImbalance (8) above the least loaded"),
        pytest.param({"b": SYSTEM_A}, {"b": 9, "a": 0, "c": 0}, {}, set(), {"a", "c"}, "load_guard_imbalance",
                     id="9 above the least loaded trips the default imbalance guard"),
        pytest.param({"b": SYSTEM_A}, {"b": 30}, {"maxImbalance": None}, set(), {"b"}, "prefix_hit",
                     id="maxImbalance null turns the imbalance guard off"),
        pytest.param({"b": SYSTEM_A}, {"b": 3}, {"maxInFlight": 3}, set(), {"a", "c"}, "load_guard_in_flight",
                     id="the absolute guard trips at maxInFlight"),
        pytest.param({"b": SYSTEM_A}, {"b": 9}, {"maxInFlight": 3}, set(), {"a", "c"}, "load_guard_in_flight",
                     id="when several guards trip, the first in order (maxInFlight) names the event"),
        pytest.param({"b": SYSTEM_A}, {"b": 2}, {"maxImbalance": 0}, set(), {"a", "c"}, "load_guard_imbalance",
                     id="maxImbalance 0 means any imbalance moves the request"),
        # Bounded loads: total 6, n 3, factor 1.5 -> bound ceil(1.5 x 7 / 3) = 4; b at 4 may take no more.
        pytest.param({"b": SYSTEM_A}, {"a": 1, "b": 4, "c": 1}, {"maxLoadFactor": 1.5}, set(), {"a", "c"},
                     "load_guard_load_factor", id="maxLoadFactor: best at the bounded-load limit moves the request"),
        pytest.param({"b": SYSTEM_A}, {"a": 2, "b": 3, "c": 1}, {"maxLoadFactor": 1.5}, set(), {"b"}, "prefix_hit",
                     id="maxLoadFactor: best below the bounded-load limit keeps affinity"),
        # Mean 2, sigma sqrt(((0-2)^2 + (4-2)^2 + 0) / 3) = 1.63; k 1: 4 > 3.63 trips; k 2: 4 < 5.27 holds.
        pytest.param({"b": SYSTEM_A}, {"a": 0, "b": 4, "c": 2}, {"sigmaK": 1}, set(), {"a", "c"}, "load_guard_sigma",
                     id="sigmaK 1: best above mean + 1 sigma moves the request"),
        pytest.param({"b": SYSTEM_A}, {"a": 0, "b": 4, "c": 2}, {"sigmaK": 2}, set(), {"b"}, "prefix_hit",
                     id="sigmaK 2: best within mean + 2 sigma keeps affinity"),
        pytest.param({"b": SYSTEM_A}, {"a": 3, "b": 3, "c": 3}, {"sigmaK": 0.01, "maxLoadFactor": 1.0}, set(), {"b"},
                     "prefix_hit", id="an even pool trips no relative guard however tight"),
        pytest.param({"b": SYSTEM_B}, {"a": 5, "c": 1}, {}, set(), {"b"}, "prefix_miss",
                     id="a cold request goes to the least loaded"),
        pytest.param({"b": SYSTEM_A[:BLOCK]}, {"b": 1}, {}, set(), {"b"}, "prefix_hit",
                     id="a match of 1 of 4 blocks (0.25) clears the default minMatchShare 0.2"),
        pytest.param({"b": SYSTEM_A[:BLOCK]}, {"b": 1}, {"minMatchShare": 0.5}, set(), {"a", "c"}, "prefix_short",
                     id="1 of 4 blocks is under minMatchShare 0.5: load decides"),
        pytest.param({"b": SYSTEM_A}, {}, {}, {"b"}, {"a", "c"}, "prefix_miss",
                     id="an excluded holder is skipped"),
        pytest.param({"a": SYSTEM_A[:2 * BLOCK], "b": SYSTEM_A}, {}, {}, set(), {"b"}, "prefix_hit",
                     id="the longest match wins over a shorter one"),
        pytest.param({"a": SYSTEM_A[:2 * BLOCK], "b": SYSTEM_A}, {"b": 20, "a": 12}, {}, set(), {"c"},
                     "load_guard_imbalance", id="a guarded best match falls back to the least loaded, not to the "
                                                "next match"),
        pytest.param({"a": SYSTEM_A, "b": SYSTEM_A}, {"a": 4, "b": 1}, {}, set(), {"b"}, "prefix_hit",
                     id="equal matches go to the less loaded holder"),
    ],
)
def test_pick_table(seeded: dict[str, str], loads: dict[str, int], params: dict[str, Any], exclude: set[str],
                    allowed: set[str], event: str) -> None:
    for seed in range(20):  # ties are broken at random: every seed must stay inside `allowed`
        state = seeded_index()
        for endpoint, prefix in seeded.items():
            state.record(endpoint, block_hashes(chat(system=prefix).body, BLOCK, 64))
        events: list[str] = []
        picker = build(views("a", "b", "c"), params, seed=seed, events=events, state=state)
        view = picker.pick(chat("question?", system=SYSTEM_A), Loads(loads), frozenset(exclude))
        assert view is not None and view.id in allowed, seed
        assert events == [event]


def test_no_candidates_gives_none() -> None:
    assert build(()).pick(chat("q", system=SYSTEM_A), Loads(), frozenset()) is None
    assert build(views("a")).pick(chat("q", system=SYSTEM_A), Loads(), frozenset({"a"})) is None


def test_slow_start_counts_a_ramping_holder_as_more_loaded() -> None:
    # b holds the prefix and has 4 in flight, but at weight 0.25 it counts as (4+1)/0.25-1 = 19 > 0 + 8.
    state = seeded_index()
    state.record("b", block_hashes(chat(system=SYSTEM_A).body, BLOCK, 64))
    events: list[str] = []
    picker = build(views("a", "b", weights={"b": 0.25}), events=events, state=state)
    assert picker.pick(chat("q", system=SYSTEM_A), Loads({"b": 4}), frozenset()).id == "a"
    assert events == ["load_guard_imbalance"]


def test_the_chosen_endpoint_records_the_blocks_and_rebuilds_keep_them() -> None:
    state = POLICY.new_state()
    vs = views("a", "b", "c", "d")
    first = build(vs, state=state, seed=5).pick(chat("q1", system=SYSTEM_A), Loads(), frozenset())
    for seed in range(10):  # a rebuild per pick, as telemetry refreshes cause, must not forget the index
        again = build(vs, state=state, seed=seed).pick(chat("q2", system=SYSTEM_A), Loads(), frozenset())
        assert again.id == first.id


def test_each_pick_adds_to_the_estimated_hit_rate_of_the_chosen_endpoint() -> None:
    state = POLICY.new_state()
    picker = build(views("a"), state=state)
    request = chat("q" * 100, system=SYSTEM_A)  # 4 full blocks of system prompt, then a short question
    chars = prompt_blocks(request.body, BLOCK, 64)[1]
    picker.pick(request, Loads(), frozenset())  # cold: nothing matched
    picker.pick(request, Loads(), frozenset())  # warm: every hashed block matched
    blocks = len(block_hashes(request.body, BLOCK, 64))
    assert state.estimate("a") == (2, blocks * BLOCK, 2 * chars)


# ---- least-prefill ----------------------------------------------------------------------------------

LEAST_PREFILL = {"selection": "least-prefill"}


def tokens_of(request: RequestInfo) -> float:
    return prompt_blocks(request.body, BLOCK, 64)[1] / 4  # the picker's estimate: 4 characters a token


@pytest.mark.parametrize(
    "seeded, loads, params, allowed, event",
    [
        pytest.param({"b": SYSTEM_A}, Loads(), {}, {"b"}, "prefix_hit", id="the holder wins on an idle pool"),
        pytest.param({"b": SYSTEM_A}, Loads({"b": 30}), {}, {"b"}, "prefix_hit",
                     id="requests decoding are no queue: no imbalance guard by default"),
        pytest.param({"b": SYSTEM_A}, Loads(pending={"b": 200.0}), {}, {"b"}, "prefix_hit",
                     id="queued prefill under the 256 tokens the prefix saves: still the holder"),
        pytest.param({"b": SYSTEM_A}, Loads(pending={"b": 300.0}), {}, {"a", "c"}, "prefix_outweighed",
                     id="queued prefill over the saving: an endpoint without it"),
        pytest.param({"b": SYSTEM_A}, Loads(pending={"b": 300.0}, speeds={"a": 100.0, "b": 1000.0, "c": 100.0}), {},
                     {"b"}, "prefix_hit", id="the holder is ten times faster: its queue clears first"),
        pytest.param({}, Loads(speeds={"a": 1000.0, "c": 3000.0}), {}, {"c"}, "prefix_miss",
                     id="a miss goes to the fastest (b, unmeasured, counts at the mean, 2,000)"),
        pytest.param({}, Loads(pending={"c": 10_000.0}, speeds={"a": 1000.0, "c": 3000.0}), {}, {"b"}, "prefix_miss",
                     id="the fastest with a queue loses to the mean speed without one"),
        pytest.param({"b": SYSTEM_A}, Loads({"b": 3}), {"maxInFlight": 3}, {"a", "c"}, "load_guard_in_flight",
                     id="a configured guard leaves the holder out"),
        pytest.param({"b": SYSTEM_A}, Loads({"a": 3, "b": 3, "c": 3}), {"maxInFlight": 3}, {"b"}, "prefix_hit",
                     id="every endpoint tripping the guard leaves none out"),
        pytest.param({"b": SYSTEM_A}, Loads({"a": 1, "b": 1}), {"maxImbalance": 0}, {"c"}, "load_guard_imbalance",
                     id="an explicit maxImbalance applies"),
        pytest.param({"b": SYSTEM_A[:BLOCK]}, Loads(), {"minMatchShare": 0.5}, {"a", "b", "c"}, "prefix_short",
                     id="a match under minMatchShare saves nothing in the estimate"),
    ],
)
def test_least_prefill_pick_table(seeded: dict[str, str], loads: Loads, params: dict[str, Any], allowed: set[str],
                                  event: str) -> None:
    for seed in range(20):
        state = seeded_index()
        for endpoint, prefix in seeded.items():
            state.record(endpoint, block_hashes(chat(system=prefix).body, BLOCK, 64))
        events: list[str] = []
        picker = build(views("a", "b", "c"), {**LEAST_PREFILL, **params}, seed=seed, events=events, state=state)
        request = chat("question?", system=SYSTEM_A)
        view = picker.pick(request, loads, frozenset())
        assert view is not None and view.id in allowed, seed
        assert events == [event]
        # What the proxy books for the choice: the prompt less the blocks that count as cached there.
        saved = 4 * BLOCK / 4 if event == "prefix_hit" else 0.0
        assert request.note.prefill_tokens == pytest.approx(tokens_of(request) - saved)


def test_least_prefill_slows_a_ramping_endpoint_down() -> None:
    # a and b measured equally fast; b ramps up at weight 0.25: a queue of 1,000 tokens at a is still sooner
    # than b for a prompt of ~500 tokens, one of 2,000 is not.
    request = chat("q" * 2000)
    speeds = {"a": 1000.0, "b": 1000.0}
    for queued, expected in ((1000.0, "a"), (2000.0, "b")):
        picker = build(views("a", "b", weights={"b": 0.25}), LEAST_PREFILL)  # fresh: no prefix cached anywhere
        assert picker.pick(request, Loads(pending={"a": queued}, speeds=speeds), frozenset()).id == expected


def test_least_prefill_counts_an_unmeasured_endpoint_at_the_mean_speed_per_unit_of_weight() -> None:
    # a (weight 2) measured 2,000 tokens/s: 1,000 per unit of weight, so unmeasured b (weight 1) counts at
    # 1,000 and c (weight 4) at 4,000; a miss goes to c, and with 3,000 tokens queued at c, to a.
    vs = tuple(EndpointView(Endpoint(i, f"http://{i}", (MODEL,), weight=w)) for i, w in (("a", 2.0), ("b", 1.0),
                                                                                        ("c", 4.0)))
    request = chat("q" * 2000)
    trace = DecisionTrace()
    assert build(vs, LEAST_PREFILL).pick(request, Loads(speeds={"a": 2000.0}), frozenset(), trace).id == "c"
    assert {i: n["speed_used"] for i, n in trace.candidates.items()} == {"a": 2000.0, "b": 1000.0, "c": 4000.0}
    assert build(vs, LEAST_PREFILL).pick(request, Loads(pending={"c": 3000.0}, speeds={"a": 2000.0}),
                                         frozenset()).id == "a"


def test_least_prefill_books_the_uncached_tokens_of_a_pinned_sessions_request() -> None:
    state = seeded_index()
    state.record("b", block_hashes(chat(system=SYSTEM_A).body, BLOCK, 64))
    picker = build(views("a", "b"), LEAST_PREFILL, state=state)
    request = chat("question?", system=SYSTEM_A)
    picker.observe(request, views("b")[0])
    assert request.note.prefill_tokens == pytest.approx(tokens_of(request) - BLOCK)
    cold = chat("question?", system=SYSTEM_B)
    picker.observe(cold, views("a")[0])
    assert cold.note.prefill_tokens == pytest.approx(tokens_of(cold))


def test_least_prefill_simulation_beats_longest_match_on_a_fleet_of_two_speeds() -> None:
    # Discrete time: 4 fast and 4 slow engines (3x), each working through its prefill queue first come, first
    # served; 40 shared 2,000-token contexts, popularity skewed. Longest-match ignores speeds and queues;
    # least-prefill must at least halve the 99th percentile wait and keep most requests on a cached prefix.
    rng = random.Random(11)
    speed = {f"f{i}": 3000.0 for i in range(4)} | {f"s{i}": 1000.0 for i in range(4)}  # tokens per tick
    contexts = [text(500 + g, 8000) for g in range(40)]
    arrivals = [[chat(text(1000 * tick + k, 200), system=contexts[min(39, int(rng.paretovariate(0.8)) - 1)])
                 for k in range(rng.choice((0, 1, 1, 2)))] for tick in range(600)]
    results = {}
    for params in ({}, LEAST_PREFILL):
        state = POLICY.new_state()
        picker = build(views(*speed), params, seed=3, state=state)
        loads = Loads(speeds=speed if params else {})
        queues: dict[str, list[list[float]]] = {i: [] for i in speed}  # per engine: [tokens left, arrival tick]
        waits, hits = [], 0
        for tick, requests in enumerate(arrivals):
            for request in requests:
                request = RequestInfo(request.model, request.request_id, request.headers, request.body)
                hashes = block_hashes(request.body, BLOCK, 64)
                cached = {i: state.matched(i, hashes) for i in speed}  # the engines cache what was sent them
                view = picker.pick(request, loads, frozenset())
                cost = tokens_of(request) - BLOCK / 4 * cached[view.id]
                hits += cost < tokens_of(request) / 2
                queues[view.id].append([cost, tick])
                loads.pending[view.id] = loads.pending.get(view.id, 0.0) + cost
                loads.counts[view.id] += 1  # in flight until its prefill is done (longest-match's guard reads it)
            for endpoint, queue in queues.items():
                budget = speed[endpoint]
                while queue and budget > 0:
                    done = min(queue[0][0], budget)
                    queue[0][0] -= done
                    budget -= done
                    loads.pending[endpoint] -= done
                    if queue[0][0] <= 0:
                        waits.append(tick + 1 - queue.pop(0)[1])
                        loads.counts[endpoint] -= 1
        waits.sort()
        results[params.get("selection", "longest-match")] = (waits[int(0.99 * len(waits))], hits / len(waits))
    assert results["least-prefill"][0] <= results["longest-match"][0] / 2, results
    assert results["least-prefill"][1] > 0.5, results


# ---- affinity and spread ----------------------------------------------------------------------------


def test_turns_of_one_conversation_stay_on_one_endpoint() -> None:
    picker = build(views("a", "b", "c", "d"), seed=3)
    loads = Loads()
    history: list[str] = []
    chosen = set()
    for turn in range(8):
        history.append(text(100 + turn, 300))  # the user's turn
        chosen.add(picker.pick(chat(*history, system=SYSTEM_A), loads, frozenset()).id)
        history.append(text(200 + turn, 200))  # the answer joins the history
    assert len(chosen) == 1


def test_completions_sharing_a_prefix_stay_together() -> None:
    picker = build(views("a", "b", "c", "d"), seed=3)
    document = text(300, 6 * BLOCK)
    chosen = {picker.pick(RequestInfo(model=MODEL, request_id="r", headers={},
                                      body={"model": MODEL, "prompt": document + f"\nQuestion {i}?"}),
                          Loads(), frozenset()).id for i in range(10)}
    assert len(chosen) == 1


def test_different_system_prompts_spread() -> None:
    picker = build(views("a", "b", "c", "d"), seed=3)
    loads = Loads()
    placed = {}
    for g in range(8):
        view = picker.pick(chat("q", system=text(1000 + g, 4 * BLOCK)), loads, frozenset())
        loads.counts[view.id] += 1  # each stays in flight: cold requests go by load (P2C)
        placed[g] = view.id
    # P2C over in-flight with 8 cold prefixes on 4 endpoints: no endpoint takes more than 3, all are used.
    assert set(placed.values()) == {"a", "b", "c", "d"}
    assert max(Counter(placed.values()).values()) <= 3


def test_the_load_guard_moves_traffic_off_a_hot_endpoint() -> None:
    # One hot prefix, requests that never finish: affinity holds until the holder is 8 (maxImbalance)
    # above the least loaded; from then on each new request goes by load, so the holder stops growing.
    events: list[str] = []
    picker = build(views("a", "b", "c", "d"), seed=2, events=events)
    loads = Loads()
    for i in range(200):
        view = picker.pick(chat(f"q{i}", system=SYSTEM_A), loads, frozenset())
        loads.counts[view.id] += 1
    counts = sorted(loads.counts.values())
    assert counts[-1] - counts[0] <= 9  # the guard's threshold + the one request that crossed it
    assert events.count("load_guard_imbalance") > 0 and events.count("prefix_hit") > 0


# ---- the index is bounded ---------------------------------------------------------------------------


def test_the_index_evicts_least_recently_routed_blocks() -> None:
    index = PrefixIndex()
    index.set_base("a", 4, "config")
    index.record("a", [1, 2, 3])
    index.record("a", [10, 11])
    assert index.size("a") == 4
    # The oldest leaf (3) went first: roots are recorded last, so a chain loses its tail before its head.
    assert index.matched("a", [1, 2, 3]) == 2
    index.record("a", [1, 2])  # touching a prefix makes it recent again
    index.record("a", [20])
    assert index.matched("a", [1, 2]) == 2
    assert index.matched("a", [10, 11]) == 1  # the leaf 11 was evicted before its root 10


def test_lowering_the_bound_evicts_the_oldest_at_once() -> None:
    index = PrefixIndex()
    index.set_base("a", 100, "config")
    for i in range(10):
        index.record("a", [i])
    index.set_factor("a", 0.5, "shrink")  # 100 x 0.5 = 50: still above the 10 held
    assert index.size("a") == 10
    index.set_base("a", 4, "config")  # base 4 below the floor of 64: min(base, 64) x ... keeps base 4
    assert index.size("a") == 4 and index.bound("a") == 4
    assert [index.matched("a", [i]) for i in range(10)] == [0] * 6 + [1] * 4  # the 4 most recent survive


def test_memory_stays_bounded_through_a_long_run_of_distinct_prompts() -> None:
    # 3000 distinct 3-block prompts (9000 distinct blocks) over two endpoints whose bound is 5: neither ever
    # holds more than 5, whichever path (record, or merge from other replicas) adds the blocks.
    state = POLICY.new_state()
    picker = build(views("a", "b"), {"maxBlocksPerEndpoint": 5}, state=state)
    for i in range(3000):
        picker.pick(chat(text(i, 3 * BLOCK)), Loads(), frozenset())
        if i % 100 == 0:
            state.merge("a", list(range(i, i + 50)))
        assert state.size("a") <= 5 and state.size("b") <= 5


def test_the_sharing_outbox_is_bounded_and_counts_what_it_drops() -> None:
    # With Redis down nothing is flushed: the outbox stops at OUTBOX_LIMIT and counts the rest as dropped.
    index = PrefixIndex()
    index.set_base("a", 10_000_000, "config")
    index.start_sharing()
    blocks = 0
    for i in range(OUTBOX_LIMIT // 500 + 5):
        index.record("a", list(range(i * 500, (i + 1) * 500)))
        blocks += 500
    assert index.queued == OUTBOX_LIMIT
    assert index.take_dropped() == blocks - OUTBOX_LIMIT
    batch = index.pending(1024)
    assert sum(len(h) for h in batch.values()) == 1024
    index.sent(batch)
    assert index.queued == OUTBOX_LIMIT - 1024


def test_a_block_routed_again_is_announced_again_only_after_refresh_after() -> None:
    index = PrefixIndex()
    index.start_sharing(refresh_after=300)
    index.record("a", [1, 2])
    index.sent(index.pending(100))
    index.now = 100.0
    index.record("a", [1, 2, 3])  # 1 and 2 were announced 100 s ago: only the new block 3 is queued
    assert index.pending(100) == {"a": [3]}
    index.sent(index.pending(100))
    index.now = 400.0
    index.record("a", [1, 2, 3])  # 1 and 2 are older than refresh_after now: announced again; 3 (at 100) too
    assert sorted(index.pending(100)["a"]) == [1, 2, 3]


def test_an_endpoint_missing_from_the_pool_keeps_its_index_until_it_leaves_the_fleet() -> None:
    state = POLICY.new_state()
    state.start_sharing()
    for endpoint_id in ("a", "b"):
        state.record(endpoint_id, [1, 2])
        state.observe(endpoint_id, 10, 20)
    build(views("a"), state=state)  # b is only ejected or draining: it comes back with its cache warm
    assert set(state.by_endpoint) == {"a", "b"} and state.queued == 4
    state.forget_endpoints(frozenset({"b"}))  # b left the fleet (the balancer tells every pool state)
    assert set(state.by_endpoint) == {"a"} and state.queued == 2
    assert state.estimate("b") == (0.0, 0.0, 0.0) and not state.has_base("b") and "b" not in state.tuning


# ---- sized from the engine's KV capacity --------------------------------------------------------------


def test_the_bound_comes_from_the_engines_kv_capacity_on_a_real_vllm_page() -> None:
    # The captured vLLM 0.32 page: num_gpu_blocks 8192 x block_size 128 = kv_cache_size_tokens 1048576.
    with open("tests/data/vllm_metrics_idle.txt") as f:
        capacity = parse_vllm_metrics(f.read()).kv_capacity_tokens
    assert capacity == 8192 * 128
    state = POLICY.new_state()
    build(views("a", "b", capacity={"a": capacity}), state=state)
    # 1048576 tokens / (256 chars / 4 chars per token) = 16384 router blocks; b reports no capacity.
    assert (state.bound("a"), state.bound("b")) == (16384, FALLBACK_BLOCKS)
    other = POLICY.new_state()
    build(views("a", capacity={"a": capacity}), {"blockChars": 512}, state=other)
    assert other.bound("a") == 8192  # bigger router blocks: fewer of them fill the same cache
    assert [(c.endpoint_id, c.new, c.reason) for c in state.changes] == [("a", 16384, "kv_capacity"),
                                                                          ("b", FALLBACK_BLOCKS, "fallback")]


def test_a_capacity_gone_stale_keeps_the_last_known_bound_and_a_number_overrides_auto() -> None:
    state = POLICY.new_state()
    build(views("a", capacity={"a": 4096 * 16}), state=state)  # 65536 tokens / 64 = 1024 blocks
    build(views("a"), state=state)  # telemetry stale: no capacity in the view
    assert state.bound("a") == 1024
    build(views("a", capacity={"a": 1}), state=state)  # a tiny cache still gets the floor of 64 blocks
    assert state.bound("a") == 64
    fixed = POLICY.new_state()
    build(views("a", capacity={"a": 4096 * 16}), {"maxBlocksPerEndpoint": 300}, state=fixed)
    assert fixed.bound("a") == 300


# ---- simulation -------------------------------------------------------------------------------------


def test_simulation_keeps_groups_together_and_load_balanced() -> None:
    """64 prefix groups (a 1 KiB system prompt each, 4 blocks) x 16 prompts over 4 endpoints, 20k picks
    with the default guard (maxImbalance 8). A closed system with 16 requests in flight (4 per endpoint
    on average): after each pick, a random in-flight request finishes. Measured over seeds 1-6 and 42:
    prefix hits 99.6%, mean top share 0.88-0.94, smallest top share 0.50-0.54, shares 19.5-28.7%,
    spread <= 10.

    (a) Affinity: all but the 64 first requests (one per group) and the guarded ones hit (>= 99%); each
        group's most used endpoint takes >= 85% of its requests on average and >= 40% for every group.
        Why not 100%: random finishes sometimes leave a holder 9 above the least loaded; the guard sends
        that request elsewhere, which seeds the prefix there too, and from then on the group's two
        holders tie on match length and share its requests by load (a hot prefix replicates).
    (b) Balance: each endpoint serves 25% +- 7% of requests (groups are placed by P2C over load, not
        evenly by count, so whole groups of ~1.6% each land unevenly); at every moment the most loaded
        endpoint is at most maxImbalance + 2 = 10 above the least (a hit may take the holder to min + 9,
        then a finish at the least loaded lowers the minimum by one more).
    """
    rng = random.Random(42)
    groups = [text(5000 + g, 4 * BLOCK) for g in range(64)]
    prompts = [text(9000 + p, 120) for p in range(16)]
    events: list[str] = []
    picker = build(views("a", "b", "c", "d"), seed=42, events=events)
    loads = Loads()
    running: list[str] = []
    by_group: dict[int, Counter[str]] = {g: Counter() for g in range(64)}
    total: Counter[str] = Counter()
    spread = 0
    n = 20_000
    for _ in range(n):
        g = rng.randrange(64)
        view = picker.pick(chat(rng.choice(prompts), system=groups[g]), loads, frozenset())
        loads.counts[view.id] += 1
        running.append(view.id)
        by_group[g][view.id] += 1
        total[view.id] += 1
        if len(running) > 16:
            done = running.pop(rng.randrange(len(running)))
            loads.counts[done] -= 1
        spread = max(spread, max(loads.counts[e] for e in "abcd") - min(loads.counts[e] for e in "abcd"))
    top_shares = [c.most_common(1)[0][1] / sum(c.values()) for c in by_group.values()]
    assert events.count("prefix_miss") == 64
    assert events.count("prefix_hit") / n >= 0.99
    assert statistics.mean(top_shares) >= 0.85, statistics.mean(top_shares)
    assert min(top_shares) >= 0.4, min(top_shares)
    for endpoint in "abcd":
        assert abs(total[endpoint] / n - 0.25) <= 0.07, dict(total)
    assert spread <= 10


HOT_SIMULATION_PARAMS = [
    # Default: maxImbalance 8 trips whenever the hot holder is 9 above the least loaded, the hot prefix is
    # seeded everywhere, and the four holders then share it by load: shares within 25% +- 4% and a spread of
    # at most maxImbalance + 3 = 11 (9 after the pick, then finishes can land on the least loaded).
    pytest.param({}, "load_guard_imbalance", 4, 0.40, 0.04, 11, 0.85, id="maxImbalance 8 (default)"),
    # Bounded loads at 1.5: with 32 in flight a holder may take requests while below ceil(1.5 x 33 / 4) = 13.
    # Three holders at ~11-13 fit under it, so the hot prefix settles on 3 endpoints and the fourth serves
    # the cold groups (shares 20-28%); the spread stays near the bound (13, +1 for a finish at the least loaded).
    pytest.param({"maxImbalance": None, "maxLoadFactor": 1.5}, "load_guard_load_factor", 3, 0.45, 0.12, 14, 0.85,
                 id="maxLoadFactor 1.5"),
    # mean + 1 sigma: sigma grows with the very imbalance it measures. Two hot holders at ~11 and two cold
    # endpoints at ~5 give mean 8, sigma 3: the holders sit at mean + 1 sigma and trip nothing, so the hot
    # prefix stays on 2 endpoints (shares 17-32%, spread up to 16). A guard against one outlier, not a split;
    # its trips move cold groups too (to the least loaded), so their affinity is the weakest here (0.75-0.82).
    pytest.param({"maxImbalance": None, "sigmaK": 1.0}, "load_guard_sigma", 2, 0.55, 0.10, 17, 0.7, id="sigmaK 1"),
]


@pytest.mark.parametrize("params, guard_event, holders, hot_top_share, share_tolerance, max_spread, cold_top_share",
                         HOT_SIMULATION_PARAMS)
def test_simulation_abandons_affinity_for_a_prefix_too_hot_for_one_endpoint(
        params: dict[str, Any], guard_event: str, holders: int, hot_top_share: float, share_tolerance: float,
        max_spread: int, cold_top_share: float) -> None:
    """Imbalance by design: 60% of 20k requests share one system prompt (a viral agent), the rest spread
    over 63 cold groups; 4 endpoints, a closed system with 32 in flight (8 per endpoint on average), after
    each pick a random in-flight request finishes. Pure affinity would keep ~19 of the 32 in flight on the
    hot prefix's first holder. Measured over seeds 1-6 and 42 (per guard: holders, hot top share, endpoint
    shares, spread, cold groups' mean top share): default 4, 0.31-0.38, 23.1-27.6%, 10-11, 0.90-0.97;
    maxLoadFactor 1.5 3, 0.34-0.41, 20.4-27.2%, 11-13, 0.89-0.97; sigmaK 1 2, 0.50, 17.8-31.3%, 14-15,
    0.75-0.82.

    (a) The guard trips (its own event, at least once): that is what seeds the hot prefix elsewhere. It trips
        rarely (3-62 times): once the prefix has several holders they tie on match length and the tie goes
        to the least loaded, which is load balancing by itself.
    (b) Affinity is abandoned for the hot prefix: it ends on `holders` endpoints or more, the busiest of them
        taking at most `hot_top_share` of it.
    (c) Balance: each endpoint's share within 25% +- `share_tolerance`, in-flight spread at most `max_spread`
        at every moment (the reasons are given per guard above).
    (d) Cold groups keep their affinity: their mean top share stays >= `cold_top_share`.
    """
    rng = random.Random(42)
    hot = text(1, 4 * BLOCK)
    cold = [text(5000 + g, 4 * BLOCK) for g in range(63)]
    prompts = [text(9000 + p, 120) for p in range(16)]
    events: list[str] = []
    picker = build(views("a", "b", "c", "d"), params, seed=42, events=events)
    loads = Loads()
    running: list[str] = []
    hot_placed: Counter[str] = Counter()
    cold_placed: dict[int, Counter[str]] = {g: Counter() for g in range(63)}
    total: Counter[str] = Counter()
    spread = 0
    n = 20_000
    for _ in range(n):
        is_hot = rng.random() < 0.6
        g = rng.randrange(63)
        view = picker.pick(chat(rng.choice(prompts), system=hot if is_hot else cold[g]), loads, frozenset())
        loads.counts[view.id] += 1
        running.append(view.id)
        (hot_placed if is_hot else cold_placed[g])[view.id] += 1
        total[view.id] += 1
        if len(running) > 32:
            done = running.pop(rng.randrange(len(running)))
            loads.counts[done] -= 1
        spread = max(spread, max(loads.counts[e] for e in "abcd") - min(loads.counts[e] for e in "abcd"))
    assert events.count(guard_event) >= 1, Counter(events)
    assert len(hot_placed) >= holders, hot_placed
    assert max(hot_placed.values()) / sum(hot_placed.values()) <= hot_top_share, hot_placed
    for endpoint in "abcd":
        assert abs(total[endpoint] / n - 0.25) <= share_tolerance, dict(total)
    assert spread <= max_spread
    assert statistics.mean(c.most_common(1)[0][1] / sum(c.values()) for c in cold_placed.values()) >= cold_top_share


# ---- parsing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, field, message",
    [
        ({"blockSize": 256}, "blockSize", "unknown parameter"),
        ({"blockChars": 8}, "blockChars", "between 16 and 65536"),
        ({"blockChars": "256"}, "blockChars", "must be an integer"),
        ({"maxBlocks": 0}, "maxBlocks", "between 1 and 4096"),
        ({"maxBlocksPerEndpoint": 2.5}, "maxBlocksPerEndpoint", "must be auto or an integer"),
        ({"maxBlocksPerEndpoint": "automatic"}, "maxBlocksPerEndpoint", "got 'automatic'"),
        ({"maxBlocksPerEndpoint": 0}, "maxBlocksPerEndpoint", "between 1 and 10000000"),
        ({"minMatchShare": 1.5}, "minMatchShare", "got 1.5"),
        ({"minMatchShare": -0.1}, "minMatchShare", ">= 0.0"),
        ({"minMatchShare": None}, "minMatchShare", "must be a number"),
        ({"maxImbalance": -1}, "maxImbalance", ">= 0"),
        ({"maxImbalance": True}, "maxImbalance", "must be an integer"),
        ({"maxInFlight": 0}, "maxInFlight", ">= 1"),
        ({"maxInFlight": "many"}, "maxInFlight", "must be an integer or null"),
        ({"maxLoadFactor": 0.5}, "maxLoadFactor", "must be a number >= 1.0 or null, got 0.5"),
        ({"maxLoadFactor": "1.5"}, "maxLoadFactor", "must be a number"),
        ({"sigmaK": 0}, "sigmaK", "must be a number > 0.0 or null, got 0"),
        ({"sigmaK": float("inf")}, "sigmaK", "must be a number"),
        ({"sharing": True}, "sharing", "must be a mapping"),
        ({"sharing": {"ttl": "forever"}}, "sharing.ttl", "must be a duration of at least 1s"),
        ({"sharing": {"ttl": "500ms"}}, "sharing.ttl", "got '500ms'"),
        ({"sharing": {"maxStreamEntries": 8}}, "sharing.maxStreamEntries", "between 16 and 1000000"),
        ({"sharing": {"enabled": "yes"}}, "sharing.enabled", "must be true or false"),
        ({"sharing": {"ttls": 1}}, "sharing.ttls", "unknown parameter (expected one of: enabled, maxStreamEntries, ttl)"),
        ({"tuning": {"window": 0}}, "tuning.window", "at least 0.1s"),
        ({"tuning": {"tolerance": 0}}, "tuning.tolerance", "> 0.0 and <= 1.0"),
        ({"tuning": {"tolerance": 2}}, "tuning.tolerance", "got 2"),
        ({"tuning": {"windows": 1}}, "tuning.windows", "unknown parameter"),
        ({"selection": "fastest"}, "selection", "must be one of longest-match, least-prefill, got 'fastest'"),
    ],
)
def test_parse_rejects_bad_parameters_naming_the_field(params: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        POLICY.parse(params)
    assert info.value.field == field
    assert message in str(info.value)


def test_parse_defaults_and_overrides() -> None:
    config = POLICY.parse({"maxInFlight": None, "maxImbalance": 4})
    assert (config.block_chars, config.max_blocks, config.max_blocks_per_endpoint) == (256, 64, "auto")
    assert (config.max_imbalance, config.max_in_flight, config.max_load_factor, config.sigma_k) == (4, None, None, None)
    assert (config.sharing.enabled, config.sharing.ttl, config.sharing.max_stream_entries) == (True, 600.0, 8192)
    assert (config.tuning.enabled, config.tuning.window, config.tuning.tolerance) == (True, 30.0, 0.1)
    other = POLICY.parse({"maxBlocksPerEndpoint": 5000, "maxLoadFactor": 1.25, "sigmaK": 2, "sharing": {"ttl": "2m"},
                          "tuning": {"enabled": False, "window": "500ms", "tolerance": 0.2}})
    assert (other.max_blocks_per_endpoint, other.max_load_factor, other.sigma_k) == (5000, 1.25, 2.0)
    assert (other.sharing.ttl, other.tuning.enabled, other.tuning.window, other.tuning.tolerance) == (120.0, False,
                                                                                                     0.5, 0.2)


def test_least_prefill_has_no_imbalance_guard_unless_one_is_set() -> None:
    assert POLICY.parse({}).selection == "longest-match"
    assert POLICY.parse({"selection": "least-prefill"}).max_imbalance is None
    assert POLICY.parse({"selection": "least-prefill", "maxImbalance": 16}).max_imbalance == 16
    assert POLICY.parse({"selection": "longest-match"}).max_imbalance == 8


def test_config_errors_name_the_path_in_the_file() -> None:
    from router.config.settings import ConfigError, parse_settings

    with pytest.raises(ConfigError) as info:
        parse_settings({"policies": [{"name": "p", "strategy": "prefix-aware",
                                      "prefixAware": {"sharing": {"ttl": "soon"}}}]})
    assert str(info.value).startswith("policies[0].prefixAware.sharing.ttl: must be a duration")


# ---- end to end -------------------------------------------------------------------------------------


async def test_shared_prefix_requests_stick_together_through_a_router(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(4)]
    router = await make_router(
        engines, policies=[{"name": "default", "models": ["*"], "strategy": "prefix-aware"}]
    )
    served: dict[int, set[str]] = {}
    for turn in range(3):
        for conv in range(6):
            messages = [{"role": "system", "content": text(7000 + conv, 3 * BLOCK)}]
            for t in range(turn + 1):
                messages.append({"role": "user", "content": text(8000 + conv * 10 + t, 200)})
            body = {"model": E2E_MODEL, "messages": messages, "max_tokens": 2}
            async with http.post(router.ingress_url + "/v1/chat/completions", json=body) as resp:
                assert resp.status == 200
                served.setdefault(conv, set()).add(resp.headers["x-fleetroute-endpoint"])
    # Completions: documents with different questions appended.
    for doc in range(4):
        for question in range(3):
            body = {"model": E2E_MODEL, "prompt": text(9500 + doc, 4 * BLOCK) + f" Q{question}?", "max_tokens": 2}
            async with http.post(router.ingress_url + "/v1/completions", json=body) as resp:
                assert resp.status == 200
                served.setdefault(100 + doc, set()).add(resp.headers["x-fleetroute-endpoint"])
    assert all(len(endpoints) == 1 for endpoints in served.values()), served
    metrics = router.ctx.metrics.registry
    assert metrics.get_sample_value("fleetroute_policy_events_total",
                                    {"policy": "default", "event": "prefix_miss"}) == 6.0 + 4.0
    assert metrics.get_sample_value("fleetroute_policy_events_total",
                                    {"policy": "default", "event": "prefix_hit"}) == 12.0 + 8.0


async def test_least_prefill_books_prefill_until_the_first_token_and_measures_speed(make_engine, make_router,
                                                                                     http) -> None:
    hang = asyncio.Event()
    engines = [await make_engine("gpu-0", hang=hang), await make_engine("gpu-1")]
    # gpu-0 is twice as fast by its weight (nothing is measured yet), so the first request goes there.
    endpoints = [{"id": e.name, "url": e.url, "models": list(e.models), "weight": w} for e, w in zip(engines, (2, 1), strict=True)]
    router = await make_router(engines, endpoints=endpoints, policies=[
        {"name": "default", "models": ["*"], "strategy": "prefix-aware", "prefixAware": LEAST_PREFILL}])
    url = router.ingress_url + "/v1/chat/completions"
    metrics = router.ctx.metrics.registry

    def stream(content: str) -> dict[str, Any]:
        return {"model": E2E_MODEL, "stream": True, "max_tokens": 2, "messages": [{"role": "user", "content": content}]}

    def pending(endpoint: str) -> float | None:
        return metrics.get_sample_value("fleetroute_endpoint_pending_prefill_tokens", {"endpoint": endpoint})

    long_body = stream(text(1, 20_000))
    long_request = asyncio.create_task(http.post(url, json=long_body))
    await engines[0].request_received.wait()  # sent, no first byte: its whole prompt is pending there
    assert pending("gpu-0") == pytest.approx(prompt_blocks(long_body, BLOCK, 64)[1] / 4)
    # gpu-0 would first have to finish 5,000 tokens: a short prompt is sooner on gpu-1, and its first token
    # there closes its booking and times gpu-1.
    async with http.post(url, json=stream("a short question")) as resp:
        assert resp.status == 200 and resp.headers["x-fleetroute-endpoint"] == "gpu-1"
        await resp.read()
    assert pending("gpu-1") == 0.0
    assert metrics.get_sample_value("fleetroute_endpoint_prefill_speed_tokens_per_second", {"endpoint": "gpu-1"}) > 0
    assert metrics.get_sample_value("fleetroute_policy_events_total", {"policy": "default", "event": "prefix_miss"}) == 2
    hang.set()
    async with await long_request as resp:
        assert resp.status == 200 and resp.headers["x-fleetroute-endpoint"] == "gpu-0"
        await resp.read()
    assert pending("gpu-0") == 0.0 and router.ctx.loads.prefill_speed("gpu-0") is not None
    async with http.get(router.admin_url + "/admin/endpoints") as resp:
        listed = {e["id"]: e for e in (await resp.json())["endpoints"]}
    assert listed["gpu-0"]["pending_prefill_tokens"] == 0.0
    assert listed["gpu-0"]["prefill_speed_tokens_per_s"] == pytest.approx(router.ctx.loads.prefill_speed("gpu-0"), abs=0.1)


async def test_turns_a_sticky_session_sends_without_a_pick_still_reach_the_prefix_index(
        make_engine, make_router, http) -> None:
    # realtime-chat pins sessions: from turn 2 on the handler keeps the pin and never asks the picker. The
    # index must still learn each turn's blocks (recency, sharing, the tuner's estimate), or a live
    # conversation would age out of the index while its engine still holds it.
    from router.routing.prefix.index import PrefixIndex

    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    router = await make_router(engines, policies=[{"name": "default", "models": ["*"], "strategy": "prefix-aware",
                                                   "stickiness": {"key": "header:x-session-id"}}])
    messages = [{"role": "system", "content": text(7100, 2 * BLOCK)}]
    for turn in range(3):
        messages.append({"role": "user", "content": text(7200 + turn, 2 * BLOCK)})
        body = {"model": E2E_MODEL, "messages": list(messages), "max_tokens": 2}
        async with http.post(router.ingress_url + "/v1/chat/completions", json=body,
                             headers={"x-session-id": "conv-1"}) as resp:
            assert resp.status == 200
            endpoint = resp.headers["x-fleetroute-endpoint"]
    metrics = router.ctx.metrics.registry
    assert metrics.get_sample_value("fleetroute_sticky_decisions_total", {"policy": "default", "outcome": "hit"}) == 2
    [index] = [state for _, _, state in router.ctx.balancer.pool_states() if isinstance(state, PrefixIndex)]
    last_turn = block_hashes(body, BLOCK, 64)
    assert index.matched(endpoint, last_turn) == len(last_turn) > 4  # the third turn's blocks too


# ---- the RoutingPolicy CRD carries the same fields ---------------------------------------------------


FULL_PARAMS = {"selection": "least-prefill", "blockChars": 512, "maxBlocks": 32, "maxBlocksPerEndpoint": "auto", "maxImbalance": None,
               "maxInFlight": 64, "maxLoadFactor": 1.5, "sigmaK": 2.5,
               "sharing": {"enabled": True, "ttl": "5m", "maxStreamEntries": 4096},
               "tuning": {"enabled": True, "window": "30s", "tolerance": 0.15}}


@pytest.mark.parametrize("params, error", [
    pytest.param(FULL_PARAMS, None, id="every field, as the router parses it"),
    pytest.param({"maxBlocksPerEndpoint": 20000, "sharing": {"ttl": 600}}, None, id="a number of blocks, seconds"),
    pytest.param({"maxBlocksPerEndpoint": "lots"}, "spec.prefixAware.maxBlocksPerEndpoint: Invalid value: 'lots'",
                 id="maxBlocksPerEndpoint is auto or a number"),
    pytest.param({"sigmaK": 0}, "spec.prefixAware.sigmaK: Invalid value: 0", id="sigmaK is positive"),
    pytest.param({"sharing": {"ttl": "ages"}}, "spec.prefixAware.sharing.ttl: Invalid value: 'ages'",
                 id="ttl is a duration"),
    pytest.param({"tuning": {"tolerance": 1.5}}, "spec.prefixAware.tuning.tolerance: Invalid value: 1.5",
                 id="tolerance is at most 1"),
    pytest.param({"tuning": {"step": 2}}, "('step' was unexpected)", id="unknown tuning fields are refused"),
])
def test_the_crd_schema_accepts_what_the_router_does(params: dict[str, Any], error: str | None) -> None:
    from router.config.settings import _policy
    from router.routing.policies.registry import PolicyRegistry
    from tests.fake_crd import FakeCRD

    obj = {"apiVersion": "fleetroute.io/v1alpha1", "kind": "RoutingPolicy",
           "metadata": {"name": "cache", "namespace": "ns"}, "spec": {"strategy": "prefix-aware", "prefixAware": params}}
    errors = FakeCRD().admit(obj)
    if error is None:
        assert errors == []
        spec = {k: v for k, v in obj["spec"].items() if k != "priority"}
        assert _policy("spec", {**spec, "name": "cache"}, PolicyRegistry()).params == POLICY.parse(params)
    else:
        assert any(error in e for e in errors), errors


def test_a_deeply_nested_or_huge_prompt_is_served_without_rendering_it_all() -> None:
    # orjson accepts 1,024 levels of nesting, Python's json recursion stops near 1,000: a client must not
    # turn that into a 500 on the pick path. And a multi-megabyte image part is never rendered to hash it.
    from router.routing.policies.prefix_aware import prompt_blocks

    deep: object = "x"
    for _ in range(1020):
        deep = [deep]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi " * 200}, deep]}
    hashes, chars = prompt_blocks(body, BLOCK, 64)
    assert hashes and chars > 0
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 5_000_000}}
    big = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "q " * 2000},
                                                                      image]}]}
    hashes, chars = prompt_blocks(big, BLOCK, 4)
    assert len(hashes) == 4 and chars < 10_000  # measured from the text, the image counted as nothing
