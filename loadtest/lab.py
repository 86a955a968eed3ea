"""The policy lab: a scenario's fleet and workload in virtual time (loadtest/fleetsim.py), over several seeds.

    python -m loadtest.lab loadtest/scenarios/seed-table.yaml --fraction 0.6 --seeds 5 \\
        --policy 'adaptive-best-score={"strategy": "adaptive", "adaptive": {"selection": "best-score"}}'

The scenario's own fleetroute policies run, plus any `--policy` (or only those, with `--only`). Each seed
draws new arrivals and requests; every policy gets the same ones per seed. It prints, per
policy, P50 and P99 TTFT for each seed, the median P99, goodput (requests per simulated second meeting the
scenario's SLO: TTFT and mean ITL) with the share that met it, and the measured prefix-cache hit rate, as a
Markdown table (`--markdown PATH` writes it too; `--json PATH` writes the run: its settings, every policy's
numbers per seed, the machine and commit, which `python -m loadtest.publish` renders into
docs/benchmarks.md). When any policy reads
the precise prefix index (`prefixAware: {index: precise}`), every policy of the run gets the engines' KV
events fed to it (loadtest/fleetsim.py, "KV events"), so all see the same requests. Seconds per policy and
seed instead of minutes: use it to explore, then confirm with `fleetroute loadtest --scenario`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from loadtest.fleetsim import KVEventFeed, simulate
from loadtest.runner import build_plan, modelled_capacity
from loadtest.scenario import Scenario, load_scenario
from loadtest.stats import percentile, warmup_start
from router.routing.policies.registry import PolicyRegistry
from worker.sim.engine import EngineConfig

CONFIG_KEYS = frozenset(p.config_key for p in PolicyRegistry().all())  # the strategies' parameter blocks


def parse_policy(text: str) -> tuple[str, str, dict[str, Any]]:
    """`adaptive` or `label={"strategy": ..., "<block>": {...}}` -> (label, strategy, params)."""
    label, sep, spec = text.partition("=")
    if not sep:
        return label, label, {}
    entry = json.loads(spec)
    strategy = entry.pop("strategy")
    unknown = sorted(set(entry) - CONFIG_KEYS)
    if unknown or len(entry) > 1:
        raise ValueError(f"policy {label!r}: give one strategy block ({', '.join(sorted(CONFIG_KEYS))}), "
                         f"got {', '.join(sorted(entry))}")
    return label, strategy, next(iter(entry.values()), {})


def scenario_policies(scenario: Scenario) -> list[tuple[str, str, dict[str, Any]]]:
    """The scenario's fleetroute policies as (label, strategy, strategy parameters); peers are live only."""
    out = []
    for entry in scenario.policies:
        if entry.peer is not None:
            continue
        unmodelled = sorted(set(entry.config) - {"name", "models", "strategy", *CONFIG_KEYS})
        if unmodelled:
            raise ValueError(f"policy {entry.label!r}: the lab models the picker only, not {', '.join(unmodelled)}")
        strategy = entry.config.get("strategy", "adaptive")
        block = next((v for k, v in entry.config.items() if k in CONFIG_KEYS), None) or {}
        out.append((entry.label, strategy, dict(block)))
    return out


def reads_kv_events(params: dict[str, Any]) -> bool:
    return params.get("index") == "precise"


