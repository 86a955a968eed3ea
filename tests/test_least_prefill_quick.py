"""Least-prefill's unexplained pick (`_least_prefill_quick`) against the explained one (the full scan that
writes every candidate's expected wait): on seeded random fleets (bookings, measured and unmeasured speeds,
capacity weights, slow start, cached prefixes, exclusions) both pick the same endpoint with the same random
draw, raise the same event and book the same uncached tokens."""

from __future__ import annotations

import random

import pytest

from router.model import Endpoint, EndpointView, RequestInfo
from router.routing.policies.base import DecisionTrace
from router.routing.policies.prefix_aware import PrefixAwarePolicy, block_hashes
from router.routing.prefix.index import PrefixIndex
from tests.test_prefix_aware import Loads, text

MODEL = "m"
POLICY = PrefixAwarePolicy()


def request(system: str, question: str) -> RequestInfo:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return RequestInfo(model=MODEL, request_id="r", headers={}, body={"model": MODEL, "messages": messages})


def fleet(rng: random.Random, n: int) -> tuple[EndpointView, ...]:
    return tuple(
        EndpointView(Endpoint(f"e{i}", f"http://e{i}", (MODEL,), weight=rng.choice((1.0, 1.0, 2.0, 0.5))),
                     weight_factor=rng.choice((1.0, 1.0, 1.0, 0.25)))
        for i in range(n))


@pytest.mark.parametrize("seed", range(40))
def test_the_quick_pick_is_the_scans_pick(seed: int) -> None:
    rng = random.Random(seed)
    views = fleet(rng, rng.choice((1, 3, 12, 60)))
    ids = [v.id for v in views]
    systems = [text(seed * 10 + k, rng.choice((300, 1200, 3000))) for k in range(3)]
    params = {"selection": "least-prefill", "minMatchShare": rng.choice((0.0, 0.2, 0.6))}
    # Prefixes cached at random endpoints (some beyond the pool: the index keeps departed endpoints a while).
    history = [(holder, block_hashes(request(system, "").body, 256, 64)[: rng.randint(1, 12)])
               for system in systems for holder in rng.sample([*ids, "gone"], k=min(len(ids) + 1, rng.randint(0, 4)))]

    def state() -> PrefixIndex:  # each pick records its choice: every pick starts from the same history
        index = POLICY.new_state()
        for i in [*ids, "gone"]:
            index.set_base(i, 1000, "config")
        for holder, hashes in history:
            index.record(holder, hashes)
        return index

    # Bookings, speeds and in-flight counts; few distinct values so that waits and loads tie.
    loads = Loads(
        counts={i: rng.choice((0, 0, 1, 3)) for i in ids},
        pending={i: rng.choice((100.0, 500.0, 2000.0)) for i in ids if rng.random() < 0.4},
        speeds={i: rng.choice((1000.0, 2000.0, 4000.0)) for i in ids if rng.random() < 0.5},
    )
    for k in range(20):
        exclude = frozenset(rng.sample(ids, k=rng.randint(0, len(ids) - 1))) if rng.random() < 0.3 else frozenset()
        draw = rng.randint(0, 10**6)
        system = rng.choice(systems)
        got: list[tuple[str | None, list[str], float | None]] = []
        for explained in (False, True):
            events: list[str] = []
            picker = POLICY.build(views, POLICY.parse(params), state(), random.Random(draw), events.append)
            req = request(system, f"q{k}")
            view = picker.pick(req, loads, exclude, DecisionTrace() if explained else None)
            got.append((view.id if view else None, events, req.note.prefill_tokens))
        assert got[0] == got[1], (seed, k)
        chosen, _, booked = got[0]
        assert chosen is not None
        # Bookings move: the chosen endpoint's queue grows and its blocks are cached there; some queue drains.
        history.append((chosen, block_hashes(request(system, f"q{k}").body, 256, 64)))
        loads.pending[chosen] = loads.pending.get(chosen, 0.0) + (booked or 0.0)
        loads.counts[chosen] += 1
        if loads.pending and rng.random() < 0.3:
            loads.pending.pop(rng.choice(sorted(loads.pending)))
