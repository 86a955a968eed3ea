"""`fleetroute loadtest`: drive load at any OpenAI-compatible URL, or run a scenario file end to end.

    fleetroute loadtest --url http://127.0.0.1:8080 --model llama-3-8b --rates 2,4,8 --requests 200
    fleetroute loadtest --scenario loadtest/scenarios/seed-table.yaml          # starts its own fleet
    fleetroute loadtest --render loadtest/results/seed-table-.../results.json  # redraw a report

With `--url`, nothing is started: the load goes to that server, times are wall-clock, and the summary is
printed (and written with `--json`). With `--scenario`, the harness starts the simulated fleet, Redis, the
agents and each router itself, runs every policy on the same arrivals and writes `results.json`, `report.md`
and PNG plots to `--out` (default `loadtest/results/<scenario>-<UTC time>/`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from router.config.settings import ConfigError

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "loadtest",
        help="load-test an OpenAI-compatible URL, or run a scenario (fleet + routers + report)",
        description="Drive load at any OpenAI-compatible URL (--url), or run a scenario file end to end: a simulated "
        "fleet, Redis, agents and each router, the same arrivals for every policy, a report with plots (--scenario).",
        epilog="Scenario files: loadtest/scenarios/*.yaml (format: loadtest/scenario.py, docs/benchmarks.md).",
    )
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--scenario", metavar="FILE", help="run a scenario file end to end")
    what.add_argument("--url", help="send the load to this OpenAI-compatible base URL (e.g. http://host:8080)")
    what.add_argument("--render", metavar="RESULTS", help="redraw the report of a scenario's results.json")
    p.add_argument("--out", metavar="DIR", help="where a scenario's results, report and plots go")
    p.add_argument("--policies", help="scenario: run only these policies (comma-separated labels)")
    p.add_argument("--gateway", choices=("router", "envoy", "both"), default="router",
                   help="scenario: fleetroute's data path: its router (default), real Envoy with `fleetroute epp` "
                        "deciding (labels gain ' via envoy'), or both, each policy on the same arrivals")
    p.add_argument("--extend", action="store_true",
                   help="scenario: keep --out's earlier results and run only what they lack (new load points or "
                        "policies; a policy that missed the SLO at a lower rate is not run higher)")
    url = p.add_argument_group("with --url")
    url.add_argument("--model", help="model name to send (required with --url)")
    url.add_argument("--workload", default="{kind: chat}",
                     help="workload as inline YAML, e.g. '{kind: sessions, outputMedian: 64}' (default chat)")
    url.add_argument("--arrivals", default="{process: poisson}",
                     help="arrival process as inline YAML, e.g. '{process: gamma, cv: 3}' (default poisson)")
    url.add_argument("--rates", help="comma-separated offered rates, requests/s (open loop)")
    url.add_argument("--concurrency", help="comma-separated virtual users per point (closed loop)")
    url.add_argument("--requests", type=int, default=200, help="requests per point (default 200)")
    url.add_argument("--timeout", default="120s", help="per-request timeout (default 120s)")
    url.add_argument("--slo-ttft", default="1s", help="SLO: time to first token (default 1s)")
    url.add_argument("--slo-itl", default="100ms", help="SLO: mean inter-token latency (default 100ms)")
    url.add_argument("--seed", type=int, default=1)
    url.add_argument("--json", metavar="PATH", help="write the summaries as JSON here")
    p.set_defaults(func=main)


def _fail(message: str) -> int:
    print(f"fleetroute loadtest: error: {message}", file=sys.stderr)
    return 2


def _inline(text: str, what: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(what, f"not valid inline YAML: {getattr(exc, 'problem', exc)}") from None


def url_scenario(args: argparse.Namespace) -> Any:
    """The --url flags as a scenario (no fleet), validated by the scenario parser."""
    from loadtest.scenario import parse_scenario

    if not args.model:
        raise ConfigError("--model", "is required with --url")
    load: dict[str, Any] = {"requests": args.requests, "timeout": args.timeout}
    if args.concurrency:
        load.update(mode="closed", concurrency=[_int(v, "--concurrency") for v in args.concurrency.split(",")])
    elif args.rates:
        load["rates"] = [_float(v, "--rates") for v in args.rates.split(",")]
    else:
        raise ConfigError("--rates", "give --rates (open loop) or --concurrency (closed loop)")
    raw = {"name": "url", "seed": args.seed, "fleet": {"model": args.model, "timeScale": 1},
           "workload": _inline(args.workload, "--workload"), "arrivals": _inline(args.arrivals, "--arrivals"),
           "load": load, "policies": ["round-robin"], "slo": {"ttft": args.slo_ttft, "itl": args.slo_itl}}
    return parse_scenario(raw)


def _int(text: str, flag: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(flag, f"must be integers, got {text!r}") from None


def _float(text: str, flag: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ConfigError(flag, f"must be numbers, got {text!r}") from None


async def run_url(args: argparse.Namespace) -> list[dict[str, Any]]:
    from loadtest.client import run_closed_loop, run_open_loop
    from loadtest.progress import Progress
    from loadtest.runner import build_plan
    from loadtest.stats import summarise

    scenario = url_scenario(args)
    base = args.url.rstrip("/").removesuffix("/v1")
    points = scenario.load.points
    progress = Progress(len(points))
    summaries = []
    for index, value in enumerate(points):
        plan = build_plan(scenario, value)
        started = time.monotonic()
        done = 0
        label = f"{value:g} {'users' if scenario.load.mode == 'closed' else 'req/s'}"

        def on_done(_r: Any, index: int = index, label: str = label, started: float = started,
                    total: int = len(plan)) -> None:
            nonlocal done
            done += 1
            progress.show(index + 1, label, done, total, started)

        if scenario.load.mode == "closed":
            results = await run_closed_loop(base, plan, concurrency=int(value), timeout=scenario.load.timeout,
                                            on_done=on_done)
        else:
            results = await run_open_loop(base, plan, timeout=scenario.load.timeout, on_done=on_done)
        progress.show(index + 1, label, done, len(plan), started, force=True)
        summaries.append({"point": value, **summarise(results, offered_rate=value, slo=scenario.slo,
                                                      closed=scenario.load.mode == "closed").to_json()})
    progress.finish()
    return summaries


def print_summaries(summaries: list[dict[str, Any]], closed: bool) -> None:
    from loadtest.report import ms_text

    head = (f"{'users' if closed else 'offered'}  {'sent':>6} {'ok':>6} {'req/s':>7} {'tok/s':>8} {'goodput':>8} "
            f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'E2E p99':>9}  errors")
    print(head)
    print("-" * len(head))
    for s in summaries:
        errors = ", ".join(f"{k} {v}" for k, v in s["errors"].items()) or "0"
        print(f"{s['point']:>7g}  {s['sent']:>6} {s['ok']:>6} {s['throughput_rps']:>7.1f} "
              f"{s['output_tokens_per_s']:>8.0f} {s['goodput_rps']:>8.1f} {ms_text(s['ttft']['p50']):>9} "
              f"{ms_text(s['ttft']['p99']):>9} {ms_text(s['itl']['p50']):>8} {ms_text(s['itl']['p99']):>8} "
              f"{ms_text(s['e2e']['p99']):>9}  {errors}")


LIVE_REPLICAS = 64  # simulated engines, agents and their ports on one machine


async def run_scenario_file(args: argparse.Namespace) -> Path:
    from loadtest.report import write_report
    from loadtest.runner import run_scenario
    from loadtest.scenario import load_scenario, with_gateway

    scenario = load_scenario(args.scenario)
    if (replicas := len(scenario.fleet.replica_ids())) > LIVE_REPLICAS:
        raise ConfigError("fleet.replicas", f"{replicas} replicas: a live run starts a process per replica and "
                          f"takes at most {LIVE_REPLICAS} (the policy lab, python -m loadtest.lab, takes more)")
    scenario = dataclasses.replace(scenario, policies=with_gateway(scenario.policies, args.gateway))
    only = [p.strip() for p in args.policies.split(",")] if args.policies else None
    known = [e.label for e in scenario.policies]
    if only and (unknown := [p for p in only if p not in known]):
        raise ConfigError("--policies", f"not in the scenario: {', '.join(unknown)} (it has: {', '.join(known)})")
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = Path(args.out) if args.out else RESULTS_DIR / f"{scenario.name}-{stamp}"
    if args.extend and not args.out:
        raise ConfigError("--extend", "needs --out, the directory of the run to extend")
    results = await run_scenario(scenario, out, policies=only, log=lambda m: print(m, file=sys.stderr),
                                 extend=args.extend)
    files = write_report(results.to_json(), out)
    print(files[0].read_text())
    print(f"results, report and plots in {out}", file=sys.stderr)
    return out


def main(args: argparse.Namespace) -> int:
    from loadtest.processes import ChildFailed

    try:
        if args.render:
            from loadtest.report import write_report

            path = Path(args.render)
            results = json.loads(path.read_text())
            files = write_report(results, Path(args.out) if args.out else path.parent)
            print(files[0].read_text())
            return 0
        if args.url:
            summaries = asyncio.run(interruptible(run_url(args)))
            if summaries is None:
                return 130
            print_summaries(summaries, closed=bool(args.concurrency))
            if args.json:
                Path(args.json).write_text(json.dumps(summaries, indent=1))
            return 0
        return 0 if asyncio.run(interruptible(run_scenario_file(args))) is not None else 130
    except ConfigError as exc:
        return _fail(str(exc))
    except (OSError, ValueError, KeyError) as exc:
        return _fail(f"{type(exc).__name__}: {exc}")
    except ChildFailed as exc:
        print(f"fleetroute loadtest: a process of the fleet failed: {exc}", file=sys.stderr)
        return 1


async def interruptible(coro: Any) -> Any:
    """Run `coro`; the first SIGINT/SIGTERM cancels it, and its cleanup stops every child process before we
    return (None). Later signals do not cancel the cleanup itself: they only say it is under way."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()

    def first_signal() -> None:
        task.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, lambda: print("still stopping the fleet's processes ...", file=sys.stderr))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, first_signal)
    try:
        return await task
    except asyncio.CancelledError:
        print("\ninterrupted; every process this run started has been stopped.", file=sys.stderr)
        return None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
