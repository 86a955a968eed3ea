"""Cluster in a box: the Helm chart as rendered, applied with real kubectl to the fake API server, and run.

    helm install --dry-run=client (real helm, tests/helm_binary.py: the manifest `helm template` gives, and the
    NOTES a user reads after `helm install`)
      -> kubectl apply (real kubectl: the chart's crds/ first, as `helm install` installs them, then the rest)
      -> tests/fake_kube.py in strict mode: namespaces must exist, built-in objects are validated against
         Kubernetes' own schemas (unknown fields refused: kubectl apply's fieldValidation=Strict), a CRD's
         schema is checked structurally and its custom resources are served from the moment it is created
         (with its schema and CEL rules, status subresource and printer columns: tests/fake_crd.py), RBAC is
         enforced for service-account tokens, pods are deleted gracefully, evictions honour
         PodDisruptionBudgets
      -> controllers (tests/cluster/controllers.py): ClusterIPs and DNS, Deployments (rolling updates),
         StatefulSets, DaemonSets, EndpointSlices, ServiceAccount admission
      -> a kubelet (tests/cluster/kubelet.py) running every container as a local process (the images'
         stand-ins: tests/cluster/images.py; `fleetroute sim --vllm` for vLLM), with probes, preStop hooks,
         graceful termination and restarts, writing pod status; on a node given GPUs (`gpus=N`), the device
         plugin's allocation, the PodResources socket and the NVIDIA runtime's driver (tests/cluster/gpus.py)
      -> kube-proxy (tests/cluster/kube_proxy.py): each Service port forwards connections to ready endpoints,
         so a test talks to the router's Service as a client in the cluster would
      -> NetworkPolicies enforced (tests/cluster/policies.py): at kube-proxy for Services, in the pods'
         processes for direct connections, each pod connecting from its own address.

The secrets the chart generates are read back as its NOTES tell a user (`from_notes`: the NOTES' own
`export API_KEY=$(kubectl get secret ...)` lines, run in a shell with the real kubectl).

Everything is driven by the objects the chart renders: no object is written by hand except what a user
would write (a namespace, RoutingPolicies, `kubectl` commands). Each module's docstring lists what it
emulates and why. One control loop reconciles on every write to the API server (no polling); the kubelet's
probes and restarts run on their own timers, scaled by `time_scale`.

Run alone: `python -m tests.cluster.harness [values.yaml...]` brings a cluster up, prints its Services and
pods, and keeps it until Ctrl-C.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.cluster.controllers import Controllers, pod_ready
from tests.cluster.gpus import NodeGpus
from tests.cluster.kube_proxy import KubeProxy
from tests.cluster.kubelet import Kubelet
from tests.cluster.network import Network
from tests.cluster.policies import PolicyTable
from tests.fake_kube import BUILTIN_RESOURCES, FakeKube
from tests.helm_binary import helm_runner

log = logging.getLogger("tests.cluster")

ROOT = Path(__file__).resolve().parent.parent.parent
CHART = ROOT / "helm" / "fleetroute"
KUBECTL = Path(sys.executable).parent / "kubectl"


class ClusterError(AssertionError):
    pass


class Cluster:
    def __init__(self, root: Path, *, values: tuple[Path, ...] = (), release: str = "t",
                 namespace: str = "inference", time_scale: float = 0.2, sim_time_scale: float = 1.0,
                 sim_gpu: str = "h100", gpus: int = 0) -> None:
        self.root, self.values, self.release, self.namespace = root, values, release, namespace
        self.time_scale, self.sim_time_scale, self.sim_gpu = time_scale, sim_time_scale, sim_gpu
        self.network = Network(root)
        # The API server at its own address on 6443 (a control-plane endpoint's usual port): the chart's
        # NetworkPolicies must let the routers reach it there.
        self.kube = FakeKube(token=None, resources=BUILTIN_RESOURCES, strict=True, host=self.network.api_server_ip,
                             port=6443)
        self.policies = PolicyTable(root / "cluster-netpol.json", node=self.network.node_ip,
                                    api_server=self.network.api_server_ip)
        self.gpus = NodeGpus(root, gpus) if gpus else None  # the node's GPUs (tests/cluster/gpus.py)
        self.controllers = Controllers(self.kube, self.network)
        self.proxy = KubeProxy(self.kube, self.policies)
        self.rendered: list[dict[str, Any]] = []
        self.notes = ""  # the chart's NOTES.txt as `helm install` prints it
        self.kubectl_env: dict[str, str] = {}
        self.http: aiohttp.ClientSession | None = None
        self.kubelet: Kubelet | None = None
        self._loop: asyncio.Task[None] | None = None
        self._failure: BaseException | None = None

    # ---- bring-up --------------------------------------------------------------------------------------

    async def start(self, *, ready_timeout: float = 90.0) -> Cluster:
        await self.kube.start()
        if self.gpus is not None:
            await self.gpus.start()
        self.http = aiohttp.ClientSession()
        self.kubelet = Kubelet(self.kube, self.network, self.root, self.http, time_scale=self.time_scale,
                               sim_time_scale=self.sim_time_scale, sim_gpu=self.sim_gpu,
                               service_links=self.controllers.service_links, policies=self.policies,
                               gpus=self.gpus)
        home = self.root / "kubectl-home"
        home.mkdir()
        self.kubectl_env = {"HOME": str(home), "PATH": f"{KUBECTL.parent}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                            "KUBECONFIG": str(self.kube.write_kubeconfig(self.root / "kubeconfig",
                                                                         namespace=self.namespace))}
        self._loop = asyncio.create_task(self._control_loop(), name="cluster control loop")
        namespace = self.root / "namespace.yaml"  # kubectl create namespace would send protobuf
        namespace.write_text(json.dumps({"apiVersion": "v1", "kind": "Namespace",
                                         "metadata": {"name": self.namespace}}))
        await self.kubectl_ok("apply", "-f", str(namespace))
        # `helm install`: the chart's crds/ first (kubectl maps each kind before applying; a custom resource
        # in the same apply as its CRD would not map), then everything else.
        await self.kubectl_ok("apply", "-f", str(CHART / "crds"))
        manifest = self.root / "rendered.yaml"
        manifest.write_text(self.render())
        self.rendered = [d for d in yaml.safe_load_all(manifest.read_text()) if d]
        await self.kubectl_ok("apply", "-f", str(manifest))
        await self.wait_ready(timeout=ready_timeout)
        return self

    def render(self) -> str:
        """The release's manifest, as `helm template` renders it; the NOTES go to `self.notes`. A client-side
        dry run of `helm install` gives both from one rendering, without a cluster (`lookup` finds nothing, as
        on a first install)."""
        helm = helm_runner(self.root / "helm-home")
        args = [a for v in self.values for a in ("-f", str(v))]
        release = json.loads(helm("install", self.release, str(CHART), "--namespace", self.namespace,
                                  "--dry-run=client", "--output", "json", *args).stdout)
        self.notes = str(release["info"].get("notes") or "")
        return str(release["manifest"])

    async def _control_loop(self) -> None:
        assert self.kubelet is not None
        try:
            while True:
                self.controllers.reconcile()
                self.policies.update(pods=self.kube.list("pods"), policies=self.kube.list("networkpolicies"),
                                     services=[s["spec"]["clusterIP"] for s in self.kube.list("services")
                                               if s["spec"].get("clusterIP") not in (None, "", "None")])
                self.kubelet.sync()
                await self.proxy.sync()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.kube.changed(), 1.0)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a harness bug: fail the test that waits, with its traceback
            log.exception("the cluster's control loop failed")
            self._failure = exc
            raise

    def check(self) -> None:
        if self._failure is not None:
            raise ClusterError(f"the cluster harness failed: {self._failure!r}") from self._failure

    async def close(self) -> None:
        started = asyncio.get_running_loop().time()
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        if self.kubelet is not None:
            await self.kubelet.close()
        killed = asyncio.get_running_loop().time()
        await self.proxy.close()
        if self.http is not None:
            await self.http.close()
        await self.kube.stop()
        if self.gpus is not None:
            await self.gpus.close()
        log.info("cluster closed in %.1fs (processes killed in %.1fs)", asyncio.get_running_loop().time() - started,
                 killed - started)

    # ---- kubectl ---------------------------------------------------------------------------------------

    async def kubectl(self, *args: str, timeout: float = 60.0) -> tuple[int, str]:
        process = await asyncio.create_subprocess_exec(str(KUBECTL), *args, env=self.kubectl_env,
                                                       stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.STDOUT)
        try:
            async with asyncio.timeout(timeout):
                out, _ = await process.communicate()
        except TimeoutError:
            process.kill()
            await process.wait()
            raise ClusterError(f"kubectl {' '.join(args)} did not finish within {timeout:g}s") from None
        return process.returncode or 0, out.decode()

    async def kubectl_ok(self, *args: str, timeout: float = 60.0) -> str:
        rc, out = await self.kubectl(*args, timeout=timeout)
        if rc != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed (rc {rc}):\n{out}")
        return out

    async def sh(self, script: str, *, timeout: float = 60.0) -> str:
        """A shell script as a user at a terminal runs it: kubectl on the PATH, the cluster's kubeconfig."""
        process = await asyncio.create_subprocess_exec("sh", "-ec", script, env=self.kubectl_env,
                                                       stdout=asyncio.subprocess.PIPE,
                                                       stderr=asyncio.subprocess.PIPE)
        try:
            async with asyncio.timeout(timeout):
                out, err = await process.communicate()
        except TimeoutError:
            process.kill()
            await process.wait()
            raise ClusterError(f"sh -c {script!r} did not finish within {timeout:g}s") from None
        if process.returncode:
            raise ClusterError(f"sh -c {script!r} failed (rc {process.returncode}):\n{err.decode()}")
        return out.decode()

    async def from_notes(self, variable: str) -> str:
        """What the NOTES' `export VARIABLE=$(kubectl ...)` line sets, run as the NOTES tell a user to."""
        line = next((line.strip() for line in self.notes.splitlines() if line.strip().startswith(f"export {variable}=")),
                    None)
        if line is None:
            raise ClusterError(f"the chart's NOTES have no `export {variable}=` line:\n{self.notes}")
        return await self.sh(f'{line}\nprintf %s "${variable}"')

    # ---- waiting and looking -----------------------------------------------------------------------------

    def workloads(self) -> list[dict[str, Any]]:
        return [o for kind in ("deployments", "statefulsets") for o in self.kube.list(kind, self.namespace)]

    def not_ready(self) -> list[str]:
        out = []
        for w in self.workloads():
            replicas = int(w["spec"].get("replicas", 1))
            s = w.get("status") or {}
            if s.get("observedGeneration") != w["metadata"]["generation"] or s.get("readyReplicas", 0) < replicas \
                    or s.get("updatedReplicas", 0) < replicas or s.get("replicas", 0) != replicas:
                out.append(f"{w['kind']} {w['metadata']['name']}: {s.get('readyReplicas', 0)}/{replicas} ready")
        return out

    async def wait_ready(self, *, timeout: float = 90.0) -> None:
        """Until every Deployment and StatefulSet is rolled out and ready; else fail with what is not."""
        try:
            await self.until(lambda: not self.not_ready(), timeout=timeout)
        except TimeoutError:
            raise ClusterError(f"the cluster is not ready after {timeout:g}s: {'; '.join(self.not_ready())}\n"
                               + self.diagnose()) from None

    async def until(self, predicate: Any, *, timeout: float) -> None:
        """Wait for `predicate()` to hold, re-checked on every write to the API server (and each second)."""
        async with asyncio.timeout(timeout):
            while not predicate():
                self.check()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.kube.changed(), 1.0)
        self.check()

    def diagnose(self) -> str:
        """Pods that are not ready, with their status message and each container's last log lines; RBAC
        refusals; controllers' failures."""
        assert self.kubelet is not None
        lines = []
        for pod in self.kube.list("pods", self.namespace):
            if pod_ready(pod):
                continue
            name = pod["metadata"]["name"]
            status = pod.get("status") or {}
            lines.append(f"pod {name}: phase {status.get('phase')} {status.get('message', '')}")
            for cs in status.get("containerStatuses") or ():
                lines.append(f"  container {cs['name']}: ready={cs['ready']} restarts={cs['restartCount']} "
                             f"state={json.dumps(cs['state'])}")
                with contextlib.suppress(StopIteration):
                    lines.append("    " + self.kubelet.runtime(name, self.namespace).logs(cs["name"], 15)
                                 .replace("\n", "\n    "))
        lines += [f"controller: {k}: {v}" for k, v in self.controllers.failures.items()]
        lines += [f"RBAC refused: {m}" for m in dict.fromkeys(self.kube.denied)]
        lines += [f"refused: {m}" for m in dict.fromkeys(self.network_denials())]
        return "\n".join(lines)

    def network_denials(self) -> list[str]:
        """Every connection the NetworkPolicies refused: at kube-proxy and in the pods."""
        return [*self.policies.denied, *self.policies.denied_by_pods()]

    def pods(self, component: str, **labels: str) -> list[dict[str, Any]]:
        """Running (not terminating) pods of a chart component (`app.kubernetes.io/component`)."""
        selector = ",".join([f"app.kubernetes.io/instance={self.release}", f"app.kubernetes.io/component={component}",
                             *(f"{k}={v}" for k, v in labels.items())])
        return [p for p in self.kube.list("pods", self.namespace, selector)
                if not p["metadata"].get("deletionTimestamp")]

    def session_from(self, address: str, **kwargs: Any) -> aiohttp.ClientSession:
        """An HTTP client whose connections come from `address`: the node's (`network.node_ip`: what `kubectl
        port-forward` carries enters through the node, which NetworkPolicies never block) or a pod's (a
        process in that pod's network namespace)."""
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=(address, 0)), **kwargs)

    def service_url(self, service: str, port_name: str) -> str:
        ip, port = self.proxy.address(self.namespace, service, port_name)
        return f"http://{ip}:{port}"

    def container_env(self, pod: str, container: str) -> dict[str, str]:
        assert self.kubelet is not None
        return dict(self.kubelet.runtime(pod, self.namespace).containers[container].env)

    def pod_ip(self, pod: str) -> str:
        obj = self.kube.get("pods", self.namespace, pod)
        assert obj is not None, f"no pod {pod}"
        return str(obj["status"]["podIP"])

    def logs(self, pod: str, container: str, lines: int = 40) -> str:
        """A container's last log lines; they outlive the pod (the kubelet's log files stay until the end)."""
        path = self.root / "pods" / f"{self.namespace}_{pod}" / f"{container}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])

    def rendered_object(self, kind: str, name: str) -> dict[str, Any]:
        return next(o for o in self.rendered if o["kind"] == kind and o["metadata"]["name"] == name)


async def _main(values: list[str]) -> None:
    import tempfile

    logging.basicConfig(level=logging.INFO)
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(Path(tmp), values=tuple(Path(v) for v in values))
        try:
            await cluster.start()
            for svc in cluster.kube.list("services", cluster.namespace):
                for port in svc["spec"]["ports"]:
                    print(f"service {svc['metadata']['name']}: {cluster.service_url(svc['metadata']['name'], port.get('name', ''))}")
            for pod in cluster.kube.list("pods", cluster.namespace):
                print(f"pod {pod['metadata']['name']}: {pod['status'].get('podIP')} (logs: {tmp}/pods)")
            await asyncio.Event().wait()
        finally:
            await cluster.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main(sys.argv[1:]))
