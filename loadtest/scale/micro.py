"""Micro-benchmarks: what one pick and one rebuild cost at 10, 100 and 1,000 endpoints, per strategy.

Every strategy in the policy registry is measured (a new one needs no change here), with its default
parameters, plus the variants in `VARIANTS` (consistent hashing with bounded loads, whose pick sums the
pool's loads). For each strategy and fleet size, on the fleet of `inputs.build_fleet`:

- `pick`: `picker.pick(req, loads, frozenset())`, the policy alone, on the balancer's current picker;
- `balancer_pick`: `Balancer.pick(req)`, what the request handler calls (picker lookup, the pick and the
  decision counter);
- `retry_pick`: `picker.pick` with one endpoint excluded, as a retry after a failed attempt is picked;
- `rebuild`: `Balancer.rebuild()`: a new snapshot (telemetry ages judged), health admission (ejections,
  breakers, slow-start weights) and a new picker;
- `refresh`: one `TelemetryFeed.refresh()` over an in-process `MemoryStore` holding every endpoint's
  record: decode, convert and apply every record, then the one rebuild (the router-side work per telemetry
  round, without the Redis round trip);
- `burst` (default strategy only): n telemetry reports, each followed by `schedule_rebuild()`, on a running
  event loop: the reports collapse into one rebuild; its cost and the number of rebuilds are recorded.

Method: `time.perf_counter_ns` around a loop of many calls (calibrated so a round lasts `target_s`),
`rounds` rounds, median and min/max of the per-call time. The garbage collector is paused inside a round,
as `timeit` does; requests cycle over the fleet's conversations. Before timing, the prefix-aware index (and
every picker's state) is warmed with every earlier turn of every conversation, through `Balancer.pick`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from loadtest.scale.inputs import MODEL, Fleet, build_fleet
from router.model import RequestInfo
from router.routing.policies.base import PolicyConfigError
from router.routing.policies.prefix_aware import block_hashes
from router.routing.policies.registry import PolicyRegistry
from router.telemetry.feed import MemoryStore, TelemetryFeed, to_telemetry
from worker.protocol import decode, encode

# Extra parameter sets worth measuring: label -> (strategy, params). Each registered strategy is also
# measured with its defaults, under its own name.
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "consistent-hash (maxLoadFactor 1.25)": ("consistent-hash", {"maxLoadFactor": 1.25}),
    "adaptive (choices all)": ("adaptive", {"choices": "all"}),
    "prefix-aware (least-prefill)": ("prefix-aware", {"selection": "least-prefill"}),
    "composite (prefix 0.5, load 0.3, memory 0.2)": ("composite", {"scorers": {"prefix": 0.5, "load": 0.3,
                                                                              "memory": 0.2}}),
}
DEFAULT_STRATEGY = "adaptive"
EMPTY: frozenset[str] = frozenset()


@dataclass(frozen=True)
class MicroSettings:
    sizes: tuple[int, ...] = (10, 100, 1000)
    rounds: int = 5
    target_s: float = 0.2  # per round
    strategies: tuple[str, ...] | None = None  # labels to run; None: all
    seed: int = 0
    max_sessions: int = 1000  # conversations per fleet: one per endpoint, at least 64, at most this


def strategies(registry: PolicyRegistry | None = None) -> dict[str, tuple[str, dict[str, Any]]]:
    """Every registered strategy with its defaults (those that have defaults: composite needs its scorers),
    then the extra variants of registered strategies."""
    registry = registry or PolicyRegistry()
    out: dict[str, tuple[str, dict[str, Any]]] = {}
    for name in registry.names():
        try:
            registry.get(name).parse({})  # type: ignore[union-attr]
        except PolicyConfigError:
            continue
        out[name] = (name, {})
    out.update({label: v for label, v in VARIANTS.items() if registry.get(v[0]) is not None})
    return out


def spread_ns(per_call_ns: Sequence[float], iterations: int) -> dict[str, Any]:
    return {"median_us": statistics.median(per_call_ns) / 1000, "min_us": min(per_call_ns) / 1000,
            "max_us": max(per_call_ns) / 1000, "iterations": iterations, "rounds": len(per_call_ns)}


def timed(run: Callable[[Any], None], *, rounds: int, target_s: float, prepare: Callable[[int], Any] = int,
          max_iterations: int = 1_000_000) -> dict[str, Any]:
    """Time `run(prepare(k))`, k calls of the measured operation (`prepare` builds their inputs, outside the
    timed region): calibrate k, then `rounds` rounds."""
    k = 1
    while True:  # calibration: double until one round of k calls takes a tenth of the target
        work = prepare(k)
        t0 = time.perf_counter_ns()
        run(work)
        elapsed = time.perf_counter_ns() - t0
        if elapsed >= target_s * 1e8 or k >= max_iterations:
            break
        k *= 2
    k = max(1, min(max_iterations, int(k * target_s * 1e9 / max(elapsed, 1))))
    work = prepare(k)
    per_call = []
    gc.collect()  # once: a full collection of a big heap costs tens of ms
    for _ in range(rounds):
        gc.disable()
        try:
            t0 = time.perf_counter_ns()
            run(work)
            per_call.append((time.perf_counter_ns() - t0) / k)
        finally:
            gc.enable()
    return spread_ns(per_call, k)


def _cycle(items: Sequence[RequestInfo], k: int) -> list[RequestInfo]:
    return [items[i % len(items)] for i in range(k)]


def measure_picks(fleet: Fleet, settings: MicroSettings) -> dict[str, Any]:
    picker = fleet.picker()
    loads = fleet.loads
    balancer = fleet.balancer
    chosen: list[str | None] = []
    for req in fleet.requests[:200]:  # sanity: what the picks return
        view = picker.pick(req, loads, EMPTY)
        chosen.append(view.id if view is not None else None)

    def pick(requests: list[RequestInfo]) -> None:
        p = picker.pick
        for req in requests:
            p(req, loads, EMPTY)

    def balancer_pick(requests: list[RequestInfo]) -> None:
        p = balancer.pick
        for req in requests:
            p(req)

    excluded = frozenset({sorted(fleet.ids)[-2]})

    def retry_pick(requests: list[RequestInfo]) -> None:
        p = picker.pick
        for req in requests:
            p(req, loads, excluded)

    kw: dict[str, Any] = {"rounds": settings.rounds, "target_s": settings.target_s,
                          "prepare": lambda k: _cycle(fleet.requests, k)}
    pool = {v.id for v in balancer.candidates(MODEL)}
    return {
        "pick": timed(pick, **kw),
        "balancer_pick": timed(balancer_pick, **kw),
        "retry_pick": timed(retry_pick, **kw),
        "checks": {
            "picks": len(chosen),
            "none": sum(1 for c in chosen if c is None),
            "outside_pool": sum(1 for c in chosen if c is not None and c not in pool),
            "distinct": len({c for c in chosen if c is not None}),
            "pool_size": len(pool),
            "endpoints": fleet.n,
        },
    }


def measure_rebuild(fleet: Fleet, settings: MicroSettings) -> dict[str, Any]:
    def rebuild(k: int) -> None:
        for _ in range(k):
            fleet.balancer.rebuild()

    return timed(rebuild, rounds=settings.rounds, target_s=settings.target_s)


def measure_refresh(fleet: Fleet, settings: MicroSettings) -> dict[str, Any]:
    store = MemoryStore()
    for record in fleet.records.values():
        store.put(record)
    # Wall time equal to each record's own time: every record is fresh, whatever the age limit.
    wall = max(r.reported_at for r in fleet.records.values())
    feed = TelemetryFeed(store=store, balancer=fleet.balancer, metrics=fleet.metrics, wall_clock=lambda: wall,
                         mono_clock=fleet.clock)
    loop = asyncio.new_event_loop()
    try:
        def refresh(k: int) -> None:
            async def many() -> None:
                for _ in range(k):
                    await feed.refresh()

            loop.run_until_complete(many())

        result = timed(refresh, rounds=settings.rounds, target_s=settings.target_s)
    finally:
        loop.close()
    result["unknown_after"] = fleet.metrics.registry.get_sample_value("fleetroute_telemetry_unknown_endpoints")
    return result


def measure_burst(fleet: Fleet, rounds: int) -> dict[str, Any]:
    """n reports, each followed by schedule_rebuild(), then the loop runs: how many rebuilds, at what cost."""
    reports = [(i, to_telemetry(decode(encode(r)), wall_now=r.reported_at, mono_now=fleet.clock.now))
               for i, r in fleet.records.items()]

    async def one() -> tuple[float, float]:
        done = asyncio.Event()
        fleet.balancer.on_rebuild = done.set
        before = fleet.rebuilds()
        t0 = time.perf_counter_ns()
        for endpoint_id, telemetry in reports:
            fleet.balancer.report_telemetry(endpoint_id, telemetry)
            fleet.balancer.schedule_rebuild()
        await done.wait()
        elapsed = time.perf_counter_ns() - t0
        fleet.balancer.on_rebuild = None
        return elapsed, fleet.rebuilds() - before

    loop = asyncio.new_event_loop()
    try:
        runs = [loop.run_until_complete(one()) for _ in range(rounds)]
    finally:
        loop.close()
    ms = [e / 1e6 for e, _ in runs]
    return {"reports": len(reports), "rebuilds_per_burst": [r for _, r in runs],
            "median_ms": statistics.median(ms), "min_ms": min(ms), "max_ms": max(ms), "rounds": rounds}


def measure_prefix_hashing(fleet: Fleet, settings: MicroSettings) -> dict[str, Any]:
    """`prefix_aware.block_hashes` alone, with the policy's configured block size and limit."""
    config = fleet.spec.params

    def hashing(requests: list[RequestInfo]) -> None:
        for req in requests:
            block_hashes(req.body, config.block_chars, config.max_blocks)

    return timed(hashing, rounds=settings.rounds, target_s=settings.target_s,
                 prepare=lambda k: _cycle(fleet.requests, k))


