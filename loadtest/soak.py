"""Soak test: minutes of mixed streaming load through a router while replicas fail every few seconds.

    python -m loadtest.soak [--duration 180] [--replicas 4] [--rate 12] [--fault-every 6] [--seed 1]

A fleet of `fleetroute sim --fault-injection` replicas behind one `fleetroute router` with its default
resilience settings (health checks, outlier ejection, breakers, slow start, retries within a budget). A
seeded open-loop chat workload streams through the router while a fault injector cycles through what GPU
replicas do: a replica killed and restarted, answering 500s, hanging before headers, stalling streams
midway, going 5x slow, failing its health check. Every fault lasts a few seconds, then is cleared.

Reports requests sent, succeeded and failed by reason, and the router's RSS at start and end. Failures
fall in two classes: those a router could have hidden by retrying (a 5xx or a timeout before any byte
reached the client) and those it must not retry (a stream cut after tokens were delivered).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import yaml

from loadtest.client import Result, run_open_loop
from loadtest.host import free_port
from loadtest.processes import Child, ProcessGroup, listener_url
from loadtest.workload import chat_sessions

FAULTS = ("kill", "errors", "hang", "stall", "slow", "unhealthy")
MID_STREAM = {"stream_error", "truncated"}




def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


async def start_sim(group: ProcessGroup, rid: str, port: int, seed: int, time_scale: float) -> Child:
    args = ["sim", "--port", str(port), "--gpu", "h100", "--model", "llama-3-8b", "--seed", str(seed),
            "--time-scale", str(time_scale), "--fault-injection"]
    return await group.start(rid, args, "sim listening")


async def inject_faults(group: ProcessGroup, sims: dict[str, Child], ports: dict[str, int], *, every: float,
                        hold: float, time_scale: float, rng: random.Random, log: list[dict],
                        stop: asyncio.Event) -> None:
    async with aiohttp.ClientSession() as http:
        i = 0
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), every)
                return
            except TimeoutError:
                pass
            rid = rng.choice(sorted(sims))
            fault = FAULTS[i % len(FAULTS)]
            i += 1
            url = f"http://127.0.0.1:{ports[rid]}"
            log.append({"t": round(time.monotonic(), 1), "replica": rid, "fault": fault})
            if fault == "kill":
                await group.stop(sims[rid], grace=0.1)
                await asyncio.sleep(hold)  # the replica stays dead for a while, then comes back
                sims[rid] = await start_sim(group, rid, ports[rid], rng.randrange(1000), time_scale)
                continue
            changes = {"errors": {"error_rate": 1.0}, "hang": {"hang": True}, "stall": {"stall_after_tokens": 3},
                       "slow": {"slowdown": 5.0}, "unhealthy": {"unhealthy": True}}[fault]
            async with http.post(url + "/sim/faults", json=changes):
                pass
            await asyncio.sleep(hold)
            async with http.delete(url + "/sim/faults"):
                pass


def classify(results: list[Result]) -> dict[str, int]:
    counts: Counter[str] = Counter()
    for r in results:
        counts["sent"] += 1
        if r.ok:
            counts["succeeded"] += 1
        else:
            counts["failed"] += 1
            counts[f"failed:{r.error}"] += 1
            counts["failed_midstream" if r.error in MID_STREAM else "failed_retryable"] += 1
    return dict(counts)


async def soak(args: argparse.Namespace) -> dict:
    from loadtest.router_overhead import machine

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    group = ProcessGroup()
    rng = random.Random(args.seed)
    fault_log: list[dict] = []
    try:
        ports = {f"sim-{i}": free_port() for i in range(args.replicas)}
        sims = {rid: await start_sim(group, rid, port, args.seed + i, args.time_scale)
                for i, (rid, port) in enumerate(ports.items())}
        config = {
            "listen": {"host": "127.0.0.1", "port": 0}, "admin": {"host": "127.0.0.1", "port": 0},
            "endpoints": [{"id": rid, "url": f"http://127.0.0.1:{port}", "models": ["llama-3-8b"]}
                          for rid, port in ports.items()],
            "policies": [{"name": "soak", "strategy": "least-connections",
                          "health": {"interval": "1s", "timeout": "500ms"},
                          "timeouts": {"firstByte": "5s", "idle": "3s"}, "retries": {"attempts": 3}}],
            "telemetry": {"interval": "500ms", "gpuSource": "sim"}, "redis": {"url": None},
            "logging": {"level": "info", "accessLog": False},
        }
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "router.yaml"
            path.write_text(yaml.safe_dump(config))
            router = await group.start("router", ["router", "--config", str(path)], "router listening")
            pid = router.process.pid
            rss_start = rss_mib(pid)
            plan = chat_sessions(model="llama-3-8b", rate=args.rate, duration=args.duration, seed=args.seed,
                                 output_median=24, output_max=64)
            stop = asyncio.Event()
            injector = asyncio.create_task(inject_faults(
                group, sims, ports, every=args.fault_every, hold=args.fault_every / 2, time_scale=args.time_scale,
                rng=rng, log=fault_log, stop=stop))
            done = 0

            def progress(_r: Result) -> None:
                nonlocal done
                done += 1
                if done % 100 == 0:
                    print(f"  {done}/{len(plan)} requests", file=sys.stderr, flush=True)

            results = await run_open_loop(listener_url(router, "ingress"), plan, timeout=60, on_done=progress)
            stop.set()
            await injector
            rss_end = rss_mib(pid)
            async with aiohttp.ClientSession() as http, http.get(listener_url(router, "admin") + "/metrics") as resp:
                metrics = await resp.text()
        def total(prefix: str, label: str = "") -> float:
            return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith(prefix) and label in line)

        retries = total("fleetroute_retries_total{")
        ejections = total("fleetroute_outlier_ejections_total{")
        budget = total("fleetroute_retry_budget_exhausted_total{")
        upstream = {kind: total("fleetroute_upstream_errors_total{", f'kind="{kind}"')
                    for kind in ("connect", "connect_timeout", "timeout", "http_5xx", "idle_timeout", "disconnect")}
        return {"started_utc": started, "machine": machine(), "seed": args.seed, "fault_every_s": args.fault_every,
                "duration_s": args.duration, "replicas": args.replicas, "rate": args.rate,
                "faults_injected": Counter(f["fault"] for f in fault_log), "requests": classify(results),
                "router_retries": retries, "router_retry_budget_exhausted": budget,
                "router_ejections": ejections, "router_upstream_errors": upstream,
                "router_rss_mib": {"start": round(rss_start, 1), "end": round(rss_end, 1)}}
    finally:
        await group.stop_all()


def render_markdown(report: dict) -> str:
    """A `--json` run as docs/benchmarks.md's table."""
    req, faults = report["requests"], report["faults_injected"]
    names = {"kill": "kills", "errors": "error bursts", "hang": "hangs", "stall": "stalls", "slow": "slowdowns",
             "unhealthy": "failed health checks"}
    sent, ok = req.get("sent", 0), req.get("succeeded", 0)
    rss = report["router_rss_mib"]
    rows = [
        ("requests sent", f"{sent:,}"),
        ("succeeded", f"{ok:,} ({ok / max(1, sent):.1%})"),
        ("failed before any byte reached the client (a router could have retried)",
         f"**{req.get('failed_retryable', 0):,}**"),
        ("failed mid-stream (a stalled or killed replica after tokens were delivered; ended with an error event, "
         "never retried)", f"{req.get('failed_midstream', 0):,}"),
        ("faults injected", ", ".join(f"{faults[f]} {names[f]}" for f in FAULTS if faults.get(f))),
        ("retries made by the router / refused by the retry budget",
         f"{report['router_retries']:,.0f} / {report['router_retry_budget_exhausted']:,.0f}"),
        ("outlier ejections", f"{report['router_ejections']:,.0f}"),
        ("router RSS at start / end", f"{rss['start']} MiB / {rss['end']} MiB"),
    ]
    m = report["machine"]
    head = (f"One run ({report['started_utc']}, {report['duration_s']:g} s at {report['rate']:g} requests/s, "
            f"{report['replicas']} replicas, a fault every {report['fault_every_s']:g} s, seed {report['seed']}; "
            f"{m.get('nproc')} CPUs, commit {m.get('commit')}):")
    return "\n".join([head, "", "| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=180.0, help="seconds of load (default 180)")
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--rate", type=float, default=12.0, help="requests per second (default 12)")
    parser.add_argument("--fault-every", type=float, default=6.0, help="seconds between faults (default 6)")
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    args = parser.parse_args()
    report = asyncio.run(soak(args))
    text = json.dumps(report, indent=2, default=dict)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
