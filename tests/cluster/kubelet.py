"""A kubelet for one node: runs each container of the pods bound to it as a local process, probes them, and
writes their status to the API server (tests/fake_kube.py).

What it does, as the kubelet does (https://kubernetes.io/docs/concepts/workloads/pods/pod-lifecycle/):

- **Volumes**: configMap and secret volumes (every key, or `items` with their paths; secrets decoded) are
  written to a directory per pod and volume; emptyDir is an empty directory; hostPath only for the kubelet's
  PodResources directory, on a node with GPUs (tests/cluster/gpus.py). A pod waits while a configMap or
  secret it needs (not `optional`) is missing, as ContainerCreating does. Other volume kinds fail the pod.
- **Environment**: only what a container would see: the image's ENV, `HOSTNAME`, the Service links
  (`<SVC>_SERVICE_HOST`, `<SVC>_PORT`... of the namespace's Services when the pod starts, unless
  `enableServiceLinks: false`), `envFrom`, then `env` in order with `$(VAR)` references expanded and `$$`
  escaped, `valueFrom` fieldRef (metadata.name/namespace/uid/labels/annotations, spec.nodeName,
  spec.serviceAccountName, status.podIP/podIPs/hostIP), secretKeyRef, configMapKeyRef (with `optional`) and
  resourceFieldRef. Never the test process's own environment (a REDIS_URL or KUBECONFIG there would hide a
  chart defect).
- **Command**: `command` or the image's ENTRYPOINT, `args` or its CMD (an image's CMD is dropped when
  `command` is set), `$(VAR)` expanded, run through the image's stand-in programs (tests/cluster/images.py),
  in the image's WORKDIR (or `workingDir`), stdout and stderr to `<pod dir>/<container>.log`, in its own
  process group.
- **Probes**: startup, readiness and liveness with `httpGet` (the pod's address; a port by name or
  number), `tcpSocket` and `exec` (the container's environment and programs), honouring
  `initialDelaySeconds`, `periodSeconds`, `timeoutSeconds`, `successThreshold` and `failureThreshold`. Startup
  gates the other two; a failed liveness or startup probe restarts the container. Readiness keeps running
  while the pod terminates (the EndpointSlice's `serving`). Pod conditions (PodScheduled, Initialized,
  ContainersReady, Ready) and containerStatuses (state, ready, started, restartCount, lastState) follow.
- **Restarts**: a container that exits is restarted (restartPolicy Always) after the CrashLoopBackOff delay,
  10 s doubling up to 5 min.
- **Termination** (the pod's `deletionTimestamp`): per container at once, the preStop hook (exec or httpGet),
  then SIGTERM to the container's main process, then SIGKILL to its whole process group when the pod's
  `deletionGracePeriodSeconds`, counted from the start of the preStop hook, runs out; then the pod is removed
  from the API server (the kubelet's final delete).

Emulations (what a container runtime would give, done otherwise here; each for the reason given):

- **Network namespace**: a loopback address per pod (tests/cluster/network.py). In `command`, `args` and env
  values, `0.0.0.0`, `127.0.0.1` and `localhost` become the pod's address; the image stand-ins bind servers to
  it (images.py). Service names resolve through the cluster DNS table, and Python processes connect from
  the pod's address, within what the NetworkPolicies allow (sitecustomize/, tests/cluster/policies.py).
- **Filesystem**: a volume's `mountPath` in `command`, `args`, env values, `workingDir` and the text of
  configMap/secret files becomes the volume's directory (`subPath` mounts point into it); a `/tmp` mount is
  also `TMPDIR`. The root filesystem is the machine's.
- **Service account**: with the token automounted (the pod's or its ServiceAccount's
  `automountServiceAccountToken` not false), the processes get `KUBECONFIG` pointing at the fake API server
  with a token of the pod's ServiceAccount, the pod's namespace as the context's, and RBAC enforced by the
  fake for that token. A real pod gets the token file and `KUBERNETES_SERVICE_HOST` instead; the client's
  in-cluster loading needs HTTPS and a fixed path, so the kubeconfig path is used.
- **Time**: probe periods and initial delays, preStop `sleep`s and crash back-off are multiplied by
  `time_scale` (0.2: a 5 s readiness period is 1 s) so a test runs in seconds. Probe timeouts are not (a
  loaded two-core machine needs them), nor termination grace periods: the processes' own shutdown timers
  (the router's drainConnections and shutdownGrace) run in real time, and a grace period scaled below them
  would kill a router mid-drain where a cluster would not. A process that exits when it is done is not
  slowed by its grace period.
- **One node** (`node-1`) with room for every pod: nodeSelectors, affinities and taints are not scheduled
  against; resources and securityContext are not enforced. GPUs are, on a node given some (`gpus`,
  tests/cluster/gpus.py: the device plugin's allocation, the PodResources API, the NVIDIA runtime's driver
  library); without them, GPU limits are ignored.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import datetime
import logging
import os
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from tests.cluster.gpus import NodeGpus, NoGpuFree
from tests.cluster.images import ROOT, Image, ShimContext, UnknownImage, image_for
from tests.cluster.network import SITECUSTOMIZE, Network, search_list
from tests.cluster.policies import POD_IP_ENV, TABLE_ENV, PolicyTable
from tests.fake_kube import FakeKube

log = logging.getLogger("tests.cluster.kubelet")

NODE = "node-1"
POD_ADDRESS_WORDS = re.compile(r"(?<![\w.])(0\.0\.0\.0|127\.0\.0\.1|localhost)(?![\w-])")
VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")
BACKOFF_BASE, BACKOFF_MAX = 10.0, 300.0


def now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: a defined variable is replaced, `$$` is `$`, anything else is kept."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return VAR_REF.sub(sub, text)


class PodFailed(Exception):
    """The pod cannot run (an unknown image, an unsupported volume): the message goes to its status."""


@dataclass
class ContainerRuntime:
    spec: dict[str, Any]
    image: Image
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    cwd: str = ""
    log_path: Path | None = None
    process: asyncio.subprocess.Process | None = None
    started_at: str | None = None
    started: bool = False  # the startup probe passed (or there is none)
    ready: bool = False
    restarts: int = 0
    last_exit: dict[str, Any] | None = None
    waiting_reason: str | None = None
    exited: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def name(self) -> str:
        return str(self.spec["name"])


class PodRuntime:
    def __init__(self, kubelet: Kubelet, pod: dict[str, Any]) -> None:
        self.kubelet = kubelet
        self.namespace, self.name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        self.uid = pod["metadata"]["uid"]
        self.spec = pod["spec"]
        self.ip = kubelet.network.pod_ip()
        self.dir = kubelet.root / "pods" / f"{self.namespace}_{self.name}"
        self.dir.mkdir(parents=True)
        self.mounts: dict[str, dict[str, Path]] = {}  # container -> mountPath -> local path
        self.containers: dict[str, ContainerRuntime] = {}
        self.error: str | None = None
        self.terminating = asyncio.Event()
        self.gone = asyncio.Event()
        self.tasks: list[asyncio.Task[Any]] = []
        self.main = asyncio.create_task(self._run(), name=f"pod {self.name}")

    # ---- life ------------------------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            self._write_status()
            await self._prepare()
            for c in self.containers.values():
                await self._start(c)
            self._write_status()
            for c in self.containers.values():
                self.tasks.append(asyncio.create_task(self._supervise(c)))
                for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                    if kind in c.spec:
                        self.tasks.append(asyncio.create_task(self._probe_loop(c, kind, c.spec[kind])))
                if "startupProbe" not in c.spec:
                    c.started = True
                if "readinessProbe" not in c.spec:
                    c.ready = True
            self._write_status()
            await self.terminating.wait()
        except PodFailed as exc:
            self.error = str(exc)
            log.error("pod %s/%s cannot run: %s", self.namespace, self.name, exc)
            self._write_status()
            await self.terminating.wait()
        await self._stop()

    def terminate(self) -> None:
        self.terminating.set()

    async def _stop(self) -> None:
        pod = self.kubelet.kube.get("pods", self.namespace, self.name)
        grace = float((pod or {}).get("metadata", {}).get("deletionGracePeriodSeconds",
                                                           self.spec.get("terminationGracePeriodSeconds", 30)))
        deadline = asyncio.get_running_loop().time() + grace
        for task in self.tasks:
            if task.get_name() != "readinessProbe":  # readiness keeps running while the pod terminates
                task.cancel()
        await asyncio.gather(*(self._stop_container(c, deadline) for c in self.containers.values()))
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.kubelet.gpus is not None:
            self.kubelet.gpus.release(self.namespace, self.name)
        if self.kubelet.kube.get("pods", self.namespace, self.name) is not None:
            self.kubelet.kube.delete("pods", self.name, namespace=self.namespace)
        self.gone.set()

    async def kill(self) -> None:
        """Tear down at once (the test is over): SIGKILL every process group."""
        self.main.cancel()
        for task in self.tasks:
            task.cancel()
        for c in self.containers.values():
            _killpg(c.process, signal.SIGKILL)
        for c in self.containers.values():
            if c.process is not None and c.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    await c.process.wait()
        await asyncio.gather(self.main, *self.tasks, return_exceptions=True)

    # ---- preparing the containers ----------------------------------------------------------------------

    async def _prepare(self) -> None:
        volumes = {}
        for volume in self.spec.get("volumes") or ():
            volumes[volume["name"]] = await self._volume(volume)
        kubeconfig = self._service_account()
        for spec in self.spec.get("initContainers") or ():
            raise PodFailed(f"init container {spec['name']!r}: init containers are not emulated")
        for spec in self.spec["containers"]:
            try:
                image = image_for(spec.get("image", ""))
            except UnknownImage as exc:
                raise PodFailed(f"container {spec['name']!r}: {exc}") from None
            mounts: dict[str, Path] = {}
            for m in spec.get("volumeMounts") or ():
                if m["name"] not in volumes:
                    raise PodFailed(f"container {spec['name']!r} mounts volume {m['name']!r}, which the pod lacks")
                mounts[m["mountPath"]] = volumes[m["name"]] / m.get("subPath", "")
            self.mounts[spec["name"]] = mounts
            self._rewrite_volume_files(volumes, mounts)
            c = ContainerRuntime(spec=spec, image=image)
            c.log_path = self.dir / f"{spec['name']}.log"
            bin_dir = self.dir / "bin" / spec["name"]
            bin_dir.mkdir(parents=True)
            ctx = ShimContext(pod_ip=self.ip, time_scale=self.kubelet.time_scale,
                              sim_time_scale=self.kubelet.sim_time_scale, sim_gpu=self.kubelet.sim_gpu)
            for name, script in image.shims(ctx).items():
                path = bin_dir / name
                path.write_text(script)
                path.chmod(0o755)
            c.env = await self._env(spec, image, mounts, bin_dir, kubeconfig)
            gpus = self.kubelet.gpus
            if gpus is not None:
                try:
                    devices = gpus.allocate(self.namespace, self.name, spec)
                except NoGpuFree as exc:
                    raise PodFailed(str(exc)) from None
                if devices:  # the device plugin's answer
                    c.env["NVIDIA_VISIBLE_DEVICES"] = ",".join(devices)
                if "NVIDIA_VISIBLE_DEVICES" in c.env:  # the NVIDIA runtime mounts the driver
                    c.env.update(gpus.runtime_env())
            command = spec.get("command")
            args = spec.get("args")
            argv = [*(command if command is not None else image.entrypoint),
                    *(args if args is not None else (image.cmd if command is None else ()))]
            c.argv = [self._in_pod(expand(a, c.env), mounts) for a in argv]
            workdir = spec.get("workingDir") or image.workdir
            c.cwd = self._in_pod(workdir, mounts) if workdir else str(self.dir)
            if not Path(c.cwd).is_dir():
                Path(c.cwd).mkdir(parents=True)
            self.containers[spec["name"]] = c

    async def _volume(self, volume: dict[str, Any]) -> Path:
        if "hostPath" in volume:
            host = self.kubelet.gpus.host_path(volume["hostPath"]["path"]) if self.kubelet.gpus else None
            if host is None:
                raise PodFailed(f"volume {volume['name']!r}: hostPath {volume['hostPath']['path']!r} is not emulated "
                                "(only the kubelet's PodResources directory, on a node with GPUs)")
            return host
        path = self.dir / "volumes" / volume["name"]
        path.mkdir(parents=True)
        if "emptyDir" in volume:
            return path
        for kind, plural, ref in (("configMap", "configmaps", "name"), ("secret", "secrets", "secretName")):
            if kind not in volume:
                continue
            source = volume[kind]
            obj = await self._wait_for(plural, source[ref], optional=source.get("optional", False),
                                       why=f"volume {volume['name']!r}")
            data = _data(obj, plural)
            items = source.get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                if item["key"] not in data:
                    raise PodFailed(f"volume {volume['name']!r}: {kind} {source[ref]!r} has no key {item['key']!r}")
                target = path / item["path"]
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data[item["key"]])
            return path
        raise PodFailed(f"volume {volume['name']!r}: only configMap, secret, emptyDir and hostPath volumes are "
                        "emulated")

    def _rewrite_volume_files(self, volumes: dict[str, Path], mounts: dict[str, Path]) -> None:
        """Mount paths named in configMap/secret files (a config file pointing at another mounted file)."""
        for volume in self.spec.get("volumes") or ():
            if "configMap" not in volume and "secret" not in volume:
                continue
            for file in volumes[volume["name"]].rglob("*"):
                if file.is_file():
                    try:
                        text = file.read_text()
                    except UnicodeDecodeError:
                        continue
                    rewritten = _rewrite_paths(text, mounts)
                    if rewritten != text:
                        file.write_text(rewritten)

    async def _wait_for(self, plural: str, name: str, *, optional: bool, why: str) -> dict[str, Any] | None:
        """The object, waiting while it does not exist (ContainerCreating); None if optional and missing."""
        kube = self.kubelet.kube
        warned = False
        while (obj := kube.get(plural, self.namespace, name)) is None:
            if optional:
                return None
            if not warned:
                log.warning("pod %s waits for %s %s/%s (%s)", self.name, plural, self.namespace, name, why)
                self.error = f"{why}: {plural} {name!r} not found"
                self._write_status()
                warned = True
            await kube.changed()
        if warned:
            self.error = None
        return obj

    def _service_account(self) -> Path | None:
        kube = self.kubelet.kube
        sa_name = self.spec.get("serviceAccountName") or "default"
        sa = kube.get("serviceaccounts", self.namespace, sa_name) or {}
        automount = self.spec.get("automountServiceAccountToken", sa.get("automountServiceAccountToken", True))
        if automount is False:
            return None
        token = kube.service_account_token(self.namespace, sa_name)
        return kube.write_service_account_kubeconfig(self.dir / "kubeconfig", namespace=self.namespace,
                                                     token=token)

    async def _env(self, spec: dict[str, Any], image: Image, mounts: dict[str, Path], bin_dir: Path,
                   kubeconfig: Path | None) -> dict[str, str]:
        home = self.dir / "home"
        home.mkdir(exist_ok=True)
        env: dict[str, str] = {
            "PATH": f"{bin_dir}:{os.environ.get('PATH', '/usr/local/bin:/usr/bin:/bin')}",
            "HOME": str(home), "HOSTNAME": self.name, "LANG": "C.UTF-8",
            "PYTHONPATH": f"{ROOT}:{SITECUSTOMIZE}",
            "FLEETROUTE_TEST_CLUSTER_DNS": str(self.kubelet.network.dns_table),
            "FLEETROUTE_TEST_CLUSTER_SEARCH": search_list(self.namespace),
            TABLE_ENV: str(self.kubelet.policies.path), POD_IP_ENV: self.ip,
            **image.env,
        }
        if "/tmp" in mounts:
            env["TMPDIR"] = str(mounts["/tmp"])
        if kubeconfig is not None:
            env["KUBECONFIG"] = str(kubeconfig)
        if self.spec.get("enableServiceLinks", True):
            env.update(self.kubelet.service_links(self.namespace))
        for source in spec.get("envFrom") or ():
            for kind, plural in (("configMapRef", "configmaps"), ("secretRef", "secrets")):
                if kind in source:
                    obj = await self._wait_for(plural, source[kind]["name"], optional=source[kind].get("optional", False),
                                               why=f"envFrom of container {spec['name']!r}")
                    for key, value in _data(obj, plural).items():
                        env[source.get("prefix", "") + key] = value.decode()
        for var in spec.get("env") or ():
            if "valueFrom" in var:
                value = await self._value_from(var["name"], var["valueFrom"], spec)
                if value is None:
                    continue
            else:
                value = expand(var.get("value", ""), env)
            env[var["name"]] = value
        for key, value in list(env.items()):
            if key not in ("PATH", "HOME", "PYTHONPATH", "TMPDIR", "KUBECONFIG") and not key.startswith("FLEETROUTE_TEST_"):
                env[key] = self._in_pod(value, mounts)
        if image.listen_env:  # the router listens on its pod's address (its config says 0.0.0.0)
            env.setdefault("FLEETROUTE_LISTEN_HOST", self.ip)
            env.setdefault("FLEETROUTE_ADMIN_HOST", self.ip)
        return env

    async def _value_from(self, name: str, source: dict[str, Any], spec: dict[str, Any]) -> str | None:
        pod = self.kubelet.kube.get("pods", self.namespace, self.name) or {}
        if "fieldRef" in source:
            path = source["fieldRef"]["fieldPath"]
            meta = pod.get("metadata", {})
            m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
            if m:
                return (meta.get(m.group(1)) or {}).get(m.group(2), "")
            fields = {"metadata.name": self.name, "metadata.namespace": self.namespace, "metadata.uid": self.uid,
                      "spec.nodeName": NODE, "spec.serviceAccountName": self.spec.get("serviceAccountName", "default"),
                      "status.podIP": self.ip, "status.podIPs": self.ip, "status.hostIP": self.kubelet.host_ip,
                      "status.hostIPs": self.kubelet.host_ip}
            if path not in fields:
                raise PodFailed(f"env {name}: fieldRef {path!r} is not emulated")
            return fields[path]
        for kind, plural in (("secretKeyRef", "secrets"), ("configMapKeyRef", "configmaps")):
            if kind in source:
                ref = source[kind]
                obj = await self._wait_for(plural, ref["name"], optional=ref.get("optional", False),
                                           why=f"env {name} of container {spec['name']!r}")
                data = _data(obj, plural) if obj is not None else {}
                if ref["key"] not in data:
                    if ref.get("optional"):
                        return None
                    raise PodFailed(f"env {name}: key {ref['key']!r} not found in {plural} {ref['name']!r} "
                                    "(CreateContainerConfigError)")
                return data[ref["key"]].decode()
        if "resourceFieldRef" in source:
            ref = source["resourceFieldRef"]
            which, resource = ref["resource"].split(".", 1)
            value = ((spec.get("resources") or {}).get(which) or {}).get(resource)
            return str(_quantity(value, ref.get("divisor", "1"))) if value is not None else "0"
        raise PodFailed(f"env {name}: valueFrom {sorted(source)} is not emulated")

    def _in_pod(self, text: str, mounts: dict[str, Path]) -> str:
        return _rewrite_paths(POD_ADDRESS_WORDS.sub(self.ip, text), mounts)

    # ---- running ---------------------------------------------------------------------------------------

    async def _start(self, c: ContainerRuntime) -> None:
        assert c.log_path is not None
        with open(c.log_path, "ab") as out:
            out.write(f"--- start {now()}: {' '.join(c.argv)}\n".encode())
            out.flush()
            try:
                c.process = await asyncio.create_subprocess_exec(
                    *c.argv, cwd=c.cwd, env=c.env, stdin=asyncio.subprocess.DEVNULL, stdout=out,
                    stderr=asyncio.subprocess.STDOUT, start_new_session=True)
            except OSError as exc:
                raise PodFailed(f"container {c.name!r}: cannot start {c.argv[0]!r}: {exc}") from None
        c.exited.clear()
        c.started_at, c.waiting_reason = now(), None
        c.started = "startupProbe" not in c.spec
        c.ready = "readinessProbe" not in c.spec

    async def _supervise(self, c: ContainerRuntime) -> None:
        """Restart the container whenever it exits (restartPolicy Always), with CrashLoopBackOff delays."""
        while True:
            assert c.process is not None
            code = await c.process.wait()
            _killpg(c.process, signal.SIGKILL)  # what the container runtime does to the rest of its processes
            c.exited.set()
            if self.terminating.is_set():
                return
            c.last_exit = {"terminated": {"exitCode": code, "reason": "Completed" if code == 0 else "Error",
                                          "startedAt": c.started_at, "finishedAt": now()}}
            c.ready = False
            c.waiting_reason = "CrashLoopBackOff"
            log.warning("container %s/%s exited with %s; last log lines:\n%s", self.name, c.name, code,
                        self.logs(c.name, 20))
            self._write_status()
            delay = min(BACKOFF_BASE * 2 ** c.restarts, BACKOFF_MAX) * self.kubelet.time_scale
            c.restarts += 1
            try:
                await asyncio.wait_for(self.terminating.wait(), delay)
                return
            except TimeoutError:
                pass
            await self._start(c)
            self._write_status()

    async def _restart(self, c: ContainerRuntime, why: str) -> None:
        log.warning("container %s/%s: %s; restarting it", self.name, c.name, why)
        _signal(c.process, signal.SIGTERM)
        try:
            await asyncio.wait_for(c.exited.wait(), float(self.spec.get("terminationGracePeriodSeconds", 30)))
        except TimeoutError:
            _killpg(c.process, signal.SIGKILL)

    async def _probe_loop(self, c: ContainerRuntime, kind: str, probe: dict[str, Any]) -> None:
        task = asyncio.current_task()
        assert task is not None
        task.set_name(kind)
        # Liveness keeps real time: its window (period x failureThreshold) is sized for the process's own
        # start-up, which the time scale does not speed up.
        scale = self.kubelet.time_scale if kind != "livenessProbe" else 1.0
        period = float(probe.get("periodSeconds", 10)) * scale
        timeout = float(probe.get("timeoutSeconds", 1))
        success_needed = int(probe.get("successThreshold", 1))
        failure_needed = int(probe.get("failureThreshold", 3))
        await asyncio.sleep(float(probe.get("initialDelaySeconds", 0)) * scale)
        successes = failures = 0
        while True:
            if kind == "startupProbe" and c.started:
                return
            if kind != "startupProbe" and not c.started:
                await asyncio.sleep(period)
                continue
            ok = c.process is not None and c.process.returncode is None and await self._probe(c, probe, timeout)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if kind == "readinessProbe":
                ready = c.ready
                if ok and successes >= success_needed:
                    ready = True
                elif not ok and (failures >= failure_needed or c.process is None or c.process.returncode is not None):
                    ready = False
                if ready != c.ready:
                    c.ready = ready
                    self._write_status()
            elif kind == "startupProbe" and ok:
                c.started = True
                self._write_status()
                return
            elif not ok and failures >= failure_needed and c.process is not None and c.process.returncode is None:
                await self._restart(c, f"{kind} failed {failures} times")
                successes = failures = 0
            await asyncio.sleep(period)

    async def _probe(self, c: ContainerRuntime, probe: dict[str, Any], timeout: float) -> bool:
        try:
            if "httpGet" in probe:
                get = probe["httpGet"]
                port = self._port(c, get["port"])
                host = get.get("host") or self.ip
                url = f"{get.get('scheme', 'HTTP').lower()}://{host}:{port}{get.get('path', '/')}"
                headers = {h["name"]: h["value"] for h in get.get("httpHeaders") or ()}
                async with self.kubelet.http.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout),
                                                 allow_redirects=False) as resp:
                    return 200 <= resp.status < 400
            if "tcpSocket" in probe:
                port = self._port(c, probe["tcpSocket"]["port"])
                _, writer = await asyncio.wait_for(asyncio.open_connection(self.ip, port), timeout)
                writer.close()
                return True
            if "exec" in probe:
                return await self._exec(c, probe["exec"]["command"], timeout) == 0
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        raise PodFailed(f"container {c.name!r}: probe {sorted(probe)} is not emulated")

    async def _exec(self, c: ContainerRuntime, command: list[str], timeout: float | None) -> int:
        mounts = self.mounts[c.name]
        argv = [self._in_pod(expand(a, c.env), mounts) for a in command]
        assert c.log_path is not None
        with open(c.log_path, "ab") as out:
            try:
                proc = await asyncio.create_subprocess_exec(*argv, cwd=c.cwd, env=c.env, stdout=out,
                                                            stderr=asyncio.subprocess.STDOUT,
                                                            stdin=asyncio.subprocess.DEVNULL, start_new_session=True)
            except OSError:
                return 127
        try:
            return await asyncio.wait_for(proc.wait(), timeout)
        except (TimeoutError, asyncio.CancelledError):
            _killpg(proc, signal.SIGKILL)
            await proc.wait()
            raise

    def _port(self, c: ContainerRuntime, port: int | str) -> int:
        if isinstance(port, int) or str(port).isdigit():
            return int(port)
        for p in c.spec.get("ports") or ():
            if p.get("name") == port:
                return int(p["containerPort"])
        raise PodFailed(f"container {c.name!r}: no port named {port!r}")

    async def _stop_container(self, c: ContainerRuntime, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        hook = (c.spec.get("lifecycle") or {}).get("preStop")
        if hook and c.process is not None and c.process.returncode is None:
            try:
                if "exec" in hook:
                    await self._exec(c, hook["exec"]["command"], max(deadline - loop.time(), 0.01))
                elif "httpGet" in hook:
                    await self._probe(c, {"httpGet": hook["httpGet"]}, max(deadline - loop.time(), 0.01))
                elif "sleep" in hook:
                    await asyncio.sleep(min(float(hook["sleep"]["seconds"]) * self.kubelet.time_scale,
                                            max(deadline - loop.time(), 0)))
            except TimeoutError:
                log.warning("pod %s: preStop hook of %s ran past the grace period", self.name, c.name)
        _signal(c.process, signal.SIGTERM)
        if c.process is None:
            return
        try:
            await asyncio.wait_for(c.process.wait(), max(deadline - loop.time(), 0.01))
        except TimeoutError:
            log.warning("pod %s: container %s outlived its grace period: SIGKILL", self.name, c.name)
        _killpg(c.process, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            await c.process.wait()

    # ---- status ----------------------------------------------------------------------------------------

    def _write_status(self) -> None:
        kube = self.kubelet.kube
        pod = kube.get("pods", self.namespace, self.name)
        if pod is None:
            return
        statuses = []
        for spec in self.spec["containers"]:
            c = self.containers.get(spec["name"])
            running = c is not None and c.process is not None and c.process.returncode is None
            if running:
                assert c is not None
                state: dict[str, Any] = {"running": {"startedAt": c.started_at}}
            else:
                reason = (c.waiting_reason if c else None) or ("CreateContainerConfigError" if self.error
                                                               else "ContainerCreating")
                state = {"waiting": {"reason": reason, **({"message": self.error} if self.error else {})}}
            statuses.append({
                "name": spec["name"], "image": spec.get("image", ""), "imageID": "", "ready": bool(c and c.ready and running),
                "started": bool(c and c.started and running), "restartCount": c.restarts if c else 0,
                "state": state, "lastState": (c.last_exit if c and c.last_exit else {}),
                **({"containerID": f"local://{c.process.pid}"} if c and c.process else {}),
            })
        ready = bool(statuses) and all(s["ready"] for s in statuses)
        started = bool(self.containers) and all(c.process is not None for c in self.containers.values())

        def condition(kind: str, ok: bool) -> dict[str, Any]:
            old = next((x for x in (pod.get("status") or {}).get("conditions") or () if x["type"] == kind), None)
            status = "True" if ok else "False"
            since = old["lastTransitionTime"] if old and old["status"] == status else now()
            return {"type": kind, "status": status, "lastProbeTime": None, "lastTransitionTime": since}

        status = {
            "phase": "Running" if started else "Pending",
            "conditions": [condition("PodScheduled", True), condition("Initialized", True),
                           condition("ContainersReady", ready), condition("Ready", ready)],
            "hostIP": self.kubelet.host_ip, "hostIPs": [{"ip": self.kubelet.host_ip}],
            "podIP": self.ip, "podIPs": [{"ip": self.ip}],
            "startTime": (pod.get("status") or {}).get("startTime") or now(),
            "containerStatuses": statuses, "qosClass": "Burstable",
        }
        if self.error:
            status["message"] = self.error
        if (pod.get("status") or {}) == status:
            return
        updated = copy.deepcopy(pod)
        updated["status"] = status
        kube.update("pods", updated, namespace=self.namespace)

    def logs(self, container: str, lines: int = 40) -> str:
        path = self.dir / f"{container}.log"
        if not path.exists():
            return "(no log)"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


class Kubelet:
    def __init__(self, kube: FakeKube, network: Network, root: Path, http: aiohttp.ClientSession, *,
                 time_scale: float, sim_time_scale: float, sim_gpu: str,
                 service_links: Callable[[str], dict[str, str]], policies: PolicyTable,
                 gpus: NodeGpus | None = None) -> None:
        self.kube, self.network, self.root, self.http = kube, network, root, http
        self.policies, self.gpus = policies, gpus
        self.time_scale, self.sim_time_scale, self.sim_gpu = time_scale, sim_time_scale, sim_gpu
        self.service_links = service_links
        self.host_ip = network.node_ip
        self.pods: dict[str, PodRuntime] = {}  # by uid

    def sync(self) -> None:
        """Start the pods bound to this node, stop those marked for deletion, forget the removed ones."""
        seen = set()
        for pod in self.kube.list("pods"):
            uid = pod["metadata"]["uid"]
            seen.add(uid)
            if pod["spec"].get("nodeName") != NODE:
                continue
            runtime = self.pods.get(uid)
            if runtime is None and not pod["metadata"].get("deletionTimestamp"):
                self.pods[uid] = PodRuntime(self, pod)
            elif runtime is not None and pod["metadata"].get("deletionTimestamp"):
                runtime.terminate()
            elif runtime is None and pod["metadata"].get("deletionTimestamp"):
                self.kube.delete("pods", pod["metadata"]["name"], namespace=pod["metadata"]["namespace"])
        for uid, runtime in list(self.pods.items()):
            if uid not in seen and not runtime.terminating.is_set():  # removed without grace (force delete)
                runtime.terminate()
            if runtime.gone.is_set():
                del self.pods[uid]

    def runtime(self, name: str, namespace: str) -> PodRuntime:
        return next(r for r in self.pods.values() if (r.name, r.namespace) == (name, namespace))

    async def close(self) -> None:
        await asyncio.gather(*(r.kill() for r in self.pods.values()), return_exceptions=True)


def _data(obj: dict[str, Any] | None, plural: str) -> dict[str, bytes]:
    if obj is None:
        return {}
    if plural == "secrets":
        out = {k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()}
        out.update({k: v.encode() for k, v in (obj.get("stringData") or {}).items()})
        return out
    out = {k: v.encode() for k, v in (obj.get("data") or {}).items()}
    out.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
    return out


def _rewrite_paths(text: str, mounts: dict[str, Path]) -> str:
    """Each mount path (as a whole path or a prefix of one) replaced by its local directory, in one pass: a
    replacement is never rewritten again (the local directories may sit under a mount path such as /tmp)."""
    if not mounts:
        return text
    local = {m.rstrip("/") or "/": str(path) for m, path in mounts.items()}
    pattern = "|".join(re.escape(m) for m in sorted(local, key=len, reverse=True))
    return re.sub(r"(?<![\w./-])(" + pattern + r")(?=/|$|[^\w.-])", lambda m: local[m.group(1)], text)


_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30,
             "Ti": 2**40, "m": 0.001}


def _quantity(value: Any, divisor: Any = "1") -> int:
    def parse(q: Any) -> float:
        m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(q))
        if m is None or m.group(2) not in _SUFFIXES:
            raise PodFailed(f"resource quantity {q!r} is not understood")
        return float(m.group(1)) * _SUFFIXES[m.group(2)]
    import math
    return math.ceil(parse(value) / parse(divisor))


def _signal(process: asyncio.subprocess.Process | None, sig: int) -> None:
    if process is not None and process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)


def _killpg(process: asyncio.subprocess.Process | None, sig: int) -> None:
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)  # its own session: the group is the container's processes, only ours
