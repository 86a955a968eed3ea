"""docs/architecture.md's layout table names every package of router/ and worker/ and exactly the modules in it."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Generated or vendored code, described in its parent's row: Envoy's ext_proc stubs and the kubelet's PodResources.
GENERATED = ("router/gateway/envoy_api", "worker/podresources")


def _packages() -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for init in sorted([*ROOT.glob("router/**/__init__.py"), *ROOT.glob("worker/**/__init__.py")]):
        package = init.parent.relative_to(ROOT).as_posix()
        if package.startswith(GENERATED):
            continue
        found[package + "/"] = {p.stem for p in init.parent.glob("*.py") if p.name != "__init__.py"}
    return found


def _documented() -> dict[str, set[str]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("### Layout"):text.index("### What each module does")]
    rows = re.findall(r"^\| `((?:router|worker)/[a-z_/]*)` \|([^|]*)\|", section, re.M)
    return {package: set(re.findall(r"`([A-Za-z_]+)`", modules)) for package, modules in rows}


def test_the_layout_table_matches_the_folders() -> None:
    assert _documented() == _packages()
