"""The tenant-fairness benchmark (loadtest/tenants.py): run tiny, a flooding tenant cannot shed or delay a light
one with fairness on and does with it off (tests/test_published_results.py checks the published table)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(240)
def test_a_flooding_tenant_sheds_and_delays_a_light_one_only_without_fairness(tmp_path: Path) -> None:
    out = tmp_path / "tenants.json"
    # 5 s of warm-up: the heavy tenant's excess (1.5 x capacity) fills the 64-place queue within about 3.5 s.
    done = subprocess.run(
        [sys.executable, "-m", "loadtest.tenants", "--duration", "11", "--warmup", "5", "--calibration", "40",
         "--json", str(out)],
        capture_output=True, text=True, cwd=ROOT, timeout=220, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(out.read_text())["runs"]
    on, off = runs["on"]["light"], runs["off"]["light"]
    assert on["sent"] >= 10 and on["sent"] == off["sent"]  # the same arrivals both times
    # With fairness every light request is served, although the heavy tenant keeps the queue full and loses
    # its own requests (queue_full, or evicted by a light newcomer)...
    assert on["served"] == on["sent"] and on["shed_by_reason"] == {}
    assert sum(runs["on"]["heavy"]["shed_by_reason"].values()) > 0
    # ...without it the light tenant is shed with the heavy one, and the requests it gets in wait behind the
    # whole queue: its P99 TTFT is several times longer (8 times in the published run).
    assert off["shed_by_reason"].get("queue_full", 0) > 0
    assert off["ttft_p99_s"] > 2 * on["ttft_p99_s"]

