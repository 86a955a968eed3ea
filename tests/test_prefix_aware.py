"""prefix-aware: block hashing, the bounded index, the load guard, a seeded simulation with stated bounds,
and one end-to-end run through a real router and fake engines."""

from __future__ import annotations

import random
import statistics
from collections import Counter
from typing import Any

import pytest

from router.model import Endpoint, EndpointView, RequestInfo
from router.policies.base import PolicyConfigError
from router.policies.prefix_aware import PrefixAwarePolicy, PrefixIndex, block_hashes
from tests.conftest import MODEL as E2E_MODEL

POLICY = PrefixAwarePolicy()
MODEL = "m"
BLOCK = 256


class Loads:
    """In-flight counts a test sets or a simulation moves."""

    def __init__(self, counts: dict[str, int] | None = None) -> None:
        self.counts: Counter[str] = Counter(counts or {})

    def in_flight(self, endpoint_id: str) -> int:
        return self.counts[endpoint_id]

    def cluster_in_flight(self, endpoint_id: str) -> int:
        return self.counts[endpoint_id]


def views(*ids: str, weights: dict[str, float] | None = None) -> tuple[EndpointView, ...]:
    weights = weights or {}
    return tuple(EndpointView(Endpoint(i, f"http://{i}", (MODEL,)), weight_factor=weights.get(i, 1.0)) for i in ids)


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
        pytest.param({"b": SYSTEM_A}, {"b": 9, "a": 0, "c": 0}, {}, set(), {"a", "c"}, "load_guard",
                     id="9 above the least loaded trips the default relative guard"),
        pytest.param({"b": SYSTEM_A}, {"b": 3}, {"maxInFlight": 3}, set(), {"a", "c"}, "load_guard",
                     id="the absolute guard trips at maxInFlight"),
        pytest.param({"b": SYSTEM_A}, {"b": 2}, {"maxImbalance": 0}, set(), {"a", "c"}, "load_guard",
                     id="maxImbalance 0 means any imbalance moves the request"),
        pytest.param({"b": SYSTEM_B}, {"a": 5}, {}, set(), {"b", "c"}, "prefix_miss",
                     id="a cold request goes by load (P2C never takes the busier of its two draws)"),
        pytest.param({"b": SYSTEM_A}, {}, {}, {"b"}, {"a", "c"}, "prefix_miss",
                     id="an excluded holder is skipped"),
        pytest.param({"a": SYSTEM_A[:2 * BLOCK], "b": SYSTEM_A}, {}, {}, set(), {"b"}, "prefix_hit",
                     id="the longest match wins over a shorter one"),
        pytest.param({"a": SYSTEM_A[:2 * BLOCK], "b": SYSTEM_A}, {"b": 20, "a": 12}, {}, set(), {"a", "c"},
                     "load_guard", id="a guarded best match falls back to load, not to the next match"),
        pytest.param({"a": SYSTEM_A, "b": SYSTEM_A}, {"a": 4, "b": 1}, {}, set(), {"b"}, "prefix_hit",
                     id="equal matches go to the less loaded holder"),
    ],
)
def test_pick_table(seeded: dict[str, str], loads: dict[str, int], params: dict[str, Any], exclude: set[str],
                    allowed: set[str], event: str) -> None:
    for seed in range(20):  # P2C fallbacks are random: every seed must stay inside `allowed`
        state = POLICY.new_state()
        config = POLICY.parse(params)
        for endpoint, prefix in seeded.items():
            state.record(endpoint, block_hashes(chat(system=prefix).body, BLOCK, 64), 1000)
        events: list[str] = []
        picker = build(views("a", "b", "c"), params, seed=seed, events=events, state=state)
        assert config.max_imbalance == picker._config.max_imbalance
        view = picker.pick(chat("question?", system=SYSTEM_A), Loads(loads), frozenset(exclude))
        assert view is not None and view.id in allowed, seed
        assert events == [event]


def test_no_candidates_gives_none() -> None:
    assert build(()).pick(chat("q", system=SYSTEM_A), Loads(), frozenset()) is None
    assert build(views("a")).pick(chat("q", system=SYSTEM_A), Loads(), frozenset({"a"})) is None


