"""Numbers anyone can check: every generated block of docs/benchmarks.md whose results are committed (under
docs/results/) is what `python -m loadtest.publish` renders from them, so a table cannot drift from its run."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtest.publish import BLOCK, render

ROOT = Path(__file__).resolve().parent.parent
# Blocks rendered from docs/results/ (lab:<stem> from docs/results/lab/<stem>.md).
COMMITTED = ("streams", "faults", "tenants", "telemetry-deltas", "overhead", "kv-ingest", "lab:kv-prefix-heavy-0.8",
             "lab:kv-mooncake-conversation-0.6")


@pytest.mark.parametrize("name", COMMITTED)
def test_the_published_block_is_what_its_committed_results_render(name: str, tmp_path: Path) -> None:
    blocks = {m.group("name"): m.group("body") for m in BLOCK.finditer((ROOT / "docs" / "benchmarks.md").read_text())}
    # A results directory that does not exist: only what is committed in docs/results/ is read.
    rendered = render(name, tmp_path / "no-local-results", tmp_path / "img")
    assert rendered is not None, f"docs/results/ has no results for the {name!r} block"
    assert blocks[name] == rendered.rstrip() + "\n", f"docs/benchmarks.md's {name!r} block differs from its results"
