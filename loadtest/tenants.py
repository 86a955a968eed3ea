"""Fair sharing between tenants on the simulated fleet: a light tenant's TTFT while another floods the pool,
with `tenancy.fairness` on and off.

    python -m loadtest.tenants --json docs/results/tenants.json     # about 3 minutes
    python -m loadtest.publish                                       # the table and plot in docs/benchmarks.md

Two `fleetroute sim` replicas (H100 profile, llama-3-8b, `--time-scale`) behind one `fleetroute router` with
least-connections and admission capped at `--slots` requests per engine (a 64-place queue, the default
classes), and two tenants of equal weight named by the `x-tenant-id` header. First the pool's capacity is
measured (requests completed per second with every slot busy); then the same seeded Poisson arrivals are sent
twice, once per setting: the heavy tenant at five times its half share (2.5 x capacity) and the light one at
half of its half share (0.25 x capacity). Every request streams, with a prompt of 100-300 random words and
16-48 output tokens (the simulator emits exactly `max_tokens`).

Reported per tenant and setting, after a warm-up: requests sent (by arrival time), served and shed (by the
router's reason, from its `fleetroute_tenant_shed_total` between the warm-up's end and the run's: a request
that arrived in the warm-up and was shed after it counts there), its share of the
tokens served, and TTFT as the client measured it (queue wait included) in simulated seconds: wall seconds
divided by the time scale, as the fleet benchmarks report them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadtest.client import PlannedRequest, Result, run_closed_loop, run_open_loop
from loadtest.fleet import Fleet, start_router, wait_for_telemetry
from loadtest.processes import ProcessGroup
from loadtest.router_overhead import machine
from loadtest.scenario import FleetSpec, ReplicaGroup
from loadtest.stats import percentile

MODEL = "llama-3-8b"
TENANTS = ("heavy", "light")
# Offered load as a multiple of the pool's capacity: each tenant's fair share is half of it (equal weights).
LOAD = {"heavy": 2.5, "light": 0.25}
WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def make_request(rng: random.Random, at: float, tenant: str) -> PlannedRequest:
    """Random words (no two prompts share a prefix, so prefix caching plays no part) and an exact length."""
    prompt_words = rng.randint(100, 300)
    output = rng.randint(16, 48)
    text = " ".join(rng.choice(WORDS) for _ in range(prompt_words))
    body = {"model": MODEL, "max_tokens": output, "messages": [{"role": "user", "content": text}]}
    return PlannedRequest(at=at, path="/v1/chat/completions", body=body, headers={"x-tenant-id": tenant},
                          prompt_tokens=prompt_words, output_tokens=output, priority=tenant)


def plan(capacity: float, duration: float, seed: int) -> list[PlannedRequest]:
    """Both tenants' Poisson arrivals over `duration` wall seconds, merged in time order."""
    rng = random.Random(seed)
    requests = []
    for tenant in TENANTS:
        rate, t = LOAD[tenant] * capacity, 0.0
        while (t := t + rng.expovariate(rate)) < duration:
            requests.append(make_request(rng, t, tenant))
    return sorted(requests, key=lambda r: r.at)


def router_extra(fairness: bool) -> dict[str, Any]:
    return {"tenancy": {"fairness": fairness, "tenants": [{"name": t} for t in TENANTS]}}


def policy(slots: int) -> dict[str, Any]:
    return {"name": "tenants", "strategy": "least-connections",
            "admission": {"maxConcurrentPerEndpoint": slots, "maxQueue": 64}}


async def shed_reasons(admin_url: str) -> dict[str, dict[str, int]]:
    """Per tenant, the router's own count of refused requests by reason."""
    async with aiohttp.ClientSession() as session, session.get(admin_url + "/metrics") as resp:
        text = await resp.text()
    out: dict[str, dict[str, int]] = {t: {} for t in TENANTS}
    for family in text_string_to_metric_families(text):
        if family.name != "fleetroute_tenant_shed":
            continue
        for sample in family.samples:
            tenant = sample.labels.get("tenant")
            if sample.name.endswith("_total") and tenant in out and sample.value:
                out[tenant][sample.labels["reason"]] = int(sample.value)
    return out


