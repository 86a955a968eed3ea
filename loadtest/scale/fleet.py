"""Router CPU against request rate and against fleet size: a real `fleetroute router`, pinned to one core,
in front of zero-latency backends, under open-loop load.

- **Backends.** One `loadtest.backend` process with one listening port per endpoint (1,000 sockets cost
  nothing idle), so every endpoint is its own upstream with its own pooled connections, as in a real fleet.
  Settings only require unique endpoint ids, so many ids may share a URL: `backend_ports: k` (CLI
  `--backend-ports`) points endpoint i at port i % k, and the router's connection pool (per host:port) is
  then shared, which shows what per-endpoint connections cost at low per-endpoint rates.
- **Router.** As shipped (uvloop, access log on, active health checks every 5 s, outlier detection,
  breakers, slow start) with one policy: `adaptive` (the default strategy) or `least-connections`.
  Telemetry: `embedded` (the shipped default without Redis: the router scrapes every endpoint's /metrics
  each second), `redis` (simulated agents publish through our own Redis at 1 Hz, `loadtest.scale.agents`;
  the router reads) or `off`.
- **Load.** An open loop (requests leave at their planned times, evenly spaced, whatever the answers do)
  from this process: the 96-byte chat request of `loadtest.router_overhead`, non-streaming, after a warm-up.
- **CPU.** utime+stime of the router from /proc over the load window, as ms per request and as a share of
  one core. Each router is also measured idle (same config, no requests) over `idle_s` first: idle CPU is
  what telemetry, health checks and housekeeping cost at that fleet size, and `net` ms per request takes
  it out. The embedded scrape's cost is idle(embedded) - idle(off) at the same fleet size.

Two sweeps: request rate (at `rate_endpoints` endpoints, embedded telemetry) and fleet size (at `size_rate`
requests per second, for each telemetry mode). Every router runs alone: each case starts its own and stops
it, so idle costs never add up across cases.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from loadtest.router_overhead import BODY, HEADERS, PATH, cpu_seconds, fire_paced, free_port, pct, run_async
from loadtest.scale.inputs import endpoint_ids
from loadtest.scale.services import (
    ForeignLoad,
    Processes,
    RouterProcess,
    router_config,
    start_agents,
    start_backend,
    start_redis,
    start_router,
    wait_telemetry_known,
)


@dataclass(frozen=True)
class FleetSettings:
    rates: tuple[float, ...] = (100, 200, 400, 800, 1600)
    rate_endpoints: int = 10
    sizes: tuple[int, ...] = (10, 100, 1000)
    size_rate: float = 400
    strategies: tuple[str, ...] = ("adaptive", "least-connections")
    telemetry_modes: tuple[str, ...] = ("off", "embedded", "redis")
    seconds: float = 5.0
    idle_s: float = 10.0  # a multiple of the health-check interval (5 s), so idle CPU includes its rounds
    warmup: int = 100
    sweeps: tuple[str, ...] = ("rate", "size")
    # None: one backend port per endpoint (a real fleet). k: endpoint i uses port i % k, so the router pools
    # connections per host:port across endpoints (isolates what per-endpoint connections cost).
    backend_ports: int | None = None


async def paced(url: str, rate: float, seconds: float, warmup: int, pid: int) -> dict[str, Any]:
    """Open-loop load at `rate` for `seconds`; router CPU read around the whole window (sends and answers)."""
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        for _ in range(warmup):
            async with session.post(url + PATH, data=BODY, headers=HEADERS) as r:
                await r.read()
        lat: list[float] = []
        lag: list[float] = []
        statuses: dict[int, int] = {}
        failures = 0

        async def one(scheduled: float) -> None:
            nonlocal failures
            t = time.perf_counter()
            lag.append(t - scheduled)
            try:
                async with session.post(url + PATH, data=BODY, headers=HEADERS) as r:
                    await r.read()
                    statuses[r.status] = statuses.get(r.status, 0) + 1
            except (aiohttp.ClientError, TimeoutError):
                failures += 1
                return
            lat.append(time.perf_counter() - t)

        n = max(1, int(rate * seconds))
        cpu0 = cpu_seconds(pid)
        elapsed = await fire_paced(one, rate, n, timeout=60)
        cpu = cpu_seconds(pid) - cpu0
    ms = [x * 1000 for x in lat] or [float("nan")]
    ok = statuses.get(200, 0)
    return {
        "rate": rate, "requests": n, "ok": ok, "errors": n - ok, "statuses": {str(k): v for k, v in statuses.items()},
        "achieved_rate": n / elapsed, "elapsed_s": elapsed, "router_cpu_s": cpu,
        "router_cpu_util": cpu / elapsed, "router_cpu_ms_per_req": cpu * 1000 / n,
        "p50_ms": pct(ms, 50), "p99_ms": pct(ms, 99), "send_lag_p99_ms": pct([x * 1000 for x in lag], 99),
    }


def idle_cpu(router: RouterProcess, seconds: float) -> float:
    c0, t0 = cpu_seconds(router.proc.pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(router.proc.pid) - c0) / (time.monotonic() - t0)


def with_net(run: dict[str, Any], idle_util: float) -> dict[str, Any]:
    """Add the CPU per request net of what the router spends idle (telemetry, health checks)."""
    net = run["router_cpu_s"] - idle_util * run["elapsed_s"]
    return {**run, "idle_cpu_util": idle_util, "net_cpu_ms_per_req": net * 1000 / run["requests"]}


@dataclass
class Bench:
    settings: FleetSettings
    workdir: Path
    procs: Processes
    ports: list[int]
    router_cpus: str | None
    load_cpus: str | None
    say: Callable[[str], None]
    redis_url: str | None = None

    def router(self, n: int, strategy: str, telemetry: str) -> tuple[RouterProcess, Any]:
        """A router for the first n endpoints, ready, with fresh telemetry for all of them (unless off)."""
        ids = endpoint_ids(n)
        agents = None
        if telemetry == "redis":
            if self.redis_url is None:
                self.redis_url = start_redis(self.procs, self.workdir, self.load_cpus).url
            agents = start_agents(self.procs, self.redis_url, n, self.load_cpus)
        k = self.settings.backend_ports or len(self.ports)
        endpoints = [(i, f"http://127.0.0.1:{self.ports[j % k]}") for j, i in enumerate(ids)]
        config = router_config(port=free_port(), admin=free_port(), endpoints=endpoints, strategy=strategy,
                               telemetry=telemetry, redis_url=self.redis_url)
        router = start_router(self.procs, self.workdir, f"{strategy}-{telemetry}-{n}", config, self.router_cpus)
        if telemetry != "off":
            wait_telemetry_known(router, n, timeout=30)
        return router, agents

    def case(self, n: int, strategy: str, telemetry: str, rates: tuple[float, ...]) -> dict[str, Any]:
        router, agents = self.router(n, strategy, telemetry)
        try:
            idle = idle_cpu(router, self.settings.idle_s)
            runs = []
            for rate in rates:
                with ForeignLoad(self.procs.pids) as foreign:
                    r = with_net(run_async(paced(router.url, rate, self.settings.seconds, self.settings.warmup,
                                                 router.proc.pid)), idle)
                r["foreign_cpu_util"] = foreign.util
                runs.append(r)
                self.say(f"  {strategy:18s} {telemetry:8s} n={n:<5d} {rate:6.0f} req/s: router "
                         f"{r['router_cpu_util']:6.1%} of a core, {r['router_cpu_ms_per_req']:.3f} ms/req "
                         f"(net of idle {idle:.1%}: {r['net_cpu_ms_per_req']:.3f}), p50 {r['p50_ms']:.2f} ms, "
                         f"errors {r['errors']}, foreign load {foreign.util or 0:.0%}")
            errors = router.errors()
        finally:
            router.proc.stop()
            if agents is not None:
                agents.stop()
        return {"endpoints": n, "strategy": strategy, "telemetry": telemetry, "idle_cpu_util": idle, "runs": runs,
                "router_errors": errors[:5]}


def run_fleet(settings: FleetSettings, *, workdir: Path, router_cpus: str | None, load_cpus: str | None,
              say: Callable[[str], None] = print) -> dict[str, Any]:
    out: dict[str, Any] = {"rate_sweep": [], "size_sweep": [], "settings": {
        k: list(v) if isinstance(v, tuple) else v for k, v in settings.__dict__.items()}}
    with Processes() as procs:
        ports = start_backend(procs, settings.backend_ports or max((*settings.sizes, settings.rate_endpoints)),
                              load_cpus)
        bench = Bench(settings, workdir, procs, ports, router_cpus, load_cpus, say)
        if "rate" in settings.sweeps:
            for strategy in settings.strategies:
                out["rate_sweep"].append(bench.case(settings.rate_endpoints, strategy, "embedded", settings.rates))
        if "size" in settings.sweeps:
            for telemetry in settings.telemetry_modes:
                for n in settings.sizes:
                    for strategy in settings.strategies:
                        out["size_sweep"].append(bench.case(n, strategy, telemetry, (settings.size_rate,)))
    out["scrape_cost"] = scrape_cost(out["size_sweep"])
    return out


def scrape_cost(cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the embedded scrape (and the Redis feed) costs idle, per fleet size: idle CPU over `off`."""
    idle: dict[tuple[int, str], list[float]] = {}
    for c in cases:
        idle.setdefault((c["endpoints"], c["telemetry"]), []).append(c["idle_cpu_util"])
    rows = []
    for n in sorted({n for n, _ in idle}):
        off = idle.get((n, "off"))
        row: dict[str, Any] = {"endpoints": n}
        for mode in ("off", "embedded", "redis"):
            if (n, mode) in idle:
                row[f"{mode}_idle_cpu_util"] = statistics.median(idle[(n, mode)])
        if off is not None:
            for mode in ("embedded", "redis"):
                if (n, mode) in idle:
                    row[f"{mode}_over_off"] = statistics.median(idle[(n, mode)]) - statistics.median(off)
        rows.append(row)
    return rows
