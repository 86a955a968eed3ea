"""`fleetroute loadtest` end to end: a scenario that starts its own fleet, Redis, agents and routers (a small
copy of the seed table, run as a user would, as a child process), and load against a plain URL."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.cli import run_url

ROOT = Path(__file__).resolve().parent.parent


def fleetroute(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "router", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.timeout(240)
def test_the_smoke_scenario_runs_every_policy_at_every_point_and_writes_a_report(tmp_path: Path) -> None:
    out = tmp_path / "smoke"
    done = fleetroute("loadtest", "--scenario", "loadtest/scenarios/smoke.yaml", "--out", str(out), timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    runs = {(r["policy"], r["point"]): r for r in results["runs"]}
    assert set(runs) == {(p, i) for p in ("round-robin", "adaptive") for i in (0, 1)}
    for run in runs.values():
        s = run["summary"]
        assert s["sent"] > 0 and s["ok"] == s["sent"] and s["errors"] == {}, s
        assert s["ttft"]["p50"] is not None and s["ttft"]["p50"] > 0
        assert set(run["utilisation"]) == {"h100-0", "a100-80g-0"}
        assert all(0 <= u <= 1.0 for u in run["utilisation"].values())
        assert run["prefix_cache_hit_rate"] > 0  # every prompt starts with the same system prompt
        assert run["router_cpu"] is not None and run["error"] is None
    assert run["timeline"] and set(run["timeline"][0]["util"]) == {"h100-0", "a100-80g-0"}
    low, high = (p["rate"] for p in results["points"])
    assert high == pytest.approx(2 * low) and low == pytest.approx(0.3 * results["modelled_capacity"])
    report = (out / "report.md").read_text()
    assert "| round-robin |" in report and "| adaptive |" in report and "P99 TTFT" in report
    assert report in done.stdout  # printed too
    pngs = sorted(out.glob("*.png"))
    assert [p.name for p in pngs] == ["smoke-ttft-cdf.png", "smoke-utilisation.png", "smoke-vs-load.png"]
    assert all(p.read_bytes().startswith(b"\x89PNG") for p in pngs)
    # The report can be redrawn from the results alone.
    again = fleetroute("loadtest", "--render", str(out / "results.json"), "--out", str(tmp_path / "re"), timeout=60)
    assert again.returncode == 0 and (tmp_path / "re" / "report.md").read_text() == report


def test_a_bad_scenario_file_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("fleet: {replicas: [{gpu: h100}]}\nworkload: {kind: chat}\nload: {rates: [1], requests: 1}\n"
                   "policies: [round-robin]\nslo: {ttft: fast}\n")
    done = fleetroute("loadtest", "--scenario", str(bad), timeout=60)
    assert done.returncode == 2
    assert "slo.ttft: must be a positive duration" in done.stderr and "Traceback" not in done.stderr


def url_args(url: str, **overrides: object) -> argparse.Namespace:
    args = dict(url=url, model="sim-model", workload="{kind: chat, outputMedian: 8, outputMax: 16, promptMedian: 30}",
                arrivals="{process: poisson}", rates="40", concurrency=None, requests=12, timeout="30s",
                slo_ttft="1s", slo_itl="100ms", seed=1)
    args.update(overrides)
    return argparse.Namespace(**args)


async def test_open_loop_against_a_plain_url_measures_every_request(make_sim) -> None:
    sim = await make_sim(time_scale=0.05)
    [summary] = await run_url(url_args(sim.url + "/v1"))
    assert (summary["point"], summary["sent"], summary["ok"]) == (40.0, 12, 12)
    assert summary["ttft"]["p50"] > 0 and summary["itl"]["p50"] > 0 and summary["output_tokens_per_s"] > 0
    assert sim.server.engine.prompt_tokens_total > 12 * 20  # the prompts really reached the engine


async def test_closed_loop_keeps_the_given_number_of_users_busy(make_sim) -> None:
    sim = await make_sim(time_scale=0.05)
    summaries = await run_url(url_args(sim.url, rates=None, concurrency="1,4", requests=16))
    assert [(s["point"], s["sent"], s["ok"]) for s in summaries] == [(1.0, 16, 16), (4.0, 16, 16)]
    # Four users keep four requests in flight: the engine batches them, so they finish faster in all.
    one, four = summaries
    assert four["throughput_rps"] > 1.5 * one["throughput_rps"] and four["duration"] < one["duration"]
