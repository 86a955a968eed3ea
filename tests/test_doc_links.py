"""Every relative link in README.md and docs/*.md reaches a file that exists, and every anchor a heading of it.

Anchors follow GitHub's rule: the heading's text lower-cased, markdown markup removed, spaces to '-', every
character but letters, digits, '-' and '_' dropped; a repeated heading gets '-1', '-2', ... Links inside code
(fenced blocks and inline spans) are not links and are skipped; so are absolute URLs.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
# [text](target) or ![alt](target), the target without spaces, an optional "title" after it.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$", re.M)
HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code spans (replaced by blanks, so headings stay put)."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub(lambda m: " " + "\n" * m.group(0).count("\n"), text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), page.read_text())
    seen: Counter[str] = Counter()
    found = set(HTML_ANCHOR.findall(text))
    for _, heading in HEADING.findall(text):
        base = slug(heading)
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def links(page: Path) -> list[str]:
    prose = _prose(page.read_text())
    return LINK.findall(prose) + REFERENCE.findall(prose)


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http:, https:, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no file {file}")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == []


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Exit codes", "exit-codes"),
        ("`tenancy.fairness`: fair sharing", "tenancyfairness-fair-sharing"),
        ("Health, isolation and recovery", "health-isolation-and-recovery"),
        ("RoutingPolicy custom resource", "routingpolicy-custom-resource"),
        ("What `prefix_aware` does (v2)", "what-prefix_aware-does-v2"),
        ("A [linked](other.md) heading", "a-linked-heading"),
    ],
)
def test_anchors_follow_githubs_rule(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_broken_link_and_a_broken_anchor_are_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## Exit codes\n\n## Exit codes\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#exit-codes) [ok](other.md#exit-codes-1) [ok](#local) [web](https://example.com/x#y)\n"
        "`[code](missing.md)`\n\n```\n[code](missing.md)\n```\n\n## Local\n"
        "[gone](missing.md) [bad](other.md#exit-code) [self](#nowhere)\n"
    )
    assert [b.split(":")[0] for b in broken_links(page)] == ["missing.md", "other.md#exit-code", "#nowhere"]
