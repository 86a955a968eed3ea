"""Composite's indexed pick (router/routing/policies/composite.py `_indexed`) against the scan it replaces.

On random fleets (capacity weights, slow-start ramps, telemetry with and without ties or gaps), loads, prompts
cached on random endpoints, scorer mixes and exclusions, the indexed pick must choose an endpoint the scan could
choose: the least key, and among equal keys the least load (ties beyond that are broken at random by both). The
reference is computed twice: with the picker's own key function (exact float equality), and from the documented
formula written out here (docs/policies.md, composite), equal within float rounding.
"""

from __future__ import annotations

import contextlib
import copy
import random
from typing import Any

import pytest

from router.model import Endpoint, EndpointView, RequestInfo, Telemetry
from router.routing.loads import LoadTracker
from router.routing.policies.base import pool_index
from router.routing.policies.composite import CompositePicker, CompositePolicy, prefix_holders
from router.routing.policies.prefix_aware import prompt_blocks
from router.routing.prefix.index import PrefixIndex
from router.runtime.metrics import RouterMetrics

MIXES: list[dict[str, Any]] = [
    {"prefix": 0.5, "load": 0.3, "memory": 0.2},  # the benchmark's
    {"load": 0.5, "gpu": 0.5},
    {"prefix": 0.7, "memory": 0.3},
    {"gpu": 0.6, "memory": 0.3, "queue": 0.1},  # adaptive's, least-load
    {"prefix": 1.0},
    {"load": 1.0},
    {"prefix": 0.4, "load": 0.4, "queue": {"weight": 0.2, "maxQueue": 4}},
]
SYSTEMS = ["You are a helpful assistant. " * 12, "Answer in French, briefly and politely. " * 9,
           "Context: " + "lorem ipsum dolor sit amet " * 30]
MODEL = "m"


class Unindexed:
    """The tracker's counts without its load index: the picker scans."""

    def __init__(self, tracker: LoadTracker) -> None:
        self.tracker = tracker

    def __getattr__(self, name: str) -> Any:
        if name == "load_index":
            raise AttributeError(name)
        return getattr(self.tracker, name)


class Counting(Unindexed):
    """The tracker, index included, counting the loads a pick reads (how many endpoints it looked at)."""

    def __init__(self, tracker: LoadTracker) -> None:
        super().__init__(tracker)
        self.reads = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tracker, name)

    def in_flight(self, endpoint_id: str) -> int:
        self.reads += 1
        return self.tracker.in_flight(endpoint_id)


