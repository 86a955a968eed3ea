"""The Helm chart closed by default, and worker pools a deployer can trust (docs/kubernetes.md#secured-by-default,
#worker-pools), rendered by the real helm binary (tests/helm_chart.py).

What is checked:
- secrets: the admin token, the client API keys and the built-in Redis password are generated into Secrets
  when none is given, differ at every cluster-less render, survive an upgrade (helm's `lookup` against the
  fake API server), and roll exactly the pods that read them when they change; the built-in Redis refuses
  clients without its password (a real server started with the rendered arguments);
- NetworkPolicies, evaluated (tests/netpol.py): clients reach the API port, only monitoring the admin port,
  routers reach DNS, the API server, workers and Redis, agents Redis, nobody else Redis;
- worker pools: a surge rollout by default, a PodDisruptionBudget, a start-up budget, a model cache and a
  RuntimeClass per pool, ephemeral-storage requests that cover the emptyDirs, the vLLM container non-root on a
  read-only root filesystem with every cache path writable, every pod at the Pod Security "restricted" level;
- cross-field checks that values.schema.json cannot express fail with a message naming the values;
- KEDA ScaledObjects, the HTTPRoute and the PrometheusRule (whose every metric and label must exist in the
  router's registry), and the NOTES' warning for an exposed router without API keys.
"""

from __future__ import annotations

import base64
import json
import os
import re
import select
import shutil
import subprocess
import time
from pathlib import Path

import promql_parser
import pytest
import redis
import yaml

from loadtest.host import free_port
from loadtest.redis_server import server_binary
from router.runtime.metrics import RouterMetrics
from tests import fake_kube
from tests.fake_kube import FakeKube, Resource
from tests.helm_chart import CHART, NAMESPACE, RELEASE, VALUE_SETS, container_env, helm, one, rendered  # noqa: F401
from tests.helm_chart import template as _template
from tests.netpol import Address, Network, Pod

ROUTER = f"{RELEASE}-fleetroute"


def _objs(text: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(text) if d]


def _secret(objs: list[dict], name: str, key: str) -> str:
    return base64.b64decode(one(objs, "Secret", name)["data"][key]).decode()


def _pod_template(objs: list[dict], kind: str, name: str) -> dict:
    return one(objs, kind, name)["spec"]["template"]


def _checksums(objs: list[dict]) -> dict[str, str | None]:
    """checksum/secrets of every workload's pods."""
    return {o["metadata"]["name"]: o["spec"]["template"]["metadata"].get("annotations", {}).get("checksum/secrets")
            for o in objs if o["kind"] in ("Deployment", "StatefulSet")}


def _workloads(objs: list[dict]) -> list[dict]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


# ---- secrets -------------------------------------------------------------------------------------------------


def test_secrets_are_generated_when_none_is_given(helm):
    # `helm template` has no cluster: `lookup` finds no earlier Secret, so each render generates new secrets.
    first, second = _objs(_template(helm)), _objs(_template(helm))
    for name, key, pattern in ((f"{ROUTER}-admin", "admin-token", r"[A-Za-z0-9]{40}"),
                               (f"{ROUTER}-api-keys", "api-keys", r"sk-[A-Za-z0-9]{40}\n"),
                               (f"{ROUTER}-redis", "redis-password", r"[A-Za-z0-9]{32}")):
        a, b = _secret(first, name, key), _secret(second, name, key)
        assert re.fullmatch(pattern, a) and re.fullmatch(pattern, b), (name, a)
        assert a != b, f"{name} is the same at every render: it is not a secret"
    # A generated secret never changes once made, so it does not feed the pods' checksum: no render (nor the
    # first upgrade, when `lookup` first finds the Secret) rolls pods for it.
    assert _checksums(first) == _checksums(second)


def test_secrets_given_in_values_are_used(rendered):
    objs = rendered["gateway-values"]
    assert _secret(objs, f"{ROUTER}-api-keys", "api-keys") == "sk-team-a-0123456789\nsk-ops-9876543210 explain\n"
    assert _secret(rendered["external-redis-values"], f"{ROUTER}-admin", "admin-token") == "change-me"
    # Secrets the user owns are referenced, never rendered.
    objs = rendered["closed-network-values"]
    assert not [o for o in objs if o["kind"] == "Secret"]
    pod = _pod_template(objs, "Deployment", ROUTER)["spec"]
    refs = {e["valueFrom"]["secretKeyRef"]["name"] for c in pod["containers"] for e in c["env"] if "valueFrom" in e
            and "secretKeyRef" in e["valueFrom"]}
    assert refs == {"fleetroute-admin", "fleetroute-redis"}
    keys = next(v["secret"] for v in pod["volumes"] if v["name"] == "api-keys")
    assert keys["secretName"] == "fleetroute-client-keys" and keys["items"][0]["key"] == "keys.txt"


