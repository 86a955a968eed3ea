"""The Helm chart's endpoint-picker mode (`epp.enabled`; helm/fleetroute/templates/epp/): fleetroute as the
endpoint picker of an InferencePool, beside its router.

tests/test_helm.py already checks the epp-values render with every other values file (built-in objects against
Kubernetes' schemas, the InferencePool against the Gateway API Inference Extension's real v1 CRD and the
HTTPRoute against ours, tests/data/crds/). Here: the contracts between the objects that no schema sees (the
pool selects the workers on their port and names the picker's Service, whose port reaches the gRPC listener
the probes check), the picker's config as `fleetroute epp` parses it, the gateway let through by the
NetworkPolicies, bad values refused by name, nothing rendered with epp off, and the picker's Role granting
exactly what a picker with that config asks the API server for.
"""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import pytest
import yaml

from router.config.settings import parse_settings
from tests.fake_crd import FakeCRD
from tests.helm_chart import (  # noqa: F401 - helm and rendered are fixtures
    CHART,
    CRD,
    NAMESPACE,
    RELEASE,
    container_env,
    helm,
    one,
    rendered,
)
from tests.helm_chart import template as _template
from tests.test_helm import _grants, role_mismatch, run_with_chart_config

FULL = f"{RELEASE}-fleetroute"
EPP = f"{FULL}-epp"
GIE_CRD = Path(__file__).parent / "data" / "crds" / "inferencepool.yaml"


def _epp_config(objs: list[dict]) -> dict:
    return yaml.safe_load(one(objs, "ConfigMap", EPP)["data"]["router.yaml"])


def test_with_epp_off_nothing_of_it_renders(rendered):
    for values, objs in rendered.items():
        if values == "epp-values":
            continue
        assert [o["metadata"]["name"] for o in objs
                if o["metadata"].get("labels", {}).get("app.kubernetes.io/component") == "epp"
                or o["kind"] == "InferencePool"] == [], values
        workers = [o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["name"].endswith("-workers")]
        assert "epp" not in yaml.safe_dump(workers), values


def test_the_pool_selects_every_worker_on_its_port_and_names_the_pickers_service(rendered):
    objs = rendered["epp-values"]
    pool = one(objs, "InferencePool", FULL)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    selector = pool["spec"]["selector"]["matchLabels"]
    workers = [o for o in objs if o["kind"] == "Deployment"
               and o["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"]
    assert workers
    for worker in workers:  # every pool's pods: fleetroute routes by model itself
        labels = worker["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), worker["metadata"]["name"]
        (http,) = [p for p in worker["spec"]["template"]["spec"]["containers"][0]["ports"] if p["name"] == "http"]
        assert pool["spec"]["targetPorts"] == [{"number": http["containerPort"]}]
    others = [o for o in objs if o["kind"] == "Deployment" and o not in workers]
    assert all(not selector.items() <= o["spec"]["template"]["metadata"]["labels"].items() for o in others)

    ref = pool["spec"]["endpointPickerRef"]
    assert ref["failureMode"] == "FailOpen"  # from values
    service = one(objs, "Service", ref["name"])
    (port,) = service["spec"]["ports"]
    assert (ref["port"]["number"], port["appProtocol"]) == (port["port"], "http2")
    picker = one(objs, "Deployment", EPP)
    assert service["spec"]["selector"].items() <= picker["spec"]["template"]["metadata"]["labels"].items()
    (container,) = picker["spec"]["template"]["spec"]["containers"]
    grpc = next(p for p in container["ports"] if p["name"] == port["targetPort"])
    args = container["args"]
    assert args[:3] == ["epp", "--config", "/etc/fleetroute/router.yaml"]
    assert args[args.index("--port") + 1] == str(grpc["containerPort"])
    assert args[args.index("--fallbacks") + 1] == "2"
    assert container["readinessProbe"]["grpc"] == {"port": grpc["containerPort"],
                                                   "service": "envoy.service.ext_proc.v3.ExternalProcessor"}
    assert container["livenessProbe"]["grpc"] == {"port": grpc["containerPort"]}

    # GIE's CRD accepts it as rendered (no defaults needed beyond its own), and refuses what the API server would.
    crd = FakeCRD(GIE_CRD)
    assert crd.admit(copy.deepcopy(pool)) == []
    bad = copy.deepcopy(pool)
    bad["spec"]["endpointPickerRef"]["failureMode"] = "FailSafe"
    assert crd.admit(bad)


def test_the_httproute_sends_the_gateways_traffic_to_the_pool(rendered):
    route = one(rendered["epp-values"], "HTTPRoute", EPP)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    spec = route["spec"]
    assert spec["parentRefs"] == [{"name": "inference", "namespace": "gateways", "sectionName": "http"}]
    assert spec["hostnames"] == ["llm.example.com"]
    (rule,) = spec["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/"}}]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": FULL}]
    assert rule["timeouts"] == {"request": "0s"}


