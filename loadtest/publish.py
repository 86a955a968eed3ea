"""Fill docs/benchmarks.md's measured tables from the committed benchmark results, so no number there is typed
by hand and every one can be re-rendered and checked.

    python -m loadtest.publish        # after loadtest/benchmarks.sh; reads docs/results/

The document holds the prose; each measured block sits between two markers and is replaced whole:

    <!-- generated:seed-table -->  ...  <!-- /generated -->

Each block renders from one result under docs/results/ (`results_path`): a scenario's summary
(`scenarios/<name>.json`, the `summary.json` of `fleetroute loadtest`; its report and plots, the PNGs
written to docs/img/), `lab:<stem>` (`lab/<stem>.json`, a `python -m loadtest.lab --json` run), and
`overhead`, `scale`, `streams`, `faults`, `tenants`, `kv-ingest`, `batching-modes`, `soak` (`<name>.json`, each
benchmark's `--json`), `telemetry-deltas` (`telemetry-deltas/*.json`). A block whose results are missing is
left as it is, named, and the command exits 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- generated:(?P<name>[\w:.-]+) -->\n)(?P<body>.*?)(<!-- /generated -->)", re.S)


def _spread(d: dict[str, Any] | None, fmt: str = "{:,.2f}") -> str:
    if not d or d.get("median") != d.get("median"):  # missing or NaN
        return "-"
    text = fmt.format(d["median"])
    return text if d["min"] == d["max"] else f"{text} [{fmt.format(d['min'])}, {fmt.format(d['max'])}]"


def _ms(d: dict[str, Any], key: str) -> str:
    return f"{_spread(d[key])} ms" if d.get(key) else "-"


def overhead_table(record: dict[str, Any]) -> str:
    s, peers, versions = record["summary"], record.get("peer_summary", {}), record.get("peers", {})
    rows = [("fleetroute", "0.1.0", {
        "rps": s["router_rps"], "ratio_vs_direct": s["ratio"], "cpu_ms_per_req": s["router_cpu_ms_per_req"],
        "rps_per_core": s["router_rps_per_core"], "added_p50_ms": s["added_p50_ms"],
        "added_p99_ms": s["added_p99_ms"], "added_ttft_p50_ms": s["added_ttft_p50_ms"],
        "stream_cpu_ms": s.get("router_stream_cpu_ms")})]
    for spec, d in peers.items():
        rows.append((spec, str(versions.get(spec, {}).get("version", "")), d))
        if "epp_cpu_ms_per_req" in d or "epp_stream_cpu_ms" in d:  # the gateway path: its picker's share alone
            rows.append(("&nbsp;&nbsp;of which fleetroute epp", "",
                         {"cpu_ms_per_req": d.get("epp_cpu_ms_per_req"), "stream_cpu_ms": d.get("epp_stream_cpu_ms")}))
    tokens = record.get("settings", {}).get("stream_tokens")
    failed = record.get("peer_errors") or {}
    machine = record.get("machine", {})
    lines = [f"Direct to the backend: {_spread(s['direct_rps'], '{:,.0f}')} req/s. Median [min, max] of "
             f"{record.get('settings', {}).get('runs', '?')} runs, run {record.get('started_utc', '?')} "
             f"({machine.get('cpu_model', '?')}, commit {machine.get('commit', '?')}); other processes took "
             f"{_spread(s.get('foreign_cpu_util'), '{:.0%}')} of a core during the runs.",
             "",
             "| router | version | req/s (one core) | vs direct | CPU ms per request (= s per 1,000) | req/s per core "
             "| added p50 | added p99 | added TTFT p50 |"
             + (f" CPU ms per streamed request ({tokens} tokens) |" if tokens else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if tokens else "")]
    for name, version, d in rows:
        lines.append(
            f"| {name} | {version} | {_spread(d.get('rps'), '{:,.0f}')} "
            f"| {_spread(d.get('ratio_vs_direct'), '{:.3f}')} "
            f"| {_spread(d.get('cpu_ms_per_req'), '{:.3f}')} | {_spread(d.get('rps_per_core'), '{:,.0f}')} "
            f"| {_ms(d, 'added_p50_ms')} | {_ms(d, 'added_p99_ms')} | {_ms(d, 'added_ttft_p50_ms')} |"
            + (f" {_spread(d.get('stream_cpu_ms'), '{:.3f}')} |" if tokens else ""))
    lines += [f"\n{spec} failed: {error}" for spec, error in failed.items()]
    variants = list(record.get("raw", {}).get("variants", {}))
    if variants:
        lines += ["", "| fleetroute configuration | req/s | CPU ms per request | vs default, same run |",
                  "|---|---|---|---|",
                  f"| default: uvloop, access log on, `workers: 1`, one core | {_spread(s['router_rps'], '{:,.0f}')} "
                  f"| {_spread(s['router_cpu_ms_per_req'], '{:.3f}')} | 1 |"]
        for label in variants:
            lines.append(f"| {label} | {_spread(s.get(label + '_rps'), '{:,.0f}')} "
                         f"| {_spread(s.get(label + '_cpu_ms_per_req'), '{:.3f}')} "
                         f"| {_spread(s.get(label + '_vs_main'), '{:.2f}')} |")
    return "\n".join(lines) + "\n"


def results_path(name: str, results: Path) -> Path:
    """Where a block's committed results live under `results` (docs/results/ by default)."""
    if name.startswith("lab:"):
        return results / "lab" / f"{name[4:]}.json"
    if name == "telemetry-deltas":
        return results / name
    if name in ("overhead", "streams", "faults", "tenants", "kv-ingest", "scale", "batching-modes", "soak"):
        return results / f"{name}.json"
    return results / "scenarios" / f"{name}.json"  # a scenario's summary.json


