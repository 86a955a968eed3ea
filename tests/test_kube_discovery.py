"""Kubernetes discovery end to end: a real router watching EndpointSlices on a fake API server (tests/fake_kube.py)
through the official client, routing real requests to fake engines on 127.0.0.1.

Every wait is on an event: the discovery's progress (`KubernetesDiscovery.wait_for`, woken by each watch
event, publish and outage change) or the fake's request log (`FakeKube.wait_for_request`). Nothing sleeps.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from router.config.settings import ConfigError, parse_settings
from router.server.app import ReloadRejected, RunningRouter, apply_settings
from tests.conftest import MODEL, router_config
from tests.fake_engine import FakeEngine
from tests.fake_kube import FakeKube, Recorded, endpoint_slice, pod, slice_endpoint

NS = "inference"
SERVICE = "vllm"
ROUND_ROBIN = [{"name": "default", "models": ["*"], "strategy": "round-robin"}]
SLICES = "/apis/discovery.k8s.io/v1/namespaces/inference/endpointslices"
MakeRouter = Callable[..., Awaitable[RunningRouter]]
MakeEngine = Callable[..., Awaitable[FakeEngine]]


@pytest.fixture
async def kube() -> AsyncIterator[FakeKube]:
    """Listed first by the tests, so that it is set up before the router and stopped after it."""
    fake = await FakeKube().start()
    yield fake
    await fake.stop()


async def start(make_router: MakeRouter, kube: FakeKube, tmp_path: Path, *, static: list[FakeEngine] | None = None,
                **discovery: Any) -> RunningRouter:
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    config = {"service": SERVICE, "kubeconfig": str(kubeconfig), "initialBackoff": "10ms", "maxBackoff": "40ms",
              **discovery}
    config = {k: v for k, v in config.items() if v is not ...}  # `...`: leave the field out
    return await make_router(static or [], discovery={"kubernetes": config}, policies=ROUND_ROBIN)


def add_pod(kube: FakeKube, engine: FakeEngine, *, ready: bool = True, terminating: bool = False,
            annotate: bool = True, slice_labels: dict[str, str] | None = None, service: str = SERVICE) -> None:
    """A Pod running `engine` and the EndpointSlice that lists it (one per pod: each engine has its own port,
    and the EndpointSlice controller groups endpoints by port)."""
    annotations = {"fleetroute.io/models": ",".join(engine.models)} if annotate else {}
    kube.create("pods", pod(engine.name, annotations=annotations), namespace=NS)
    kube.create("endpointslices", endpoint_slice(
        f"{service}-{engine.name}", service=service, port=engine.port, labels=slice_labels,
        endpoints=[slice_endpoint(engine.name, ready=ready, terminating=terminating, namespace=NS)],
    ), namespace=NS)


def set_conditions(kube: FakeKube, name: str, **conditions: bool) -> None:
    obj = copy.deepcopy(kube.get("endpointslices", NS, f"{SERVICE}-{name}"))
    assert obj is not None
    obj["endpoints"] = [slice_endpoint(name, namespace=NS, **conditions)]
    kube.update("endpointslices", obj, namespace=NS)


def states(router: RunningRouter) -> dict[str, str]:
    """What the balancer routes by (discovery rebuilds the snapshot before it wakes its waiters)."""
    return {v.id: v.state.value for v in router.ctx.balancer.snapshot.views}


async def until(router: RunningRouter, predicate: Callable[[], bool]) -> None:
    assert router.ctx.discovery is not None
    async with asyncio.timeout(5):
        await router.ctx.discovery.wait_for(predicate)


def sample(router: RunningRouter, name: str, **labels: str) -> float:
    return router.ctx.metrics.registry.get_sample_value(name, {"source": "kubernetes", **labels}) or 0.0


async def chat(http: aiohttp.ClientSession, router: RunningRouter, model: str = MODEL) -> str:
    """One request; the id of the endpoint that served it."""
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    async with http.post(router.ingress_url + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["x-fleetroute-endpoint"]


def lists(kube: FakeKube, after: int = 0) -> list[Recorded]:
    return [r for r in kube.requests[after:] if r.path == SLICES and not r.watch]


def is_watch(r: Recorded) -> bool:
    return r.path == SLICES and r.watch


# ---- membership and conditions -----------------------------------------------------------------------


async def test_the_router_follows_pods_as_their_endpoint_slices_change(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    a, b, c = [await make_engine(f"vllm-{x}") for x in "abc"]
    add_pod(kube, a)
    add_pod(kube, b)
    router = await start(make_router, kube, tmp_path)
    # Start-up waited for the first list: the pods are routable before the first request.
    assert states(router) == {"vllm-a": "serving", "vllm-b": "serving"}
    assert {router.ctx.balancer.snapshot.by_id["vllm-a"].endpoint.url} == {a.url}
    assert {await chat(http, router) for _ in range(4)} == {"vllm-a", "vllm-b"}

    add_pod(kube, c)  # scale up
    await until(router, lambda: "vllm-c" in states(router))
    assert {await chat(http, router) for _ in range(6)} == {"vllm-a", "vllm-b", "vllm-c"}

    set_conditions(kube, "vllm-b", ready=False)  # readiness probe failing: kept, but no new requests
    await until(router, lambda: states(router)["vllm-b"] == "draining")
    assert {await chat(http, router) for _ in range(4)} == {"vllm-a", "vllm-c"}

    # Scale down: vllm-c terminates while it streams an answer. The stream finishes; nothing new goes there.
    c.gate = asyncio.Event()
    held = None
    for _ in range(4):
        body = {"model": MODEL, "messages": [], "stream": True}
        resp = await http.post(router.ingress_url + "/v1/chat/completions", json=body)
        if resp.headers["x-fleetroute-endpoint"] == "vllm-c":
            held = resp
            await resp.content.readuntil(b"\n\n")  # the first token is through; the engine waits on its gate
            break
        await resp.read()
        resp.release()
    assert held is not None
    set_conditions(kube, "vllm-c", ready=True, terminating=True)
    await until(router, lambda: states(router)["vllm-c"] == "draining")
    assert {await chat(http, router) for _ in range(4)} == {"vllm-a"}
    c.gate.set()
    rest = (await held.read()).decode()
    held.release()
    assert rest.rstrip().endswith("data: [DONE]")  # the in-flight request completed

    kube.delete("endpointslices", f"{SERVICE}-vllm-c", namespace=NS)  # the pod is gone
    set_conditions(kube, "vllm-b", ready=True)  # and vllm-b is ready again
    await until(router, lambda: states(router) == {"vllm-a": "serving", "vllm-b": "serving"})
    assert {await chat(http, router) for _ in range(4)} == {"vllm-a", "vllm-b"}
    assert sample(router, "fleetroute_discovery_up") == 1.0
    assert sample(router, "fleetroute_discovery_relists_total", reason="initial") == 1.0


async def test_a_burst_of_slice_changes_reaches_the_balancer_as_one_update(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path,
) -> None:
    router = await start(make_router, kube, tmp_path, modelAnnotation=None, models=[MODEL])
    assert states(router) == {}
    assert sample(router, "fleetroute_discovery_updates_total") == 1.0  # the initial (empty) set
    engines = [await make_engine(f"vllm-{i}") for i in range(5)]
    with kube.batch():  # five new slices and a change to one, arriving in one chunk of the watch
        for engine in engines:
            add_pod(kube, engine)
        set_conditions(kube, "vllm-0", ready=True, terminating=True)
    await until(router, lambda: len(states(router)) == 5)
    assert states(router)["vllm-0"] == "draining"
    assert sample(router, "fleetroute_discovery_updates_total") == 2.0


# ---- watch resumption, bookmarks and 410 --------------------------------------------------------------


@pytest.mark.parametrize("abrupt", [False, True], ids=["server-ends-the-watch", "connection-cut"])
async def test_a_dropped_watch_resumes_from_its_resource_version_without_a_list(
    kube: FakeKube, abrupt: bool, make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path,
) -> None:
    a, b = await make_engine("vllm-a"), await make_engine("vllm-b")
    add_pod(kube, a)
    router = await start(make_router, kube, tmp_path)
    first = await kube.wait_for_request(is_watch)
    assert first.query["allowWatchBookmarks"] == "true" and first.query["watch"] in ("true", "True")
    assert first.headers["Authorization"] == "Bearer fake-token"  # the kubeconfig's credentials
    assert router.ctx.discovery is not None
    seen = router.ctx.discovery.resource_version
    assert seen == str(kube.rv)

    mark = len(kube.requests)
    assert kube.close_watches(abrupt=abrupt) == 1
    resumed = await kube.wait_for_request(is_watch, after=mark)
    assert resumed.query["resourceVersion"] == seen
    assert lists(kube, mark) == []  # resumed, not relisted

    add_pod(kube, b)  # the resumed watch delivers
    await until(router, lambda: "vllm-b" in states(router))
    assert router.ctx.discovery.resource_version == str(kube.rv)
    assert sample(router, "fleetroute_discovery_errors_total", kind="watch") == 0.0  # routine, not an outage
    assert sample(router, "fleetroute_discovery_relists_total", reason="expired") == 0.0


async def test_bookmarks_advance_the_resource_version_past_compacted_history(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path,
) -> None:
    a, b = await make_engine("vllm-a"), await make_engine("vllm-b")
    add_pod(kube, a)
    router = await start(make_router, kube, tmp_path)
    discovery = router.ctx.discovery
    assert discovery is not None
    await kube.wait_for_request(is_watch)
    quiet = discovery.resource_version
    for i in range(3):  # the cluster moves on; none of it is ours (another Service's slices)
        kube.create("endpointslices", endpoint_slice(f"other-{i}", service="other", port=9000,
                                                     endpoints=[slice_endpoint(f"other-{i}")]), namespace=NS)
    kube.bookmark()
    await until(router, lambda: discovery.resource_version == str(kube.rv))
    assert quiet != discovery.resource_version and states(router) == {"vllm-a": "serving"}

    kube.compact()  # the history before the bookmark is gone: resuming from `quiet` would be 410 Gone
    mark = len(kube.requests)
    kube.close_watches()
    resumed = await kube.wait_for_request(is_watch, after=mark)
    assert resumed.query["resourceVersion"] == str(kube.rv)
    add_pod(kube, b)
    await until(router, lambda: "vllm-b" in states(router))
    assert lists(kube) == lists(kube)[:1]  # still only the start-up list
    assert sample(router, "fleetroute_discovery_relists_total", reason="expired") == 0.0


@pytest.mark.parametrize("how", ["error-event-on-resume", "http-410-on-resume", "error-event-on-open-watch"])
async def test_410_gone_relists_and_keeps_the_endpoints_steady(
    kube: FakeKube, how: str, make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path,
    http: aiohttp.ClientSession,
) -> None:
    a, b = await make_engine("vllm-a"), await make_engine("vllm-b")
    add_pod(kube, a)
    add_pod(kube, b)
    router = await start(make_router, kube, tmp_path)
    await kube.wait_for_request(is_watch)
    mark = len(kube.requests)
    if how == "error-event-on-open-watch":
        kube.expire_watches()  # the API server's watch cache fell behind: ERROR 410 on the open watch
    else:
        kube.expired_as_http = how == "http-410-on-resume"
        kube.create("endpointslices", endpoint_slice("other-0", service="other", port=9000,
                                                     endpoints=[slice_endpoint("other-0")]), namespace=NS)
        kube.compact()  # our resourceVersion is now older than the history kept
        kube.close_watches()

    relist = await kube.wait_for_request(lambda r: r.path == SLICES and not r.watch, after=mark)
    assert "resourceVersion" not in relist.query  # a fresh, consistent list
    after = await kube.wait_for_request(is_watch, after=kube.requests.index(relist))
    assert after.query["resourceVersion"] == str(kube.rv)  # watching again from the new list
    assert sample(router, "fleetroute_discovery_relists_total", reason="expired") == 1.0
    # No flap: the relist found the same endpoints, so the balancer was never handed another set.
    assert states(router) == {"vllm-a": "serving", "vllm-b": "serving"}
    assert sample(router, "fleetroute_discovery_updates_total") == 1.0
    set_conditions(kube, "vllm-b", ready=False)
    await until(router, lambda: states(router)["vllm-b"] == "draining")
    assert {await chat(http, router) for _ in range(3)} == {"vllm-a"}


# ---- outage -----------------------------------------------------------------------------------------


async def test_an_api_server_outage_keeps_the_last_known_endpoints_and_is_counted(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession,
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fleetroute.discovery")
    a, b, c = [await make_engine(f"vllm-{x}") for x in "abc"]
    add_pod(kube, a)
    add_pod(kube, b)
    router = await start(make_router, kube, tmp_path)
    discovery = router.ctx.discovery
    assert discovery is not None
    await kube.wait_for_request(is_watch)

    await kube.stop()  # the API server goes away: connections cut, then refused
    await until(router, lambda: sample(router, "fleetroute_discovery_errors_total", kind="watch") >= 3)
    assert not discovery.up and sample(router, "fleetroute_discovery_up") == 0.0
    # The pods did not go anywhere: requests keep flowing to both.
    assert states(router) == {"vllm-a": "serving", "vllm-b": "serving"}
    assert {await chat(http, router) for _ in range(4)} == {"vllm-a", "vllm-b"}
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert 'fleetroute_discovery_up{source="kubernetes"} 0.0' in text
    assert 'fleetroute_discovery_errors_total{kind="watch",source="kubernetes"}' in text
    warnings = [r for r in caplog.records if r.name == "fleetroute.discovery" and r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # logged once, however many retries

    # Meanwhile the cluster changed, and the outage outlasted the API server's history.
    kube.delete("endpointslices", f"{SERVICE}-vllm-b", namespace=NS)
    add_pod(kube, c)
    kube.compact()
    await kube.start()  # same port
    await until(router, lambda: discovery.up and states(router) == {"vllm-a": "serving", "vllm-c": "serving"})
    assert sample(router, "fleetroute_discovery_relists_total", reason="expired") == 1.0
    assert sample(router, "fleetroute_discovery_up") == 1.0
    assert {await chat(http, router) for _ in range(4)} == {"vllm-a", "vllm-c"}
    assert [r.getMessage() for r in caplog.records if r.name == "fleetroute.discovery"
            and "reachable again" in r.getMessage()] == ["kubernetes API reachable again"]


async def test_a_refused_credential_is_counted_and_the_router_still_starts(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
) -> None:
    static = await make_engine("static-0")
    kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    kube.token = "rotated"  # the kubeconfig's token is no longer accepted: 401 on every request
    config = {"service": SERVICE, "kubeconfig": str(tmp_path / "kubeconfig"), "syncTimeout": "100ms",
              "initialBackoff": "10ms", "maxBackoff": "20ms"}
    router = await make_router([static], discovery={"kubernetes": config}, policies=ROUND_ROBIN)
    assert states(router) == {"static-0": "serving"}  # serves with what it has after syncTimeout
    await until(router, lambda: sample(router, "fleetroute_discovery_errors_total", kind="list") >= 2)
    assert sample(router, "fleetroute_discovery_up") == 0.0
    assert await chat(http, router) == "static-0"


async def test_a_config_reload_changes_the_static_endpoints_and_keeps_the_discovered_ones(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path,
) -> None:
    a, static = await make_engine("vllm-a"), await make_engine("static-0")
    add_pod(kube, a)
    router = await start(make_router, kube, tmp_path)
    assert set(states(router)) == {"vllm-a"}
    new = replace(router.ctx.settings, endpoints=parse_settings(router_config([static])).endpoints)
    apply_settings(router.ctx, new)  # what SIGHUP does
    await until(router, lambda: set(states(router)) == {"vllm-a", "static-0"})
    changed = replace(new, discovery=parse_settings({"discovery": {"kubernetes": {"service": "other"}}}).discovery)
    with pytest.raises(ReloadRejected, match="discovery"):  # a different watch needs a restart
        apply_settings(router.ctx, changed)


# ---- models and configuration --------------------------------------------------------------------------


async def test_models_come_from_the_pod_annotation_then_the_slice_label_then_the_config(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession,
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    annotated = await make_engine("vllm-a", models=(MODEL, "org/llama-3-8b-lora"))
    labelled = await make_engine("vllm-b", models=("mistral-7b",))
    plain = await make_engine("vllm-c", models=("fallback-7b",))
    static = await make_engine("static-0", models=("static-1b",))
    app = {"app": "vllm"}  # Service labels, copied onto its slices by the EndpointSlice controller
    add_pod(kube, annotated, slice_labels=app)
    add_pod(kube, labelled, annotate=False, slice_labels={**app, "fleetroute.io/model": "mistral-7b"})
    add_pod(kube, plain, annotate=False, slice_labels=app)
    stranger = await make_engine("other-a", models=("secret-model",))
    add_pod(kube, stranger, slice_labels={"app": "other"}, service="other")  # not selected
    # The kubeconfig from $KUBECONFIG, and the namespace from its context.
    monkeypatch.setenv("KUBECONFIG", str(kube.write_kubeconfig(tmp_path / "env-kubeconfig", namespace=NS)))
    router = await make_router([static], policies=ROUND_ROBIN, discovery={"kubernetes": {
        "labelSelector": "app=vllm,app notin (other)", "models": ["fallback-7b"]}})
    assert router.ctx.discovery is not None and router.ctx.discovery.namespace == NS

    routes = {model: await chat(http, router, model) for model in
              ("org/llama-3-8b-lora", MODEL, "mistral-7b", "fallback-7b", "static-1b")}
    assert routes == {"org/llama-3-8b-lora": "vllm-a", MODEL: "vllm-a", "mistral-7b": "vllm-b",
                      "fallback-7b": "vllm-c", "static-1b": "static-0"}
    async with http.get(router.ingress_url + "/v1/models") as resp:
        listed = {m["id"] for m in (await resp.json())["data"]}
    assert listed == {MODEL, "org/llama-3-8b-lora", "mistral-7b", "fallback-7b", "static-1b"}

    def pod_reads() -> list[str]:
        return sorted(r.path.rsplit("/", 1)[1] for r in kube.requests if "/pods/" in r.path)

    assert pod_reads() == ["vllm-a", "vllm-b", "vllm-c"]  # one read per pod...
    set_conditions(kube, "vllm-a", ready=False)
    await until(router, lambda: states(router)["vllm-a"] == "draining")
    set_conditions(kube, "vllm-a", ready=True)
    await until(router, lambda: states(router)["vllm-a"] == "serving")
    assert pod_reads() == ["vllm-a", "vllm-b", "vllm-c"]  # ...cached while the pod lives


async def test_endpoint_weights_come_from_the_services_weight_label(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, tmp_path: Path,
) -> None:
    big = await make_engine("vllm-h100")
    small = await make_engine("vllm-a100")
    odd = await make_engine("vllm-odd")
    app = {"app": "vllm"}
    add_pod(kube, big, slice_labels={**app, "fleetroute.io/weight": "1.8"})
    add_pod(kube, small, slice_labels=app)
    add_pod(kube, odd, slice_labels={**app, "fleetroute.io/weight": "fast"})  # unusable: logged, weight 1
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig", namespace=NS)
    router = await make_router([], policies=ROUND_ROBIN, discovery={"kubernetes": {
        "labelSelector": "app=vllm", "kubeconfig": str(kubeconfig)}})
    await until(router, lambda: len(router.ctx.balancer.endpoints()) == 3)
    weights = {ep.id: ep.weight for ep in router.ctx.balancer.endpoints()}
    assert weights == {"vllm-h100": 1.8, "vllm-a100": 1.0, "vllm-odd": 1.0}


@pytest.mark.parametrize(
    ("kubernetes", "message"),
    [
        ({}, "discovery.kubernetes.services: is required (or labelSelector, or inferencePool)"),
        ({"service": "vllm", "labelSelector": "app=vllm"},
         "discovery.kubernetes.labelSelector: set one of services, labelSelector or inferencePool, not services "
         "and labelSelector"),
        ({"servce": "vllm"}, "discovery.kubernetes.servce: unknown field (expected one of:"),
        ({"service": "vLLM_0"}, "discovery.kubernetes.service: must be a Service name"),
        ({"labelSelector": "app=vllm,tier in (a"}, "discovery.kubernetes.labelSelector: has an invalid requirement"),
        ({"service": "vllm", "namespace": "Inference"}, "discovery.kubernetes.namespace: must be a namespace name"),
        ({"service": "vllm", "port": "8000"}, "discovery.kubernetes.port: must be a port name"),
        ({"service": "vllm", "port": 70000}, "discovery.kubernetes.port: must be a port name"),
        ({"service": "vllm", "scheme": "grpc"}, "discovery.kubernetes.scheme: must be one of http, https"),
        ({"service": "vllm", "modelAnnotation": "models please"},
         "discovery.kubernetes.modelAnnotation: must be a Kubernetes label or annotation key"),
        ({"service": "vllm", "modelAnnotation": None, "modelLabel": None},
         "discovery.kubernetes.models: is required when modelAnnotation and modelLabel are both null"),
        ({"service": "vllm", "models": "llama"}, "discovery.kubernetes.models: must be a list of model names"),
        ({"service": "vllm", "watchTimeout": "500ms"}, "discovery.kubernetes.watchTimeout: must be at least 1s"),
        ({"service": "vllm", "initialBackoff": "2s", "maxBackoff": "1s"},
         "discovery.kubernetes.maxBackoff: must be >= initialBackoff"),
        ({"service": "vllm", "kubeconfig": ""}, "discovery.kubernetes.kubeconfig: must be a non-empty string"),
        ({"services": []}, "discovery.kubernetes.services: is required (or labelSelector, or inferencePool)"),
        ({"services": "vllm"}, "discovery.kubernetes.services: must be a list of at most 64 Service names"),
        ({"services": [f"s{i}" for i in range(65)]}, "discovery.kubernetes.services: must be a list of at most 64"),
        ({"services": ["vllm", "Bad_Name"]}, "discovery.kubernetes.services: must be a Service name"),
        ({"services": ["vllm"], "service": "vllm"}, "discovery.kubernetes.services: set either service or services"),
        ({"services": ["vllm"], "labelSelector": "app=vllm"},
         "discovery.kubernetes.labelSelector: set one of services, labelSelector or inferencePool, not services "
         "and labelSelector"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_discovery_config_is_rejected_naming_the_field(kubernetes: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings({"discovery": {"kubernetes": kubernetes}})
    assert str(info.value).startswith(message)


async def test_discovery_follows_only_the_services_the_config_names(
    kube: FakeKube, make_engine: MakeEngine, make_router: MakeRouter, http: aiohttp.ClientSession, tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue #24 item 5: with a label selector, whoever may create a Service carrying the workers' labels adds an
    upstream (its EndpointSlices copy the labels). Named Services are followed, and nothing else."""
    small, big = await make_engine("vllm-small"), await make_engine("vllm-big")
    intruder = await make_engine("intruder", models=(MODEL,))
    worker = {"app.kubernetes.io/instance": "t", "app.kubernetes.io/component": "worker"}
    add_pod(kube, small, service="t-fleetroute-small", slice_labels=worker)
    add_pod(kube, big, service="t-fleetroute-big", slice_labels=worker)
    add_pod(kube, intruder, service="not-ours", slice_labels=worker)  # the same labels, another Service
    named = await start(make_router, kube, tmp_path, service=..., services=["t-fleetroute-small", "t-fleetroute-big"])
    assert named.ctx.discovery is not None
    assert named.ctx.discovery.selector == "kubernetes.io/service-name in (t-fleetroute-small,t-fleetroute-big)"
    await until(named, lambda: set(states(named)) == {"vllm-small", "vllm-big"})
    assert {await chat(http, named) for _ in range(4)} == {"vllm-small", "vllm-big"}
    add_pod(kube, await make_engine("vllm-small-2"), service="t-fleetroute-small", slice_labels=worker)
    await until(named, lambda: set(states(named)) == {"vllm-small", "vllm-big", "vllm-small-2"})  # still live
    assert not [r for r in caplog.records if "labelSelector" in r.getMessage()]

    selected = await start(make_router, kube, tmp_path, service=...,
                           labelSelector="app.kubernetes.io/instance=t,app.kubernetes.io/component=worker")
    await until(selected, lambda: "intruder" in states(selected))  # the older form follows the intruder too
    assert any(r.levelno == logging.WARNING and "whoever may create a Service" in r.getMessage()
               for r in caplog.records)


