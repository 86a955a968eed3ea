"""python -m loadtest.scale.refresh_cost: a telemetry round's balancer work, refresh against full rebuild.

On the micro-benchmark's fleet (`inputs.build_fleet`: fresh telemetry, requests in flight, 1% ejected, 1%
ramping), `Balancer.rebuild()` and `Balancer.refresh_telemetry()` are timed in alternating rounds in one
process, so machine noise hits both alike; the median of 5 rounds per call is printed, in ms. On a router
without `refresh_telemetry` (an older commit) both columns time `rebuild()`.
"""

from __future__ import annotations

import gc
import logging
import statistics
import time

from loadtest.scale.inputs import build_fleet


def main() -> None:
    logging.getLogger("fleetroute").setLevel(logging.ERROR)  # the fleet's ejections warn: not what is timed
    for strategy in ("least-connections", "adaptive"):
        for n in (10, 100, 1000):
            fleet = build_fleet(n, strategy, {}, seed=0, sessions=64)
            balancer = fleet.balancer
            calls = max(5, 2000 // n)
            timings: dict[str, list[float]] = {"rebuild": [], "refresh_telemetry": []}
            refresh = getattr(balancer, "refresh_telemetry", balancer.rebuild)
            gc.disable()
            try:
                for _ in range(5):
                    for name, call in (("rebuild", balancer.rebuild), ("refresh_telemetry", refresh)):
                        started = time.perf_counter_ns()
                        for _ in range(calls):
                            call()
                        timings[name].append((time.perf_counter_ns() - started) / calls / 1e6)
            finally:
                gc.enable()
                fleet.close()
            print(f"{strategy:18s} n={n:<5d} rebuild {statistics.median(timings['rebuild']):8.3f} ms  "
                  f"refresh_telemetry {statistics.median(timings['refresh_telemetry']):8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
