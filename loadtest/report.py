"""A scenario's report: Markdown tables and PNG plots from its `results.json` (so a report can be redrawn
without rerunning: `fleetroute loadtest --render results.json`).

Capacity is the highest offered rate whose P99 TTFT is within the SLO: the last tested rate that passes
before the first one that fails, and, between those two, the rate where P99 TTFT crosses the SLO ("~"),
interpolated on log(P99) (P99 grows about exponentially towards saturation). A P99 that failed requests
reach counts as failing. Ratios compare each policy with the baseline (round-robin when the run has it, else
the first policy), all measured in the same run; a ratio is left out ("-") when either capacity lies outside
the sweep. Closed-loop runs (points are concurrencies, not rates) have no capacity column.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BASELINE = "round-robin"


@dataclass(frozen=True)
class Capacity:
    tested: float | None  # highest passing tested rate before the first failure; None: even the lowest fails
    interpolated: float | None  # where P99 TTFT crosses the SLO; None: no crossing inside the sweep
    all_pass: bool

    def text(self) -> str:
        if self.tested is None:
            return "below the sweep"
        if self.all_pass:
            return f">= {self.tested:,.1f}"
        if self.interpolated is not None:
            return f"{self.tested:,.1f} (~{self.interpolated:,.1f})"
        return f"{self.tested:,.1f}"

    @property
    def value(self) -> float | None:
        """The capacity to compare, or None when it lies outside the sweep (censored)."""
        if self.tested is None or self.all_pass:
            return None
        return self.interpolated if self.interpolated is not None else self.tested


def capacity(points: Sequence[tuple[float, float | None]], slo_ttft: float) -> Capacity:
    """`points`: (offered rate, P99 TTFT; None or infinite when failures reach the P99), any order."""
    ordered = sorted(points)
    last_pass: tuple[float, float] | None = None
    for rate, p99 in ordered:
        if p99 is not None and p99 <= slo_ttft:
            last_pass = (rate, p99)
            continue
        if last_pass is None:
            return Capacity(None, None, False)
        if p99 is None or math.isinf(p99):
            return Capacity(last_pass[0], None, False)
        r1, y1 = last_pass
        interpolated = None
        if p99 > y1 > 0:
            interpolated = r1 + (math.log(slo_ttft) - math.log(y1)) / (math.log(p99) - math.log(y1)) * (rate - r1)
        return Capacity(r1, interpolated, False)
    return Capacity(last_pass[0] if last_pass else None, None, last_pass is not None)


def ms_text(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if math.isinf(seconds):
        return "failed"  # failed requests reach this percentile
    return f"{seconds * 1000:,.0f} ms" if seconds < 10 else f"{seconds:,.1f} s"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or base is None or base == 0 or math.isinf(value) or math.isinf(base):
        return "-"
    return f"{value / base:.2f}x"


def _errors(summary: Mapping[str, Any]) -> str:
    errors = summary.get("errors") or {}
    return ", ".join(f"{k} {v}" for k, v in errors.items()) or "0"


def policies_of(results: Mapping[str, Any]) -> list[str]:
    seen: list[str] = []
    for run in results["runs"]:
        if run["policy"] not in seen:
            seen.append(run["policy"])
    return seen


def fixed_point(results: Mapping[str, Any]) -> int:
    """The index of the load point of the fixed-load table (the scenario's `load.fixed`, else the middle)."""
    load = results["scenario"]["load"]
    values = [p["value"] for p in results["points"]]
    fixed = load.get("fixed")
    if fixed is not None and fixed in values:
        return values.index(fixed)
    return len(values) // 2


def run_at(results: Mapping[str, Any], policy: str, point: int) -> Mapping[str, Any] | None:
    return next((r for r in results["runs"] if r["policy"] == policy and r["point"] == point), None)


def capacities(results: Mapping[str, Any]) -> dict[str, Capacity]:
    slo = results["scenario"]["slo"]["ttft"]
    out = {}
    for policy in policies_of(results):
        runs = [r for r in results["runs"] if r["policy"] == policy]
        out[policy] = capacity([(r["offered_rate"], r["summary"]["ttft"]["p99"]) for r in runs], slo)
    return out


def render_markdown(results: Mapping[str, Any], *, images: Sequence[str] = ()) -> str:
    sc = results["scenario"]
    fleet, load, slo = sc["fleet"], sc["load"], sc["slo"]
    policies = policies_of(results)
    base = BASELINE if BASELINE in policies else policies[0]
    fixed = fixed_point(results)
    fixed_rate = results["points"][fixed]["rate"]
    closed = load.get("mode") == "closed"
    caps = capacities(results)
    m = results["machine"]
    replicas = ", ".join(f"{g['count']} x {g['gpu']}" for g in fleet["replicas"])
    faults = "; ".join(f"{f['replica']} slowed {f['slowdown']:g}x" for f in fleet["faults"])
    workload = sc["workload"]
    params = ", ".join(f"{k}={v}" for k, v in workload["params"].items())
    trace = f", trace {Path(workload['trace_path']).name}" if workload.get("trace_path") else ""
    arrivals = sc["arrivals"]
    warmup = f", statistics after a {load['warmup']:g} s warm-up" if load["warmup"] else ""
    per_run = f"{load['requests']} requests" if load.get("requests") else f"{load['duration']:g} s of arrivals"
    arr = arrivals["process"] + (f" (CV {arrivals['cv']:g})" if arrivals["process"] == "gamma" else "")
    lines = [
        f"### Scenario `{sc['name']}`",
        "",
        sc["description"] or "",
        "",
        f"- **Fleet**: {replicas} (simulated vLLM, time scale {fleet['time_scale']:g}: one simulated second lasts "
        f"{fleet['time_scale']:g} wall seconds; all times below are simulated){'; ' + faults if faults else ''}. "
        f"Telemetry: {fleet['telemetry']}, every {fleet['telemetry_interval']:g} s (simulated).",
        f"- **Workload**: {workload['kind']}{trace}{' (' + params + ')' if params else ''}; arrivals {arr}; "
        f"{per_run} per run{warmup}.",
        f"- **SLO**: TTFT <= {ms_text(slo['ttft'])}, mean ITL <= {ms_text(slo['itl'])}. Modelled capacity "
        "(perfect balance, "
        f"virtual time): {results['modelled_capacity']:,.1f} req/s.",
        f"- **Machine**: {m.get('nproc')} CPUs ({m.get('cpu_model') or 'unknown'}), Python {m.get('python')}, "
        f"commit {m.get('commit')}.",
        "",
        f"| policy | capacity (req/s, P99 TTFT <= {ms_text(slo['ttft'])}) | vs {base} | TTFT p50 @ {fixed_rate:,.1f} "
        f"{'users' if closed else 'req/s'} "
        f"| TTFT p99 | vs {base} | goodput (req/s) | SLO met | util CV | prefix-cache hits | errors |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base_run = run_at(results, base, fixed)
    base_p99 = base_run["summary"]["ttft"]["p99"] if base_run else None
    for policy in policies:
        run = run_at(results, policy, fixed)
        if run is None:
            continue
        s = run["summary"]
        capacity_text = "- (closed loop)" if closed else caps[policy].text()
        lines.append(
            f"| {policy} | {capacity_text} | {_ratio(caps[policy].value, caps[base].value)} "
            f"| {ms_text(s['ttft']['p50'])} | {ms_text(s['ttft']['p99'])} | {_ratio(s['ttft']['p99'], base_p99)} "
            f"| {s['goodput_rps']:,.1f} | {_pct(s['slo_attainment'])} | {run['utilisation_cv']:.2f} "
            f"| {_pct(run['prefix_cache_hit_rate'])} | {_errors(s)} |"
        )
    lines += [
        "",
        "<details><summary>Every load point</summary>",
        "",
        f"| {'users' if closed else 'offered (req/s)'} | policy | arrived (req/s) | throughput (req/s) | output tok/s "
        "| goodput | SLO met | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | E2E p99 | util CV | prefix-cache hits "
        "| preemptions | errors | router CPU | client late p99 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for point, p in enumerate(results["points"]):
        for policy in policies:
            run = run_at(results, policy, point)
            if run is None:
                continue
            s = run["summary"]
            late = s.get("client_lateness_p99")
            cpu = run.get("router_cpu")
            lines.append(
                f"| {p['rate']:,.1f} | {policy} | {s.get('realised_rate', 0.0):,.1f} | {s['throughput_rps']:,.1f} "
                f"| {s['output_tokens_per_s']:,.0f} "
                f"| {s['goodput_rps']:,.1f} | {_pct(s['slo_attainment'])} | {ms_text(s['ttft']['p50'])} "
                f"| {ms_text(s['ttft']['p99'])} | {ms_text(s['itl']['p50'])} | {ms_text(s['itl']['p99'])} "
                f"| {ms_text(s['e2e']['p99'])} "
                f"| {run['utilisation_cv']:.2f} | {_pct(run['prefix_cache_hit_rate'])} | {run['preemptions']:,.0f} "
                f"| {_errors(s)} | {'-' if cpu is None else f'{cpu:.0%}'} "
                f"| {'-' if late is None else f'{late * 1000:,.0f} ms wall'} |"
            )
    lines += ["", "</details>", ""]
    lines += [f"![{Path(img).stem}]({img})" for img in images]
    return "\n".join(lines).rstrip() + "\n"


def write_report(results: Mapping[str, Any], out_dir: Path, *, image_prefix: str = "") -> list[Path]:
    """report.md and the PNG plots in `out_dir`; returns the files written. `image_prefix` is how report.md
    refers to the images (empty: beside it)."""
    from loadtest.plots import write_plots

    out_dir.mkdir(parents=True, exist_ok=True)
    images = write_plots(results, out_dir)
    report = out_dir / "report.md"
    report.write_text(render_markdown(results, images=[image_prefix + p.name for p in images]))
    return [report, *images]
