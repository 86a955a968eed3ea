"""A discrete-event driver for `EngineCore` in virtual time: no sleeping, no event loop.

Time jumps from one engine step to the next (by each step's duration), or, when the engine has nothing
it can run, to the next arrival or to the end of the wait the engine asked for (a static batching window).
A request that arrives during a step joins at the next step boundary, as it would in a live engine,
and its latencies are measured from its own `arrival`. An hour of simulated traffic takes seconds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from worker.sim.engine import EngineCore, SimRequest


def run_virtual(engine: EngineCore, arrivals: Iterable[SimRequest]) -> list[SimRequest]:
    """Run every request to completion; returns them in arrival order."""
    reqs = sorted(arrivals, key=lambda r: r.arrival)
    now = reqs[0].arrival if reqs else 0.0
    nxt = 0
    while True:
        while nxt < len(reqs) and reqs[nxt].arrival <= now:
            engine.add_request(reqs[nxt])
            nxt += 1
        if not engine.has_work():
            if nxt == len(reqs):
                return reqs
            now = reqs[nxt].arrival
            continue
        result = engine.step(now)
        if not result.idle:
            now += result.duration
            continue
        wake = now + result.duration if result.duration > 0 else math.inf
        if nxt < len(reqs):
            wake = min(wake, reqs[nxt].arrival)
        if wake == math.inf:
            raise RuntimeError("the engine has work but neither runs it nor asks to wait")
        now = wake
