"""adaptive's own picker (policies/adaptive.py): the composite picker's scores and picks to the last bit, and a
telemetry round's `refresh` that patches the changed endpoints only.

Two properties, on seeded random fleets (missing telemetry, ramping and heavier endpoints, every selection and
sample size): an `AdaptivePicker` scores and picks exactly as a `CompositePicker` of adaptive's configuration
(same random stream), and a picker refreshed through any sequence of rounds equals one built afresh over the
same views. The balancer-level property (rounds with lost, reordered and stale reports) is in
tests/test_telemetry_refresh.py.
"""

from __future__ import annotations

import random

import pytest

from router.model import Endpoint, EndpointView, RequestInfo, Telemetry
from router.routing.policies.adaptive import AdaptivePicker, AdaptivePolicy
from router.routing.policies.composite import CompositePicker

REQ = RequestInfo(model="m", request_id="r", headers={}, body={})
CONFIGS = [{}, {"choices": "all"}, {"selection": "best-score"}, {"choices": "all", "selection": "best-score"},
           {"choices": 5, "signals": {"queue": "num_requests", "memory": "gpu_mem_util"}},
           {"weights": {"gpu": 0, "memory": 1, "queue": 3}, "maxQueue": 4}]


class Loads:
    def __init__(self, counts: dict[str, int]) -> None:
        self.counts = counts

    def in_flight(self, endpoint_id: str) -> int:
        return self.counts.get(endpoint_id, 0)

    def in_flight_cost(self, endpoint_id: str) -> float:
        return 0.0

    def mean_request_cost(self) -> float:
        return 0.0


def telemetry(rng: random.Random) -> Telemetry | None:
    if rng.random() < 0.2:
        return None
    def maybe(value: float) -> float | None:
        return None if rng.random() < 0.15 else value
    return Telemetry(reported_at=rng.random(), gpu_util=maybe(rng.choice([0.0, 1.0, rng.random()])),
                     gpu_mem_util=maybe(rng.random()), kv_cache_usage=maybe(rng.random()),
                     num_waiting=maybe(float(rng.randrange(40))), num_running=maybe(float(rng.randrange(8))))


def fleet(rng: random.Random, n: int) -> tuple[EndpointView, ...]:
    return tuple(EndpointView(Endpoint(f"e{i}", f"http://e{i}", ("m",), weight=rng.choice([1.0, 1.0, 2.0])),
                              telemetry(rng), weight_factor=rng.choice([1.0, 1.0, 1.0, 0.25]))
                 for i in range(n))


def agree(mine: AdaptivePicker, theirs: AdaptivePicker | CompositePicker, views: tuple[EndpointView, ...],
          loads: Loads, seed: int) -> None:
    for view in views:
        for in_flight in (0.0, 3.0):
            assert mine.score(view, in_flight) == theirs.score(view, in_flight)  # bit for bit, not approximately
    for k in range(4):
        exclude = frozenset({views[0].id}) if k == 3 else frozenset()
        mine._rng.seed(seed + k)
        theirs._rng.seed(seed + k)
        assert mine.pick(REQ, loads, exclude) == theirs.pick(REQ, loads, exclude)


@pytest.mark.parametrize("params", CONFIGS)
def test_adaptive_scores_and_picks_as_the_composite_picker_of_its_configuration(params):
    policy = AdaptivePolicy()
    config = policy.parse(params)
    for seed in range(25):
        rng = random.Random(seed)
        views = fleet(rng, rng.randrange(1, 40))
        loads = Loads({v.id: rng.randrange(4) for v in views if rng.random() < 0.5})
        events: list[str] = []
        mine = policy.build(views, config, None, random.Random(), events.append)
        theirs = CompositePicker(views, config.composite, random.Random(), events.append)
        agree(mine, theirs, views, loads, seed)


@pytest.mark.parametrize("params", CONFIGS)
def test_a_refreshed_picker_equals_one_built_afresh_after_any_rounds(params):
    policy = AdaptivePolicy()
    config = policy.parse(params)
    for seed in range(25):
        rng = random.Random(seed)
        views = fleet(rng, rng.randrange(1, 40))
        picker = policy.build(views, config, None, random.Random(), lambda _e: None)
        for _round in range(rng.randrange(1, 8)):
            changed = {}
            for i in rng.sample(range(len(views)), rng.randrange(len(views) + 1)):
                changed[views[i].id] = EndpointView(views[i].endpoint, telemetry(rng), views[i].state,
                                                    views[i].weight_factor)
            before, old_views = picker, views
            views = tuple(changed.get(v.id, v) for v in views)
            picker = policy.refresh(picker, views, changed)
            assert picker is not None and picker is not before
            # The old picker still scores its own round's views: a pick in progress reads what it started with.
            agree(before, policy.build(old_views, config, None, random.Random(), lambda _e: None), old_views,
                  Loads({}), seed)
        loads = Loads({v.id: rng.randrange(4) for v in views})
        agree(picker, policy.build(views, config, None, random.Random(), lambda _e: None), views, loads, seed)


def test_refresh_leaves_a_picker_it_does_not_know_to_a_build():
    assert AdaptivePolicy().refresh(object(), (), {}) is None