@pytest.fixture
async def cluster(tmp_path):
    """The fake API server, serving Secrets and the kinds helm maps the chart's objects to, and a kubeconfig."""
    kinds = [("", "v1", "secrets", "Secret"), ("", "v1", "configmaps", "ConfigMap"),
             ("", "v1", "serviceaccounts", "ServiceAccount"), ("", "v1", "persistentvolumeclaims", "PersistentVolumeClaim"),
             ("apps", "v1", "deployments", "Deployment"), ("apps", "v1", "statefulsets", "StatefulSet"),
             ("policy", "v1", "poddisruptionbudgets", "PodDisruptionBudget"),
             ("rbac.authorization.k8s.io", "v1", "roles", "Role"),
             ("rbac.authorization.k8s.io", "v1", "rolebindings", "RoleBinding"),
             ("networking.k8s.io", "v1", "networkpolicies", "NetworkPolicy"),
             ("networking.k8s.io", "v1", "ingresses", "Ingress"),
             ("autoscaling", "v2", "horizontalpodautoscalers", "HorizontalPodAutoscaler")]
    extra = tuple(Resource(g, v, plural, kind, kind.lower()) for g, v, plural, kind in kinds)
    saved = fake_kube.RESOURCES
    fake_kube.RESOURCES = (*saved, *(r for r in extra if r.plural not in {s.plural for s in saved}))
    kube = await FakeKube(token=None).start()
    try:
        yield kube, kube.write_kubeconfig(tmp_path / "kubeconfig")
    finally:
        await kube.stop()
        fake_kube.RESOURCES = saved


def _release_secret(name: str, data: dict[str, str], *, ours: bool = True) -> dict:
    """A Secret as an earlier release of this chart left it (helm's ownership marks), or the user's own."""
    meta: dict = {"name": name, "namespace": NAMESPACE}
    if ours:
        meta["labels"] = {"app.kubernetes.io/managed-by": "Helm"}
        meta["annotations"] = {"meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": NAMESPACE}
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "data": {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}}


async def _render_against(helm, kubeconfig: Path, *args: str) -> list[dict]:
    # `--dry-run=server` renders with `lookup` reading the cluster, as install and upgrade do. helm runs in a
    # thread: the fake API server answers on this event loop meanwhile.
    import asyncio

    proc = await asyncio.to_thread(
        helm, "template", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=server",
        "--disable-openapi-validation", *args, kubeconfig=kubeconfig)
    return _objs(proc.stdout)


async def test_generated_secrets_survive_an_upgrade(helm, cluster):
    kube, kubeconfig = cluster
    fresh = await _render_against(helm, kubeconfig)  # the first install: nothing to find
    kept = {"admin-token": "Kept0admin0token", "api-keys": "sk-kept-key\n", "redis-password": "Kept0password"}
    for name, key in ((f"{ROUTER}-admin", "admin-token"), (f"{ROUTER}-api-keys", "api-keys"),
                      (f"{ROUTER}-redis", "redis-password")):
        kube.create("secrets", _release_secret(name, {key: kept[key]}), namespace=NAMESPACE)
    upgraded = await _render_against(helm, kubeconfig)
    assert _secret(upgraded, f"{ROUTER}-admin", "admin-token") == "Kept0admin0token"
    assert _secret(upgraded, f"{ROUTER}-api-keys", "api-keys") == "sk-kept-key\n"
    assert _secret(upgraded, f"{ROUTER}-redis", "redis-password") == "Kept0password"
    # The upgrade rolls nothing: the pods already read these very secrets.
    assert _checksums(upgraded) == _checksums(fresh)
    # A value given in values replaces the kept one (and rolls the router).
    given = await _render_against(helm, kubeconfig, "--set", "router.adminToken.value=NewToken")
    assert _secret(given, f"{ROUTER}-admin", "admin-token") == "NewToken"
    assert _checksums(given)[ROUTER] != _checksums(fresh)[ROUTER]


async def test_a_rotated_user_secret_rolls_the_router_at_the_next_upgrade(helm, cluster):
    kube, kubeconfig = cluster
    args = ("--set", "router.adminToken.existingSecret=ops-admin")
    kube.create("secrets", _release_secret("ops-admin", {"admin-token": "first"}, ours=False), namespace=NAMESPACE)
    before = _checksums(await _render_against(helm, kubeconfig, *args))
    kube.update("secrets", _release_secret("ops-admin", {"admin-token": "second"}, ours=False), namespace=NAMESPACE)
    after = _checksums(await _render_against(helm, kubeconfig, *args))
    assert before[ROUTER] != after[ROUTER]
    assert {k: v for k, v in before.items() if k != ROUTER} == {k: v for k, v in after.items() if k != ROUTER}


@pytest.mark.parametrize(
    ("change", "rolled"),
    [
        pytest.param("router.adminToken.value=other", {ROUTER}, id="admin-token"),
        pytest.param("router.apiKeys.keys[0]=sk-other", {ROUTER}, id="api-keys"),
        pytest.param("redis.auth.password=other", {ROUTER, f"{ROUTER}-default", f"{ROUTER}-redis"}, id="redis-password"),
    ],
)
def test_a_changed_secret_rolls_exactly_the_pods_that_read_it(helm, rendered, change, rolled):
    before = _checksums(rendered["default"])
    after = _checksums(_objs(_template(helm, "--set", change)))
    assert {name for name in before if before[name] != after[name]} == rolled


