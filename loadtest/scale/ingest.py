"""Telemetry ingestion through Redis: 1,000 simulated agents at 1 Hz, one real router reading them.

Processes (each pinned when the machine has two cores: the router alone on one, the rest on the other):

- our own Redis server (`services.start_redis`);
- the agent driver (`loadtest.scale.agents`): the real publisher and wire format, writes spread evenly
  over each second;
- `fleetroute router` with the N endpoints configured and `redis.url` set: its telemetry feed is wired
  exactly as shipped (`app._upstream`: `RedisStore` pipelined HGETALLs, pub/sub wake-ups, `run_feed`
  refreshing at most every interval/4, one rebuild per refresh; `SharedLoads` exchanging in-flight counts).
  Its one policy has active health checks off and no request reaches it, so what it spends is the cost of
  ingesting (and of its idle housekeeping, measured separately first).

Measured, over a window of `window_s` seconds once the router knows every endpoint's telemetry:

- router CPU (utime+stime from /proc, % of one core), before the agents start (idle: the feed still reads
  N empty keys each second) and with them;
- Redis server CPU (INFO cpu, user+sys), with the agents;
- rebuilds per second (`fleetroute_snapshot_rebuilds_total` plus `fleetroute_snapshot_refreshes_total`, the
  telemetry rounds applied without a full rebuild: snapshot swaps per second);
- telemetry age at the last rebuild, per endpoint (`fleetroute_telemetry_age_seconds`, scraped a few
  times after the window, so the scrapes cost the router nothing inside it): p50, p99, max. Records are
  1 s apart, so even instant pick-up gives ages spread over [0, 1 s] (mean 0.5 s): the mean above 0.5 s
  is the reader's pick-up delay;
- endpoints without fresh telemetry (`fleetroute_telemetry_unknown_endpoints`) and store errors: both must
  stay 0 (no endpoint goes stale);
- the driver's own record: publishes per second and how late against schedule.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtest.router_overhead import ROOT, cpu_seconds, free_port, pct, pinned
from loadtest.scale.inputs import STALE_AFTER, endpoint_ids
from loadtest.scale.services import (
    ForeignLoad,
    Processes,
    RouterProcess,
    redis_cpu_seconds,
    router_config,
    start_agents,
    start_redis,
    start_router,
    value,
    wait_telemetry_known,
)

REBUILDS = "fleetroute_snapshot_rebuilds_total"
REFRESHES = "fleetroute_snapshot_refreshes_total"
STORE_ERRORS = "fleetroute_telemetry_store_errors_total"


@dataclass(frozen=True)
class IngestSettings:
    agents: int = 1000
    interval: float = 1.0
    window_s: float = 20.0
    idle_s: float = 10.0
    age_scrapes: int = 4
    strategy: str = "adaptive"
    driver_processes: int = 1
    router_env: tuple[tuple[str, str], ...] = ()  # extra environment for the router (e.g. PYTHONPATH)
    label: str = "as installed"  # hiredis is a base dependency: redis-py uses its C parser unless it is missing


def cpu_window(router: RouterProcess, seconds: float, redis_url: str | None = None) -> dict[str, Any]:
    """Router (and Redis) CPU over `seconds`, with the rebuild counter read just outside the window."""
    before = router.metrics()
    r0 = redis_cpu_seconds(redis_url) if redis_url else None
    c0, t0 = cpu_seconds(router.proc.pid), time.monotonic()
    time.sleep(seconds)
    c1, t1 = cpu_seconds(router.proc.pid), time.monotonic()
    r1 = redis_cpu_seconds(redis_url) if redis_url else None
    after = router.metrics()
    elapsed = t1 - t0
    rebuilds = (value(after, REBUILDS) + value(after, REFRESHES)) - (value(before, REBUILDS) + value(before, REFRESHES))
    errors = value(after, STORE_ERRORS) - value(before, STORE_ERRORS)
    return {
        "seconds": elapsed,
        "router_cpu_util": (c1 - c0) / elapsed,
        "redis_cpu_util": (r1 - r0) / elapsed if r0 is not None and r1 is not None else None,
        "rebuilds_per_s": rebuilds / elapsed,
        "store_errors": errors,
        "metrics_after": after,
    }


def telemetry_ages(router: RouterProcess, scrapes: int, spacing: float) -> dict[str, Any]:
    ages: list[float] = []
    unknown: list[float] = []
    series = 0
    for i in range(scrapes):
        if i:
            time.sleep(spacing)
        m = router.metrics()
        sample = [v for _, v in m.get("fleetroute_telemetry_age_seconds", [])]
        series = max(series, len(sample))
        ages.extend(sample)
        unknown.append(value(m, "fleetroute_telemetry_unknown_endpoints"))
    return {
        "samples": len(ages), "endpoints_with_age": series,
        "p50_s": pct(ages, 50) if ages else None, "p99_s": pct(ages, 99) if ages else None,
        "max_s": max(ages) if ages else None, "mean_s": statistics.fmean(ages) if ages else None,
        "stale": sum(1 for a in ages if a > STALE_AFTER), "unknown_max": max(unknown) if unknown else None,
    }


def hiredis_available(env: dict[str, str] | None) -> bool:
    """Does redis-py find hiredis (its C parser) in the router's environment?"""
    probe = "import redis.utils, sys; sys.stdout.write(str(redis.utils.HIREDIS_AVAILABLE))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=30)
    return out.stdout.strip() == "True"


