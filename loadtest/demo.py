"""`fleetroute demo`: a whole GPU fleet on one machine, and what each routing policy does with it.

1. Starts simulated vLLM replicas (`fleetroute sim`, default 2 x H100 + 2 x A100-80G) as child processes.
2. Measures the fleet's capacity for the demo workload in virtual time (the same engine model, no waiting)
   and offers `--load` (default 80%) of it, so the policies are compared near saturation where they differ.
3. For each policy, starts a router (`fleetroute router`) in front of the fleet, replays the *same* seeded
   multi-turn chat workload through it (open loop, streaming), and samples each replica's GPU busy time.
4. Prints one row per policy: requests/s, P50/P99 time to first token, P99 end-to-end, per-replica
   utilisation and its coefficient of variation (spread), then stops every child, also on Ctrl-C.

Times are reported in simulated seconds (wall time / time-scale): what the same fleet on real GPUs would
show, give or take the router's and this client's own overhead, which the time-scale divides too.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.client import Result, run_open_loop
from loadtest.processes import ChildFailed, ProcessGroup
from loadtest.workload import chat_sessions

POLICIES = ("round-robin", "least-connections", "consistent-hash", "adaptive")  # the default comparison
# Also accepted by --policies; left out of the default so the demo stays about a minute.
CHOICES = (*POLICIES, "prefix-aware")
DEFAULT_FLEET = "h100:2,a100-80g:2"


@dataclass(frozen=True)
class DemoOptions:
    fleet: tuple[str, ...]
    model: str = "llama-3-8b"
    time_scale: float = 4.0
    duration: float = 10.0  # wall seconds of arrivals per policy
    load: float = 0.8
    seed: int = 1
    policies: tuple[str, ...] = POLICIES


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


def fleet_capacity(fleet: tuple[str, ...], model: str, seed: int) -> float:
    """Requests per simulated second the fleet sustains on the demo workload, from the engine model run in
    virtual time on a saturating batch of the workload's own requests."""
    from worker.sim.engine import EngineConfig, EngineCore, SimRequest
    from worker.sim.profiles import profile
    from worker.sim.tokenizer import render_chat, tokenize
    from worker.sim.virtual import run_virtual

    sample = chat_sessions(model=model, rate=50.0, duration=8.0, seed=seed + 1000)[:300]
    prompts = [(tokenize(render_chat(p.body["messages"])), p.body["max_tokens"]) for p in sample]
    per_gpu: dict[str, float] = {}
    for name in set(fleet):
        engine = EngineCore(profile(name), EngineConfig(), random.Random(seed))
        done = run_virtual(engine, [SimRequest(f"r{i}", toks, out, 0.0) for i, (toks, out) in enumerate(prompts)])
        per_gpu[name] = len(done) / max(r.finished_at for r in done)
    return sum(per_gpu[name] for name in fleet)


class Progress:
    def __init__(self, total_policies: int) -> None:
        self.total_policies = total_policies
        self._last = 0.0
        self.tty = sys.stderr.isatty()

    def show(self, index: int, policy: str, done: int, total: int, started: float, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < 0.2:
            return
        self._last = now
        width = 24
        filled = int(width * done / max(total, 1))
        line = (f"[{index}/{self.total_policies}] {policy:<18} |{'#' * filled}{'.' * (width - filled)}| "
                f"{done}/{total} requests  {now - started:5.1f}s")
        if self.tty:
            print("\r" + line, end="", file=sys.stderr, flush=True)
        elif force:
            print(line, file=sys.stderr, flush=True)

    def finish(self) -> None:
        if self.tty:
            print(file=sys.stderr)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclass
class PolicyReport:
    policy: str
    requests: int
    ok: int
    errors: dict[str, int]
    rps: float
    ttft_p50: float | None
    ttft_p99: float | None
    e2e_p99: float | None
    utilisation: dict[str, float]
    served: dict[str, int]

    @property
    def utilisation_cv(self) -> float:
        values = list(self.utilisation.values())
        mean = statistics.fmean(values) if values else 0.0
        return statistics.pstdev(values) / mean if mean > 0 else 0.0


def summarise(policy: str, results: list[Result], wall: float, scale: float,
              utilisation: dict[str, float]) -> PolicyReport:
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    served: dict[str, int] = {}
    for r in ok:
        served[r.endpoint] = served.get(r.endpoint, 0) + 1
    ttft = [r.ttft / scale for r in ok if r.ttft is not None]
    e2e = [r.e2e / scale for r in ok if r.e2e is not None]
    return PolicyReport(policy, len(results), len(ok), errors, len(ok) / (wall / scale) if wall else 0.0,
                        percentile(ttft, 50), percentile(ttft, 99), percentile(e2e, 99), utilisation, served)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:,.0f} ms"


def render(reports: list[PolicyReport], replicas: list[str], capacity: float, rate: float, opts: DemoOptions) -> str:
    lines = [
        "",
        f"fleet: {', '.join(replicas)}",
        f"workload: multi-turn chat, {rate * opts.time_scale:.1f} req/s offered "
        f"({opts.load:.0%} of the modelled capacity {capacity:.1f} req/s), same seeded requests for every policy",
        f"times in simulated seconds (wall / time-scale {opts.time_scale:g})",
        "",
    ]
    header = f"{'policy':<18} {'req/s':>7} {'TTFT p50':>10} {'TTFT p99':>10} {'E2E p99':>10} {'errors':>7} " \
             f"{'util CV':>8}  per-replica utilisation"
    lines += [header, "-" * len(header)]
    for r in reports:
        util = "  ".join(f"{rid}={u:.0%}" for rid, u in r.utilisation.items())
        lines.append(f"{r.policy:<18} {r.rps:>7.1f} {_ms(r.ttft_p50):>10} {_ms(r.ttft_p99):>10} {_ms(r.e2e_p99):>10} "
                     f"{r.requests - r.ok:>7} {r.utilisation_cv:>8.2f}  {util}")
    lines.append("")
    lines.append("util CV = coefficient of variation of replica utilisation (lower = better balanced).")
    return "\n".join(lines)