@pytest.fixture
def redis_binary():
    try:
        return server_binary()
    except Exception as exc:  # noqa: BLE001 - say why instead of a stack trace
        pytest.fail(f"no Redis server binary for this test: {exc}")


def test_builtin_redis_refuses_clients_without_its_password(rendered, redis_binary, tmp_path):
    # Start a real server with the StatefulSet's arguments and environment, as the kubelet would (on a free
    # loopback port: later options win), then connect as an outsider and as a router.
    objs = rendered["default"]
    (container,) = _pod_template(objs, "StatefulSet", f"{ROUTER}-redis")["spec"]["containers"]
    env = container_env(objs, container)
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m[1]], a) for a in container["args"]]
    port = free_port()
    proc = subprocess.Popen([redis_binary, *args, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log, deadline = b"", time.monotonic() + 20
        while b"Ready to accept connections" not in log and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
            chunk = os.read(proc.stdout.fileno(), 4096) if ready else b""
            assert chunk, f"redis did not start: {log.decode(errors='replace')[-2000:]}"
            log += chunk
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, socket_timeout=5).ping()
        (router,) = _pod_template(objs, "Deployment", ROUTER)["spec"]["containers"]
        url = container_env(objs, router)["REDIS_URL"].replace(f"{ROUTER}-redis:6379", f"127.0.0.1:{port}")
        assert redis.Redis.from_url(url, socket_timeout=5).ping()
        # The readiness probe: PONG only with the password (redis-cli exits 0 on an error reply, so the probe
        # greps). Run where a redis-cli is installed, as on the Debian machines the tests run on.
        probe = container["readinessProbe"]["exec"]["command"]
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if cli is not None:
            script = probe[2].replace("redis-cli", cli).replace("-p 6379", f"-p {port}")
            auth = {"PATH": os.environ["PATH"], "REDISCLI_AUTH": env["REDISCLI_AUTH"]}
            assert subprocess.run([probe[0], probe[1], script], env=auth, timeout=10).returncode == 0
            assert subprocess.run([probe[0], probe[1], script], env={"PATH": os.environ["PATH"]}, timeout=10).returncode == 1
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


# ---- network policies ----------------------------------------------------------------------------------------


def _pods(objs: list[dict]) -> dict[str, Pod]:
    pods = {}
    for w in [*_workloads(objs), *(o for o in objs if o["kind"] == "DaemonSet")]:
        tmpl = w["spec"]["template"]
        ports = {p["name"]: p["containerPort"] for c in tmpl["spec"]["containers"] for p in c.get("ports", [])}
        pods[w["metadata"]["name"]] = Pod(w["metadata"]["name"], NAMESPACE, tmpl["metadata"]["labels"], ports)
    return pods


GPU_AGENT = f"{ROUTER}-gpu-telemetry"
OUTSIDERS = {
    "stranger": Pod("stranger", NAMESPACE, {"app": "stranger"}),  # another app in the release's namespace
    "elsewhere": Pod("elsewhere", "default", {"app": "web"}),
    "ingress": Pod("ingress", "ingress-nginx", {"app.kubernetes.io/name": "ingress-nginx"}),
    "prometheus": Pod("prometheus", "monitoring", {"app.kubernetes.io/name": "prometheus"}),
    "grafana": Pod("grafana", "monitoring", {"app.kubernetes.io/name": "grafana"}),
    "kube-dns": Pod("kube-dns", "kube-system", {"k8s-app": "kube-dns"}),
    "api-server": Address("api-server", "10.0.0.1"),
    "internet": Address("internet", "203.0.113.5"),
}


def _network(objs: list[dict]) -> tuple[Network, dict]:
    return Network([o for o in objs if o["kind"] == "NetworkPolicy"]), {**_pods(objs), **OUTSIDERS}


@pytest.mark.parametrize(
    ("sender", "receiver", "port", "protocol", "default", "closed"),
    [
        # Clients reach the OpenAI API: from anywhere by default, only from the ingress controller when closed.
        ("elsewhere", ROUTER, 8080, "TCP", True, False),
        ("ingress", ROUTER, 8080, "TCP", True, True),
        # The admin port (/metrics, and /admin behind the token) only from monitoring (closed: Prometheus only).
        ("prometheus", ROUTER, 9090, "TCP", True, True),
        ("grafana", ROUTER, 9090, "TCP", True, False),
        ("stranger", ROUTER, 9090, "TCP", False, False),
        ("elsewhere", ROUTER, 9090, "TCP", False, False),
        # Routers reach DNS, the API server (the Service's port and the endpoints'), workers and Redis.
        (ROUTER, "kube-dns", 53, "UDP", True, True),
        (ROUTER, "api-server", 443, "TCP", True, True),
        (ROUTER, "api-server", 6443, "TCP", True, True),
        (ROUTER, f"{ROUTER}-default", 8000, "TCP", True, True),
        (ROUTER, f"{ROUTER}-redis", 6379, "TCP", True, True),
        # ...and nothing else (by default the API server's address is unknown: port 443 anywhere is open).
        (ROUTER, "internet", 443, "TCP", True, False),
        (ROUTER, "internet", 80, "TCP", False, False),
        # Workers take requests from routers and scrapes from monitoring; agents publish to Redis; models come
        # over HTTPS by default (closed: from a pre-filled claim, no egress).
        ("stranger", f"{ROUTER}-default", 8000, "TCP", False, False),
        ("prometheus", f"{ROUTER}-default", 8000, "TCP", True, True),
        (f"{ROUTER}-default", f"{ROUTER}-redis", 6379, "TCP", True, True),
        (f"{ROUTER}-default", "kube-dns", 53, "UDP", True, True),
        (f"{ROUTER}-default", "internet", 443, "TCP", True, False),
        # Redis: only the release's clients, and it connects nowhere.
        ("stranger", f"{ROUTER}-redis", 6379, "TCP", False, False),
        ("prometheus", f"{ROUTER}-redis", 6379, "TCP", False, False),
        (f"{ROUTER}-redis", "internet", 443, "TCP", False, False),
    ],
)
def test_network_policies_let_through_what_the_release_needs(rendered, sender, receiver, port, protocol, default, closed):
    for value_set, expected in (("default", default), ("closed-network-values", closed)):
        network, places = _network(rendered[value_set])
        got = network.allows(places[sender], places[receiver], port, protocol)
        assert got == expected, f"{value_set}: {sender} -> {receiver}:{port}/{protocol} is {'open' if got else 'closed'}"


@pytest.mark.parametrize(
    ("source", "sender", "receiver", "port", "expected"),
    [
        # Node agents publish to Redis (as its labelled clients) and are scraped from monitoring only...
        ("nvml", GPU_AGENT, f"{ROUTER}-redis", 6379, True),
        ("nvml", "prometheus", GPU_AGENT, 9402, True),
        ("nvml", "stranger", GPU_AGENT, 9402, False),
        ("nvml", GPU_AGENT, "kube-dns", 53, True),
        # ...and reach nothing else: NVML and the kubelet's socket are no network peers.
        ("nvml", GPU_AGENT, "internet", 443, False),
        ("nvml", GPU_AGENT, "internet", 9400, False),
        # With the dcgm source, also the node's dcgm-exporter.
        ("dcgm", GPU_AGENT, "internet", 9400, True),
        ("dcgm", GPU_AGENT, "internet", 443, False),
    ],
)
def test_gpu_node_agents_are_closed_too(helm, source, sender, receiver, port, expected):
    objs = _objs(_template(helm, "-f", str(CHART / "ci" / f"gpu-telemetry-{source}-values.yaml")))
    network, places = _network(objs)
    protocol = "UDP" if port == 53 else "TCP"
    got = network.allows(places[sender], places[receiver], port, protocol)
    assert got == expected, f"{source}: {sender} -> {receiver}:{port} is {'open' if got else 'closed'}"


def test_network_policies_can_be_left_to_the_cluster(helm):
    objs = _objs(_template(helm, "--set", "networkPolicy.enabled=false"))
    assert not [o for o in objs if o["kind"] == "NetworkPolicy"]


# ---- worker pools --------------------------------------------------------------------------------------------


def _pool(objs: list[dict], name: str) -> tuple[dict, dict]:
    dep = one(objs, "Deployment", f"{ROUTER}-{name}")
    containers = {c["name"]: c for c in dep["spec"]["template"]["spec"]["containers"]}
    return dep, containers["vllm"]


def test_pools_roll_out_with_a_surge_unless_told_otherwise(rendered):
    dep, _ = _pool(rendered["two-pools-values"], "llama-8b")
    # The default: the old pods serve until the new one is ready (needs a spare GPU; without one the new pod
    # waits and the old ones keep serving). A one-replica pool never goes down in a rollout.
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert one(rendered["default"], "Deployment", f"{ROUTER}-default")["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    dep, vllm = _pool(rendered["two-pools-values"], "llama-70b")
    assert dep["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    # The rollout is reported stuck only after a new pod had its whole start-up budget.
    startup = vllm["startupProbe"]
    assert dep["spec"]["progressDeadlineSeconds"] > startup["periodSeconds"] * startup["failureThreshold"]


def test_every_pool_has_its_own_disruption_budget_and_start_up_budget(helm, rendered):
    objs = rendered["two-pools-values"]
    for name, threshold in (("llama-8b", 90), ("llama-70b", 360)):
        dep, vllm = _pool(objs, name)
        pdb = one(objs, "PodDisruptionBudget", f"{ROUTER}-{name}")
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
        assert pdb["spec"]["maxUnavailable"] == 1
        # ...and no other pool's pods.
        others = [d for d in _workloads(objs) if d is not dep]
        assert not [d for d in others if pdb["spec"]["selector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
        assert vllm["startupProbe"]["failureThreshold"] == threshold
    solo = one(rendered["pvc-cache-values"], "PodDisruptionBudget", f"{ROUTER}-solo")["spec"]
    assert solo["minAvailable"] == 1 and "maxUnavailable" not in solo
    budgets = [o["metadata"]["name"] for o in _objs(_template(helm, "--set", "worker.pdb.enabled=false"))
               if o["kind"] == "PodDisruptionBudget"]
    assert budgets == [ROUTER]


def _volumes(dep: dict) -> dict[str, dict]:
    return {v["name"]: v for v in dep["spec"]["template"]["spec"]["volumes"]}


def _gib(quantity: str) -> float:
    number, unit = re.fullmatch(r"([0-9.]+)(Gi|Mi)", quantity).groups()
    return float(number) / (1024 if unit == "Mi" else 1)


def test_model_cache_per_pool(rendered):
    # emptyDir sized per pool, with an ephemeral-storage request covering every emptyDir on disk: the 70B pool
    # (about 141 GB of weights) gets 200Gi, not the default 100Gi it would outgrow mid-download.
    objs = rendered["two-pools-values"]
    for name, size in (("llama-8b", "100Gi"), ("llama-70b", "200Gi")):
        dep, vllm = _pool(objs, name)
        volumes = _volumes(dep)
        assert volumes["models"]["emptyDir"] == {"sizeLimit": size}
        on_disk = [v["emptyDir"]["sizeLimit"] for v in volumes.values() if "emptyDir" in v and v["emptyDir"].get("medium") != "Memory"]
        assert _gib(vllm["resources"]["requests"]["ephemeral-storage"]) == sum(_gib(s) for s in on_disk)
    # A claim per pool, shared by its pods (ReadWriteMany), or ReadWriteOnce for a pool replaced in place.
    objs = rendered["pvc-cache-values"]
    claims = {c["metadata"]["name"]: c["spec"] for c in objs if c["kind"] == "PersistentVolumeClaim"}
    assert claims[f"{ROUTER}-chat-models"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "efs-sc",
                                               "resources": {"requests": {"storage": "60Gi"}}}
    assert claims[f"{ROUTER}-solo-models"]["accessModes"] == ["ReadWriteOnce"]
    for name in ("chat", "solo"):
        dep, vllm = _pool(objs, name)
        assert _volumes(dep)["models"]["persistentVolumeClaim"] == {"claimName": f"{ROUTER}-{name}-models"}
        assert _gib(vllm["resources"]["requests"]["ephemeral-storage"]) == 10  # $HOME and /tmp only
    # A read-only claim filled beforehand: mounted read-only, and vLLM never reaches for the Hub.
    dep, vllm = _pool(rendered["closed-network-values"], "default")
    assert _volumes(dep)["models"]["persistentVolumeClaim"] == {"claimName": "models-ro", "readOnly": True}
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in vllm["env"]
    assert next(m for m in vllm["volumeMounts"] if m["name"] == "models")["readOnly"] is True


def test_runtime_class_per_pool(rendered, helm):
    objs = rendered["two-pools-values"]
    assert _pool(objs, "llama-70b")[0]["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in _pool(objs, "llama-8b")[0]["spec"]["template"]["spec"]
    objs = _objs(_template(helm, "--set", "worker.runtimeClassName=nvidia-cdi"))
    assert _pool(objs, "default")[0]["spec"]["template"]["spec"]["runtimeClassName"] == "nvidia-cdi"


# Environment variables naming directories vLLM and its libraries write to.
WRITABLE_ENV = ("HOME", "HF_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "VLLM_CACHE_ROOT", "VLLM_CONFIG_ROOT",
                "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "NUMBA_CACHE_DIR", "OUTLINES_CACHE_DIR", "TMPDIR")


@pytest.mark.parametrize("values", ["default", "two-pools-values", "pvc-cache-values"])
def test_vllm_runs_non_root_on_a_read_only_root_filesystem(rendered, values):
    for dep in (d for d in rendered[values] if d["kind"] == "Deployment" and d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker"):
        pod = dep["spec"]["template"]["spec"]
        vllm = next(c for c in pod["containers"] if c["name"] == "vllm")
        sc, psc = vllm["securityContext"], pod["securityContext"]
        assert sc["readOnlyRootFilesystem"] and sc["runAsNonRoot"] and psc["runAsUser"] != 0
        # The user has no /etc/passwd entry: torch's getpass.getuser() needs $USER.
        env = {e["name"]: e.get("value") for e in vllm["env"]}
        assert env["USER"]
        # Every directory it writes to lies on a writable volume: an emptyDir, or the model cache.
        volumes = {v["name"]: v for v in pod["volumes"]}
        writable = [m["mountPath"] for m in vllm["volumeMounts"]
                    if not m.get("readOnly") and ("emptyDir" in volumes[m["name"]] or "persistentVolumeClaim" in volumes[m["name"]])]
        for name in WRITABLE_ENV:
            assert any(env[name] == p or env[name].startswith(p.rstrip("/") + "/") for p in writable), (name, env[name])
        assert {"/tmp", "/dev/shm", env["HOME"], env["HF_HOME"]} <= set(writable)
        # fsGroup makes a claim writable for the non-root user, without a recursive chown of the whole model at
        # every mount.
        assert psc["fsGroup"] and psc["fsGroupChangePolicy"] == "OnRootMismatch"


def _restricted_violations(pod: dict) -> list[str]:
    """The Pod Security Standards' "restricted" level (kubernetes.io/docs/concepts/security/pod-security-standards)."""
    out = []
    allowed_volumes = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                       "projected", "secret"}
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            out.append(flag)
    for volume in pod.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= allowed_volumes:
            out.append(f"volume {volume['name']}: {kinds}")
    psc = pod.get("securityContext", {})
    for c in pod["containers"] + pod.get("initContainers", []):
        sc = c.get("securityContext", {})
        where = f"container {c['name']}"
        if sc.get("privileged"):
            out.append(f"{where}: privileged")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{where}: allowPrivilegeEscalation is not false")
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{where}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{where}: runAsUser 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"{where}: seccompProfile {seccomp}")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []) or set(caps.get("add", [])) - {"NET_BIND_SERVICE"}:
            out.append(f"{where}: capabilities {caps}")
        if any(p.get("hostPort") for p in c.get("ports", [])):
            out.append(f"{where}: hostPort")
    return out


@pytest.mark.parametrize("values", VALUE_SETS)
def test_every_pod_meets_the_restricted_pod_security_level(rendered, values):
    for workload in _workloads(rendered[values]):
        assert _restricted_violations(workload["spec"]["template"]["spec"]) == [], workload["metadata"]["name"]


def test_restricted_check_can_fail(rendered):
    pod = json.loads(json.dumps(_pod_template(rendered["default"], "Deployment", f"{ROUTER}-default")["spec"]))
    del pod["securityContext"]["runAsNonRoot"]
    del pod["containers"][0]["securityContext"]["runAsNonRoot"]
    pod["volumes"].append({"name": "host", "hostPath": {"path": "/"}})
    assert _restricted_violations(pod) == ["volume host: {'hostPath'}", "container vllm: runAsNonRoot is not true"]


# ---- cross-field checks --------------------------------------------------------------------------------------

POOL = "pools[0].name=a,pools[0].model=m,pools[0].servedModelNames[0]=m"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param([f"{POOL},pools[1].name=a,pools[1].model=m,pools[1].servedModelNames[0]=n"],
                     'pools[1] (a): the pool name "a" is used twice (pools[0] has it too): pool names must be unique',
                     id="duplicate-pool-names"),
        pytest.param([f"{POOL},pools[0].gpus=1,pools[0].engine.tensorParallelSize=4"],
                     "pools[0] (a): engine.tensorParallelSize 4 needs 4 GPUs per pod, but gpus is 1", id="tp-over-gpus"),
        pytest.param([f"{POOL},pools[0].gpus=6,pools[0].engine.tensorParallelSize=4"],
                     "pools[0] (a): gpus (6) must be a multiple of engine.tensorParallelSize (4)", id="tp-not-dividing"),
        pytest.param([f"{POOL},pools[0].gpus=4,pools[0].engine.tensorParallelSize=2"],
                     "pools[0] (a): engine.tensorParallelSize 2 uses 2 of the pod's 4 GPUs", id="gpus-left-idle"),
        pytest.param([f"{POOL},pools[0].rollout.maxSurge=0,pools[0].rollout.maxUnavailable=0"],
                     "pools[0] (a): rollout.maxSurge and rollout.maxUnavailable are both 0", id="rollout-stuck"),
        pytest.param([f"{POOL},pools[0].replicaCount=2,pools[0].cache.type=persistentVolumeClaim,pools[0].cache.accessMode=ReadWriteOnce"],
                     "pools[0] (a): cache.accessMode ReadWriteOnce mounts the cache on one node at a time, but the pool may run several pods",
                     id="rwo-claim-many-pods"),
        pytest.param([f"{POOL},pools[0].cache.type=persistentVolumeClaim,pools[0].cache.accessMode=ReadWriteOnce"],
                     "so a surge pod might never start: set rollout.maxSurge 0 and rollout.maxUnavailable 1", id="rwo-claim-surge"),
        pytest.param([f"{POOL},pools[0].cache.type=existingClaim"],
                     "pools[0] (a): cache.type existingClaim needs cache.existingClaim, the claim's name", id="claim-unnamed"),
        pytest.param([f"{POOL},pools[0].cache.readOnly=true"],
                     "pools[0] (a): cache.readOnly needs a claim the model was copied into beforehand", id="read-only-empty-dir"),
        pytest.param([f"{POOL},pools[0].autoscaling.enabled=true,metrics.serviceMonitor.enabled=true"],
                     "pools[0] (a): autoscaling needs autoscaling.serverAddress", id="keda-no-prometheus"),
        pytest.param([f"{POOL},pools[0].autoscaling.enabled=true,pools[0].autoscaling.serverAddress=http://p:9090,"
                      "pools[0].autoscaling.minReplicas=5,pools[0].autoscaling.maxReplicas=2,metrics.serviceMonitor.enabled=true"],
                     "pools[0] (a): autoscaling.minReplicas (5) is above autoscaling.maxReplicas (2)", id="keda-min-over-max"),
        pytest.param([f"{POOL},pools[0].autoscaling.enabled=true,pools[0].autoscaling.serverAddress=http://p:9090"],
                     "enable metrics.serviceMonitor, or give autoscaling.query", id="keda-no-scrape-labels"),
        pytest.param(["router.httpRoute.enabled=true"], "router.httpRoute.enabled needs router.httpRoute.parentRefs",
                     id="route-without-gateway"),
    ],
)
def test_cross_field_checks_fail_with_a_clear_message(helm, args, message):
    proc = helm("template", RELEASE, str(CHART), *(a for arg in args for a in ("--set", arg)), check=False)
    assert proc.returncode != 0, f"helm accepted {args}"
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["router.apiKeys.keys[0]=two words"], "at '/router/apiKeys/keys/0'", id="api-key-with-space"),
        pytest.param(["redis.auth.password=p@ss"], "at '/redis/auth/password'", id="redis-password-not-url-safe"),
        pytest.param(["pools[0].autoscaling.minReplicas=0"], "at '/pools/0/autoscaling/minReplicas'", id="keda-scale-to-zero"),
        pytest.param(["pools[0].cache.type=hostPath"], "at '/pools/0/cache/type'", id="cache-type"),
        pytest.param(["router.httpRoute.timeouts.request=1 hour"], "at '/router/httpRoute/timeouts/request'", id="route-timeout"),
        pytest.param(["networkPolicy.clients[0].ipBlock.except[0]=10.0.0.0/8"], "at '/networkPolicy/clients/0/ipBlock'",
                     id="peer-without-cidr"),
    ],
)
def test_bad_new_values_are_rejected_by_the_schema(helm, args, message):
    proc = helm("template", RELEASE, str(CHART), *(a for arg in args for a in ("--set", arg)), check=False)
    assert proc.returncode != 0 and "values don't meet the specifications of the schema" in proc.stderr, proc.stderr
    assert message in proc.stderr, proc.stderr


