"""The scorer contract (router/routing/policies/scorers.py) and registry: one clamp, in the composite, so a scorer's
out-of-range output cannot distort a pick; names and the docs' table from the registry."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from router.model import EndpointView
from router.routing.loads import LoadTracker
from router.routing.policies.base import DecisionTrace, PolicyConfigError
from router.routing.policies.composite import CompositePolicy
from router.routing.policies.scorer_registry import BUILTIN, SCORERS, ScorerRegistry
from router.routing.policies.scorers import At, ScorerSpec
from router.runtime.metrics import RouterMetrics
from router.server.explain import Attempt, summarise
from tests.test_policies import FixedLoads, req, tel, views

DOCS = Path(__file__).resolve().parent.parent / "docs" / "policies.md"


class Fixed:
    """A snapshot scorer that returns what it is told per endpoint, however wild."""

    reads = "what the test says"
    formula = "given"
    fields = ()
    per_request = False
    shape = None
    uses_telemetry = False
    counts_queued = False

    def __init__(self, name: str, values: Mapping[str, float]) -> None:
        self.name = name
        self.values = values

    def parse(self, body: Mapping[str, Any], where: str, weight: float) -> ScorerSpec:
        return ScorerSpec(self.name, weight)

    def table(self, views: tuple[EndpointView, ...], spec: ScorerSpec) -> dict[str, float]:
        return dict(self.values)

    def score(self, spec: ScorerSpec, fixed: float, at: At) -> float:
        return fixed

    def explain(self, weight: float, score: float) -> str:
        return f"{self.name} {weight} x {score}"


WILD = {"a": 1.7, "b": -0.2, "c": math.nan, "d": 0.4}
TAME = {"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.4}  # what the one clamp makes of WILD


def policy_with(values: Mapping[str, float]) -> CompositePolicy:
    return CompositePolicy(ScorerRegistry([*BUILTIN, Fixed("given", values)]))


@pytest.mark.parametrize("indexed", [False, True], ids=["scan", "indexed pick"])
def test_a_scorer_out_of_range_or_nan_weighs_as_its_clamped_value(indexed: bool) -> None:
    """1.7 counts as 1, -0.2 and NaN as 0: every pick of a composite with the wild scorer is the pick of the same
    composite with a scorer returning the clamped values (same seed, same loads as they move)."""
    vs = views("a", "b", "c", "d", telemetry={i: tel(0.5) for i in "abcd"})
    params = {"scorers": {"given": 0.5, "load": 0.3, "gpu": 0.2}, "choices": "all"}
    chosen: dict[str, list[str]] = {}
    for label, values in (("wild", WILD), ("tame", TAME)):
        policy = policy_with(values)
        picker = policy.build(vs, policy.parse(params), policy.new_state(), random.Random(3), lambda _e: None)
        if indexed:
            loads: Any = LoadTracker(RouterMetrics())
            loads.set_pools({"m": vs})
        else:
            loads = FixedLoads({i: 0 for i in "abcd"})
        held = []
        picks = []
        for _ in range(60):
            view = picker.pick(req(), loads, frozenset())
            picks.append(view.id)
            if indexed:
                track = loads.track(view.id)
                track.__enter__()
                held.append(track)
            else:
                loads.counts[view.id] += 1
        chosen[label] = picks
        # The clamped values in action: a (1.0) takes the most, b and c (0) the least; NaN never wins a tie.
        counts = {i: picks.count(i) for i in "abcd"}
        assert counts["a"] > counts["d"] > max(counts["b"], counts["c"]), counts
    assert chosen["wild"] == chosen["tame"]


def test_an_explanation_names_each_scorers_contribution() -> None:
    vs = views("a", "b", telemetry={"a": tel(0.2, 0.5), "b": tel(0.6, 0.1)})
    policy = CompositePolicy()
    picker = policy.build(vs, policy.parse({"scorers": {"gpu": 0.5, "memory": 0.3, "load": 0.2}, "choices": "all"}),
                          policy.new_state(), random.Random(1), lambda _e: None)
    trace = DecisionTrace()
    chosen = picker.pick(req(), FixedLoads({"a": 1, "b": 3}), frozenset(), trace)
    assert chosen is not None
    parts = trace.candidates[chosen.id]["scorers"]
    assert set(parts) == {"gpu", "memory", "load"}
    assert sum(trace.detail["weights"][n] * parts[n] for n in parts) == pytest.approx(trace.candidates[chosen.id]["score"])
    sentence = summarise(Attempt(chosen.id, trace, {}, {}))
    for text in ("gpu 0.5 x", "(GPU headroom)", "memory 0.3 x", "(KV cache free)", "load 0.2 x"):
        assert text in sentence, sentence


def test_an_unknown_scorer_is_a_config_error_listing_the_registered_ones() -> None:
    with pytest.raises(PolicyConfigError) as exc:
        CompositePolicy().parse({"scorers": {"vibes": 1}})
    assert exc.value.field == "scorers.vibes"
    assert exc.value.message == f"unknown scorer (expected one of: {', '.join(SCORERS.names())})"
    # A registered scorer is a known name at once: no list to update elsewhere.
    policy = policy_with(TAME)
    assert policy.parse({"scorers": {"given": 1}}).scorers == (ScorerSpec("given", 1.0),)
    with pytest.raises(ValueError, match="registered twice"):
        ScorerRegistry([*BUILTIN, Fixed("gpu", {})])


def scorer_table(registry: ScorerRegistry = SCORERS) -> list[str]:
    """The docs' scorer table, rendered from the registry."""
    rows = ["| Scorer | Reads | Score (before the clamp to [0, 1]) | Fields beside `weight` | Per request |",
            "|---|---|---|---|---|"]
    for name in registry.names():
        s = registry.get(name)
        assert s is not None
        fields = ", ".join(f"`{f}`" for f in s.fields) or "none"
        rows.append(f"| `{name}` | {s.reads} | {s.formula} | {fields} | {'yes' if s.per_request else 'no'} |")
    return rows


def test_the_docs_scorer_table_is_the_registrys() -> None:
    text = DOCS.read_text()
    marker = "<!-- scorer table: generated from router/routing/policies/scorer_registry.py"
    assert marker in text
    after = text[text.index(marker):].splitlines()[1:]
    table = []
    for line in after:
        if not line.startswith("|"):
            if table:
                break
            continue
        table.append(line)
    expected = scorer_table()
    assert table == expected, "docs/policies.md's scorer table should read:\n" + "\n".join(expected)
    # The formula block of the composite section names every scorer too.
    section = text[text.index("## composite"):]
    for name in SCORERS.names():
        assert re.search(rf"^{name}\(e\)", section, re.M), name


def test_the_crd_schema_lists_the_registrys_scorers_and_their_fields() -> None:
    """The RoutingPolicy CRD validates in the API server, before the router parses: its scorer names and fields
    must be the registry's (a scorer added to the registry and not to the CRD would be refused there)."""
    import yaml

    crd = yaml.safe_load((DOCS.parent.parent / "manifests" / "crd" / "routingpolicies.fleetroute.io.yaml").read_text())
    spec = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    scorers = spec["properties"]["composite"]["properties"]["scorers"]["properties"]
    assert list(scorers) == SCORERS.names()
    for name, schema in scorers.items():
        scorer = SCORERS.get(name)
        assert scorer is not None
        assert set(schema.get("properties", {})) == {"weight", *scorer.fields}, name