def test_discovery_config_defaults_and_unknown_sources() -> None:
    kube = parse_settings({"discovery": {"kubernetes": {"service": "vllm"}}}).discovery.kubernetes
    assert kube is not None
    assert (kube.namespace, kube.port, kube.model_annotation, kube.model_label, kube.kubeconfig) == \
        (None, None, "fleetroute.io/models", "fleetroute.io/model", None)
    assert parse_settings({"discovery": {"kubernetes": None}}).discovery.kubernetes is None
    with pytest.raises(ConfigError, match=r"^discovery.consul: unknown field"):
        parse_settings({"discovery": {"consul": {}}})


async def test_in_a_pod_the_service_account_and_its_namespace_are_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The service account's files, where the kubelet mounts them (redirected: the test must not touch /var).
    from kubernetes.aio.config import incluster_config

    from router.kube.discovery import kubernetes as discovery_module
    from router.server.app import build_context

    for name, text in (("token", "sa-token"), ("ca.crt", "-----BEGIN CERTIFICATE-----\n"), ("namespace", "gpu\n")):
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(incluster_config, "SERVICE_TOKEN_FILENAME", str(tmp_path / "token"))
    monkeypatch.setattr(incluster_config, "SERVICE_CERT_FILENAME", str(tmp_path / "ca.crt"))
    monkeypatch.setattr(discovery_module, "IN_CLUSTER_NAMESPACE", str(tmp_path / "namespace"))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    settings = parse_settings({"discovery": {"kubernetes": {"service": SERVICE}}})
    assert settings.discovery.kubernetes is not None
    ctx = build_context(settings)
    discovery = discovery_module.KubernetesDiscovery(settings=settings.discovery.kubernetes, balancer=ctx.balancer,
                                                     static=(), metrics=ctx.metrics)
    configuration = discovery_module.client.Configuration()
    await discovery._load_config(configuration)
    assert configuration.host == "https://10.96.0.1:443"
    assert configuration.ssl_ca_cert == str(tmp_path / "ca.crt")
    assert await configuration.get_api_key_with_prefix("BearerToken") == "bearer sa-token"
    assert discovery.namespace == "gpu"


async def test_an_unusable_kubeconfig_fails_start_up_as_a_config_error(
    make_router: MakeRouter, tmp_path: Path,
) -> None:
    config = {"service": SERVICE, "kubeconfig": str(tmp_path / "missing")}
    with pytest.raises(ConfigError, match=r"^discovery.kubernetes.kubeconfig: cannot configure the Kubernetes"):
        await make_router([], discovery={"kubernetes": config})
