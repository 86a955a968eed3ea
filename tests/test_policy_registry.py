"""The registry is the one list of strategies: the CLI's help, docs/policies.md and the explanations all follow it,
so adding a policy is its module, one line in BUILTIN and its tests, and nothing here can silently lag."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from router.routing.policies.base import Explained
from router.routing.policies.registry import BUILTIN, SENTENCES, sentence

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "router" / "routing" / "policies"


def test_the_cli_help_lists_every_registered_strategy() -> None:
    done = subprocess.run([sys.executable, "-m", "router", "router", "--help"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    line = done.stdout[done.stdout.index("strategy: adaptive"):]
    listed = re.findall(r"[a-z-]+", " ".join(line.split("\n")[:3]).split("adaptive", 1)[1].split("adaptive:")[0])
    assert [name for name in listed if name] == [policy.name for policy in BUILTIN]


def test_docs_have_a_summary_row_and_a_section_for_every_strategy() -> None:
    doc = (ROOT / "docs" / "policies.md").read_text()
    summary = doc[doc.index("## Summary"):doc.index("## Presets")]
    rows = re.findall(r"^\| `([a-z-]+)` \|", summary, re.M)
    sections = set(re.findall(r"^## ([a-z-]+)$", doc, re.M))
    names = [policy.name for policy in BUILTIN]
    assert rows == names
    assert set(names) <= sections


def test_every_reason_a_picker_gives_is_explained_by_a_sentence() -> None:
    given = set()
    for path in POLICIES.glob("*.py"):
        for line in path.read_text().splitlines():  # `trace.reason = "a" if ... else "b"`, and the guards' names
            if re.search(r"\breason = ", line) or re.search(r'return "load_guard_', line):
                given |= set(re.findall(r'"([a-z][a-z_]+)"', line))
    assert given, "no reasons found: the pattern above no longer matches the pickers' code"
    unexplained = given - set(SENTENCES)
    assert not unexplained, f"reasons without a sentence: {sorted(unexplained)}"


def test_a_sentence_is_written_from_the_trace() -> None:
    write = sentence("ring_walk")
    assert write is not None
    text = write(Explained(detail={"owner": "gpu-3"}, chosen={}, candidates=4, sampled=0))
    assert text == "the key's owner gpu-3 is excluded; the next endpoint on the ring"
    assert sentence("no_such_reason") is None