def test_the_picker_parses_its_config_with_discovery_from_the_pool(rendered, monkeypatch):
    objs = rendered["epp-values"]
    cfg = _epp_config(objs)
    router = yaml.safe_load(one(objs, "ConfigMap", FULL)["data"]["router.yaml"])
    # The router's config, discovery aside, and nothing only the HTTP ingress uses.
    assert {k: v for k, v in cfg.items() if k != "discovery"} == \
        {k: v for k, v in router.items() if k not in ("discovery", "listen", "workers", "auth")}
    (container,) = one(objs, "Deployment", EPP)["spec"]["template"]["spec"]["containers"]
    for name, value in container_env(objs, container).items():
        monkeypatch.setenv(name, value)
    settings = parse_settings(cfg)
    kube = settings.discovery.kubernetes
    assert kube is not None
    assert (kube.inference_pool, kube.namespace, kube.services) == (FULL, NAMESPACE, ())
    assert settings.auth is not None and settings.auth.admin_token_digest is not None
    assert settings.control is not None  # RoutingPolicies route behind the gateway too


def test_the_gateway_reaches_the_picker_and_the_workers(rendered):
    objs = rendered["epp-values"]
    gateway = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "envoy-gateway-system"}}}]
    picker = one(objs, "NetworkPolicy", EPP)["spec"]
    grpc = {"port": 9002, "protocol": "TCP"}
    assert {"ports": [grpc], "from": gateway} in picker["ingress"]
    workers = one(objs, "NetworkPolicy", f"{FULL}-workers")["spec"]
    assert {"from": gateway, "ports": [{"port": 8000, "protocol": "TCP"}]} in workers["ingress"]
    epp_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "fleetroute",
                                                "app.kubernetes.io/instance": RELEASE,
                                                "app.kubernetes.io/component": "epp"}}}
    assert epp_pods in workers["ingress"][0]["from"]  # its health checks and engine-metrics reads
    assert any(rule.get("to") == [{"podSelector": {"matchLabels": {
        **epp_pods["podSelector"]["matchLabels"], "app.kubernetes.io/component": "worker"}}}]
        for rule in picker["egress"])


def test_without_gateway_peers_the_gateways_own_namespace_is_let_through(helm):
    objs = [d for d in yaml.safe_load_all(_template(
        helm, "--set", "epp.enabled=true,epp.httpRoute.enabled=true,epp.httpRoute.gateway.name=gw,"
                       "epp.httpRoute.gateway.namespace=istio-ingress")) if d]
    picker = one(objs, "NetworkPolicy", EPP)["spec"]
    assert picker["ingress"][0]["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-ingress"}}}]
    assert one(objs, "InferencePool", FULL)["spec"]["endpointPickerRef"]["failureMode"] == "FailClose"  # GIE's default


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ("epp.enabled=true,epp.failureMode=FailSafe", "at '/epp/failureMode': value must be one of"),
        ("epp.enabled=true,epp.httpRoute.enabled=true",
         "epp.httpRoute.gateway.name is required with epp.httpRoute.enabled: the Gateway to attach to"),
        ("epp.enabled=true,epp.service.port=0", "at '/epp/service/port'"),
        ("epp.enabld=true", "additional properties 'enabld' not allowed"),
    ],
)
def test_bad_epp_values_are_refused_by_name(helm, values, message):
    proc = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", values, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr


async def test_the_pickers_role_grants_exactly_what_the_picker_uses(rendered, make_router, tmp_path):
    """A picker's discovery and RoutingPolicy watch with the chart's EPP config, against the fake API server with
    GIE's CRD: every request it makes is one the picker's Role allows, and every grant is used."""
    from tests.fake_kube import FakeKube, inference_pool, inference_pool_crd, pod
    from tests.test_routing_policy_crd import policy

    objs = rendered["epp-values"]
    cfg = _epp_config(objs)
    grants = _grants(one(objs, "Role", EPP))
    kube = FakeKube()
    kube.crds["routingpolicies"] = FakeCRD(CRD)
    await kube.start()
    try:
        kube.create("customresourcedefinitions", inference_pool_crd())
        pool = one(objs, "InferencePool", FULL)
        kube.create("inferencepools", inference_pool(
            FULL, selector=pool["spec"]["selector"]["matchLabels"], ports=[8000]), namespace=NAMESPACE)
        worker = one(objs, "Deployment", f"{FULL}-default")["spec"]["template"]
        kube.create("pods", pod("worker-0", labels=worker["metadata"]["labels"], ready=True,
                                annotations={"fleetroute.io/models": "m"}), namespace=NAMESPACE)
        kube.create("routingpolicies", policy("chat", models=["*"]), namespace=NAMESPACE)
        router = await run_with_chart_config(make_router, kube, cfg, tmp_path, identity="epp-0")
        async with asyncio.timeout(10):
            await kube.wait_for_request(lambda r: r.path.endswith("/pods") and r.watch)
            await kube.wait_for_request(lambda r: r.path.endswith("/inferencepools") and r.watch)
        assert {ep.id for ep in router.ctx.balancer.endpoints()} == {"worker-0"}  # no Pod read by name
        assert role_mismatch(grants, kube) == (set(), set())
    finally:
        await kube.stop()


def test_the_notes_say_where_the_pool_is_and_that_the_gateway_authenticates(helm):
    notes = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                 "-f", str(CHART / "ci" / "epp-values.yaml")).stdout.split("NOTES:", 1)[1]
    assert f"InferencePool {FULL} (failureMode FailOpen) names the picker Service\n   {EPP}:9002" in notes
    assert "The picker does not check client API keys" in notes
    default = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client").stdout
    assert "InferencePool" not in default.split("NOTES:", 1)[1]


def test_the_picker_alone_without_the_router(helm, monkeypatch):
    """`router.enabled: false`: the gateway and the picker instead of the router; what remains is complete."""
    import kubernetes_validate

    from tests.helm_chart import KUBE_VERSIONS

    objs = [d for d in yaml.safe_load_all(_template(helm, "--set", "router.enabled=false,epp.enabled=true")) if d]
    routers = [f"{o['kind']}/{o['metadata']['name']}" for o in objs
               if o["metadata"]["labels"].get("app.kubernetes.io/component", "").startswith("router")]
    assert routers == [f"Secret/{FULL}-admin"]  # the admin token: the picker's admin listener uses it too
    assert {"epp", "worker", "redis"} <= {o["metadata"]["labels"].get("app.kubernetes.io/component") for o in objs}
    for obj in objs:
        if obj["kind"] == "InferencePool":
            assert FakeCRD(GIE_CRD).admit(copy.deepcopy(obj)) == []
            continue
        kubernetes_validate.validate(obj, KUBE_VERSIONS[0], strict=True)
    # The picker's config is whole without the router's objects: the admin token Secret and Redis are there.
    (container,) = one(objs, "Deployment", EPP)["spec"]["template"]["spec"]["containers"]
    for name, value in container_env(objs, container).items():
        monkeypatch.setenv(name, value)
    assert parse_settings(_epp_config(objs)).discovery.kubernetes.inference_pool == FULL  # type: ignore[union-attr]

    proc = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--set", "router.enabled=false",
                check=False)
    assert proc.returncode != 0
    assert "router.enabled and epp.enabled are both false: nothing would route requests" in proc.stderr