READ_COST = """
import asyncio, json, sys, time
from router.runtime.redis_client import RedisSettings, connect
from router.telemetry.feed import RedisStore
from loadtest.scale.inputs import endpoint_ids

async def main(url, n, rounds):
    store = RedisStore(connect(RedisSettings(url=url), timeout=5))
    ids = endpoint_ids(n)
    found = len(await store.read(ids))
    cpu, wall = [], []
    for _ in range(rounds):
        c, w = time.process_time(), time.perf_counter()
        await store.read(ids)
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    await store.close()
    print(json.dumps({"found": found, "cpu_ms": sorted(cpu)[len(cpu) // 2] * 1000,
                      "wall_ms": sorted(wall)[len(wall) // 2] * 1000}))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3])))
"""


def read_cost(url: str, n: int, cpus: str | None, env: dict[str, str] | None, rounds: int = 5) -> dict[str, Any]:
    """One full read as the router's `RedisStore` does it (N pipelined HGETALLs), timed in a process of its
    own with the router's environment: its CPU (median of `rounds`) is what each refresh spends on Redis."""
    cmd = pinned([sys.executable, "-c", READ_COST, url, str(n), str(rounds)], cpus)
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    if out.returncode != 0:
        return {"error": out.stderr[-500:]}
    return json.loads(out.stdout)


def run_ingest(settings: IngestSettings, *, workdir: Path, router_cpus: str | None, load_cpus: str | None,
               say: Callable[[str], None] = print) -> dict[str, Any]:
    ids = endpoint_ids(settings.agents)
    with Processes() as procs:
        redis = start_redis(procs, workdir, load_cpus)
        config = router_config(port=free_port(), admin=free_port(),
                               endpoints=[(i, "http://127.0.0.1:9") for i in ids],  # never contacted
                               strategy=settings.strategy, telemetry="redis", redis_url=redis.url,
                               health_checks=False)
        config["telemetry"]["interval"] = f"{settings.interval}s"
        env = {**os.environ, **dict(settings.router_env)} if settings.router_env else None
        router = start_router(procs, workdir, "ingest", config, router_cpus, env=env)
        time.sleep(min(2.0, settings.idle_s))  # start-up work (the first snapshot, imports) out of the way
        idle = cpu_window(router, settings.idle_s)
        idle.pop("metrics_after")
        say(f"  [{settings.label}] router idle, Redis configured, no agents: {idle['router_cpu_util']:.1%} of a core, "
            f"{idle['rebuilds_per_s']:.1f} rebuilds/s")
        agents = start_agents(procs, redis.url, settings.agents, load_cpus, interval=settings.interval,
                              processes=settings.driver_processes)
        known_after = wait_telemetry_known(router, len(ids), timeout=30)
        d0 = agents.cpu_seconds()
        with ForeignLoad(procs.pids) as foreign:
            busy = cpu_window(router, settings.window_s, redis.url)
        busy["foreign_cpu_util"] = foreign.util
        driver_cpu = (agents.cpu_seconds() - d0) / busy["seconds"]
        after = busy.pop("metrics_after")
        ages = telemetry_ages(router, settings.age_scrapes, spacing=0.37 * settings.interval)
        read = read_cost(redis.url, settings.agents, router_cpus, env)
        driver = agents.stop()
        errors = router.errors()
    result = {
        "label": settings.label, "hiredis": hiredis_available(env),
        "agents": settings.agents, "interval_s": settings.interval, "strategy": settings.strategy,
        "idle": idle, "ingesting": busy,
        "ingest_cpu_util": busy["router_cpu_util"] - idle["router_cpu_util"],
        "router_cpu_ms_per_report": (busy["router_cpu_util"] - idle["router_cpu_util"]) * 1000
        / (settings.agents / settings.interval),
        "telemetry_known_after_s": known_after,
        "age": ages,
        "full_read": read,
        "unknown_at_end": value(after, "fleetroute_telemetry_unknown_endpoints"),
        "driver": {**driver, "cpu_util": driver_cpu},
        "router_errors": errors[:5],
    }
    say(f"  [{settings.label}] ingesting {settings.agents} agents at {1 / settings.interval:g} Hz: router "
        f"{busy['router_cpu_util']:.1%} of a core ({result['ingest_cpu_util']:+.1%} over idle), Redis "
        f"{(busy['redis_cpu_util'] or 0):.1%}, {busy['rebuilds_per_s']:.1f} rebuilds/s, age p50 "
        f"{ages['p50_s']:.3f} s p99 {ages['p99_s']:.3f} s max {ages['max_s']:.3f} s, stale {ages['stale']}, "
        f"driver {driver.get('rate_per_s', 0):.0f} publishes/s (late p99 {driver.get('late_p99_ms') or 0:.1f} ms)")
    return result
