"""The policy lab's `--json` run: what `python -m loadtest.publish` renders into docs/benchmarks.md is the
table the run printed, with the seeds, policies and commit it ran with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest.lab import main, render_record


def test_a_lab_run_written_as_json_renders_the_table_it_printed(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "lab" / "smoke.json"
    assert main(["loadtest/scenarios/smoke.yaml", "--fraction", "0.3", "--seeds", "2", "--policy",
                 "least-connections", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    record = json.loads(out.read_text())
    assert record["scenario"] == "smoke" and record["fraction"] == 0.3 and record["seeds"] == 2
    assert list(record["results"]) == ["round-robin", "adaptive", "least-connections"]
    assert all(len(runs) == 2 and all(r["p99"] >= r["p50"] > 0 for r in runs) for runs in record["results"].values())
    assert record["machine"]["commit"]
    assert render_record(record) in printed
    assert f"seeds 1-2; commit {record['machine']['commit']}" in printed
