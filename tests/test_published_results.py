"""Numbers anyone can check: every generated block of docs/benchmarks.md is what `python -m loadtest.publish`
renders from the results committed under docs/results/, each names a commit that exists, and `publish` fails
when a block's results are missing."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from loadtest.publish import BLOCK, main, render, results_path
from loadtest.runner import CDF_POINTS, compact

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "docs" / "results"
# Live runs of 2026-12-01 whose result files were not kept: published until loadtest/benchmarks.sh reruns them.
# A rerun that commits its results must take its block off this list (the test below says so).
AWAITING_RERUN = frozenset({
    "seed-table", "prefix-heavy", "no-sharing", "peers-heterogeneous", "peers-prefix-heavy",
    "peers-prefix-heavy-repeat", "peers-prefix-heavy-high", "scale",
})
# "commit 1a2b3c4" in a block's text, or a table's commit column ("| after-1 | 1a2b3c4+dirty router/ |").
COMMIT = re.compile(r"commit ([0-9a-f]{7,40})\b|^\| [\w-]+ \| ([0-9a-f]{7,40})(?:\+dirty[^|]*)? \|", re.M)
NO_COMMIT = frozenset({"faults"})  # run before loadtest/faults.py recorded its commit; published until its rerun


def blocks() -> dict[str, str]:
    return {m.group("name"): m.group("body") for m in BLOCK.finditer(DOC.read_text())}


def published() -> list[str]:
    return sorted(set(blocks()) - AWAITING_RERUN)


def test_exactly_the_blocks_awaiting_a_rerun_lack_committed_results() -> None:
    missing = {name for name in blocks() if not results_path(name, RESULTS).exists()}
    assert missing == AWAITING_RERUN, (
        f"blocks without results under docs/results/: {sorted(missing)}; expected {sorted(AWAITING_RERUN)} "
        "(a block whose results are now committed leaves AWAITING_RERUN)")


@pytest.mark.parametrize("name", published())
def test_the_published_block_is_what_its_committed_results_render(name: str, tmp_path: Path) -> None:
    rendered = render(name, RESULTS, tmp_path / "img")
    assert rendered is not None, f"docs/results/ has no results for the {name!r} block"
    assert blocks()[name] == rendered.rstrip() + "\n", (
        f"docs/benchmarks.md's {name!r} block differs from its results: run `python -m loadtest.publish`")


def _in_history(sha: str) -> bool:
    return subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=ROOT, capture_output=True).returncode == 0


@pytest.mark.parametrize("name", published())
def test_every_commit_a_published_block_names_exists(name: str) -> None:
    git = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True)
    if git.returncode != 0 or git.stdout.strip() != "false":
        pytest.skip("needs the repository's full history")
    named = {sha for pair in COMMIT.findall(blocks()[name]) for sha in pair if sha}
    if name in NO_COMMIT:
        assert not named, f"{name!r} names its commit now: take it off NO_COMMIT"
        return
    assert named, f"the {name!r} block names no commit"
    assert all(_in_history(sha) for sha in named), f"{name!r} names a commit not in the history: {sorted(named)}"


def test_publish_fails_naming_a_block_whose_results_are_missing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    results = tmp_path / "results"
    (results / "lab").mkdir(parents=True)
    lab = RESULTS / "lab" / "seed-table-0.6.json"
    (results / "lab" / lab.name).write_text(lab.read_text())
    doc = tmp_path / "benchmarks.md"
    doc.write_text("<!-- generated:lab:seed-table-0.6 -->\nold\n<!-- /generated -->\n"
                   "<!-- generated:lab:nothing-here -->\nkept\n<!-- /generated -->\n")
    args = ["--doc", str(doc), "--results", str(results), "--images", str(tmp_path / "img")]
    assert main(args) == 1
    assert "'lab:nothing-here'" in capsys.readouterr().err
    text = doc.read_text()
    assert "old" not in text and "Virtual-time lab: `seed-table` at 0.6" in text  # the rest is still filled
    assert "kept" in text  # the missing block is left as it was
    (results / "lab" / "nothing-here.json").write_text(lab.read_text())
    assert main(args) == 0


def test_a_scenario_summary_keeps_the_cdf_without_every_request(tmp_path: Path) -> None:
    ttft = [i / 1000 for i in range(5 * CDF_POINTS + 3, 0, -1)]
    summary = compact({"runs": [{"policy": "p", "ttft": ttft, "summary": {"sent": len(ttft)}}]})
    run = summary["runs"][0]
    assert len(run["ttft"]) <= CDF_POINTS and run["ttft"] == sorted(run["ttft"])
    stride = run["ttft_stride"]
    # The i-th value kept is the (i+1)*stride-th smallest: the CDF plot's height there is exact.
    assert all(v == pytest.approx(sorted(ttft)[(i + 1) * stride - 1]) for i, v in enumerate(run["ttft"]))
    assert len(json.dumps(summary)) < len(json.dumps(ttft)) / 4
