"""python -m loadtest.scale.refresh_cost: a telemetry round's balancer work, refresh against full rebuild.

On the micro-benchmark's fleet (`inputs.build_fleet`: fresh telemetry, requests in flight, 1% ejected, 1%
ramping), three things are timed in alternating rounds in one process, so machine noise hits them alike:

- `rebuild`: `Balancer.rebuild()`, the full rebuild;
- `round`: one telemetry round as the feed applies it: `report_telemetry` for the endpoints that reported
  (`--reported`, a fraction of the fleet drawn at random each round, with new values and a newer report
  time), then `refresh_telemetry()`; `round_refresh` is the `refresh_telemetry()` part of it;
- `refresh_only`: `refresh_telemetry()` alone, after a round that reported nothing.

The median of `--rounds` rounds per call is printed in ms (and written to `--json`). On a router without
`refresh_telemetry` (an older commit) the round's refresh is the rebuild. Reports are made before the clock
starts and applied inside it, so `round` covers what the balancer does per report and per round.

    python -m loadtest.scale.refresh_cost --reported 0.25 --json docs/results/refresh/after-1.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import random
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from loadtest.scale.inputs import build_fleet

STRATEGIES: dict[str, dict[str, Any]] = {
    "least-connections": {},
    "adaptive": {},
    "adaptive-all": {"choices": "all"},
}


def measure(label: str, n: int, reported: float, rounds: int, seed: int) -> dict[str, float]:
    strategy = "adaptive" if label.startswith("adaptive") else label
    fleet = build_fleet(n, strategy, STRATEGIES[label], seed=0, sessions=64)
    balancer = fleet.balancer
    rng = random.Random(seed)
    ids = sorted(fleet.ids)
    calls = max(5, 2000 // n)
    refresh = getattr(balancer, "refresh_telemetry", balancer.rebuild)

    def reports() -> list[list[tuple[str, Any]]]:
        """One batch of reports per call: each endpoint drawn reports new values, newer than what it last said."""
        batches = []
        for _ in range(calls):
            fleet.clock.now += 1e-3  # a newer report each round (the clock stays far from staleAfter)
            batch = []
            for endpoint_id in rng.sample(ids, round(reported * n)):
                old = balancer.snapshot.by_id[endpoint_id].telemetry
                if old is None:
                    continue
                batch.append((endpoint_id, replace(old, reported_at=fleet.clock.now, gpu_util=rng.random(),
                                                   kv_cache_usage=rng.random(), num_waiting=float(rng.randrange(8)))))
            batches.append(batch)
        return batches

    def rebuild_calls() -> float:
        started = time.perf_counter_ns()
        for _ in range(calls):
            balancer.rebuild()
        return (time.perf_counter_ns() - started) / calls / 1e6

    def round_calls() -> tuple[float, float]:
        """(the whole round, its refresh alone), per round."""
        batches = reports()
        total = refreshing = 0
        for batch in batches:
            started = time.perf_counter_ns()
            for endpoint_id, telemetry in batch:
                balancer.report_telemetry(endpoint_id, telemetry)
            reported = time.perf_counter_ns()
            refresh()
            done = time.perf_counter_ns()
            total += done - started
            refreshing += done - reported
        return total / calls / 1e6, refreshing / calls / 1e6

    def refresh_calls() -> float:
        started = time.perf_counter_ns()
        for _ in range(calls):
            refresh()
        return (time.perf_counter_ns() - started) / calls / 1e6

    timings: dict[str, list[float]] = {"rebuild": [], "round": [], "round_refresh": [], "refresh_only": []}
    gc.disable()
    try:
        for _ in range(rounds):
            timings["rebuild"].append(rebuild_calls())
            whole, refreshing = round_calls()
            timings["round"].append(whole)
            timings["round_refresh"].append(refreshing)
            timings["refresh_only"].append(refresh_calls())
    finally:
        gc.enable()
        fleet.close()
    return {name: statistics.median(values) for name, values in timings.items()}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reported", type=float, default=0.25, help="fraction of endpoints reporting per round")
    parser.add_argument("--sizes", default="10,100,1000", help="fleet sizes, comma-separated")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=f"of: {', '.join(STRATEGIES)}")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds per fleet (the median is kept)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    if not 0.0 <= args.reported <= 1.0:
        parser.error("--reported must be a fraction from 0 to 1")
    labels = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in labels if s not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategy {unknown[0]!r} (one of: {', '.join(STRATEGIES)})")
    try:
        sizes = [int(s) for s in args.sizes.split(",") if s]
    except ValueError:
        parser.error(f"--sizes must be integers, got {args.sizes!r}")
    logging.getLogger("fleetroute").setLevel(logging.ERROR)  # the fleet's ejections warn: not what is timed
    results = []
    for label in labels:
        for n in sizes:
            medians = measure(label, n, args.reported, args.rounds, seed=n)
            results.append({"strategy": label, "endpoints": n, **{f"{k}_ms": round(v, 4) for k, v in medians.items()}})
            print(f"{label:18s} n={n:<5d} rebuild {medians['rebuild']:8.3f} ms  round {medians['round']:8.3f} ms "
                  f"(its refresh {medians['round_refresh']:7.3f} ms)  refresh_only {medians['refresh_only']:7.3f} ms",
                  flush=True)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"command": "python -m loadtest.scale.refresh_cost", "commit": commit(),
                                         "reported": args.reported, "rounds": args.rounds, "results": results},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
