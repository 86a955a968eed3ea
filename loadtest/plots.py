"""PNG plots of a scenario's results (matplotlib, headless): TTFT distributions at the fixed load, goodput and
P99 TTFT against offered load, and each replica's utilisation over time under each policy."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loadtest.report import fixed_point, policies_of, run_at


def _pyplot():  # noqa: ANN202 - the matplotlib module
    import matplotlib

    matplotlib.use("Agg")  # no display: render straight to PNG
    import matplotlib.pyplot as plt

    return plt


def write_plots(results: Mapping[str, Any], out_dir: Path) -> list[Path]:
    name = results["scenario"]["name"]
    written = [_ttft_cdf(results, out_dir / f"{name}-ttft-cdf.png")]
    if len(results["points"]) > 1:
        written.append(_versus_load(results, out_dir / f"{name}-vs-load.png"))
    written.append(_utilisation(results, out_dir / f"{name}-utilisation.png"))
    return written


def _ttft_cdf(results: Mapping[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fixed = fixed_point(results)
    rate = results["points"][fixed]["rate"]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for policy in policies_of(results):
        run = run_at(results, policy, fixed)
        if run is None or not run["ttft"]:
            continue
        values = sorted(run["ttft"])
        stride = run.get("ttft_stride", 1)  # a committed summary keeps every stride-th order statistic
        n = max(run["summary"]["sent"], len(values) * stride)  # failed requests never reach the top of the curve
        ax.plot([v * 1000 for v in values], [(i + 1) * stride / n for i in range(len(values))], label=policy,
                linewidth=1.4)
    slo = results["scenario"]["slo"]["ttft"] * 1000
    ax.axvline(slo, color="grey", linestyle=":", linewidth=1)
    ax.text(slo, 0.02, " SLO", color="grey", fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (ms, simulated, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"{results['scenario']['name']}: TTFT distribution at {rate:,.1f} req/s")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _versus_load(results: Mapping[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for policy in policies_of(results):
        runs = sorted((r for r in results["runs"] if r["policy"] == policy), key=lambda r: r["offered_rate"])
        rates = [r["offered_rate"] for r in runs]
        left.plot(rates, [r["summary"]["goodput_rps"] for r in runs], marker="o", label=policy, linewidth=1.4)
        p99 = [r["summary"]["ttft"]["p99"] for r in runs]
        p99 = [None if y is not None and math.isinf(y) else y for y in p99]  # failed requests reach the P99
        right.plot([x for x, y in zip(rates, p99, strict=True) if y is not None],
                   [y * 1000 for y in p99 if y is not None], marker="o", label=policy, linewidth=1.4)
    lo, hi = min(p["rate"] for p in results["points"]), max(p["rate"] for p in results["points"])
    left.plot([lo, hi], [lo, hi], color="grey", linestyle=":", linewidth=1, label="offered")
    left.set_xlabel("offered load (req/s, simulated)")
    left.set_ylabel("goodput (req/s meeting the SLO)")
    left.set_title("goodput vs offered load")
    slo = results["scenario"]["slo"]["ttft"] * 1000
    right.axhline(slo, color="grey", linestyle=":", linewidth=1)
    right.set_yscale("log")
    right.set_xlabel("offered load (req/s, simulated)")
    right.set_ylabel("P99 TTFT (ms, log scale)")
    right.set_title("P99 time to first token vs offered load")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(results["scenario"]["name"])
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _smooth(values: list[float], width: int) -> list[float]:
    """A trailing moving average: one sample is the busy fraction of a short window, mostly 0 or 1."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= width:
            total -= values[i - width]
        out.append(total / min(i + 1, width))
    return out


def _utilisation(results: Mapping[str, Any], path: Path) -> Path:
    plt = _pyplot()
    fixed = fixed_point(results)
    policies = [p for p in policies_of(results) if run_at(results, p, fixed) is not None]
    cols = min(3, len(policies)) or 1
    rows = (len(policies) + cols - 1) // cols or 1
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False, sharey=True)
    gpus: list[str] = []
    for ax, policy in zip(axes.flat, policies, strict=False):
        run = run_at(results, policy, fixed)
        assert run is not None
        timeline = run["timeline"]
        times = [t["t"] for t in timeline]
        width = max(1, len(timeline) // 30)  # about 30 independent points across the run
        replicas = sorted(run["utilisation"])
        gpus = sorted({r.rsplit("-", 1)[0] for r in replicas})
        for gpu in gpus:
            mine = [r for r in replicas if r.rsplit("-", 1)[0] == gpu]
            series = {r: _smooth([min(1.0, t["util"].get(r, 0.0)) * 100 for t in timeline], width) for r in mine}
            for r in mine:  # each replica faint, the GPU type's mean bold
                ax.plot(times, series[r], linewidth=0.6, alpha=0.35, color=_replica_colour(r, replicas))
            mean = [sum(series[r][i] for r in mine) / len(mine) for i in range(len(times))]
            ax.plot(times, mean, linewidth=2.0, color=_replica_colour(mine[-1], replicas), label=f"{gpu} (mean)")
        ax.set_title(f"{policy} (util CV {run['utilisation_cv']:.2f})", fontsize=9)
        ax.set_ylim(0, 105)
        ax.grid(True, alpha=0.3)
    for ax in axes.flat[len(policies):]:
        ax.axis("off")
    for ax in axes[:, 0]:
        ax.set_ylabel("GPU busy (%)")
    for ax in axes[-1, :]:
        ax.set_xlabel("simulated seconds")
    axes.flat[0].legend(fontsize=7, loc="lower left")
    rate = results["points"][fixed]["rate"]
    fig.suptitle(f"{results['scenario']['name']}: per-replica GPU utilisation at {rate:,.1f} req/s "
                 "(thin: each replica, moving average; bold: mean per GPU type)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _replica_colour(rid: str, replicas: list[str]) -> Any:
    """Replicas of the same GPU type share a colour family, so a heterogeneous fleet reads at a glance."""
    import matplotlib

    gpu = rid.rsplit("-", 1)[0]
    gpus = sorted({r.rsplit("-", 1)[0] for r in replicas})
    maps = ["Blues", "Oranges", "Greens", "Purples", "Reds", "Greys"]
    same = [r for r in replicas if r.rsplit("-", 1)[0] == gpu]
    shade = 0.45 + 0.5 * (same.index(rid) / max(len(same) - 1, 1))
    return matplotlib.colormaps[maps[gpus.index(gpu) % len(maps)]](shade)