def warm(fleet: Fleet) -> None:
    """Every earlier turn of every conversation through Balancer.pick, each held in flight for the next 2n
    picks (requests take a while): the prefix index learns where each conversation went, and the load
    guard spreads hot prefixes over several endpoints, as under live traffic; the round-robin cursor and the
    hash ring are in use. The fleet's base loads are back when this returns."""
    window: deque[contextlib.AbstractContextManager[None]] = deque()
    try:
        for req in fleet.warm:
            view = fleet.balancer.pick(req)
            if view is not None:
                held = fleet.loads.track(view.id)
                held.__enter__()
                window.append(held)
            if len(window) > 2 * fleet.n:
                window.popleft().__exit__(None, None, None)
    finally:
        while window:
            window.popleft().__exit__(None, None, None)


def run_micro(settings: MicroSettings, say: Callable[[str], None] = print,
              registry: PolicyRegistry | None = None) -> dict[str, Any]:
    """{label: {size: {...}}} for the picks and rebuilds, plus the bursts of the default strategy. Every
    strategy of `registry` (the built-in one by default) is measured."""
    chosen = strategies(registry)
    if settings.strategies is not None:
        unknown = set(settings.strategies) - set(chosen)
        if unknown:
            raise ValueError(f"unknown strategies {sorted(unknown)}; known: {sorted(chosen)}")
        chosen = {k: v for k, v in chosen.items() if k in settings.strategies}
    out: dict[str, Any] = {"strategies": {}, "burst": {},
                           "settings": settings.__dict__ | {"sizes": list(settings.sizes)}}
    quiet = logging.getLogger("fleetroute")  # the setup's ejections log warnings: not what is measured
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    gc.collect()
    gc.freeze()  # what exists now (imported modules) is never collected: later collections stay cheap
    try:
        for label, (strategy, params) in chosen.items():
            out["strategies"][label] = _run_strategy(label, strategy, params, settings, out["burst"], say, registry)
    finally:
        gc.unfreeze()
        quiet.setLevel(level)
    return out