# ---- KEDA, HTTPRoute, alerts, NOTES --------------------------------------------------------------------------


def test_keda_scales_pools_on_the_engines_queue(rendered):
    objs = rendered["keda-values"]
    chat = one(objs, "ScaledObject", f"{ROUTER}-chat")
    assert chat["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{ROUTER}-chat"}
    assert (chat["spec"]["minReplicaCount"], chat["spec"]["maxReplicaCount"]) == (2, 8)
    (trigger,) = chat["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and trigger["authenticationRef"] == {"name": "prometheus-bearer"}
    meta = trigger["metadata"]
    assert meta["serverAddress"] == "http://prometheus-operated.monitoring.svc:9090" and meta["authModes"] == "bearer"
    assert meta["threshold"] == "4"
    # The query selects the series the worker ServiceMonitor scrapes from this pool's Service.
    (selector,) = _selectors(meta["query"])
    assert selector == ("vllm:num_requests_waiting", {"namespace": NAMESPACE, "service": f"{ROUTER}-chat"})
    service = one(objs, "Service", f"{ROUTER}-chat")
    monitor = one(objs, "ServiceMonitor", f"{ROUTER}-workers")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    # KEDA owns the replica count: the Deployment leaves it alone.
    assert "replicas" not in one(objs, "Deployment", f"{ROUTER}-chat")["spec"]
    batch = one(objs, "ScaledObject", f"{ROUTER}-batch")["spec"]["triggers"][0]["metadata"]
    assert _selectors(batch["query"]) == [("fleetroute_admission_queue_depth", {"namespace": NAMESPACE, "model": "qwen2.5-7b"})]
    assert not [o for o in rendered["default"] if o["kind"] == "ScaledObject"]


def test_httproute_sends_the_api_to_the_ingress_service(rendered):
    objs = rendered["gateway-values"]
    route = one(objs, "HTTPRoute")
    assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways", "sectionName": "https"}]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    (rule,) = route["spec"]["rules"]
    service = one(objs, "Service", ROUTER)
    assert rule["backendRefs"] == [{"name": ROUTER, "port": service["spec"]["ports"][0]["port"]}]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]  # never the admin port
    # Long streams: no whole-request deadline at the gateway; the router's own timeouts apply.
    assert rule["timeouts"] == {"request": "0s"}
    assert not [o for o in objs if o["kind"] == "Ingress"]


