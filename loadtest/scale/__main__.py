"""python -m loadtest.scale: see the package docstring (loadtest/scale/__init__.py)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.router_overhead import ROOT
from loadtest.scale import __doc__ as DOC
from loadtest.scale.fleet import FleetSettings, run_fleet
from loadtest.scale.ingest import IngestSettings, run_ingest
from loadtest.scale.micro import MicroSettings, pinned, run_micro
from loadtest.scale.report import machine_facts, render_markdown, write_plots
from loadtest.scale.services import workdir

PARTS = ("micro", "ingest", "fleet")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x)


def _words(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m loadtest.scale", description=DOC,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="short rounds and windows, fewer cases (a smoke run)")
    p.add_argument("--parts", type=_words, default=PARTS, help="comma-separated: micro,ingest,fleet (default all)")
    p.add_argument("--json", type=Path, default=None, help="result file (default loadtest/results/scale-<UTC>.json)")
    p.add_argument("--markdown", type=Path, default=None, help="also write the Markdown tables here")
    p.add_argument("--plots", type=Path, default=None, help="also write the PNG plots into this directory")
    p.add_argument("--sizes", type=_ints, default=None, help="fleet sizes (default 10,100,1000)")
    p.add_argument("--strategies", type=_words, default=None,
                   help="micro-benchmark: strategy labels to measure (default: every registered one + variants)")
    p.add_argument("--rounds", type=int, default=None, help="micro-benchmark rounds (default 5; quick 3)")
    p.add_argument("--agents", type=int, default=1000, help="ingestion: simulated agents (default 1000)")
    p.add_argument("--agent-processes", type=int, default=1,
                   help="ingestion: driver processes sharing the agents (default 1; ~0.7 ms CPU per publish)")
    p.add_argument("--hiredis-path", type=Path, default=None,
                   help="ingestion: also run with this directory on the router's PYTHONPATH (pip install --target "
                        "DIR hiredis): the C parser for an environment installed without it (a base dependency)")
    p.add_argument("--rates", type=_floats, default=None, help="rate sweep, req/s (default 100,200,400,800,1600)")
    p.add_argument("--size-rate", type=float, default=None, help="fleet-size sweep rate (default 400 req/s)")
    p.add_argument("--fleet-strategies", type=_words, default=None,
                   help="router sweeps: strategies (default adaptive,least-connections)")
    p.add_argument("--telemetry-modes", type=_words, default=None,
                   help="fleet-size sweep: off,embedded,redis (default all three)")
    p.add_argument("--sweeps", type=_words, default=("rate", "size"), help="router sweeps: rate,size (default both)")
    p.add_argument("--backend-ports", type=int, default=None,
                   help="router sweeps: endpoint i uses backend port i %% K (default: one port per endpoint)")
    p.add_argument("--router-cpus", default=None, help="taskset list for routers (default 0 on 2+ cores)")
    p.add_argument("--load-cpus", default=None,
                   help="taskset list for backend, Redis, agents and load (default 1 on 2+ cores)")
    args = p.parse_args(argv)
    unknown = set(args.parts) - set(PARTS)
    if unknown:
        p.error(f"unknown --parts {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if (os.cpu_count() or 1) >= 2 and shutil.which("taskset"):
        args.router_cpus = args.router_cpus or "0"
        args.load_cpus = args.load_cpus or "1"
    return args


def settings_from(args: argparse.Namespace) -> tuple[MicroSettings, IngestSettings, FleetSettings]:
    q = args.quick
    micro = MicroSettings(
        sizes=args.sizes or (10, 100, 1000), rounds=args.rounds or (3 if q else 5), target_s=0.02 if q else 0.2,
        strategies=args.strategies, max_sessions=200 if q else 1000,
    )
    ingest = IngestSettings(agents=args.agents, window_s=5 if q else 20, idle_s=3 if q else 10,
                            age_scrapes=3 if q else 5, driver_processes=args.agent_processes)
    fleet = FleetSettings(
        rates=args.rates or ((200, 800) if q else (100, 200, 400, 800, 1600)),
        sizes=args.sizes or ((10, 1000) if q else (10, 100, 1000)),
        size_rate=args.size_rate or (200 if q else 400),
        strategies=args.fleet_strategies or (("adaptive",) if q else ("adaptive", "least-connections")),
        telemetry_modes=args.telemetry_modes or ("off", "embedded", "redis"),
        backend_ports=args.backend_ports, sweeps=args.sweeps,
        seconds=1.5 if q else 5.0, idle_s=5.0 if q else 10.0, warmup=50 if q else 200,
    )
    return micro, ingest, fleet


def _terminate(signum: int, _frame: object) -> None:
    """SIGTERM (`timeout`, a CI runner) unwinds like Ctrl-C: the `finally` blocks stop every child by PID."""
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)
    raw = sys.argv[1:] if argv is None else argv
    args = parse_args(raw)
    micro_settings, ingest_settings, fleet_settings = settings_from(args)

    def say(msg: str) -> None:
        print(msg, flush=True)

    started = time.time()
    result: dict[str, Any] = {
        "command": shlex.join(["python", "-m", "loadtest.scale", *raw]),
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "quick": args.quick,
        "machine": machine_facts(),
        "pinning": {"router_cpus": args.router_cpus, "load_cpus": args.load_cpus},
    }
    say(f"machine: {result['machine']}")
    if "micro" in args.parts:
        say("micro-benchmark (pick, rebuild, refresh, burst):")
        # Alone on the routers' core: nothing else of ours runs meanwhile.
        with pinned(int(args.router_cpus.split(",")[0]) if args.router_cpus else None) as cpu:
            result["micro"] = run_micro(micro_settings, say)
            result["micro"]["cpu"] = cpu
    if args.load_cpus:  # from here on this process is a load generator
        os.sched_setaffinity(0, {int(c) for c in args.load_cpus.split(",")})
    with workdir() as tmp:
        if "ingest" in args.parts:
            say("telemetry ingestion through Redis:")
            runs = [run_ingest(ingest_settings, workdir=tmp, router_cpus=args.router_cpus,
                               load_cpus=args.load_cpus, say=say)]
            if args.hiredis_path is not None:
                with_c = IngestSettings(**{**ingest_settings.__dict__, "label": "hiredis",
                                           "router_env": (("PYTHONPATH", str(args.hiredis_path.resolve())),)})
                runs.append(run_ingest(with_c, workdir=tmp, router_cpus=args.router_cpus, load_cpus=args.load_cpus,
                                       say=say))
            result["ingest"] = runs
        if "fleet" in args.parts:
            say("router CPU against request rate and fleet size:")
            result["fleet"] = run_fleet(fleet_settings, workdir=tmp, router_cpus=args.router_cpus,
                                        load_cpus=args.load_cpus, say=say)
    result["elapsed_s"] = round(time.time() - started, 1)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(started))
    path = args.json or ROOT / "loadtest" / "results" / f"scale-{stamp}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    say(f"wrote {path} ({result['elapsed_s']} s)")
    if args.markdown is not None:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(render_markdown(result))
        say(f"wrote {args.markdown}")
    if args.plots is not None:
        for plot in write_plots(result, args.plots):
            say(f"wrote {plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