def _run_strategy(label: str, strategy: str, params: dict[str, Any], settings: MicroSettings,
                  bursts: dict[str, Any], say: Callable[[str], None],
                  registry: PolicyRegistry | None) -> dict[str, Any]:
    per_size: dict[str, Any] = {}
    for n in settings.sizes:
        fleet = build_fleet(n, strategy, params, seed=settings.seed,
                            sessions=min(settings.max_sessions, max(64, n)), policies=registry)
        try:
            warm(fleet)
            before = fleet.events()
            r = measure_picks(fleet, settings)
            r["events"] = {k: v - before.get(k, 0) for k, v in fleet.events().items() if v - before.get(k, 0)}
            r["rebuild"] = measure_rebuild(fleet, settings)
            r["refresh"] = measure_refresh(fleet, settings)
            r["health"] = {"ejected": len(fleet.ejected), "ramping": len(fleet.ramping)}
            r["prompt_bytes"] = _prompt_sizes(fleet.requests)
            if strategy == "prefix-aware":  # how much of its pick is hashing the prompt (independent of n)
                r["prefix_hashing"] = measure_prefix_hashing(fleet, settings)
            if strategy == DEFAULT_STRATEGY and not params:
                bursts[str(n)] = measure_burst(fleet, settings.rounds)
        finally:
            fleet.close()
        per_size[str(n)] = r
        say(f"  {label:38s} n={n:<5d} pick {r['pick']['median_us']:8.2f} us  balancer.pick "
            f"{r['balancer_pick']['median_us']:8.2f} us  retry {r['retry_pick']['median_us']:8.2f} us  rebuild "
            f"{r['rebuild']['median_us'] / 1000:8.3f} ms  refresh {r['refresh']['median_us'] / 1000:8.3f} ms")
    return {"strategy": strategy, "params": params, "sizes": per_size}


def _prompt_sizes(requests: Iterable[RequestInfo]) -> dict[str, float]:
    sizes = sorted(sum(len(m["content"]) for m in r.body["messages"]) for r in requests)
    return {"median": statistics.median(sizes), "max": sizes[-1], "min": sizes[0]}


@contextlib.contextmanager
def pinned(cpu: int | None) -> Iterator[int | None]:
    """This process on one CPU (`cpu`, else the last it may use) while measuring, less noise from
    migrations; the affinity is restored afterwards. None where the OS does not allow pinning."""
    try:
        allowed = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        yield None
        return
    chosen = cpu if cpu is not None else max(allowed)
    os.sched_setaffinity(0, {chosen})
    try:
        yield chosen
    finally:
        os.sched_setaffinity(0, allowed)