def render(name: str, results: Path, images: Path) -> str | None:
    """The block's new text, or None when its results are not there."""
    images.mkdir(parents=True, exist_ok=True)
    path = results_path(name, results)
    if not path.exists():
        return None
    if name == "telemetry-deltas":  # committed A/B runs of the ingestion benchmark
        from loadtest.scale.report import render_ingest_ab

        runs = [(p.stem, json.loads(p.read_text())) for p in path.glob("*.json")]
        return render_ingest_ab(sorted(runs, key=lambda run: run[1]["started_utc"])) if runs else None
    result = json.loads(path.read_text())
    if name.startswith("lab:"):
        from loadtest.lab import render_record

        return render_record(result)
    if name == "overhead":
        return overhead_table(result)
    if name == "faults":
        from loadtest.faults import table

        commit = f", commit {result['machine']['commit']}" if "machine" in result else ""
        return table(result) + f"\nRun {result['started_utc']}{commit}; the whole result: `{_shown(path)}`.\n"
    if name == "tenants":
        from loadtest import tenants

        plot = tenants.write_plot(result, images)
        return tenants.render_markdown(result) + f"\n![{plot.stem}](img/{plot.name})\n"
    if name == "streams":
        from loadtest.streams import render_markdown, write_plot

        plot = write_plot(result, images)
        return render_markdown(result) + f"\n![{plot.stem}](img/{plot.name})\n"
    if name == "kv-ingest":
        from loadtest.kv_ingest import render_markdown as kv_ingest_markdown

        return kv_ingest_markdown(result) + f"\nThe whole result: `{_shown(path)}`.\n"
    if name == "batching-modes":
        from loadtest.batching_modes import render_record as batching_markdown

        return batching_markdown(result)
    if name == "soak":
        from loadtest.soak import render_markdown as soak_markdown

        return soak_markdown(result)
    if name == "scale":
        from loadtest.scale.report import render_markdown, write_plots

        plots = write_plots(result, images)
        text = render_markdown(result)
        return text + "\n" + "\n".join(f"![{p.stem}](img/{p.name})" for p in plots) + "\n"
    from loadtest.plots import write_plots as scenario_plots
    from loadtest.report import render_markdown as scenario_markdown

    plots = scenario_plots(result, images)
    return scenario_markdown(result, images=[f"img/{p.name}" for p in plots])


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def publish(doc: Path, results: Path, images: Path) -> list[str]:
    images.mkdir(parents=True, exist_ok=True)
    text = doc.read_text()
    missing: list[str] = []

    def fill(match: re.Match[str]) -> str:
        name = match.group("name")
        body = render(name, results, images)
        if body is None:
            missing.append(name)
            return match.group(0)
        return match.group(1) + body.rstrip() + "\n" + match.group(4)

    doc.write_text(BLOCK.sub(fill, text))
    return missing


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.publish", description=__doc__.split("\n\n")[0])
    p.add_argument("--doc", type=Path, default=ROOT / "docs" / "benchmarks.md")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results",
                   help="the committed results (default docs/results/)")
    p.add_argument("--images", type=Path, default=ROOT / "docs" / "img")
    args = p.parse_args(argv)
    missing = publish(args.doc, args.results, args.images)
    for name in missing:
        print(f"no results for block {name!r} (expected {_shown(results_path(name, args.results))}): "
              "left as it was", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
