"""The batching-mode benchmark stays runnable, and its headline holds on a small seeded workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.batching_modes import main, percentile, render_record


def test_percentile_interpolates_between_ranks() -> None:
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert percentile([1.0, 2.0], 0.99) == pytest.approx(1.99)
    assert percentile([5.0], 0.99) == 5.0


def test_continuous_batching_out_serves_dynamic_and_static_under_overload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "results.json"
    assert main(["--requests", "300", "--rates", "2,96", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "| offered rate | mode |" in table
    record = json.loads(out.read_text())
    assert render_record(record) in table  # what publish renders is what the run printed
    results = {(r["rate"], r["mode"]): r for r in record["results"]}
    assert len(results) == 6
    # Light load: every mode keeps up, so throughput is the offered load; only waiting differs.
    light = [results["2 req/s", m]["req_s"] for m in ("continuous", "dynamic", "static")]
    assert max(light) / min(light) < 1.2
    assert results["2 req/s", "continuous"]["ttft_p50_s"] < results["2 req/s", "dynamic"]["ttft_p50_s"]
    # Overload: capacity, where iteration-level scheduling pays several times over.
    over = {m: results["96 req/s", m]["output_tok_s"] for m in ("continuous", "dynamic", "static")}
    assert over["continuous"] > 1.5 * over["dynamic"] > 1.5 * over["static"]