def test_slow_start_counts_a_ramping_holder_as_more_loaded() -> None:
    # b holds the prefix and has 4 in flight, but at weight 0.25 it counts as (4+1)/0.25-1 = 19 > 0 + 8.
    state = POLICY.new_state()
    state.record("b", block_hashes(chat(system=SYSTEM_A).body, BLOCK, 64), 1000)
    events: list[str] = []
    picker = build(views("a", "b", weights={"b": 0.25}), events=events, state=state)
    assert picker.pick(chat("q", system=SYSTEM_A), Loads({"b": 4}), frozenset()).id == "a"
    assert events == ["load_guard"]


def test_the_chosen_endpoint_records_the_blocks_and_rebuilds_keep_them() -> None:
    state = POLICY.new_state()
    vs = views("a", "b", "c", "d")
    first = build(vs, state=state, seed=5).pick(chat("q1", system=SYSTEM_A), Loads(), frozenset())
    for seed in range(10):  # a rebuild per pick, as telemetry refreshes cause, must not forget the index
        again = build(vs, state=state, seed=seed).pick(chat("q2", system=SYSTEM_A), Loads(), frozenset())
        assert again.id == first.id


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
    assert events.count("load_guard") > 0 and events.count("prefix_hit") > 0


# ---- the index is bounded ---------------------------------------------------------------------------


def test_the_index_evicts_least_recently_routed_blocks() -> None:
    index = PrefixIndex()
    index.record("a", [1, 2, 3], bound=4)
    index.record("a", [10, 11], bound=4)
    assert index.size("a") == 4
    # The oldest leaf (3) went first: roots are recorded last, so a chain loses its tail before its head.
    assert index.matched("a", [1, 2, 3]) == 2
    index.record("a", [1, 2], bound=4)  # touching a prefix makes it recent again
    index.record("a", [20], bound=4)
    assert index.matched("a", [1, 2]) == 2
    assert index.matched("a", [10, 11]) == 1  # the leaf 11 was evicted before its root 10


def test_a_tiny_bound_holds_through_a_long_run() -> None:
    state = POLICY.new_state()
    picker = build(views("a", "b"), {"maxBlocksPerEndpoint": 5}, state=state)
    for i in range(300):
        picker.pick(chat(text(i, 3 * BLOCK)), Loads(), frozenset())
    assert state.size("a") <= 5 and state.size("b") <= 5


def test_indices_of_departed_endpoints_are_dropped_once_they_outnumber_the_pool() -> None:
    state = POLICY.new_state()
    for i in range(8):
        state.record(f"old-{i}", [i], 10)
    build(views("a", "b", "c"), state=state)  # 8 <= 2 * 3 + 4: kept (they may only be ejected for a while)
    assert len(state.by_endpoint) == 8
    build(views("a"), state=state)  # 8 > 2 * 1 + 4: dropped
    assert state.by_endpoint == {}


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


# ---- parsing ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params, field, message",
    [
        ({"blockSize": 256}, "blockSize", "unknown parameter"),
        ({"blockChars": 8}, "blockChars", "between 16 and 65536"),
        ({"blockChars": "256"}, "blockChars", "must be an integer"),
        ({"maxBlocks": 0}, "maxBlocks", "between 1 and 4096"),
        ({"maxBlocksPerEndpoint": 2.5}, "maxBlocksPerEndpoint", "must be an integer"),
        ({"maxImbalance": -1}, "maxImbalance", ">= 0"),
        ({"maxImbalance": True}, "maxImbalance", "must be an integer"),
        ({"maxInFlight": 0}, "maxInFlight", ">= 1"),
        ({"maxInFlight": "many"}, "maxInFlight", "must be an integer or null"),
    ],
)
def test_parse_rejects_bad_parameters_naming_the_field(params: dict[str, Any], field: str, message: str) -> None:
    with pytest.raises(PolicyConfigError) as info:
        POLICY.parse(params)
    assert info.value.field == field
    assert message in str(info.value)


def test_parse_defaults_and_overrides() -> None:
    config = POLICY.parse({"maxInFlight": None, "maxImbalance": 4})
    assert (config.block_chars, config.max_blocks, config.max_blocks_per_endpoint) == (256, 64, 32768)
    assert (config.max_imbalance, config.max_in_flight) == (4, None)


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
    assert all(len(endpoints) == 1 for endpoints in served.values()), served
    metrics = router.ctx.metrics.registry
    assert metrics.get_sample_value("fleetroute_policy_events_total",
                                    {"policy": "default", "event": "prefix_miss"}) == 6.0
    assert metrics.get_sample_value("fleetroute_policy_events_total",
                                    {"policy": "default", "event": "prefix_hit"}) == 12.0