def _selectors(expr: str) -> list[tuple[str, dict[str, str]]]:
    """Every vector selector of a PromQL expression: (metric name, {label: value} of its matchers)."""
    found = []

    def walk(node) -> None:
        kind = type(node).__name__
        if kind == "VectorSelector":
            found.append((node.name, {m.name: m.value for m in node.matchers.matchers}))
        for attr in {"BinaryExpr": ("lhs", "rhs"), "AggregateExpr": ("expr", "param"), "ParenExpr": ("expr",),
                     "UnaryExpr": ("expr",), "SubqueryExpr": ("expr",), "MatrixSelector": ("vector_selector",)}.get(kind, ()):
            child = getattr(node, attr)
            if child is not None:
                walk(child)
        if kind == "Call":
            for arg in node.args:
                walk(arg)

    walk(promql_parser.parse(expr))
    return found


def _grouping_labels(expr: str) -> list[tuple[set[str], list[str]]]:
    """(the metrics under each `by (...)` aggregation, its labels)."""
    found = []

    def walk(node) -> None:
        kind = type(node).__name__
        if kind == "AggregateExpr" and node.modifier is not None:
            found.append(({name for name, _ in _selectors(str(node.expr))}, list(node.modifier.labels)))
        for attr in ("lhs", "rhs", "expr"):
            child = getattr(node, attr, None)
            if child is not None and not isinstance(child, (str, int, float)):
                walk(child)

    walk(promql_parser.parse(expr))
    return found


