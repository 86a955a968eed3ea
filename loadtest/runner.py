"""Run a scenario: every policy on the identical arrival sequence at every load point, on a fresh fleet.

For each load point (rate-major, so the policies' runs at one load are close together in time and share
whatever the machine was doing) and each policy:

1. a fresh fleet (simulated replicas, and agents when telemetry goes through Redis; Redis itself is started
   once and flushed between runs), so no run inherits another's KV or prefix cache;
2. a fresh router for the policy (fleetroute, or a peer router from loadtest/peers), waiting until it has
   telemetry for every replica; where the machine has two cores or more, the router runs alone on the
   first (its whole process tree) and everything else (replicas, agents, Redis, this load client) on the
   others, the same for every router, and the router's CPU use is recorded (a saturated router shows);
3. the point's plan, the same requests at the same (scaled) times for every policy, sent open loop (or closed
   loop with `load.mode: closed`) while the replicas' GPU-busy time is sampled for the utilisation timeline;
4. a summary (loadtest.stats) in simulated time, the replicas' utilisation and its spread, the engines'
   measured prefix-cache hit rate, and the router's policy-event counters, appended to `results.json`.

The modelled capacity that `capacityFractions` refer to is computed first, in virtual time: every replica
of the fleet run saturated with the workload's own requests (worker.sim.virtual), summed. It is an upper
bound: a router that balanced perfectly, with no queueing, would reach it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from loadtest import arrivals
from loadtest.client import PlannedRequest, Result, run_closed_loop, run_open_loop
from loadtest.fleet import Fleet, busy_fractions, start_gateway, start_router, wait_for_telemetry
from loadtest.host import cpu_seconds
from loadtest.processes import ChildFailed, ProcessGroup
from loadtest.progress import Progress
from loadtest.scenario import PolicyEntry, Scenario, build_workload
from loadtest.stats import coefficient_of_variation, summarise, window_of
from loadtest.workload import Priorities
from router.config.settings import ConfigError

CAPACITY_SAMPLE = 600  # requests per GPU type for the modelled capacity


def build_plan(scenario: Scenario, rate: float) -> list[PlannedRequest]:
    """A load point's requests in simulated time; the same for every policy.

    Every point of a sweep replays one arrival sequence, drawn at unit rate from the scenario's seed and
    divided by the point's rate: the points differ only in their rate, not in where the bursts fall, and
    the same requests arrive in the same order (a lower rate's plan is a prefix of a higher one's when the
    run is a `duration`) - except that multi-turn sessions keep their users' think time in simulated
    seconds, so at a higher rate more arrivals open new sessions."""
    arrivals_rng = random.Random(f"{scenario.seed}-arrivals")
    content_rng = random.Random(f"{scenario.seed}-requests")
    load = scenario.load
    workload = build_workload(scenario.workload, scenario.fleet.model)
    if load.mode == "closed":
        times = [0.0] * (load.requests or 1000)
    else:
        # With a request count, arrivals run long enough to produce it (bursty processes vary), then are cut.
        horizon = (load.duration * rate if load.duration is not None else 2 * (load.requests or 0) + 1)
        a = scenario.arrivals
        if a.process == "trace":
            unit = arrivals.rescaled(workload.timestamps, 1.0, horizon)
        elif a.process == "constant":
            unit = arrivals.constant(1.0, horizon)
        else:
            unit = arrivals.gamma(1.0, a.cv if a.process == "gamma" else 1.0, horizon, arrivals_rng)
        times = [t / rate for t in unit]
        if load.requests is not None:
            times = times[: load.requests]
    plan = workload.requests(times, content_rng)
    return Priorities(scenario.workload.priorities).apply(plan, content_rng)


def modelled_capacity(scenario: Scenario) -> float:
    """Requests per simulated second the whole (healthy) fleet sustains on this workload, with perfect
    balance and no queueing."""
    from worker.sim.engine import EngineConfig, EngineCore, SimRequest
    from worker.sim.profiles import profile
    from worker.sim.tokenizer import render_chat, tokenize
    from worker.sim.virtual import run_virtual

    f = scenario.fleet
    workload = build_workload(scenario.workload, f.model)
    plan = workload.requests([0.0] * CAPACITY_SAMPLE, random.Random(f"{scenario.seed}-capacity"))
    prompts = []
    for p in plan:
        body = p.body
        text = render_chat(body["messages"]) if "messages" in body else body["prompt"]
        prompts.append((tokenize(text), int(body["max_tokens"])))
    config = EngineConfig(max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
                          enable_prefix_caching=f.prefix_caching)
    per_gpu: dict[str, float] = {}
    for group in f.replicas:
        engine = EngineCore(profile(group.gpu), config, random.Random(scenario.seed))
        done = run_virtual(engine, [SimRequest(f"r{i}", toks, out, 0.0) for i, (toks, out) in enumerate(prompts)])
        per_gpu[group.gpu] = len(done) / max(r.finished_at for r in done)
    # Faults are left out: a degraded-node run offers the same load as its healthy twin.
    return sum(per_gpu[gpu] for _, gpu in f.replica_ids())


def offered_rates(scenario: Scenario, capacity: float) -> list[float]:
    load = scenario.load
    if load.mode == "closed":
        return list(load.points)
    if load.rates:
        return list(load.rates)
    return [fraction * capacity for fraction in load.capacity_fractions]


@dataclass
class RunRecord:
    policy: str
    point: int
    point_value: float  # the rate, fraction or concurrency as the scenario wrote it
    offered_rate: float  # simulated req/s (closed loop: the concurrency)
    summary: dict[str, Any]
    utilisation: dict[str, float]
    utilisation_cv: float
    timeline: list[dict[str, Any]]
    prefix_cache_hit_rate: float | None
    preemptions: float
    router_events: dict[str, float]
    ttft: list[float]  # simulated seconds, every successful request, for the CDF plots
    router_version: str
    wall_seconds: float
    started_at: str
    router_cpu: float | None = None  # cores the router (its process tree) used during the load
    error: str | None = None


@dataclass
class ScenarioResults:
    scenario: dict[str, Any]
    machine: dict[str, Any]
    modelled_capacity: float
    points: list[dict[str, float]]
    runs: list[RunRecord] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "runs": [dataclasses.asdict(r) for r in self.runs]}

    def save(self, path: Path) -> None:
        """`path` (results.json: every request's TTFT) and summary.json beside it: what `loadtest.publish`
        renders, small enough to commit as docs/results/scenarios/<scenario>.json."""
        data = self.to_json()
        for target, text in ((path, json.dumps(data, indent=1, default=str)),
                             (path.with_name("summary.json"), json.dumps(compact(data), separators=(",", ":"),
                                                                          default=str))):
            tmp = target.with_suffix(".tmp")
            tmp.write_text(text + "\n")
            tmp.replace(target)


CDF_POINTS = 500  # TTFT order statistics a summary keeps per run: enough for the CDF plot


def compact(data: dict[str, Any]) -> dict[str, Any]:
    """A run's results without its per-request data: each run's TTFTs thinned to every `stride`-th order
    statistic (the CDF plot reads the stride)."""
    out = dict(data)
    runs = []
    for run in data["runs"]:
        values = sorted(run["ttft"])
        stride = max(1, -(-len(values) // CDF_POINTS))
        runs.append({**run, "ttft": [round(v, 5) for v in values[stride - 1::stride]], "ttft_stride": stride})
    out["runs"] = runs
    return out


def describe(scenario: Scenario) -> dict[str, Any]:
    out = dataclasses.asdict(scenario)
    out["path"] = str(scenario.path) if scenario.path else None
    out["workload"]["trace_path"] = str(scenario.workload.trace_path) if scenario.workload.trace_path else None
    return out


async def _sample_utilisation(fleet: Fleet, session: aiohttp.ClientSession, every: float,
                              into: list[dict[str, Any]]) -> None:
    previous = await fleet.gpu_busy(session)
    start = next(iter(previous.values()))[1] if previous else 0.0
    while True:
        await asyncio.sleep(every)
        current = await fleet.gpu_busy(session)
        into.append({
            "t": round(next(iter(current.values()))[1] - start, 4),
            "util": {rid: round((b - previous[rid][0]) / max(t - previous[rid][1], 1e-9), 4)
                     for rid, (b, t) in current.items()},
        })
        previous = current


async def _router_events(admin_url: str, session: aiohttp.ClientSession) -> dict[str, float]:
    """fleetroute's policy-event counters (`prefix_hit`, `load_guard`, ...) summed over policies."""
    from prometheus_client.parser import text_string_to_metric_families

    async with session.get(admin_url + "/metrics") as resp:
        text = await resp.text()
    events: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "fleetroute_policy_events":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels.get("event", "?")
                    events[key] = events.get(key, 0.0) + sample.value
    return events


@dataclass(frozen=True)
class StartedRouter:
    url: str  # base URL for the clients
    admin: str | None  # fleetroute's admin URL; None for a peer
    headers: dict[str, str]  # sent with every request (a peer's API key)
    version: str
    pids: tuple[int, ...]  # the router's processes (their trees are what runs on the router's cores)
    telemetry_ready: bool = True  # fleetroute: telemetry of every replica arrived before the load started
    peer: Any = None  # loadtest.peers.StartedPeer


async def _start_policy(entry: PolicyEntry, fleet: Fleet, scenario: Scenario, cpus: set[int] | None) -> StartedRouter:
    if entry.peer is not None:
        from loadtest.peers import parse_peer_spec, start_peer

        spec = parse_peer_spec(entry.peer)
        peer = await start_peer(fleet.group, spec.peer, spec.policy, list(fleet.urls.items()), scenario.fleet.model,
                                cpu=",".join(str(c) for c in sorted(cpus)) if cpus else None)
        return StartedRouter(peer.url, None, dict(peer.headers), str(peer.version), (peer.child.process.pid,),
                             peer=peer)
    if entry.gateway == "envoy":  # Envoy moves the bytes, `fleetroute epp` decides: both count as the router
        children, ingress, admin = await start_gateway(fleet, entry.config, scenario.router, cpus=cpus)
    else:
        child, ingress, admin = await start_router(fleet, entry.config, scenario.router, cpus=cpus)
        children = [child]
    # Telemetry is sampled every interval of simulated time; allow a few intervals, in wall time.
    f = scenario.fleet
    ready = await wait_for_telemetry(admin, len(fleet.urls), timeout=max(10.0, 5 * f.telemetry_interval * f.time_scale))
    version = "fleetroute" if entry.gateway == "router" else "fleetroute epp + envoy"
    return StartedRouter(ingress, admin, {}, version, tuple(c.process.pid for c in children), telemetry_ready=ready)


def _failed_record(entry: PolicyEntry, point: int, value: float, rate: float, started_at: str, wall0: float,
                   error: str) -> RunRecord:
    return RunRecord(policy=entry.label, point=point, point_value=value, offered_rate=rate, summary={},
                     utilisation={}, utilisation_cv=0.0, timeline=[], prefix_cache_hit_rate=None, preemptions=0.0,
                     router_events={}, ttft=[], router_version="", wall_seconds=round(time.monotonic() - wall0, 1),
                     started_at=started_at, error=error)


async def run_one(scenario: Scenario, entry: PolicyEntry, point: int, value: float, rate: float,
                  plan: Sequence[PlannedRequest], *, redis: Any, on_done: Callable[[Result], None],
                  router_cpus: set[int] | None = None) -> RunRecord:
    """One policy at one load point on a fresh fleet. A run that cannot start (a child that fails, a peer
    that will not come up) is recorded with its error rather than ending the whole scenario."""
    from loadtest.peers import PeerError

    f = scenario.fleet
    scale = f.time_scale
    group = ProcessGroup()
    fleet = Fleet(f, group, seed=scenario.seed, redis_url=redis.url if redis is not None else None)
    started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    wall0 = time.monotonic()
    timeline: list[dict[str, Any]] = []
    router: StartedRouter | None = None
    try:
        if redis is not None:
            import redis as redis_lib

            with contextlib.closing(redis_lib.Redis.from_url(redis.url)) as client:
                client.flushdb()  # nothing from the previous run: sessions, shared loads, telemetry
        await fleet.start()
        router = await _start_policy(entry, fleet, scenario, router_cpus)
        url, admin = router.url, router.admin
        wall_plan = [dataclasses.replace(p, at=p.at * scale, headers={**p.headers, **router.headers}) for p in plan]
        timeout = scenario.load.timeout * scale
        async with aiohttp.ClientSession() as session:
            before = await fleet.gpu_busy(session)
            counters_before = await fleet.engine_counters(session)
            cpu0, t0 = sum(map(cpu_seconds, router.pids)), time.monotonic()
            expected = (plan[-1].at * scale if plan else 1.0) or 1.0
            sampler = asyncio.create_task(_sample_utilisation(fleet, session, max(1.0, expected / 60), timeline))
            try:
                if scenario.load.mode == "closed":
                    results = await run_closed_loop(url, wall_plan, concurrency=int(value), timeout=timeout,
                                                    on_done=on_done)
                else:
                    results = await run_open_loop(url, wall_plan, timeout=timeout, on_done=on_done)
            finally:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sampler
            router_cpu = (sum(map(cpu_seconds, router.pids)) - cpu0) / max(time.monotonic() - t0, 1e-9)
            after = await fleet.gpu_busy(session)
            counters = await fleet.engine_counters(session)
            events = await _router_events(admin, session) if admin else {}
    except (ChildFailed, PeerError, aiohttp.ClientError, OSError) as exc:
        return _failed_record(entry, point, value, rate, started_at, wall0, f"{type(exc).__name__}: {exc}")
    finally:
        if router is not None and router.peer is not None:
            from loadtest.peers import stop_peer

            await stop_peer(group, router.peer)  # its temporary config directory too
        await group.stop_all()
    utilisation = busy_fractions(before, after)

    def delta(name: str) -> float:
        return sum(counters[r][name] - counters_before[r][name] for r in counters)

    queries, hits = delta("prefix_cache_queries"), delta("prefix_cache_hits")
    closed = scenario.load.mode == "closed"
    summary = summarise(results, offered_rate=rate, slo=scenario.slo, scale=scale, warmup=scenario.load.warmup,
                        closed=closed)
    start, _ = window_of(results, scale=scale, warmup=scenario.load.warmup, closed=closed)
    kept = [r for r in results if (r.sent_at if closed else r.planned.at) >= start]
    return RunRecord(
        policy=entry.label, point=point, point_value=value, offered_rate=rate, summary=summary.to_json(),
        utilisation={k: round(v, 4) for k, v in utilisation.items()},
        utilisation_cv=round(coefficient_of_variation(utilisation), 4), timeline=timeline,
        prefix_cache_hit_rate=hits / queries if queries else None,
        preemptions=delta("preemptions"),
        router_events=events,
        ttft=[round(r.ttft / scale, 5) for r in kept if r.ok and r.ttft is not None],
        router_version=router.version,
        router_cpu=round(router_cpu, 3),
        wall_seconds=round(time.monotonic() - wall0, 1), started_at=started_at,
        error=None if router.telemetry_ready else "telemetry of some replicas had not arrived when the load started",
    )


def check_peers(entries: Sequence[PolicyEntry]) -> None:
    """Refuse, before anything starts, a scenario naming a peer that is not installed (and say how)."""
    from loadtest.peers import parse_peer_spec, unavailable_reason

    missing = []
    for entry in entries:
        if entry.peer is not None and (reason := unavailable_reason(parse_peer_spec(entry.peer).peer)):
            missing.append(f"{entry.peer}: {reason}")
    if missing:
        raise ConfigError("policies", "peer routers not available: " + "; ".join(dict.fromkeys(missing)))
    if any(entry.gateway == "envoy" for entry in entries):
        from loadtest.envoy import MISSING, envoy_binary

        if envoy_binary() is None:
            raise ConfigError("policies", f"a policy runs through Envoy (gateway: envoy) but {MISSING}")


def harness_cpus() -> tuple[set[int] | None, set[int] | None]:
    """(router cores, everything else's cores): the router (ours or a peer) alone on core 0, the replicas,
    agents, Redis and the load client on the others; (None, None) on a one-core machine."""
    try:
        available = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        return None, None
    if len(available) < 2:
        return None, None
    first = min(available)
    return {first}, available - {first}


def _extend(results: ScenarioResults, previous: dict[str, Any]) -> set[tuple[str, float]]:
    """Take an earlier run of the same scenario into `results` (its runs, its points); returns what needs
    no run now: the (policy, point) pairs done, and every point above one where a policy already missed
    the SLO's P99 (its capacity is found)."""
    slo = results.scenario["slo"]["ttft"]
    values = sorted({p["value"] for p in [*previous["points"], *results.points]})
    rate_of = {p["value"]: p["rate"] for p in [*previous["points"], *results.points]}
    results.points = [{"value": v, "rate": rate_of[v]} for v in values]
    skip: set[tuple[str, float]] = set()
    for raw in previous["runs"]:
        record = RunRecord(**{**raw, "point": values.index(raw["point_value"])})
        results.runs.append(record)
        skip.add((record.policy, record.point_value))
        skip.update(_past_capacity(record, values, slo))
    return skip


def _past_capacity(record: RunRecord, values: list[float], slo: float) -> set[tuple[str, float]]:
    """The points above `record`'s when its P99 TTFT missed the SLO (or it has none: the run failed)."""
    p99 = (record.summary.get("ttft") or {}).get("p99")
    if p99 is not None and p99 <= slo:
        return set()
    return {(record.policy, v) for v in values if v > record.point_value}


async def run_scenario(scenario: Scenario, out_dir: Path, *, policies: Sequence[str] | None = None,
                       log: Callable[[str], None] = print, extend: bool = False) -> ScenarioResults:
    """Run the scenario into `out_dir`. With `extend`, an earlier run's results.json there is kept and only
    what it lacks is run (new load points, new policies), for a sweep that did not reach every policy's
    capacity."""
    from loadtest.router_overhead import machine

    out_dir.mkdir(parents=True, exist_ok=True)
    entries = [e for e in scenario.policies if policies is None or e.label in policies]
    check_peers(entries)
    capacity = modelled_capacity(scenario)
    rates = offered_rates(scenario, capacity)
    results = ScenarioResults(
        scenario=describe(scenario), machine=machine(), modelled_capacity=capacity,
        points=[{"value": v, "rate": r} for v, r in zip(scenario.load.points, rates, strict=True)],
    )
    skip: set[tuple[str, float]] = set()
    if extend and (out_dir / "results.json").exists():
        skip = _extend(results, json.loads((out_dir / "results.json").read_text()))
    values = [p["value"] for p in results.points]
    log(f"{scenario.name}: {sum(g.count for g in scenario.fleet.replicas)} replicas, modelled capacity "
        f"{capacity:.1f} req/s; {len(rates)} load points x {len(entries)} policies")
    redis = None
    tmp = tempfile.TemporaryDirectory(prefix="fleetroute-loadtest-")
    router_cpus, other_cpus = harness_cpus()
    own_affinity = os.sched_getaffinity(0) if other_cpus else None
    try:
        if other_cpus:  # this process and every child it starts (replicas, agents, Redis) keep off the router's
            os.sched_setaffinity(0, other_cpus)
        if scenario.fleet.telemetry == "redis":
            from loadtest.redis_server import RedisServer

            redis = RedisServer(Path(tmp.name)).start()
        todo = [(value, rate, entry) for value, rate in zip(scenario.load.points, rates, strict=True)
                for entry in entries if (entry.label, value) not in skip]
        progress = Progress(len(todo))
        plan: list[PlannedRequest] = []
        planned_for: float | None = None
        for index, (value, rate, entry) in enumerate(todo, 1):
            # stopPastCapacity: this policy missed the SLO at a lower point (the fixed-load table's point runs)
            if (entry.label, value) in skip and value != scenario.load.fixed:
                log(f"{entry.label} @ {rate:.1f} req/s: skipped, past its capacity")
                continue
            if planned_for != value:  # rate-major: one plan per load point
                plan, planned_for = build_plan(scenario, rate), value
            label = f"{entry.label} @ {rate:.1f} req/s" if scenario.load.mode == "open" else \
                f"{entry.label} @ {int(value)} users"
            started = time.monotonic()
            done = 0

            def on_done(_r: Result, index: int = index, label: str = label, started: float = started,
                        total: int = len(plan)) -> None:
                nonlocal done
                done += 1
                progress.show(index, label, done, total, started)

            record = await run_one(scenario, entry, values.index(value), value, rate, plan, redis=redis,
                                   on_done=on_done, router_cpus=router_cpus)
            progress.show(index, label, done, len(plan), started, force=True)
            if record.error:
                log(f"{label}: {record.error}")
            results.runs.append(record)
            results.save(out_dir / "results.json")
            if scenario.load.stop_past_capacity and scenario.load.mode == "open":
                skip.update(_past_capacity(record, values, scenario.slo.ttft))
        progress.finish()
    finally:
        if redis is not None:
            redis.kill()
        tmp.cleanup()
        if own_affinity is not None:
            os.sched_setaffinity(0, own_affinity)
    return results