def body(system: str, question: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def fleet(rng: random.Random, n: int) -> tuple[EndpointView, ...]:
    ties = rng.random() < 0.5  # telemetry from a few values, so snapshot scores tie
    out = []
    for i in range(n):
        def signal() -> float | None:
            if rng.random() < 0.15:
                return None  # unknown: the neutral fill
            return rng.choice((0.0, 0.25, 0.5, 1.0, 1.3)) if ties else rng.uniform(-0.1, 1.1)
        t = None if rng.random() < 0.1 else Telemetry(
            reported_at=0.0, gpu_util=signal(), kv_cache_usage=signal(),
            num_waiting=rng.choice((None, 0, 1, 3, 9)))
        out.append(EndpointView(Endpoint(f"e{i}", f"http://e{i}", (MODEL,), weight=rng.choice((1.0, 1.0, 1.0, 2.0, 0.5))),
                                telemetry=t, weight_factor=rng.choice((1.0, 1.0, 1.0, 1.0, 0.5, 0.1))))
    return tuple(out)


def documented_keys(params: dict[str, Any], views: tuple[EndpointView, ...], loads: LoadTracker,
                   exclude: frozenset[str], state: PrefixIndex, hashes: list[int]) -> dict[str, tuple[float, float]]:
    """docs/policies.md's formula, written out: each scorer clamped to [0, 1], weighted (normalised), summed,
    clamped, times the slow-start factor; key (load + 1) / (max(score, 0.01) x weight)."""
    def clamp(x: float) -> float:
        return 0.0 if x != x else min(1.0, max(0.0, x))

    weights = {k: (v["weight"] if isinstance(v, dict) else v) for k, v in params.items()}
    total = sum(weights.values())

    def filled(values: dict[str, float | None], default: float) -> dict[str, float]:
        known = [x for x in values.values() if x is not None]
        mean = sum(known) / len(known) if known else default
        return {k: mean if x is None else x for k, x in values.items()}

    def free(signal: str) -> dict[str, float]:
        return filled({v.id: None if v.telemetry is None or getattr(v.telemetry, signal) is None
                       else clamp(1 - getattr(v.telemetry, signal)) for v in views}, 0.5)

    gpu, memory = free("gpu_util"), free("kv_cache_usage")
    queue = filled({v.id: None if v.telemetry is None or v.telemetry.num_waiting is None
                    else float(v.telemetry.num_waiting) for v in views}, 0.0)
    max_queue = params["queue"].get("maxQueue", 32) if isinstance(params.get("queue"), dict) else 32
    candidates = [v for v in views if v.id not in exclude]
    most = max(loads.in_flight(v.id) for v in candidates)
    out = {}
    for v in candidates:
        load = loads.in_flight(v.id)
        raw = {"gpu": gpu[v.id], "memory": memory[v.id], "queue": 1 - queue[v.id] / max_queue,
               "load": 1 - load / most if most else 1.0,
               "prefix": state.matched(v.id, hashes) / len(hashes) if hashes else 0.0}
        s = clamp(sum(w / total * clamp(raw[k]) for k, w in weights.items())) * v.weight_factor
        out[v.id] = ((load + 1) / (max(s, 0.01) * v.endpoint.weight), float(load))
    return out


@pytest.mark.parametrize("seed", range(40))
def test_the_indexed_pick_chooses_what_the_scan_could_choose(seed: int) -> None:
    rng = random.Random(seed)
    indexed = 0
    for case in range(12):
        n = rng.choice((1, 2, 3, 9, 20, 60))
        views = fleet(rng, n)
        params = dict(rng.choice(MIXES))
        policy = CompositePolicy()
        config = policy.parse({"scorers": params, "choices": "all"})
        state = policy.new_state()
        prompts = [body(rng.choice(SYSTEMS), f"question {k}") for k in range(4)]
        for _ in range(rng.randrange(0, 3 * n + 1)):  # cached prefixes: some prompts, some of their blocks
            hashes, _ = prompt_blocks(rng.choice(prompts), 256, 64)
            state.record(rng.choice(views).id, hashes[: rng.randrange(1, len(hashes) + 1)])
        tracker = LoadTracker(RouterMetrics())
        with contextlib.ExitStack() as held:
            spread = rng.choice((1, 2, 6))
            for v in views:
                for _ in range(rng.randrange(0, spread + 1)):
                    held.enter_context(tracker.track(v.id))
            tracker.set_pools({MODEL: views})
            assert pool_index(tracker, views) is not None
            for step in range(6):
                exclude = frozenset(v.id for v in views if rng.random() < 0.1)
                if len(exclude) == n:
                    exclude = frozenset()
                request = RequestInfo(model=MODEL, request_id="r", headers={}, body=rng.choice(prompts))
                hashes = prompt_blocks(request.body, 256, 64)[0] if "prefix" in params else []
                # Each path picks on its own copy of the prefix index (a pick records where it sent the prompt).
                fast = policy.build(views, config, copy.deepcopy(state), random.Random(step), lambda _e: None)
                scan = policy.build(views, config, copy.deepcopy(state), random.Random(step), lambda _e: None)
                best = least_key(fast, views, tracker, exclude, state, hashes)
                documented = documented_keys(params, views, tracker, exclude, state, hashes)
                least = min(documented.values())
                chosen = fast.pick(request, tracker, exclude)
                scanned = scan.pick(request, Unindexed(tracker), exclude)
                assert chosen is not None and scanned is not None and chosen.id not in exclude
                indexed += fast._indexable
                for view in (chosen, scanned):
                    # Exactly the least (key, load) the scan compares ...
                    assert key_of(fast, view, views, tracker, exclude, state, hashes) == best, (seed, case, params, view is chosen, n)
                    # ... which is the documented formula's least, up to float rounding.
                    assert documented[view.id][0] == pytest.approx(least[0], rel=1e-9, abs=1e-12)
    assert indexed > 0


def least_key(picker: CompositePicker, views: tuple[EndpointView, ...], loads: LoadTracker, exclude: frozenset[str],
              state: PrefixIndex, hashes: list[int]) -> tuple[float, float]:
    """The least (key, load) over the candidates: the scan's choice, with the picker's own key function."""
    return min(key_of(picker, v, views, loads, exclude, state, hashes) for v in views if v.id not in exclude)


def key_of(picker: CompositePicker, view: EndpointView, views: tuple[EndpointView, ...], loads: LoadTracker,
           exclude: frozenset[str], state: PrefixIndex, hashes: list[int]) -> tuple[float, float]:
    at = picker._at
    at.most = max(float(loads.in_flight(v.id)) for v in views if v.id not in exclude)
    at.blocks = len(hashes)
    at.queued = 0.0
    lv = float(loads.in_flight(view.id))
    return picker._key(view, lv, state.matched(view.id, hashes) if hashes else 0)[0], lv


def test_holders_are_the_endpoints_matching_the_first_block() -> None:
    index = PrefixIndex()
    a, _ = prompt_blocks(body(SYSTEMS[2], "x"), 256, 64)
    assert len(a) > 2
    b, _ = prompt_blocks(body(SYSTEMS[1], "x"), 256, 64)
    index.record("e1", a)
    index.record("e2", a[:2])
    index.record("e3", b)
    index.record("e4", a[1:])  # not the first block: no leading match
    assert prefix_holders(index, a) == {"e1": len(a), "e2": 2}
    assert prefix_holders(index, b) == {"e3": len(b)}


def test_at_a_thousand_endpoints_a_pick_looks_at_few() -> None:
    """The benchmark's shape (docs/results/scale-picks): 1,000 endpoints, 1-12 requests in flight each, telemetry
    spread, a prompt cached on a few endpoints; the indexed pick reads a small share of the loads."""
    rng = random.Random(5)
    views = tuple(EndpointView(Endpoint(f"e{i}", f"http://e{i}", (MODEL,)),
                               telemetry=Telemetry(reported_at=0.0, kv_cache_usage=rng.uniform(0, 1)))
                  for i in range(1000))
    policy = CompositePolicy()
    config = policy.parse({"scorers": {"prefix": 0.5, "load": 0.3, "memory": 0.2}})
    state = policy.new_state()
    prompt = body(SYSTEMS[2], "q")
    hashes, _ = prompt_blocks(prompt, 256, 64)
    for v in rng.sample(views, 5):
        state.record(v.id, hashes[:3])
    picker = policy.build(views, config, state, random.Random(1), lambda _e: None)
    tracker = LoadTracker(RouterMetrics())
    with contextlib.ExitStack() as held:
        for v in views:
            for _ in range(1 + min(11, int(rng.expovariate(1 / 3)))):
                held.enter_context(tracker.track(v.id))
        tracker.set_pools({MODEL: views})
        counting = Counting(tracker)
        chosen = picker.pick(RequestInfo(model=MODEL, request_id="r", headers={}, body=prompt), counting, frozenset())
        assert chosen is not None
        assert counting.reads < 100, counting.reads