def tenant_summary(results: list[Result], tenant: str, *, warmup: float, scale: float,
                   served_tokens_all: int) -> dict[str, Any]:
    mine = [r for r in results if r.planned.priority == tenant and r.planned.at >= warmup]
    served = [r for r in mine if r.ok]
    tokens = sum((r.planned.prompt_tokens or 0) + r.output_tokens for r in served)
    ttfts = [r.ttft / scale for r in served if r.ttft is not None]
    return {
        "sent": len(mine), "served": len(served), "failed": dict(Counter(r.error for r in mine if not r.ok)),
        "share_of_tokens_served": tokens / served_tokens_all if served_tokens_all else 0.0,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p90_s": percentile(ttfts, 90),
        "ttft_p99_s": percentile(ttfts, 99), "ttft_max_s": max(ttfts) if ttfts else None,
    }


async def _after(delay: float, reading: Any) -> Any:
    await asyncio.sleep(delay)
    return await reading


async def measure_capacity(url: str, slots_total: int, requests: int, seed: int, scale: float) -> float:
    """Requests per wall second with every slot busy (twice as many clients as slots, so the queue is never
    empty), skipping the first slots_total completions (the ramp)."""
    rng = random.Random(seed + 1)
    calibration = [make_request(rng, 0.0, "light") for _ in range(requests)]
    done: list[float] = []
    await run_closed_loop(url, calibration, concurrency=2 * slots_total, timeout=120 * scale,
                          on_done=lambda r: done.append(time.perf_counter()) if r.ok else None)
    steady = sorted(done)[slots_total:]
    if len(steady) < 2:
        raise SystemExit(f"capacity run: only {len(done)} of {requests} requests succeeded")
    return (len(steady) - 1) / (steady[-1] - steady[0])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    spec = FleetSpec(model=MODEL, replicas=(ReplicaGroup("h100", args.replicas),), time_scale=args.time_scale,
                     telemetry="embedded")
    group = ProcessGroup()
    fleet = Fleet(spec, group, seed=args.seed)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    runs: dict[str, Any] = {}
    try:
        await fleet.start()
        capacity = None
        for fairness in (True, False):
            child, url, admin = await start_router(fleet, policy(args.slots), router_extra(fairness))
            try:
                if not await wait_for_telemetry(admin, args.replicas, timeout=30):
                    raise SystemExit("the router saw no telemetry from the replicas within 30 s")
                if capacity is None:
                    capacity = await measure_capacity(url, args.slots * args.replicas, args.calibration,
                                                      args.seed, args.time_scale)
                    print(f"capacity: {capacity:.2f} requests/s (wall)", file=sys.stderr)
                requests = plan(capacity, args.duration, args.seed)
                # The router's shed counts over the counted window: read when the warm-up's arrivals end.
                at_warmup = asyncio.create_task(_after(args.warmup, shed_reasons(admin)))
                results = await run_open_loop(url, requests, timeout=120 * args.time_scale)
                before, after = await at_warmup, await shed_reasons(admin)
                shed = {t: {reason: n - before[t].get(reason, 0) for reason, n in after[t].items()
                            if n > before[t].get(reason, 0)} for t in TENANTS}
            finally:
                await group.stop(child)
            counted = [r for r in results if r.ok and r.planned.at >= args.warmup]
            total_tokens = sum((r.planned.prompt_tokens or 0) + r.output_tokens for r in counted)
            name = "on" if fairness else "off"
            runs[name] = {t: {**tenant_summary(results, t, warmup=args.warmup, scale=args.time_scale,
                                               served_tokens_all=total_tokens), "shed_by_reason": shed[t]}
                          for t in TENANTS}
            runs[name]["light"]["ttfts_s"] = sorted(
                round(r.ttft / args.time_scale, 4) for r in counted if r.planned.priority == "light" and r.ttft)
            print(f"fairness {name}: light P99 TTFT {runs[name]['light']['ttft_p99_s']}", file=sys.stderr)
    finally:
        await group.stop_all()
    return {"benchmark": "tenants", "started_utc": started, "machine": machine(),
            "settings": {"replicas": args.replicas, "gpu": "h100", "time_scale": args.time_scale,
                         "slots_per_engine": args.slots, "max_queue": 64, "duration_s": args.duration,
                         "warmup_s": args.warmup, "seed": args.seed, "load": LOAD,
                         "capacity_rps_wall": capacity},
            "runs": runs}


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def render_markdown(result: dict[str, Any]) -> str:
    s, m = result["settings"], result["machine"]
    lines = [f"Run {result['started_utc']} on {m.get('nproc', '?')} cores ({m.get('cpu_model', '?')}), commit "
             f"{m.get('commit', '?')}; {s['replicas']} simulated {s['gpu'].upper()} replicas at time scale "
             f"{s['time_scale']:g}, {s['slots_per_engine']} slots each, a {s['max_queue']}-place queue; capacity "
             f"measured at {s['capacity_rps_wall'] * s['time_scale']:.1f} requests/s (simulated); "
             f"{s['duration_s']:g} s of arrivals per setting, the first {s['warmup_s']:g} s not counted; seed "
             f"{s['seed']}. Times are simulated seconds (wall / {s['time_scale']:g}).",
             "",
             "| fairness | tenant | offered (of capacity) | sent | served | shed (router's reason) "
             "| share of tokens served | TTFT p50 | TTFT p90 | TTFT p99 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, run in result["runs"].items():
        for tenant in TENANTS:
            t = run[tenant]
            shed = ", ".join(f"{n} {reason}" for reason, n in sorted(t["shed_by_reason"].items())) or "0"
            lines.append(f"| {name} | {tenant} | {s['load'][tenant]:g}x | {t['sent']:,} | {t['served']:,} | {shed} "
                         f"| {t['share_of_tokens_served']:.1%} | {_seconds(t['ttft_p50_s'])} "
                         f"| {_seconds(t['ttft_p90_s'])} | {_seconds(t['ttft_p99_s'])} |")
    light_on, light_off = result["runs"]["on"]["light"], result["runs"]["off"]["light"]
    on, off = light_on["ttft_p99_s"], light_off["ttft_p99_s"]
    if on and off:
        # The percentiles are of served requests: the shed ones are said beside them, not hidden in them.
        lines += ["", f"The light tenant: with fairness {light_on['served']:,} of {light_on['sent']:,} requests "
                      f"served, P99 TTFT {_seconds(on)}; without, {light_off['served']:,} of {light_off['sent']:,} "
                      f"served (the rest shed) and the served ones' P99 TTFT {_seconds(off)} ({off / on:.1f} times "
                      f"longer)."]
    return "\n".join(lines) + "\n"


def write_plot(result: dict[str, Any], out_dir: Path) -> Path:
    """The light tenant's TTFT distribution with fairness on and off."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4))
    for name, style in (("on", "-"), ("off", "--")):
        ttfts = result["runs"][name]["light"]["ttfts_s"]
        if ttfts:
            ax.plot(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], style, label=f"fairness {name}")
    ax.set_xscale("log")
    ax.set_xlabel("light tenant's TTFT (simulated seconds, log scale)")
    ax.set_ylabel("fraction of its served requests")
    ax.set_title("A light tenant against one sending 5x its share")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tenants-light-ttft.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.tenants", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--slots", type=int, default=8, help="admission.maxConcurrentPerEndpoint (default 8)")
    p.add_argument("--time-scale", type=float, default=4.0, help="the simulators' slow-down (default 4)")
    p.add_argument("--duration", type=float, default=60.0, help="wall seconds of arrivals per setting")
    p.add_argument("--warmup", type=float, default=10.0, help="wall seconds of arrivals not counted")
    p.add_argument("--calibration", type=int, default=120, help="requests of the capacity run")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", type=Path, help="write the result here")
    args = p.parse_args(argv)
    if args.warmup >= args.duration:
        p.error("--warmup must be shorter than --duration")
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(render_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