def _router_series() -> dict[str, set[str]]:
    """Every series name the router exports (counters with _total, histograms' _bucket, _sum, _count), with its
    labels, read from a registry with one child per collector."""
    metrics = RouterMetrics()
    for collector in vars(metrics).values():
        names = getattr(collector, "_labelnames", None)
        if names:
            collector.labels(*("x" for _ in names))
    return {s.name: set(s.labels) - {"le"} for family in metrics.registry.collect() for s in family.samples}


# Labels Prometheus Operator gives every target. `endpoint` is not among them here: the router's ServiceMonitor
# honours the router's own `endpoint` label (test_router_service_monitor_keeps_the_endpoint_label).
TARGET_LABELS = {"namespace", "job", "pod", "service", "instance", "container"}


def test_alerts_read_the_routers_real_metrics(rendered):
    objs = rendered["monitoring-values"]
    rule = one(objs, "PrometheusRule")
    (group,) = rule["spec"]["groups"]
    alerts = {r["alert"]: r for r in group["rules"]}
    assert set(alerts) == {"FleetrouteNoHealthyEndpoint", "FleetrouteEndpointEjected", "FleetrouteBreakerOpen",
                           "FleetrouteRequestsShed", "FleetrouteTelemetryStale", "FleetrouteTelemetryStoreDown"}
    series = _router_series()
    metrics_service = one(objs, "Service", f"{ROUTER}-metrics")["metadata"]["name"]
    for name, alert in alerts.items():
        assert alert["labels"]["team"] == "inference" and alert["labels"]["severity"] in ("warning", "critical")
        for metric, matchers in _selectors(alert["expr"]):
            assert metric in series, f"{name}: {metric} is not a series of router/runtime/metrics.py"
            assert set(matchers) <= series[metric] | TARGET_LABELS, f"{name}: {metric} has no label {set(matchers) - series[metric]}"
            # This release's routers only: their namespace, and the job Prometheus Operator names after the Service.
            assert matchers["namespace"] == NAMESPACE and matchers["job"] == metrics_service, name
        for metric_names, labels in _grouping_labels(alert["expr"]):
            for metric in metric_names:
                assert set(labels) <= series[metric] | TARGET_LABELS, f"{name}: by ({labels}) over {metric}"
    assert "status=\"503\"" in alerts["FleetrouteNoHealthyEndpoint"]["expr"].replace(" ", "")
    assert "> 0.05" in alerts["FleetrouteRequestsShed"]["expr"]


