"""The Helm chart (helm/fleetroute), rendered by a real `helm` binary and checked offline (the binary and the
renders: tests/helm_chart.py; security, pools, KEDA, HTTPRoute and alerts: tests/test_helm_hardening.py).

What is checked:
- `helm lint --strict`, and `helm template` with the default values and every values file in
  helm/fleetroute/ci/ (external Redis, two pools, ingress, monitoring, HPA, closed network, model-cache claims,
  KEDA, Gateway API, GPU telemetry from NVML or DCGM);
- every rendered built-in object against the Kubernetes OpenAPI schemas (`kubernetes-validate`, strict:
  unknown fields are errors), RoutingPolicy objects against the CRD's openAPIV3Schema and CEL rules, and the
  other projects' kinds (ServiceMonitor, PodMonitor, PrometheusRule, ScaledObject, HTTPRoute) against our
  own short CRDs of the fields the chart uses, checked against those projects' API references
  (tests/data/crds/; tests/fake_crd.py: jsonschema and cel-python; unknown fields are refused);
- the router ConfigMap is accepted by the router's own `parse_settings`, with the environment and Secret files
  its pod gives it;
- the contracts between objects that no schema sees: probes on the admin port, termination grace above
  the router's drain, the checksum roll, discovery's label selector and model annotation versus the
  worker Services and pods, the agent's endpoint id and Redis, least-privilege RBAC, the GPU node agents'
  command line (parsed by the real CLI) against the workers' namespace, engine container and the kubelet's
  socket;
- bad values are rejected by values.schema.json with a message that names the value;
- every value is documented (`## @param`), docs/kubernetes.md's values reference is current (regenerate it with
  `python scripts/helm_values_reference.py --write`), the chart's CRD is a copy of manifests/crd/, and
  manifests/fleetroute.yaml is the chart rendered with defaults and manifests/fleetroute-values.yaml
  (`MANIFEST_COMMAND` below renders it).
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import importlib.util
import json
import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from router.config.settings import parse_settings
from tests.helm_chart import (  # noqa: F401 - helm and rendered are fixtures
    CHART,
    CHART_CRD,
    CI_VALUES,
    CRD,
    KUBE_VERSIONS,
    MANIFEST,
    MANIFEST_NAMESPACE,
    MANIFEST_RELEASE,
    NAMESPACE,
    RELEASE,
    ROOT,
    VALUE_SETS,
    container_env,
    helm,
    mount_secrets,
    relocate,
    rendered,
)
from tests.helm_chart import one as _one
from tests.helm_chart import router_config as _router_config
from tests.helm_chart import template as _template
from tests.helm_chart import values as _values

# The other projects' kinds the chart can render, which kubernetes-validate does not know: our own CRDs of the
# fields the chart uses (each file's header names the documentation it was checked against).
FOREIGN_CRDS = sorted((ROOT / "tests" / "data" / "crds").glob("*.yaml"))
CUSTOM_API_VERSIONS = {"monitoring.coreos.com/v1", "keda.sh/v1alpha1", "gateway.networking.k8s.io/v1",
                       "inference.networking.k8s.io/v1"}




def test_lint_strict(helm):
    for extra in ([], *(["-f", str(p)] for p in CI_VALUES)):
        proc = helm("lint", "--strict", str(CHART), *extra)
        assert "0 chart(s) failed" in proc.stdout, proc.stdout


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_object_validates_against_kubernetes_schemas(rendered, values):
    checked = 0
    for obj in rendered[values]:
        if obj["apiVersion"] in {"fleetroute.io/v1alpha1", *CUSTOM_API_VERSIONS}:  # validated against their CRDs below
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{values}: {obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes "
                            f"{version}: {exc.message} at {'.'.join(map(str, exc.path))}")
        checked += 1
    assert checked >= 10




def _crd_errors(crd, obj: dict) -> list[str]:
    """What the API server would answer creating `obj`: its schema and CEL rules (tests/fake_crd.py), plus the
    CEL rules on array items, which FakeCRD does not walk into (HTTPRoute's backendRefs have some). `obj` is
    left as it is (admission defaults a copy)."""
    def items_rules(schema: dict, value: object, path: str) -> list[str]:
        errors = []
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if value.get(key) is not None:
                    errors += items_rules(sub, value[key], f"{path}.{key}".lstrip("."))
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                errors += crd._cel(schema["items"], item, f"{path}[{i}]") + items_rules(schema["items"], item, f"{path}[{i}]")
        return errors

    obj = copy.deepcopy(obj)
    return crd.admit(obj) or items_rules(crd.schema, obj, "")


@pytest.fixture(scope="session")
def crds():
    from tests.fake_crd import FakeCRD

    found = {}
    for path in FOREIGN_CRDS:
        crd = FakeCRD(path)
        found[(f"{crd.crd['spec']['group']}/{crd.crd['spec']['versions'][0]['name']}", crd.crd["spec"]["names"]["kind"])] = crd
    return found


@pytest.mark.parametrize("values", VALUE_SETS)
def test_custom_resources_are_well_formed(rendered, crds, values):
    for obj in rendered[values]:
        if obj["kind"] == "RoutingPolicy":
            assert obj["apiVersion"] == "fleetroute.io/v1alpha1"
            if not CRD.exists():
                pytest.skip(f"{CRD.relative_to(ROOT)} does not exist yet (the RoutingPolicy CRD is written "
                            "separately): RoutingPolicy objects are not schema-checked")
            # The fake API server's admission: the CRD's schema (as the API server reads it) and CEL rules.
            from tests.fake_crd import FakeCRD

            assert FakeCRD(CRD).admit(obj) == [], f"{obj['metadata']['name']} is refused by the CRD"
        elif obj["apiVersion"] in CUSTOM_API_VERSIONS:
            crd = crds.get((obj["apiVersion"], obj["kind"]))
            assert crd is not None, f"no CRD for {obj['apiVersion']} {obj['kind']} in tests/data/crds/ (write one)"
            assert _crd_errors(crd, obj) == [], f"{obj['kind']}/{obj['metadata']['name']} is refused by its CRD"


def test_foreign_crds_are_crds_the_api_server_accepts():
    from tests.fake_crd import crd_problems

    for path in FOREIGN_CRDS:
        crd = yaml.safe_load(path.read_text())
        kubernetes_validate.validate(crd, KUBE_VERSIONS[0], strict=True)
        assert crd_problems(crd) == [], path.name  # structural, CEL rules that compile


def test_foreign_crds_refuse_what_their_api_servers_refuse(rendered, crds):
    # The checks above can fail: a ScaledObject threshold that is a number, not a string; an HTTPRoute
    # backend without a port; a backendRequest timeout longer than the request's; a misspelt field.
    objs = rendered["keda-values"]
    scaled = json.loads(json.dumps(_one(objs, "ScaledObject", f"{RELEASE}-fleetroute-chat")))
    scaled["spec"]["triggers"][0]["metadata"]["threshold"] = 4
    assert _crd_errors(crds[("keda.sh/v1alpha1", "ScaledObject")], scaled)
    route = _one(rendered["gateway-values"], "HTTPRoute")
    crd = crds[("gateway.networking.k8s.io/v1", "HTTPRoute")]
    no_port = json.loads(json.dumps(route))
    del no_port["spec"]["rules"][0]["backendRefs"][0]["port"]
    assert _crd_errors(crd, no_port) == ['spec.rules[0].backendRefs[0]: Invalid value: "object": Must have port for Service reference']
    slow = json.loads(json.dumps(route))
    slow["spec"]["rules"][0]["timeouts"] = {"request": "10s", "backendRequest": "20s"}
    assert _crd_errors(crd, slow)
    # A typo in a template is an unknown field, which the API server refuses (strict field validation).
    monitor = json.loads(json.dumps(_one(rendered["gpu-telemetry-nvml-values"], "PodMonitor")))
    monitor["spec"]["podMetricsEndpoints"][0]["relabelings"][0]["targetLable"] = "node"
    assert "Additional properties are not allowed ('targetLable' was unexpected)" in \
        "".join(_crd_errors(crds[("monitoring.coreos.com/v1", "PodMonitor")], monitor))
    rule = json.loads(json.dumps(_one(rendered["monitoring-values"], "PrometheusRule")))
    rule["spec"]["groups"][0]["rules"][0]["for"] = "2 minutes"
    assert _crd_errors(crds[("monitoring.coreos.com/v1", "PrometheusRule")], rule)


def _parse_as_the_router_pod(objs: list[dict], tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The router's settings from its ConfigMap, with the environment and Secret files its pod gives it."""
    pod = _one(objs, "Deployment", f"{RELEASE}-fleetroute")["spec"]["template"]["spec"]
    (router,) = pod["containers"]
    for name in ("REDIS_URL", "FLEETROUTE_ADMIN_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in container_env(objs, router).items():
        monkeypatch.setenv(name, value)
    return parse_settings(relocate(_router_config(objs), mount_secrets(objs, pod, router, tmp_path)))


@pytest.mark.parametrize("values", VALUE_SETS)
def test_router_accepts_its_rendered_config(rendered, values, tmp_path, monkeypatch):
    settings = _parse_as_the_router_pod(rendered[values], tmp_path, monkeypatch)
    # Probes and Prometheus come from outside the pod: the admin listener must not be loopback-only.
    assert settings.admin.host == "0.0.0.0"
    assert settings.discovery is not None and settings.discovery.kubernetes is not None
    # Closed by default: /admin needs the token, the OpenAI API a client key, unless the values say otherwise.
    assert settings.auth is not None and settings.auth.admin_token_digest is not None
    assert settings.auth.client_keys == _values(values)["router"]["apiKeys"]["enabled"]
    # RoutingPolicies are on by default (issue #16: the chart made them, but no router watched them).
    control = settings.control.kubernetes if settings.control is not None else None
    assert control is not None and control.namespace == NAMESPACE
    assert control.lease_name == f"{RELEASE}-fleetroute-routing-policy-status"


@pytest.mark.parametrize("values", VALUE_SETS)
def test_the_charts_own_routing_policies_are_within_the_delegation(rendered, values, tmp_path, monkeypatch):
    from router.kube.control.delegation import check, file_conflict
    from router.kube.control.spec import policy_from_spec
    from router.routing.policies.registry import PolicyRegistry
    from tests.fake_crd import FakeCRD

    settings = _parse_as_the_router_pod(rendered[values], tmp_path, monkeypatch)
    assert settings.control is not None and settings.control.kubernetes is not None
    control = settings.control.kubernetes
    policies = [o for o in rendered[values] if o["kind"] == "RoutingPolicy"]
    for obj in policies:
        stored = json.loads(json.dumps(obj))
        assert FakeCRD(CRD).admit(stored) == []  # as the API server stores it (models and priority defaulted)
        priority, policy = policy_from_spec(obj["metadata"]["name"], stored["spec"], PolicyRegistry())
        assert check(policy, priority, control) is None, obj["metadata"]["name"]
        assert file_conflict(policy.name, {p.name for p in settings.policies}, control) is None
    # Nothing else is delegated by default than the pools' own models and the chart's RoutingPolicies': a
    # RoutingPolicy someone else creates for another model (or "*") routes nothing.
    pools = _values(values)["pools"]
    expected = {m for p in pools for m in p["servedModelNames"]} | {
        m for o in policies for m in o["spec"].get("models", ["*"])}
    assert sorted(control.allowed_models) == sorted(expected)
    assert (values != "monitoring-values") or len(policies) == 2


def test_router_deployment_probes_drain_and_hardening(rendered):
    objs = rendered["default"]
    dep = _one(objs, "Deployment", f"{RELEASE}-fleetroute")
    pod = dep["spec"]["template"]["spec"]
    (router,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in router["ports"]}
    cfg = _router_config(objs)
    assert ports == {"http": cfg["listen"]["port"], "admin": cfg["admin"]["port"]}
    assert router["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    # The kubelet kills the pod terminationGracePeriodSeconds after deletion; the preStop sleep and then
    # the router's whole drain (shutdownGrace) must fit inside it.
    grace = int(cfg["shutdownGrace"].removesuffix("s"))
    pre_stop = int(router["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pre_stop > 0 and pod["terminationGracePeriodSeconds"] > grace + pre_stop
    sc = router["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["seccompProfile"]["type"] == "RuntimeDefault"
    assert pod["securityContext"]["runAsNonRoot"]
    anti = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert dep["spec"]["replicas"] == 2 and cfg["workers"] == 1
    assert _one(objs, "PodDisruptionBudget", f"{RELEASE}-fleetroute")["spec"]["maxUnavailable"] == 1
    assert not [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
    # An admin token by default, from the chart's Secret (tests/test_helm_hardening.py checks how it is made).
    ref = next(e for e in router["env"] if e["name"] == "FLEETROUTE_ADMIN_TOKEN")["valueFrom"]["secretKeyRef"]
    assert ref == {"name": f"{RELEASE}-fleetroute-admin", "key": "admin-token"}
    assert cfg["admin"]["tokenEnv"] == "FLEETROUTE_ADMIN_TOKEN"


def test_config_change_rolls_router_pods(helm, rendered):
    def checksum(objs):
        dep = _one(objs, "Deployment", f"{RELEASE}-fleetroute")
        return dep["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    before = checksum(rendered["default"])
    text = _one(rendered["default"], "ConfigMap", f"{RELEASE}-fleetroute")["data"]["router.yaml"]
    assert before == hashlib.sha256(text.rstrip("\n").encode()).hexdigest()
    changed = [d for d in yaml.safe_load_all(_template(helm, "--set", "router.logLevel=debug")) if d]
    assert checksum(changed) != before


def test_admin_token_comes_from_a_secret(rendered):
    objs = rendered["external-redis-values"]
    secret = _one(objs, "Secret", f"{RELEASE}-fleetroute-admin")
    (router,) = _one(objs, "Deployment", f"{RELEASE}-fleetroute")["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e for e in router["env"]}
    ref = env["FLEETROUTE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert ref["name"] == secret["metadata"]["name"] and ref["key"] in secret["data"]


def test_worker_pools_match_discovery(rendered, tmp_path, monkeypatch):
    objs = rendered["two-pools-values"]
    cfg = _router_config(objs)
    (router,) = _one(objs, "Deployment", f"{RELEASE}-fleetroute")["spec"]["template"]["spec"]["containers"]
    kube = cfg["discovery"]["kubernetes"]
    assert kube["namespace"] == NAMESPACE and kube["modelAnnotation"] == "fleetroute.io/models"
    # Discovery names the pool Services, and follows nothing else (issue #24 item 5: a label selector also
    # followed any Service someone created with the workers' labels).
    assert "labelSelector" not in kube
    workers = {o["metadata"]["name"] for o in objs
               if o["kind"] == "Service" and o["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"}
    assert kube["services"] == [f"{RELEASE}-fleetroute-llama-8b", f"{RELEASE}-fleetroute-llama-70b"]
    assert set(kube["services"]) == workers
    pools = yaml.safe_load((CHART / "ci" / "two-pools-values.yaml").read_text())["pools"]
    for pool in pools:
        name = f"{RELEASE}-fleetroute-{pool['name']}"
        svc = _one(objs, "Service", name)
        assert [p["name"] for p in svc["spec"]["ports"]] == [kube["port"]]
        # The pool's capacity weight rides on the Service's labels, which its EndpointSlices copy.
        assert svc["metadata"]["labels"].get("fleetroute.io/weight") == (str(pool["weight"]) if "weight" in pool else None)
        dep = _one(objs, "Deployment", name)
        tmpl = dep["spec"]["template"]
        assert svc["spec"]["selector"].items() <= tmpl["metadata"]["labels"].items()
        assert dep["spec"]["replicas"] == pool["replicaCount"]
        assert tmpl["metadata"]["annotations"]["fleetroute.io/models"] == ",".join(pool["servedModelNames"])
        containers = {c["name"]: c for c in tmpl["spec"]["containers"]}
        vllm, agent = containers["vllm"], containers["agent"]
        assert vllm["image"].startswith("vllm/vllm-openai:")
        assert vllm["resources"]["limits"]["nvidia.com/gpu"] == pool["gpus"]
        args = vllm["args"]
        assert f"--model={pool['model']}" in args
        assert f"--tensor-parallel-size={pool['gpus']}" in args
        assert args[args.index("--served-model-name") + 1:][:len(pool["servedModelNames"])] == pool["servedModelNames"]
        assert f"--kv-cache-dtype={pool['engine']['kvCacheDtype']}" in args
        assert f"--max-model-len={pool['engine']['maxModelLen']}" in args
        assert "--enable-prefix-caching" in args
        chunked = pool["engine"].get("enableChunkedPrefill", True)
        assert ("--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill") in args
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert vllm[probe]["httpGet"] == {"path": "/health", "port": "http"}
        # The agent reports under the pod's name, which is the endpoint id discovery gives the pod, to the
        # Redis the routers read (its URL, with the password, from the environment).
        assert "--endpoint-id=$(POD_NAME)" in agent["args"]
        assert "--engine-url=http://127.0.0.1:8000" in agent["args"]
        assert "redis" not in cfg and not [a for a in agent["args"] if a.startswith("--redis")]
        assert container_env(objs, agent)["REDIS_URL"] == container_env(objs, router)["REDIS_URL"]
        pod_name = next(e for e in agent["env"] if e["name"] == "POD_NAME")
        assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert agent["securityContext"]["readOnlyRootFilesystem"]
    spec_args = _one(objs, "Deployment", f"{RELEASE}-fleetroute-llama-8b")["spec"]["template"]["spec"]["containers"][0]["args"]
    spec = json.loads(spec_args[spec_args.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    assert len(cfg["policies"]) == 2
    chat = _parse_as_the_router_pod(objs, tmp_path, monkeypatch).policies[0]  # a preset with an override
    assert (chat.preset, chat.strategy, chat.admission.max_concurrent_per_endpoint) == ("realtime-chat", "prefix-aware", 32)


def _grants(role: dict) -> set[tuple[str, str, str, str | None]]:
    """(apiGroup, resource, verb, name or None for any) for every rule of a Role."""
    return {(group, resource, verb, name) for rule in role["rules"] for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]
            for name in (rule.get("resourceNames") or [None])}


def test_rbac_is_least_privilege(rendered):
    lease = f"{RELEASE}-fleetroute-routing-policy-status"
    assert _grants(_one(rendered["default"], "Role")) == {
        ("discovery.k8s.io", "endpointslices", "list", None),
        ("discovery.k8s.io", "endpointslices", "watch", None),
        ("", "pods", "get", None),
        ("fleetroute.io", "routingpolicies", "list", None),
        ("fleetroute.io", "routingpolicies", "watch", None),
        ("fleetroute.io", "routingpolicies/status", "patch", None),
        # Issue #24 item 13: the Lease by name. Create cannot be limited by name in RBAC (the object does not
        # exist when the request is authorized), hence its own rule.
        ("coordination.k8s.io", "leases", "get", lease),
        ("coordination.k8s.io", "leases", "update", lease),
        ("coordination.k8s.io", "leases", "create", None),
    }
    assert _router_config(rendered["default"])["control"]["kubernetes"]["leaseName"] == lease
    binding = _one(rendered["default"], "RoleBinding")
    sa = _one(rendered["default"], "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    assert not [o for o in rendered["default"] if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def _verb(r) -> tuple[str, str, str, str] | None:
    """(apiGroup, resource, verb, name) of one request the fake API server recorded; None for discovery
    documents (non-resource URLs every authenticated client may read)."""
    parts = r.path.strip("/").split("/")
    if parts[0] == "api" and len(parts) >= 3:
        group, rest = "", parts[2:]
    elif parts[0] == "apis" and len(parts) >= 4:
        group, rest = parts[1], parts[3:]
    else:
        return None
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]
    resource, name = rest[0] + ("/" + rest[2] if len(rest) == 3 else ""), rest[1] if len(rest) >= 2 else ""
    verb = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}.get(r.method)
    if verb is None:
        verb = "get" if name else ("watch" if r.watch else "list")
    return group, resource, verb, name


@pytest.fixture
async def fake_kube():
    """The fake API server with the CRD; requested before make_router, so it stops after the routers."""
    from tests.fake_crd import FakeCRD
    from tests.fake_kube import FakeKube

    kube = FakeKube()
    kube.crds["routingpolicies"] = FakeCRD(CRD)
    await kube.start()
    yield kube
    await kube.stop()


async def test_the_role_grants_exactly_what_the_routers_use(rendered, fake_kube, make_router, tmp_path):
    """A router with the chart's config (discovery and RoutingPolicies) against the fake API server: every
    request it makes is one the rendered Role allows, and every permission the Role grants is used."""
    from tests.fake_kube import endpoint_slice, pod, slice_endpoint
    from tests.test_routing_policy_crd import policy

    objs = rendered["default"]
    cfg = _router_config(objs)
    grants = _grants(_one(objs, "Role"))
    kube = fake_kube
    service = cfg["discovery"]["kubernetes"]["services"][0]
    kube.create("pods", pod("worker-0", annotations={"fleetroute.io/models": "m"}), namespace=NAMESPACE)
    kube.create("endpointslices", endpoint_slice(f"{service}-abc", service=service, port=8000, endpoints=[
        slice_endpoint("worker-0", namespace=NAMESPACE)]), namespace=NAMESPACE)
    kube.create("routingpolicies", policy("chat", models=["*"]), namespace=NAMESPACE)
    router = await run_with_chart_config(make_router, kube, cfg, tmp_path, identity="router-0")
    assert {ep.id for ep in router.ctx.balancer.endpoints()} == {"worker-0"}  # its Pod was read
    assert role_mismatch(grants, kube) == (set(), set())


async def run_with_chart_config(make_router, kube, cfg: dict, tmp_path: Path, *, identity: str):
    """A router (or, with the picker's config, what a picker runs: the same discovery and RoutingPolicy watch)
    with the chart's `discovery` and `control` against the fake API server, once it holds the status Lease and
    has written a RoutingPolicy's status and renewed the Lease."""
    timing = {"kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig")), "initialBackoff": "10ms",
              "maxBackoff": "40ms"}
    router = await make_router(
        [], policies=cfg["policies"], discovery={"kubernetes": {**cfg["discovery"]["kubernetes"], **timing}},
        control={"kubernetes": {**cfg["control"]["kubernetes"], **timing, "identity": identity,
                                "leaseDuration": "1s"}})
    control = router.ctx.control
    assert control is not None
    async with asyncio.timeout(10):
        await control.wait_for(lambda: control.leader and "chat" in control.outcomes)
        await kube.wait_for_request(lambda r: r.path.endswith("/routingpolicies/chat/status"))
        await kube.wait_for_request(lambda r: r.method == "PUT" and "/leases/" in r.path)  # a renewal
    return router


def role_mismatch(grants: set, kube) -> tuple[set, set]:
    """The requests the fake API server saw that the Role's grants do not allow, and the grants never used."""
    used = {v for r in kube.requests if (v := _verb(r)) is not None}
    refused = {v for v in used if (v[0], v[1], v[2], v[3]) not in grants and (v[0], v[1], v[2], None) not in grants}
    unused = {g for g in grants if not any(u[:3] == g[:3] and (g[3] is None or u[3] == g[3]) for u in used)}
    return refused, unused


def test_routing_policies_can_be_switched_off(helm):
    off = [d for d in yaml.safe_load_all(_template(helm, "--set", "routingPolicyControl.enabled=false")) if d]
    assert "control" not in _router_config(off)
    assert {(g, r) for g, r, _, _ in _grants(_one(off, "Role"))} == {
        ("discovery.k8s.io", "endpointslices"), ("", "pods")}
    notes = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client",
                 "--set", "routingPolicyControl.enabled=false").stdout.split("NOTES:", 1)[1]
    assert "kubectl get rp" not in notes and "RoutingPolicies are off" in notes
    # RoutingPolicy objects no router would apply are an error, not a silent no-op (issue #16).
    proc = helm("template", RELEASE, str(CHART), "-f", str(CHART / "ci" / "monitoring-values.yaml"),
                "--set", "routingPolicyControl.enabled=false", check=False)
    assert proc.returncode != 0
    assert "routingPolicies are set, but routingPolicyControl.enabled is false" in proc.stderr
    proc = helm("template", RELEASE, str(CHART), "-f", str(CHART / "ci" / "monitoring-values.yaml"),
                "--set", "routingPolicyControl.maxPriority=-1,routingPolicies[0].spec.priority=5", check=False)
    assert "routingPolicies[0] (chat): priority 5 is above routingPolicyControl.maxPriority (-1)" in proc.stderr


def test_routing_policy_delegation_values_reach_the_router(helm, tmp_path, monkeypatch):
    objs = [d for d in yaml.safe_load_all(_template(
        helm, "-f", str(CHART / "ci" / "monitoring-values.yaml"), "--set",
        "routingPolicyControl.allowedModels={team-a-*,qwen2.5-1.5b-instruct},routingPolicyControl.maxPriority=50,"
        "routingPolicyControl.overrideFilePolicies=true")) if d]
    control = _parse_as_the_router_pod(objs, tmp_path, monkeypatch).control
    assert control is not None and control.kubernetes is not None
    # The pools' models first (delegatePoolModels), then allowedModels, then the chart's RoutingPolicies', once each.
    assert control.kubernetes.allowed_models == ("qwen2.5-1.5b-instruct", "team-a-*", "qwen2.5-1.5b-batch")
    assert (control.kubernetes.max_priority, control.kubernetes.override_file_policies) == (50, True)


def test_the_charts_routing_policies_with_model_aliases_are_delegated(helm, tmp_path, monkeypatch):
    from router.kube.control.delegation import check
    from router.kube.control.spec import policy_from_spec
    from router.routing.policies.registry import PolicyRegistry
    from tests.fake_crd import FakeCRD

    canary = [{"name": "canary", "spec": {"models": ["qwen2.5-1.5b-v*"], "aliases": [{"name": "qwen2.5-1.5b", "targets": [
        {"model": "qwen2.5-1.5b-v1", "weight": 90}, {"model": "qwen2.5-1.5b-v2", "weight": 10}]}]}}]
    objs = [d for d in yaml.safe_load_all(_template(helm, "--set-json", f"routingPolicies={json.dumps(canary)}")) if d]
    control = _parse_as_the_router_pod(objs, tmp_path, monkeypatch).control
    assert control is not None and control.kubernetes is not None
    # The alias takes the requests for its name and sends them to its targets: all three are delegated.
    assert {"qwen2.5-1.5b-v*", "qwen2.5-1.5b", "qwen2.5-1.5b-v1", "qwen2.5-1.5b-v2"} <= set(control.kubernetes.allowed_models)
    obj = json.loads(json.dumps(_one(objs, "RoutingPolicy", "canary")))
    assert FakeCRD(CRD).admit(obj) == []
    priority, policy = policy_from_spec("canary", obj["spec"], PolicyRegistry())
    assert check(policy, priority, control.kubernetes) is None


def test_redis_builtin_external_secret_or_off(rendered):
    kinds = lambda name: {(o["kind"], o["metadata"]["name"]) for o in rendered[name]}  # noqa: E731

    def env_of(objs, component):
        deps = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
        return [container_env(objs, c) for d in deps for c in d["spec"]["template"]["spec"]["containers"]
                if c["name"] in ("router", "agent")]

    # Built in, with a password: its URL reaches routers and agents through the environment, never the ConfigMap.
    objs = rendered["default"]
    assert ("StatefulSet", f"{RELEASE}-fleetroute-redis") in kinds("default")
    assert "redis" not in _router_config(objs)
    password = base64.b64decode(_one(objs, "Secret", f"{RELEASE}-fleetroute-redis")["data"]["redis-password"]).decode()
    urls = {env["REDIS_URL"] for env in env_of(objs, "router") + env_of(objs, "worker")}
    assert urls == {f"redis://:{password}@{RELEASE}-fleetroute-redis:6379/0"}
    assert password not in _one(objs, "ConfigMap", f"{RELEASE}-fleetroute")["data"]["router.yaml"]
    # External, by URL: no built-in StatefulSet; routers and agents take the URL from the config and flags.
    assert not [k for k in kinds("external-redis-values") if k[0] in ("StatefulSet", "Secret") and "redis" in k[1]]
    assert _router_config(rendered["external-redis-values"])["redis"]["url"] == "redis://redis.cache.svc:6379/2"
    # From a Secret: no URL (and no password) in the ConfigMap; $REDIS_URL in router and agent.
    objs = rendered["external-redis-secret-values"]
    assert "redis" not in _router_config(objs)
    for env in env_of(objs, "router") + env_of(objs, "worker"):
        assert env["REDIS_URL"].startswith("redis://")
    # Redis off: the router scrapes engines itself, and no agent runs.
    objs = rendered["hpa-values"]
    assert _router_config(objs)["redis"] == {"url": None}
    workers = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"]
    assert workers and all(len(w["spec"]["template"]["spec"]["containers"]) == 1 for w in workers)


def test_hpa_ingress_and_monitoring(rendered):
    hpa = _one(rendered["hpa-values"], "HorizontalPodAutoscaler")
    assert hpa["spec"]["minReplicas"] == 3 and hpa["spec"]["scaleTargetRef"]["name"] == f"{RELEASE}-fleetroute"
    assert "replicas" not in _one(rendered["hpa-values"], "Deployment", f"{RELEASE}-fleetroute")["spec"]
    ingress = _one(rendered["ingress-values"], "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{RELEASE}-fleetroute", "port": {"name": "http"}}
    objs = rendered["monitoring-values"]
    monitors = {o["metadata"]["name"]: o for o in objs if o["kind"] == "ServiceMonitor"}
    metrics_svc = _one(objs, "Service", f"{RELEASE}-fleetroute-metrics")
    router_sm = monitors[f"{RELEASE}-fleetroute-router"]
    assert router_sm["spec"]["selector"]["matchLabels"].items() <= metrics_svc["metadata"]["labels"].items()
    assert router_sm["spec"]["endpoints"][0]["port"] == metrics_svc["spec"]["ports"][0]["name"]
    # The ingress Service never exposes the admin port.
    assert [p["targetPort"] for p in _one(objs, "Service", f"{RELEASE}-fleetroute")["spec"]["ports"]] == ["http"]
    dashboard = json.loads(_one(objs, "ConfigMap", f"{RELEASE}-fleetroute-dashboard")["data"]["fleetroute.json"])
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p["targets"])
    metrics_py = (ROOT / "router" / "runtime" / "metrics.py").read_text()
    for name in set(re.findall(r"\bfleetroute_[a-z_]+", exprs)):
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{base}"' in metrics_py, f"dashboard uses {name}, which router/runtime/metrics.py does not define"
    for needed in ("fleetroute_endpoint_in_flight_requests", "fleetroute_time_to_first_byte_seconds_bucket",
                   "fleetroute_outlier_ejections_total", "fleetroute_breaker_state", "fleetroute_admission_shed_total",
                   "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total", "DCGM_FI_DEV_GPU_UTIL"):
        assert needed in exprs


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--set", "router.replicaCount=-1"], "at '/router/replicaCount': minimum: got -1, want 1", id="negative-replicas"),
        pytest.param(["--set", "router.replicaCont=2"], "replicaCont", id="unknown-key"),
        pytest.param(["--set", "pools[0].engine.kvCacheDtype=fp4"], "kvCacheDtype", id="bad-kv-cache-dtype"),
        pytest.param(["--set", "router.podAntiAffinity=always"], "podAntiAffinity", id="bad-anti-affinity"),
        pytest.param(["--set", "redis.external.url=http://redis:6379"], "at '/redis/external/url'", id="bad-redis-url"),
        pytest.param(["--set", "pools[0].engine.gpuMemoryUtilization=1.5"], "gpuMemoryUtilization", id="gpu-mem-over-1"),
        pytest.param(["--set", "gpuTelemetry.source=sim"], "at '/gpuTelemetry/source': value must be one of 'none', "
                     "'nvml', 'dcgm'", id="gpu-telemetry-source-sim"),
        # The sidecar cannot see its pod's GPUs: its old `nvml` source is gone from the chart (gpuTelemetry instead).
        pytest.param(["--set", "agent.gpuSource=nvml"], "gpuSource", id="agent-gpu-source-removed"),
        pytest.param(["--set", "gpuTelemetry.dcgm.url=localhost:9400"], "at '/gpuTelemetry/dcgm/url'", id="dcgm-url"),
        pytest.param(["--set", "router.policies[0].name=chat,router.policies[0].preset=chat"],
                     "at '/router/policies/0/preset': value must be one of 'realtime-chat', 'batch-generation', "
                     "'rag-search'", id="unknown-preset"),
        pytest.param(["--set", "routingPolicyControl.maxPriority=2000"],
                     "at '/routingPolicyControl/maxPriority': maximum: got 2,000, want 1,000", id="max-priority"),
        pytest.param(["--set", "routingPolicyControl.allowedModel={a}"], "allowedModel", id="unknown-control-key"),
    ],
)
def test_bad_values_are_rejected_with_a_clear_message(helm, args, message):
    proc = helm("template", RELEASE, str(CHART), *args, check=False)
    assert proc.returncode != 0, f"helm accepted {args}"
    assert "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


def test_gpu_telemetry_without_redis_fails_with_the_reason(helm):
    proc = helm("template", RELEASE, str(CHART), "--set", "gpuTelemetry.source=nvml,redis.enabled=false", check=False)
    assert proc.returncode != 0 and "gpuTelemetry.source needs redis.enabled and agent.enabled" in proc.stderr


def _worker_args(objs: list[dict]) -> list[list[str]]:
    """The agent sidecars' args, one list per worker Deployment."""
    return [c["args"] for o in objs if o["kind"] == "Deployment"
            and o["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"
            for c in o["spec"]["template"]["spec"]["containers"] if c["name"] == "agent"]


def test_gpu_telemetry_node_agents_find_the_workers_gpus(rendered):
    from router.cli import build_parser

    # Off by default: no DaemonSet, and the sidecars publish engine signals only.
    assert not [o for o in rendered["default"] if o["kind"] == "DaemonSet"]
    assert all("--gpu-source=none" in args for args in _worker_args(rendered["default"]))
    for name in ("gpu-telemetry-nvml-values", "gpu-telemetry-dcgm-values"):
        objs = rendered[name]
        values = yaml.safe_load((CHART / "ci" / f"{name}.yaml").read_text())["gpuTelemetry"]
        ds = _one(objs, "DaemonSet", f"{RELEASE}-fleetroute-gpu-telemetry")
        pod = ds["spec"]["template"]["spec"]
        (agent,) = pod["containers"]
        args = build_parser().parse_args(agent["args"])  # the real command line accepts what the chart writes
        assert args.source == values["source"] and args.interval == values.get("interval", "1s")
        # It publishes the pods the routers discover (pod names in the release namespace) ...
        assert args.namespace == [_router_config(objs)["discovery"]["kubernetes"]["namespace"]] == [NAMESPACE]
        # ... counting the GPUs of the workers' engine container, and each worker's agent merges its record.
        engines = {c["name"] for o in objs if o["kind"] == "Deployment" and "nvidia.com/gpu" in str(o)
                   for c in o["spec"]["template"]["spec"]["containers"] if "nvidia.com/gpu" in str(c.get("resources"))}
        assert args.container == sorted(engines) == ["vllm"]
        assert all("--gpu-source=node" in a for a in _worker_args(objs))
        assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
        assert pod["automountServiceAccountToken"] is False  # no Kubernetes API access
        assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
        assert {t["key"] for t in pod["tolerations"]} == {"nvidia.com/gpu"}
        env = {e["name"]: e for e in agent["env"]}
        assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        ports = {p["name"]: p["containerPort"] for p in agent["ports"]}
        assert ports == {"metrics": args.metrics_port}
        assert agent["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
        sc = agent["securityContext"]
        assert sc["capabilities"]["drop"] == ["ALL"] and sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        if args.source == "nvml":
            # Every GPU of the node through the NVIDIA runtime, and the kubelet's socket, which only root may use.
            assert pod["runtimeClassName"] == values["nvml"]["runtimeClassName"]
            assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
            assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility"
            (volume,) = pod["volumes"]
            assert volume["hostPath"] == {"path": "/var/lib/kubelet/pod-resources", "type": "Directory"}
            (mount,) = agent["volumeMounts"]
            assert mount["name"] == volume["name"] and mount["readOnly"]
            assert args.pod_resources_socket == mount["mountPath"] + "/kubelet.sock"
            assert sc["runAsUser"] == 0
            # The node agent writes where the routers' agents read: the same Redis, password included.
            (router,) = _one(objs, "Deployment", f"{RELEASE}-fleetroute")["spec"]["template"]["spec"]["containers"]
            assert container_env(objs, agent)["REDIS_URL"] == container_env(objs, router)["REDIS_URL"]
            assert not [a for a in agent["args"] if a.startswith("--redis")]
            # ... and may: Redis' NetworkPolicy lets in the pods labelled as its clients.
            assert ds["spec"]["template"]["metadata"]["labels"]["fleetroute.io/redis-client"] == "true"
            monitor = _one(objs, "PodMonitor")
            assert monitor["spec"]["selector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
            assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        else:
            # dcgm-exporter has mapped the pods already: no socket, no GPU, no root.
            assert "volumes" not in pod and "runtimeClassName" not in pod
            assert sc["runAsNonRoot"] and sc["runAsUser"] == 10001
            assert args.dcgm_url == values["dcgm"]["url"]
            assert args.dcgm_hostname_check  # another node's series are left out (worker/node_sources.py)
            assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
            assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "fleetroute-redis"
            assert not [a for a in agent["args"] if a.startswith("--redis")]


def test_the_dcgm_hostname_check_can_be_turned_off_for_an_exporter_that_names_its_pod(helm):
    from router.cli import build_parser

    values = CHART / "ci" / "gpu-telemetry-dcgm-values.yaml"
    objs = [d for d in yaml.safe_load_all(_template(helm, "-f", str(values), "--set",
                                                    "gpuTelemetry.dcgm.checkHostname=false")) if d]
    (agent,) = _one(objs, "DaemonSet", f"{RELEASE}-fleetroute-gpu-telemetry")["spec"]["template"]["spec"]["containers"]
    assert build_parser().parse_args(agent["args"]).dcgm_hostname_check is False


def _schema_paths(schema: dict, documented: set[str], prefix: str = "") -> tuple[set[str], set[str]]:
    """(every path values.schema.json knows, the leaves: paths where it stops describing structure or where
    a `## @param` documents a whole object such as `resources`). Each leaf must be documented."""
    paths, leaves = set(), set()
    for key, sub in schema.get("properties", {}).items():
        path = f"{prefix}{key}"
        paths.add(path)
        items = sub.get("items", {}) if sub.get("type") == "array" else {}
        if "properties" in sub and path not in documented:
            more, more_leaves = _schema_paths(sub, documented, path + ".")
        elif "properties" in items and any(d.startswith(path + "[].") for d in documented):
            leaves.add(path)
            more, more_leaves = _schema_paths(items, documented, path + "[].")
        else:
            more, more_leaves = set(), {path}
        paths |= more
        leaves |= more_leaves
    return paths, leaves


def _reference_module():
    spec = importlib.util.spec_from_file_location("helm_values_reference", ROOT / "scripts" / "helm_values_reference.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_value_is_documented_and_in_the_schema():
    ref = _reference_module()
    documented = {key for kind, key, _ in ref.params((CHART / "values.yaml").read_text()) if kind != "section"}
    paths, leaves = _schema_paths(json.loads((CHART / "values.schema.json").read_text()), documented)
    # routingPolicies[] items are documented by the routingPolicies line and the CRD reference.
    leaves -= {"routingPolicies[].name", "routingPolicies[].spec"}
    assert leaves - documented == set(), "values without a `## @param` line"
    assert documented - paths == set(), "`## @param` lines for values the schema does not know"


def test_docs_values_reference_is_current():
    ref = _reference_module()
    doc = (ROOT / "docs" / "kubernetes.md").read_text()
    assert ref.render_doc(doc, (CHART / "values.yaml").read_text()) == doc, (
        "docs/kubernetes.md's values reference is out of date: run `python scripts/helm_values_reference.py --write`")


def test_chart_ships_the_crd():
    if not CRD.exists():
        pytest.skip(f"{CRD.relative_to(ROOT)} does not exist yet (the RoutingPolicy CRD is written separately); "
                    f"copy it to {CHART_CRD.relative_to(ROOT)} once it does")
    assert CHART_CRD.exists(), f"copy {CRD.relative_to(ROOT)} to {CHART_CRD.relative_to(ROOT)}"
    assert CHART_CRD.read_bytes() == CRD.read_bytes(), f"{CHART_CRD.relative_to(ROOT)} differs from {CRD.relative_to(ROOT)}"


# What a CRD's openAPIV3Schema node may hold (apiextensions.k8s.io/v1 JSONSchemaProps, as structural schemas use
# it), what an x-kubernetes-validations rule and a printer column may hold. A description with an unquoted
# comma inside a {flow mapping} splits into stray keys (issue #16): they show here, and in kubernetes-validate.
SCHEMA_KEYS = {
    "type", "format", "title", "description", "default", "nullable", "enum", "properties", "additionalProperties",
    "items", "required", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
    "maxLength", "pattern", "minItems", "maxItems", "uniqueItems", "minProperties", "maxProperties", "allOf",
    "anyOf", "oneOf", "not", "example", "externalDocs", "x-kubernetes-int-or-string",
    "x-kubernetes-preserve-unknown-fields", "x-kubernetes-embedded-resource", "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys", "x-kubernetes-map-type", "x-kubernetes-validations",
}
RULE_KEYS = {"rule", "message", "messageExpression", "reason", "fieldPath", "optionalOldSelf"}
COLUMN_KEYS = {"name", "type", "format", "description", "priority", "jsonPath"}


def _schema_problems(node: dict, path: str, *, bounded: bool) -> list[str]:
    """Keys outside the vocabulary, descriptions that are not whole sentences (a lost tail ends mid-phrase),
    and, where `bounded` (the spec, which the CEL rules read), strings, lists and maps without a size bound:
    the API server estimates each rule's cost from those bounds and refuses a CRD whose rules could cost too
    much."""
    problems = [f"{path}: stray key {key!r}" for key in node if key not in SCHEMA_KEYS]
    description = node.get("description")
    if description is not None and not (isinstance(description, str) and description.rstrip().endswith(".")):
        problems.append(f"{path}: description {description!r} is not a sentence ending in '.'")
    for rule in node.get("x-kubernetes-validations", ()):
        problems += [f"{path}: rule with stray key {key!r}" for key in rule if key not in RULE_KEYS]
        problems += [f"{path}: {problem}" for problem in _costly(rule["rule"], node)]
    if bounded:
        kind = "string" if node.get("type") == "string" or node.get("x-kubernetes-int-or-string") else node.get("type")
        if kind == "string" and "maxLength" not in node and "enum" not in node:
            problems.append(f"{path}: a string without maxLength")
        if kind == "array" and "maxItems" not in node:
            problems.append(f"{path}: a list without maxItems")
        if isinstance(node.get("additionalProperties"), dict) and "maxProperties" not in node:
            problems.append(f"{path}: a map without maxProperties")
    for key, sub in (node.get("properties") or {}).items():
        problems += _schema_problems(sub, f"{path}.{key}", bounded=bounded)
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            problems += _schema_problems(node[key], f"{path}.{key}", bounded=bounded)
    return problems


def _costly(rule: str, node: dict) -> list[str]:
    """Operations whose estimated cost the API server cannot bound, so that it refuses the CRD ("estimated rule
    cost exceeds budget"): `string(...)` (its result has no size estimate), and a regular expression matched
    against anything but a string with maxLength (an int-or-string field is typed dyn, sized like a whole
    request, whatever its maxLength: apiextensions-apiserver's SchemaDeclType). cel-go costs endsWith by its
    argument and `+` linearly, which is what the duration rules use instead."""
    problems = [f"rule {rule!r} calls string()"] if re.search(r"\bstring\(", rule) else []
    for receiver in re.findall(r"((?:self|\w+)(?:\.\w+)*)\.matches\(", rule):
        target = node
        parts = receiver.split(".")
        if parts[0] != "self":
            continue  # a comprehension's variable (a map key): bounded by the map's maxProperties
        for part in parts[1:]:
            target = (target.get("properties") or {}).get(part, {})
        if target.get("type") != "string" or "maxLength" not in target:
            problems.append(f"rule {rule!r} matches a regular expression against {receiver}, not a bounded string")
    return problems


def _rendered_crd(helm) -> dict:
    """The CRD as `helm install` sends it: the chart's crds/ folder, rendered with --include-crds."""
    docs = [d for d in yaml.safe_load_all(_template(helm, "--include-crds")) if d]
    (crd,) = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    return crd


@pytest.mark.parametrize("source", ["manifests/crd", "chart --include-crds"])
def test_the_crd_is_a_valid_kubernetes_object(helm, source):
    crd = yaml.safe_load(CRD.read_text()) if source == "manifests/crd" else _rendered_crd(helm)
    for version in KUBE_VERSIONS:
        try:
            kubernetes_validate.validate(crd, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"the CRD ({source}) is invalid for Kubernetes {version}: {exc.message} at "
                        f"{'.'.join(map(str, exc.path))}")
    (version,) = crd["spec"]["versions"]
    schema = version["schema"]["openAPIV3Schema"]
    problems = _schema_problems(schema, "openAPIV3Schema", bounded=False)
    problems += _schema_problems(schema["properties"]["spec"], "spec", bounded=True)
    for column in version["additionalPrinterColumns"]:
        problems += [f"column {column['name']}: stray key {key!r}" for key in column if key not in COLUMN_KEYS]
        if not column.get("description", ".").endswith("."):
            problems.append(f"column {column['name']}: description {column['description']!r} is cut short")
    assert problems == []
    assert crd == yaml.safe_load(CRD.read_text())  # the chart installs the same object as manifests/crd/


def _without_source_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("# Source: ")).strip() + "\n"


def test_plain_manifests_are_the_chart_with_defaults(helm):
    fresh = _template(helm, "-f", str(MANIFEST_VALUES), release=MANIFEST_RELEASE, namespace=MANIFEST_NAMESPACE)
    assert MANIFEST.exists(), f"render it: {MANIFEST_COMMAND}"
    assert _without_source_comments(MANIFEST.read_text()) == _without_source_comments(fresh), (
        f"manifests/fleetroute.yaml is out of date; render it again: {MANIFEST_COMMAND}")


MANIFEST_VALUES = ROOT / "manifests" / "fleetroute-values.yaml"
MANIFEST_COMMAND = (f"helm template {MANIFEST_RELEASE} helm/fleetroute --namespace {MANIFEST_NAMESPACE} "
                    "-f manifests/fleetroute-values.yaml > manifests/fleetroute.yaml (docs/kubernetes.md#without-helm)")


def test_notes_tell_how_to_reach_the_endpoint_and_see_policies(helm):
    # `helm install --dry-run=client` renders NOTES.txt without a cluster.
    for extra, url in (([], "http://127.0.0.1:8080/v1/models"),
                       (["-f", str(CHART / "ci" / "ingress-values.yaml")], "https://llm.example.com/v1/models")):
        out = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *extra).stdout
        notes = out.split("NOTES:", 1)[1]
        assert url in notes and f"kubectl get rp -n {NAMESPACE}" in notes
        assert '"model": "qwen2.5-1.5b-instruct"' in notes
        assert "http://127.0.0.1:9090/status" in notes  # the status page, through the metrics port-forward


def test_trusted_proxies_reach_the_router(helm, tmp_path, monkeypatch):
    """An ingress controller's network, given as a value, is what the routers believe X-Forwarded-* from."""
    import ipaddress

    objs = [d for d in yaml.safe_load_all(_template(
        helm, "--set", "router.trustedProxies={10.42.0.0/16,fd00::/8}")) if d]
    listen = _parse_as_the_router_pod(objs, tmp_path, monkeypatch).listen
    assert listen.trusted_proxies == (ipaddress.ip_network("10.42.0.0/16"), ipaddress.ip_network("fd00::/8"))
    # By default nobody is trusted: the routers write the forwarding headers themselves.
    assert _parse_as_the_router_pod([d for d in yaml.safe_load_all(_template(helm)) if d], tmp_path / "d",
                                    monkeypatch).listen.trusted_proxies == ()


def test_tenants_reach_the_router_with_their_keys(helm, tmp_path, monkeypatch):
    """router.tenancy becomes the router's `tenancy:` block, and router.apiKeys.keys may name a key's tenant."""
    from router.server import auth

    objs = [d for d in yaml.safe_load_all(_template(
        helm, "--set", "router.apiKeys.keys={sk-acme-1 tenant=acme,sk-ops-2 explain tenant=ops,sk-anyone-3}",
        "--set", "router.tenancy.tenants[0].name=acme,router.tenancy.tenants[0].weight=3",
        "--set", "router.tenancy.tenants[0].requestsPerMinute=600,router.tenancy.tenants[1].name=ops",
        "--set", "router.tenancy.budgetFailMode=closed")) if d]
    settings = _parse_as_the_router_pod(objs, tmp_path, monkeypatch)
    tenancy = settings.tenancy
    assert tenancy is not None and tenancy.names() == ("default", "acme", "ops")
    assert tenancy.tenant("acme").weight == 3 and tenancy.tenant("acme").requests_per_minute == 600
    assert tenancy.budget_fail_mode == "closed" and tenancy.fairness
    tenants = dict(zip(settings.auth.api_key_digests, settings.auth.api_key_tenants, strict=True))
    assert [tenants[auth._digest(k)] for k in ("sk-acme-1", "sk-ops-2", "sk-anyone-3")] == ["acme", "ops", "default"]
    # By default there are no tenants.
    assert _parse_as_the_router_pod([d for d in yaml.safe_load_all(_template(helm)) if d], tmp_path / "d",
                                    monkeypatch).tenancy is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "redis.enabled=false,router.tenancy.tenants[0].name=acme,router.tenancy.tenants[0].tokensPerMinute=9"],
         "router.tenancy.tenants[0] (acme): budgets (requestsPerMinute, tokensPerMinute) are shared between the routers "
         "through Redis"),
        (["--set", "router.tenancy.tenants[0].name=Acme Corp"], "at '/router/tenancy/tenants/0/name'"),
        (["--set", "router.tenancy.budgetFailMode=sometimes"], "at '/router/tenancy/budgetFailMode'"),
        (["--set", "router.tenancy.tenant=x"], "tenant"),
        (["--set", "router.apiKeys.keys={sk-a team=acme}"], "at '/router/apiKeys/keys/0'"),
    ],
    ids=["budgets-without-redis", "bad-name", "bad-fail-mode", "unknown-key", "bad-key-flag"],
)
def test_bad_tenancy_values_are_rejected_with_a_clear_message(helm, args, message):
    result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]


def test_tracing_values_reach_the_router_with_headers_from_a_secret_and_an_egress_rule(helm, monkeypatch):
    """router.tracing becomes the router's `tracing:` block; the export headers come from an existing Secret through
    the variable the config names, and the router's NetworkPolicy lets it reach the collector."""
    objs = [d for d in yaml.safe_load_all(_template(
        helm, "--set", "router.tracing.enabled=true", "--set-json", "router.tracing.sampleRatio=0.25",
        "--set", "router.tracing.endpoint=https://otel.observability:4318/v1/traces",
        "--set", "router.tracing.headersSecret.name=otlp-auth",
        "--set", "networkPolicy.otlpCollector.ports={4318,443}")) if d]
    config = _router_config(objs)
    assert config["tracing"] == {"enabled": True, "endpoint": "https://otel.observability:4318/v1/traces",
                                 "serviceName": f"{RELEASE}-fleetroute", "sampleRatio": 0.25,
                                 "headersEnv": "FLEETROUTE_OTLP_HEADERS"}
    (router,) = _one(objs, "Deployment", f"{RELEASE}-fleetroute")["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in router["env"] if e["name"] == "FLEETROUTE_OTLP_HEADERS"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "otlp-auth", "key": "headers"}
    monkeypatch.setenv("FLEETROUTE_OTLP_HEADERS", "x-api-key=abc")
    tracing = parse_settings({"tracing": config["tracing"]}).tracing
    assert tracing is not None and tracing.enabled and tracing.headers == (("x-api-key", "abc"),)
    egress = _one(objs, "NetworkPolicy", f"{RELEASE}-fleetroute-router")["spec"]["egress"]
    assert {"ports": [{"port": 4318, "protocol": "TCP"}, {"port": 443, "protocol": "TCP"}]} in egress
    # Off by default: no block, no variable, no egress rule for a collector.
    default = [d for d in yaml.safe_load_all(_template(helm)) if d]
    assert "tracing" not in _router_config(default)
    egress = _one(default, "NetworkPolicy", f"{RELEASE}-fleetroute-router")["spec"]["egress"]
    assert all(rule.get("ports") != [{"port": 4318, "protocol": "TCP"}] for rule in egress)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set", "router.tracing.sampleRatio=2"], "at '/router/tracing/sampleRatio'"),
        (["--set", "router.tracing.endpoint=collector:4318"], "at '/router/tracing/endpoint'"),
        (["--set", "router.tracing.sample=1"], "sample"),
    ],
    ids=["ratio-above-1", "not-a-url", "unknown-key"],
)
def test_bad_tracing_values_are_rejected_with_a_clear_message(helm, args, message):
    result = helm("template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args, check=False)
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
