"""InferencePool discovery end to end (router/kube/discovery/inference_pool.py): a real router following a Gateway API
Inference Extension InferencePool and its Pods on the fake API server (tests/fake_kube.py), which serves
InferencePools with GIE's real v1 CRD (schema, defaults and CEL rules: tests/data/crds/inferencepool.yaml),
through the official client, routing real requests to fake engines on 127.0.0.1.

Every wait is on an event (`KubernetesDiscovery.wait_for`, `FakeKube.wait_for_request`). Pods share the address
127.0.0.1, so their endpoints differ by id; which engine serves is told by its port (the pool's targetPorts).
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.config.settings import ConfigError, parse_settings
from router.server.app import RunningRouter
from tests.conftest import MODEL
from tests.fake_engine import FakeEngine
from tests.fake_kube import FakeKube, inference_pool, inference_pool_crd, pod

NS = "inference"
POOL = "llama"
SELECTOR = {"app": "vllm"}
ROUND_ROBIN = [{"name": "default", "models": ["*"], "strategy": "round-robin"}]
PODS = "/api/v1/namespaces/inference/pods"
POOLS = "/apis/inference.networking.k8s.io/v1/namespaces/inference/inferencepools"
MakeRouter = Callable[..., Awaitable[RunningRouter]]
MakeEngine = Callable[..., Awaitable[FakeEngine]]


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    fake = await FakeKube().start()
    fake.create("customresourcedefinitions", inference_pool_crd())  # GIE installed: InferencePools are served
    yield fake
    await fake.stop()


async def start(make_router: MakeRouter, kube: FakeKube, tmp_path: Path, **discovery: Any) -> RunningRouter:
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    config = {"inferencePool": POOL, "kubeconfig": str(kubeconfig), "initialBackoff": "10ms", "maxBackoff": "40ms",
              **discovery}
    return await make_router([], discovery={"kubernetes": config}, policies=ROUND_ROBIN)


def add_pod(kube: FakeKube, name: str, *, ready: bool = True, labels: dict[str, str] | None = None,
            ip: str | None = "127.0.0.1", models: str = MODEL) -> None:
    kube.create("pods", pod(name, labels=labels or SELECTOR, ready=ready, ip=ip,
                            annotations={"fleetroute.io/models": models}), namespace=NS)


def set_ready(kube: FakeKube, name: str, ready: bool) -> None:
    obj = copy.deepcopy(kube.get("pods", NS, name))
    assert obj is not None
    obj["status"] = pod(name, ready=ready)["status"]
    kube.update("pods", obj, namespace=NS)


def edit_pool(kube: FakeKube, **spec: Any) -> None:
    obj = copy.deepcopy(kube.get("inferencepools", NS, POOL))
    assert obj is not None
    obj["spec"].update(spec)
    kube.update("inferencepools", obj, namespace=NS)


def states(router: RunningRouter) -> dict[str, str]:
    return {v.id: v.state.value for v in router.ctx.balancer.snapshot.views}


def urls(router: RunningRouter) -> dict[str, str]:
    return {v.id: v.endpoint.url for v in router.ctx.balancer.snapshot.views}


async def until(router: RunningRouter, predicate: Callable[[], bool]) -> None:
    assert router.ctx.discovery is not None
    async with asyncio.timeout(5):
        await router.ctx.discovery.wait_for(predicate)


def sample(router: RunningRouter, name: str, **labels: str) -> float:
    return router.ctx.metrics.registry.get_sample_value(name, {"source": "inferencepool", **labels}) or 0.0


async def chat(http: aiohttp.ClientSession, router: RunningRouter) -> str:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(router.ingress_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-fleetroute-endpoint"]


async def test_ready_pods_the_pool_selects_join_and_a_terminating_pod_drains(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    engine = await make_engine("engine")
    kube.create("inferencepools", inference_pool(POOL, selector=SELECTOR, ports=[engine.port]), namespace=NS)
    stored = kube.get("inferencepools", NS, POOL)
    assert stored is not None and stored["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"  # CRD default
    add_pod(kube, "vllm-0")
    add_pod(kube, "vllm-1", ready=False)  # still loading its model: not an endpoint
    add_pod(kube, "vllm-2", ip=None)  # not scheduled yet: no address
    add_pod(kube, "other-0", labels={"app": "other"})  # not selected by the pool
    router = await start(make_router, kube, tmp_path)
    # Start-up waited for the pool and the first list of its pods.
    assert states(router) == {"vllm-0": "serving"}
    assert urls(router) == {"vllm-0": engine.url}
    assert await chat(http, router) == "vllm-0" and len(engine.requests) == 1
    watch = await kube.wait_for_request(lambda r: r.path == PODS and r.watch)
    assert watch.query["labelSelector"] == "app=vllm"  # the API server filters the pods

    set_ready(kube, "vllm-1", True)  # model loaded: readiness probe passes
    await until(router, lambda: states(router) == {"vllm-0": "serving", "vllm-1": "serving"})
    assert {await chat(http, router) for _ in range(4)} == {"vllm-0", "vllm-1"}

    set_ready(kube, "vllm-1", False)  # readiness fails: it leaves, as GIE's picker drops it
    await until(router, lambda: states(router) == {"vllm-0": "serving"})

    kube.delete_gracefully("pods", "vllm-0", namespace=NS)  # scale-down: deletionTimestamp, still running
    await until(router, lambda: states(router) == {"vllm-0": "draining"})
    async with http.post(router.ingress_url + "/v1/chat/completions",
                         json={"model": MODEL, "messages": []}) as resp:
        assert resp.status == 503  # its model stays known: no endpoint for it now, not "no such model"
    kube.delete("pods", "vllm-0", namespace=NS)  # the kubelet removes it once its containers stopped
    await until(router, lambda: states(router) == {})
    assert sample(router, "fleetroute_discovery_up") == 1.0
    assert sample(router, "fleetroute_discovery_updates_total") == 5.0


async def test_the_pool_changing_its_selector_or_ports_relists_its_pods(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    a, b = await make_engine("engine-a"), await make_engine("engine-b")
    kube.create("inferencepools", inference_pool(POOL, selector=SELECTOR, ports=[a.port]), namespace=NS)
    add_pod(kube, "vllm-0", labels={**SELECTOR, "tier": "blue"})
    add_pod(kube, "vllm-1", labels={**SELECTOR, "tier": "green"})
    router = await start(make_router, kube, tmp_path)
    assert set(states(router)) == {"vllm-0", "vllm-1"}

    mark = len(kube.requests)
    edit_pool(kube, selector={"matchLabels": {**SELECTOR, "tier": "green"}})
    relist = await kube.wait_for_request(lambda r: r.path == PODS and not r.watch, after=mark)
    assert relist.query["labelSelector"] == "app=vllm,tier=green"
    await until(router, lambda: states(router) == {"vllm-1": "serving"})
    assert sample(router, "fleetroute_discovery_relists_total", reason="pool-changed") == 1.0

    # Two target ports (a pod running two engines, e.g. data-parallel ranks): one endpoint each, named as GIE does.
    edit_pool(kube, targetPorts=[{"number": a.port}, {"number": b.port}])
    await until(router, lambda: set(states(router)) == {"vllm-1-rank-0", "vllm-1-rank-1"})
    assert urls(router) == {"vllm-1-rank-0": a.url, "vllm-1-rank-1": b.url}
    served = [await chat(http, router) for _ in range(4)]
    assert set(served) == {"vllm-1-rank-0", "vllm-1-rank-1"}
    assert (len(a.requests), len(b.requests)) == (served.count("vllm-1-rank-0"), served.count("vllm-1-rank-1"))

    # The API server would refuse a pool listing a port twice (the CRD's CEL rule), as the fake does over HTTP.
    twice = copy.deepcopy(kube.get("inferencepools", NS, POOL))
    assert twice is not None
    twice["spec"]["targetPorts"] = [{"number": a.port}, {"number": a.port}]
    assert kube.crds["inferencepools"].admit(twice) == [
        'spec.targetPorts: Invalid value: "object": port number must be unique']

    kube.delete("inferencepools", POOL, namespace=NS)  # the pool is gone: so are its endpoints
    await until(router, lambda: states(router) == {})
    kube.create("inferencepools", inference_pool(POOL, selector=SELECTOR, ports=[b.port]), namespace=NS)
    await until(router, lambda: urls(router) == {"vllm-0": b.url, "vllm-1": b.url})


async def test_a_pool_that_does_not_exist_yet_is_waited_for_with_a_log_line(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fleetroute.discovery")
    engine = await make_engine("engine")
    add_pod(kube, "vllm-0")
    router = await start(make_router, kube, tmp_path, syncTimeout="50ms")  # serves (nothing) after syncTimeout
    assert states(router) == {}
    waiting = [r.getMessage() for r in caplog.records if r.name == "fleetroute.discovery"
               and r.levelno == logging.WARNING]
    assert waiting == [f"waiting for InferencePool {NS}/{POOL}: it does not exist (or selects nothing); no "
                       "endpoints come from it until it does"]
    assert not [r for r in kube.requests if r.path == PODS]  # no pod is watched before the pool says which
    kube.create("inferencepools", inference_pool(POOL, selector=SELECTOR, ports=[engine.port]), namespace=NS)
    await until(router, lambda: states(router) == {"vllm-0": "serving"})
    assert await chat(http, router) == "vllm-0"


async def test_the_pool_watch_expiring_relists_and_keeps_the_endpoints_steady(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path,
) -> None:
    engine = await make_engine("engine")
    kube.create("inferencepools", inference_pool(POOL, selector=SELECTOR, ports=[engine.port]), namespace=NS)
    add_pod(kube, "vllm-0")
    router = await start(make_router, kube, tmp_path)
    await kube.wait_for_request(lambda r: r.path == POOLS and r.watch)
    await kube.wait_for_request(lambda r: r.path == PODS and r.watch)
    mark = len(kube.requests)
    kube.expire_watches()  # ERROR 410 on both open watches
    await kube.wait_for_request(lambda r: r.path == POOLS and not r.watch, after=mark)
    await kube.wait_for_request(lambda r: r.path == PODS and not r.watch, after=mark)
    await until(router, lambda: sample(router, "fleetroute_discovery_relists_total", reason="expired") == 1.0)
    assert states(router) == {"vllm-0": "serving"}
    assert sample(router, "fleetroute_discovery_updates_total") == 1.0  # no flap
    add_pod(kube, "vllm-1")  # both watches are live again
    await until(router, lambda: set(states(router)) == {"vllm-0", "vllm-1"})


async def test_without_the_inference_pool_crd_the_failure_says_so_and_is_retried(
    make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fleetroute.discovery")
    kube = await FakeKube().start()  # GIE's CRD not installed
    try:
        engine = await make_engine("engine")
        add_pod(kube, "vllm-0")
        router = await start(make_router, kube, tmp_path, syncTimeout="50ms")
        await until(router, lambda: sample(router, "fleetroute_discovery_errors_total", kind="pool") >= 2)
        assert sample(router, "fleetroute_discovery_up") == 0.0
        assert any("is the Gateway API Inference Extension CRD (inference.networking.k8s.io/v1) installed?"
                   in r.getMessage() + str(getattr(r, "error", "")) for r in caplog.records)
        kube.create("customresourcedefinitions", inference_pool_crd())
        kube.create("inferencepools", inference_pool(POOL, selector=SELECTOR, ports=[engine.port]), namespace=NS)
        await until(router, lambda: states(router) == {"vllm-0": "serving"})
        assert sample(router, "fleetroute_discovery_up") == 1.0
    finally:
        await kube.stop()


@pytest.mark.parametrize(
    ("kubernetes", "message"),
    [
        ({"inferencePool": "llama", "service": "vllm"},
         "discovery.kubernetes.inferencePool: set one of services, labelSelector or inferencePool, not services "
         "and inferencePool"),
        ({"inferencePool": "llama", "labelSelector": "app=vllm"},
         "discovery.kubernetes.inferencePool: set one of services, labelSelector or inferencePool, not "
         "labelSelector and inferencePool"),
        ({"inferencePool": "Llama_3"}, "discovery.kubernetes.inferencePool: must be an InferencePool name"),
        ({"inferencePool": "llama", "port": 8000},
         "discovery.kubernetes.port: cannot be set with inferencePool: the pool's targetPorts are the ports"),
        ({}, "discovery.kubernetes.services: is required (or labelSelector, or inferencePool)"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_pool_config_is_rejected_naming_the_field(kubernetes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings({"discovery": {"kubernetes": kubernetes}})
    assert str(info.value).startswith(message)