def run(scenario_path: str, fraction: float, seeds: int, policies: list[str],
        *, with_scenario_policies: bool = True) -> dict[str, list[dict[str, float]]]:
    base = load_scenario(scenario_path)
    if base.fleet.faults:
        raise ValueError("the lab models no faults: run a degraded-node scenario live")
    capacity = modelled_capacity(base)
    results: dict[str, list[dict[str, float]]] = {}
    parsed = (scenario_policies(base) if with_scenario_policies else []) + [parse_policy(p) for p in policies]
    kv_events = any(reads_kv_events(params) for _, _, params in parsed)
    slo = base.slo
    f = base.fleet
    engine = EngineConfig(max_num_seqs=f.max_num_seqs, max_num_batched_tokens=f.max_num_batched_tokens,
                          enable_prefix_caching=f.prefix_caching)
    for seed in range(1, seeds + 1):
        scenario = dataclasses.replace(base, seed=seed)
        plan = build_plan(scenario, fraction * capacity)
        for label, strategy, params in parsed:
            outcomes = simulate(plan, scenario.fleet.replica_ids(), strategy=strategy, params=params,
                                telemetry_interval=scenario.fleet.telemetry_interval, engine=engine,
                                weights=scenario.fleet.weights(), seed=seed,
                                kv_events=KVEventFeed() if kv_events else None)
            start = warmup_start([o.planned.at for o in outcomes], scenario.load.warmup)
            kept = [o for o in outcomes if o.planned.at >= start and o.ttft is not None]
            ttft = [o.ttft for o in kept if o.ttft is not None]
            good = sum(1 for o in kept if o.ttft is not None and o.ttft <= slo.ttft
                       and (not o.itl or statistics.fmean(o.itl) <= slo.itl))
            # Over the time the window's work took (loadtest/stats.py's `span`): never above what was served.
            span = max((o.planned.at + (o.e2e or 0.0) for o in kept), default=start) - start
            results.setdefault(label, []).append({
                "p50": percentile(ttft, 50) or 0.0, "p99": percentile(ttft, 99) or 0.0,
                "hit": sum(o.cached_tokens for o in kept) / max(1, sum(o.prompt_tokens for o in kept)),
                "slo_met": good / max(1, len(kept)), "goodput": good / span if span > 0 else 0.0,
            })
    return results


def title(record: dict[str, Any]) -> str:
    return (f"Virtual-time lab: `{record['scenario']}` at {record['fraction']:g} of the modelled capacity, "
            f"seeds 1-{record['seeds']}" + (f"; commit {record['machine']['commit']}" if "machine" in record else ""))


def render_record(record: dict[str, Any]) -> str:
    """A `--json` run as the Markdown table docs/benchmarks.md shows."""
    return render(record["results"], title(record))


def render(results: dict[str, list[dict[str, float]]], title: str) -> str:
    lines = [title, "", "| policy | TTFT p50 per seed (ms) | TTFT p99 per seed (ms) | median p99 "
             "| goodput (req/s, median) | SLO met | prefix-cache hits |", "|---|---|---|---|---|---|---|"]
    for label, runs in results.items():
        p50 = " / ".join(f"{r['p50'] * 1000:,.0f}" for r in runs)
        p99 = " / ".join(f"{r['p99'] * 1000:,.0f}" for r in runs)
        median = statistics.median(r["p99"] for r in runs) * 1000
        hits = statistics.fmean(r["hit"] for r in runs)
        if all("goodput" in r for r in runs):
            goodput = f"{statistics.median(r['goodput'] for r in runs):,.1f}"
            met = f"{statistics.fmean(r['slo_met'] for r in runs):.0%}"
        else:  # a run from before the lab measured them
            goodput = met = "-"
        lines.append(f"| {label} | {p50} | {p99} | **{median:,.0f} ms** | {goodput} | {met} | {hits:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.lab", description=__doc__.split("\n\n")[0])
    p.add_argument("scenario")
    p.add_argument("--fraction", type=float, default=0.6, help="offered load, of the modelled capacity")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--policy", action="append", default=[],
                   help='a policy besides the scenario\'s: a strategy name, or label={"strategy": ..., '
                        '"<block>": {...}} (repeat)')
    p.add_argument("--only", action="store_true", help="only the --policy ones, not the scenario's")
    p.add_argument("--markdown", metavar="PATH")
    p.add_argument("--json", metavar="PATH", help="write the run (settings, results, machine, commit) as JSON")
    args = p.parse_args(argv)
    from loadtest.router_overhead import machine

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    facts = machine()  # the commit whose code this process imported, before a long run
    results = run(args.scenario, args.fraction, args.seeds, args.policy, with_scenario_policies=not args.only)
    record = {"scenario": Path(args.scenario).stem, "fraction": args.fraction, "seeds": args.seeds,
              "policies": args.policy, "only": args.only, "started_utc": started, "machine": facts,
              "results": results}
    text = render_record(record)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