async def _gpu_busy(session: aiohttp.ClientSession, urls: dict[str, str]) -> dict[str, tuple[float, float]]:
    out = {}
    for rid, url in urls.items():
        async with session.get(url + "/sim/gpu") as resp:
            sample = await resp.json()
        out[rid] = (sample["busy_seconds_total"], sample["sim_time"])
    return out


def router_config(replicas: dict[str, str], model: str, strategy: str) -> dict[str, Any]:
    return {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "endpoints": [{"id": rid, "url": url, "models": [model]} for rid, url in replicas.items()],
        "policies": [{"name": "demo", "models": ["*"], "strategy": strategy}],
        "telemetry": {"interval": "250ms", "staleAfter": "3s", "gpuSource": "sim"},
        "redis": {"url": None},  # embedded telemetry: the demo needs no Redis
        "logging": {"level": "info", "accessLog": False},
        "shutdownGrace": "5s",
    }


async def run_demo(opts: DemoOptions) -> list[PolicyReport]:
    group = ProcessGroup()
    reports: list[PolicyReport] = []
    try:
        replicas: dict[str, str] = {}
        counts: dict[str, int] = {}
        print(f"starting {len(opts.fleet)} simulated replicas ...", file=sys.stderr, flush=True)
        starts = []
        for i, gpu in enumerate(opts.fleet):
            counts[gpu] = counts.get(gpu, 0) + 1
            rid = f"{gpu}-{counts[gpu] - 1}"
            args = ["sim", "--port", "0", "--gpu", gpu, "--model", opts.model, "--seed", str(opts.seed + i),
                    "--time-scale", str(opts.time_scale)]
            starts.append((rid, group.start(rid, args, "sim listening")))
        for rid, start in starts:
            replicas[rid] = (await start).ready["url"]
        pids = " ".join(str(c.process.pid) for c in group.children)
        print(f"fleet ready: {', '.join(replicas)} (pids {pids})", file=sys.stderr, flush=True)
        capacity = fleet_capacity(opts.fleet, opts.model, opts.seed)
        rate = opts.load * capacity / opts.time_scale  # wall-clock requests per second
        plan = chat_sessions(model=opts.model, rate=rate, duration=opts.duration, seed=opts.seed)
        progress = Progress(len(opts.policies))
        with tempfile.TemporaryDirectory(prefix="fleetroute-demo-") as tmp:
            async with aiohttp.ClientSession() as session:
                for index, strategy in enumerate(opts.policies, 1):
                    path = Path(tmp) / f"router-{strategy}.yaml"
                    path.write_text(yaml.safe_dump(router_config(replicas, opts.model, strategy)))
                    router = await group.start(f"router-{strategy}", ["router", "--config", str(path)],
                                               "router listening")
                    before = await _gpu_busy(session, replicas)
                    started = time.monotonic()
                    done = 0

                    def on_done(_r: Result, index: int = index, strategy: str = strategy,
                                started: float = started) -> None:
                        nonlocal done
                        done += 1
                        progress.show(index, strategy, done, len(plan), started)

                    results = await run_open_loop(router.ready["ingress"], plan, timeout=60 * opts.time_scale,
                                                  on_done=on_done)
                    wall = time.monotonic() - started
                    progress.show(index, strategy, done, len(plan), started, force=True)
                    after = await _gpu_busy(session, replicas)
                    await group.stop(router)
                    utilisation = {
                        rid: (after[rid][0] - before[rid][0]) / max(after[rid][1] - before[rid][1], 1e-9)
                        for rid in replicas
                    }
                    reports.append(summarise(strategy, results, wall, opts.time_scale, utilisation))
        progress.finish()
        print(render(reports, list(replicas), capacity, rate, opts))
        return reports
    finally:
        await group.stop_all()


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
                                   ("time-scale", args.time_scale, 0.5, 100)):
        if not low <= value <= high:
            print(f"fleetroute demo: error: --{name} must be between {low} and {high}, got {value}", file=sys.stderr)
            return 2
    opts = DemoOptions(fleet=fleet, time_scale=args.time_scale, duration=args.duration, load=args.load,
                       seed=args.seed, policies=policies)
    return asyncio.run(_interruptible(opts))


async def _interruptible(opts: DemoOptions) -> int:
    """Run the demo; SIGINT/SIGTERM cancel it, and its cleanup stops every child before we return."""
    task = asyncio.current_task()
    loop = asyncio.get_running_loop()
    assert task is not None
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await run_demo(opts)
    except asyncio.CancelledError:
        print("\ninterrupted; every replica and router stopped.", file=sys.stderr)
        return 130
    except (ChildFailed, aiohttp.ClientError) as exc:
        print(f"\nfleetroute demo: error: {exc}", file=sys.stderr)
        return 1
    return 0