def test_alert_check_can_fail():
    assert "fleetroute_requests" not in _router_series()  # a counter's series ends in _total
    assert "model" not in _router_series()["fleetroute_breaker_state"]


def test_router_service_monitor_keeps_the_endpoint_label(rendered):
    monitor = one(rendered["monitoring-values"], "ServiceMonitor", f"{ROUTER}-router")
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["honorLabels"] is True


@pytest.mark.parametrize(
    ("args", "warned"),
    [
        pytest.param([], False, id="default"),
        pytest.param(["-f", str(CHART / "ci" / "ingress-values.yaml")], False, id="ingress-with-keys"),
        pytest.param(["-f", str(CHART / "ci" / "ingress-values.yaml"), "--set", "router.apiKeys.enabled=false"], True,
                     id="ingress-without-keys"),
        pytest.param(["-f", str(CHART / "ci" / "gateway-values.yaml"), "--set", "router.apiKeys.enabled=false"], True,
                     id="httproute-without-keys"),
        pytest.param(["--set", "router.service.type=LoadBalancer,router.apiKeys.enabled=false"], True,
                     id="load-balancer-without-keys"),
        pytest.param(["--set", "router.apiKeys.enabled=false"], False, id="cluster-internal-without-keys"),
    ],
)
def test_notes_warn_when_the_router_is_exposed_without_api_keys(helm, args, warned):
    out = helm("install", RELEASE, str(CHART), "--namespace", NAMESPACE, "--dry-run=client", *args).stdout
    notes = out.split("NOTES:", 1)[1]
    assert ("WARNING: the router is exposed" in notes) == warned, notes
    keyed = "router.apiKeys.enabled=false" not in " ".join(args)
    assert ('-H "Authorization: Bearer $API_KEY"' in notes) == keyed
    assert f"kubectl get secret -n {NAMESPACE} {ROUTER}-admin" in notes
