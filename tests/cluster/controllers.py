"""The controllers of a cluster's control plane that the chart relies on, reconciling against the fake API
server (tests/fake_kube.py) in the test process:

- **Services**: a ClusterIP from the cluster's block (the API server allocates it at creation; here at the
  next reconcile) and its DNS name (tests/cluster/network.py). NodePort and LoadBalancer Services are
  ClusterIP Services here; headless ones get no address.
- **Deployments**: pods named `<deployment>-<pod-template-hash>-<5 chars>` labelled `pod-template-hash`, the
  hash of the pod template (FNV-32a, encoded as the controller does; of our JSON, not Go's struct dump). A
  rollout follows the RollingUpdate arithmetic of the deployment controller (`maxSurge` rounded up,
  `maxUnavailable` down, both percentages of `replicas`, 25% each by default; at most replicas + maxSurge
  pods, at least replicas - maxUnavailable available, unhealthy old pods removed first), or Recreate.
  Terminating pods count for neither, as in the ReplicaSet controller. Status: observedGeneration, replicas,
  updatedReplicas, readyReplicas, availableReplicas (minReadySeconds 0), unavailableReplicas, and the
  Available and Progressing conditions, which `kubectl rollout status` reads. No ReplicaSet objects: pods are
  owned by the Deployment directly (no test reads ReplicaSets).
- **StatefulSets**: `<sts>-<ordinal>` with OrderedReady (one at a time, each after the lower ones are
  ready) or Parallel management, the pod-name/pod-index/controller-revision-hash labels, hostname and
  subdomain; RollingUpdate replaces the highest ordinal first, one pod at a time.
- **DaemonSets**: one pod on the one node, `<ds>-<5 chars>`, replaced on a template change.
- **EndpointSlices**, per Service with a selector: one slice per set of resolved target ports, named
  `<svc>-<5 chars>`, labelled `kubernetes.io/service-name` and `endpointslice.kubernetes.io/managed-by` with
  the Service's own labels copied, each pod with an IP an endpoint: its address, `targetRef` (the Pod),
  `nodeName`, and the discovery.k8s.io/v1 conditions: `serving` = the pod is Ready, `terminating` = it has a
  deletionTimestamp, `ready` = serving and not terminating (always true with `publishNotReadyAddresses`).
  Ports by name with the target port resolved on the pod (a named `targetPort` is the container port of that
  name).
- **ServiceAccount admission**: a pod whose ServiceAccount does not exist is refused (the controller reports
  a ReplicaFailure condition and retries), as the API server's ServiceAccount admission plugin does.

Writes happen only when the wanted object differs from the stored one, so a reconcile of a settled cluster
writes nothing.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import random
from typing import Any

from tests.cluster.kubelet import NODE, now
from tests.cluster.network import Network
from tests.fake_kube import FakeKube, _selects

log = logging.getLogger("tests.cluster.controllers")

SAFE_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # k8s.io/apimachinery/pkg/util/rand: no vowels, no 0/1/3


def safe_encode(text: str) -> str:
    return "".join(SAFE_ALPHABET[ord(ch) % len(SAFE_ALPHABET)] for ch in text)


def template_hash(template: dict[str, Any]) -> str:
    """pod-template-hash: FNV-32a of the template, its decimal digits safe-encoded (controller.ComputeHash)."""
    h = 0x811C9DC5
    for byte in json.dumps(template, sort_keys=True).encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return safe_encode(str(h))


def random_suffix(rng: random.Random, n: int = 5) -> str:
    return "".join(rng.choice(SAFE_ALPHABET) for _ in range(n))


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or ())


def terminating(pod: dict[str, Any]) -> bool:
    return bool(pod["metadata"].get("deletionTimestamp"))


def _scaled(value: Any, total: int, *, round_up: bool) -> int:
    if isinstance(value, str) and value.endswith("%"):
        exact = total * int(value[:-1]) / 100
        return math.ceil(exact) if round_up else math.floor(exact)
    return int(value)


class Controllers:
    def __init__(self, kube: FakeKube, network: Network, *, seed: int = 0) -> None:
        self.kube, self.network = kube, network
        self.rng = random.Random(seed)
        self.failures: dict[str, str] = {}  # controller object -> why its last pod creation failed

    def reconcile(self) -> None:
        for ns in self.kube.list("namespaces"):  # the ServiceAccount controller: a "default" in each namespace
            name = ns["metadata"]["name"]
            if self.kube.get("serviceaccounts", name, "default") is None:
                self.kube.create("serviceaccounts", {"metadata": {"name": "default"}}, namespace=name)
        for svc in self.kube.list("services"):
            self._service(svc)
        for d in self.kube.list("deployments"):
            self._deployment(d)
        for sts in self.kube.list("statefulsets"):
            self._statefulset(sts)
        for ds in self.kube.list("daemonsets"):
            self._daemonset(ds)
        for svc in self.kube.list("services"):
            self._endpoint_slices(svc)

    # ---- Services ------------------------------------------------------------------------------------

    def _service(self, svc: dict[str, Any]) -> None:
        spec = svc["spec"]
        if spec.get("clusterIP") in (None, ""):
            updated = copy.deepcopy(svc)
            ip = self.network.service_ip()
            updated["spec"]["clusterIP"], updated["spec"]["clusterIPs"] = ip, [ip]
            self.kube.update("services", updated, namespace=svc["metadata"]["namespace"])
            self.network.add_service(svc["metadata"]["name"], svc["metadata"]["namespace"], ip)

    def service_links(self, namespace: str) -> dict[str, str]:
        """The docker-links style variables the kubelet gives a new pod for each Service of its namespace."""
        env: dict[str, str] = {}
        for svc in self.kube.list("services", namespace):
            ip, ports = svc["spec"].get("clusterIP"), svc["spec"].get("ports") or []
            if not ip or ip == "None" or not ports:
                continue
            name = svc["metadata"]["name"].upper().replace("-", "_")
            first = ports[0]
            env[f"{name}_SERVICE_HOST"] = ip
            env[f"{name}_SERVICE_PORT"] = str(first["port"])
            env[f"{name}_PORT"] = f"{first.get('protocol', 'TCP').lower()}://{ip}:{first['port']}"
            for p in ports:
                proto = p.get("protocol", "TCP")
                if p.get("name"):
                    env[f"{name}_SERVICE_PORT_{p['name'].upper().replace('-', '_')}"] = str(p["port"])
                prefix = f"{name}_PORT_{p['port']}_{proto}"
                env[prefix] = f"{proto.lower()}://{ip}:{p['port']}"
                env[f"{prefix}_PROTO"], env[f"{prefix}_PORT"], env[f"{prefix}_ADDR"] = proto.lower(), str(p["port"]), ip
        return env

    # ---- pods for workloads ----------------------------------------------------------------------------

    def _owned(self, owner: dict[str, Any]) -> list[dict[str, Any]]:
        uid = owner["metadata"]["uid"]
        return [p for p in self.kube.list("pods", owner["metadata"]["namespace"])
                if any(r.get("uid") == uid for r in p["metadata"].get("ownerReferences") or ())]

    def _create_pod(self, owner: dict[str, Any], name: str, labels: dict[str, str],
                    extra_spec: dict[str, Any] | None = None) -> bool:
        ns = owner["metadata"]["namespace"]
        template = owner["spec"]["template"]
        spec = copy.deepcopy(template["spec"])
        spec.setdefault("restartPolicy", "Always")
        spec.setdefault("terminationGracePeriodSeconds", 30)
        spec.setdefault("dnsPolicy", "ClusterFirst")
        spec.setdefault("serviceAccountName", spec.get("serviceAccount") or "default")
        spec.setdefault("schedulerName", "default-scheduler")
        spec["nodeName"] = NODE  # the scheduler's binding: one node with room for everything
        spec.update(extra_spec or {})
        key = f"{owner['kind']}/{owner['metadata']['name']}"
        if self.kube.get("serviceaccounts", ns, spec["serviceAccountName"]) is None:
            message = (f'pods "{name}" is forbidden: error looking up service account '
                       f'{ns}/{spec["serviceAccountName"]}: serviceaccount "{spec["serviceAccountName"]}" not found')
            if self.failures.get(key, "").split(": ", 1)[-1] != message.split(": ", 1)[-1]:
                log.warning("%s: %s", key, message)
            self.failures[key] = message
            return False
        self.failures.pop(key, None)
        meta = template.get("metadata") or {}
        self.kube.create("pods", {
            "metadata": {
                "name": name, "namespace": ns, "labels": {**(meta.get("labels") or {}), **labels},
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [{"apiVersion": owner["apiVersion"], "kind": owner["kind"],
                                     "name": owner["metadata"]["name"], "uid": owner["metadata"]["uid"],
                                     "controller": True, "blockOwnerDeletion": True}],
            },
            "spec": spec,
            "status": {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "True", "lastProbeTime": None, "lastTransitionTime": now()}]},
        }, namespace=ns)
        return True

    def _delete_pod(self, pod: dict[str, Any]) -> None:
        self.kube.delete_gracefully("pods", pod["metadata"]["name"], namespace=pod["metadata"]["namespace"])

    def _write_status(self, plural: str, obj: dict[str, Any], status: dict[str, Any]) -> None:
        current = obj.get("status") or {}
        if {k: v for k, v in current.items() if k != "conditions"} == \
                {k: v for k, v in status.items() if k != "conditions"} and \
                [(c["type"], c["status"]) for c in current.get("conditions") or ()] == \
                [(c["type"], c["status"]) for c in status.get("conditions") or ()]:
            return
        updated = copy.deepcopy(obj)
        updated["status"] = status
        self.kube.update(plural, updated, namespace=obj["metadata"]["namespace"])

    def _deployment(self, d: dict[str, Any]) -> None:
        spec = d["spec"]
        replicas = int(spec.get("replicas", 1))
        h = template_hash(spec["template"])
        pods = self._owned(d)
        active = [p for p in pods if not terminating(p)]
        new = [p for p in active if p["metadata"]["labels"].get("pod-template-hash") == h]
        old = [p for p in active if p not in new]
        strategy = spec.get("strategy") or {}
        name = d["metadata"]["name"]

        def create(n: int) -> None:
            for _ in range(n):
                if not self._create_pod(d, f"{name}-{h}-{random_suffix(self.rng)}", {"pod-template-hash": h}):
                    return

        if strategy.get("type") == "Recreate":
            if old:
                for p in old:
                    self._delete_pod(p)
            elif not any(terminating(p) for p in pods):
                create(replicas - len(new))
        else:
            rolling = strategy.get("rollingUpdate") or {}
            surge = _scaled(rolling.get("maxSurge", "25%"), replicas, round_up=True)
            unavailable = _scaled(rolling.get("maxUnavailable", "25%"), replicas, round_up=False)
            if surge == 0 and unavailable == 0:
                unavailable = 1
            # Scale the new pods up: at most replicas + maxSurge pods in all.
            if len(new) < replicas:
                create(min(replicas + surge - len(active), replicas - len(new)))
            # Scale the old ones down, unhealthy first, keeping replicas - maxUnavailable available.
            min_available = replicas - unavailable
            new_unavailable = sum(1 for p in new if not pod_ready(p))
            budget = len(active) - min_available - new_unavailable
            for p in [p for p in old if not pod_ready(p)][:max(budget, 0)]:
                self._delete_pod(p)
                old.remove(p)
                budget -= 1
            available = sum(1 for p in active if pod_ready(p) and p in new + old)
            for p in [p for p in old if pod_ready(p)][:max(min(budget, available - min_available), 0)]:
                self._delete_pod(p)
            if not old and len(new) > replicas:  # scaled down
                for p in sorted(new, key=pod_ready)[:len(new) - replicas]:
                    self._delete_pod(p)
        pods = [p for p in self._owned(d) if not terminating(p)]
        updated = [p for p in pods if p["metadata"]["labels"].get("pod-template-hash") == h]
        ready = sum(1 for p in pods if pod_ready(p))
        conditions = [
            {"type": "Available", "status": "True" if ready >= replicas - _scaled(
                (strategy.get("rollingUpdate") or {}).get("maxUnavailable", "25%"), replicas, round_up=False) else "False",
             "reason": "MinimumReplicasAvailable", "message": "Deployment has minimum availability.",
             "lastUpdateTime": now(), "lastTransitionTime": now()},
            {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"
             if len(updated) == replicas == ready and len(pods) == replicas else "ReplicaSetUpdated",
             "message": f'ReplicaSet "{name}-{h}" is progressing.', "lastUpdateTime": now(),
             "lastTransitionTime": now()},
        ]
        key = f"Deployment/{name}"
        if key in self.failures:
            conditions.append({"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate",
                               "message": self.failures[key], "lastUpdateTime": now(), "lastTransitionTime": now()})
        self._write_status("deployments", d, {
            "observedGeneration": d["metadata"].get("generation", 1), "replicas": len(pods),
            "updatedReplicas": len(updated), "readyReplicas": ready, "availableReplicas": ready,
            **({"unavailableReplicas": replicas - ready} if ready < replicas else {}),
            "conditions": conditions,
        })

    def _statefulset(self, sts: dict[str, Any]) -> None:
        spec = sts["spec"]
        name, replicas = sts["metadata"]["name"], int(spec.get("replicas", 1))
        revision = f"{name}-{template_hash(spec['template'])}"
        by_ordinal = {int(p["metadata"]["name"].rsplit("-", 1)[1]): p for p in self._owned(sts)}
        ordered = spec.get("podManagementPolicy", "OrderedReady") == "OrderedReady"
        for i in range(replicas):
            pod = by_ordinal.get(i)
            if pod is None:
                if self._create_pod(sts, f"{name}-{i}", {
                        "statefulset.kubernetes.io/pod-name": f"{name}-{i}", "apps.kubernetes.io/pod-index": str(i),
                        "controller-revision-hash": revision},
                        {"hostname": f"{name}-{i}", "subdomain": spec.get("serviceName", "")}) and ordered:
                    break
                if ordered:
                    break
            elif ordered and (terminating(pod) or not pod_ready(pod)):
                break
        for i in sorted((i for i in by_ordinal if i >= replicas), reverse=True):
            if not terminating(by_ordinal[i]):
                self._delete_pod(by_ordinal[i])
            if ordered:
                break
        current = [by_ordinal[i] for i in range(replicas) if i in by_ordinal]
        strategy = (spec.get("updateStrategy") or {}).get("type", "RollingUpdate")
        if strategy == "RollingUpdate" and len(current) == replicas and all(
                pod_ready(p) and not terminating(p) for p in current):
            stale = [p for p in current if p["metadata"]["labels"].get("controller-revision-hash") != revision]
            if stale:
                self._delete_pod(max(stale, key=lambda p: int(p["metadata"]["name"].rsplit("-", 1)[1])))
        pods = [p for p in self._owned(sts) if not terminating(p)]
        ready = sum(1 for p in pods if pod_ready(p))
        updated = sum(1 for p in pods if p["metadata"]["labels"].get("controller-revision-hash") == revision)
        self._write_status("statefulsets", sts, {
            "observedGeneration": sts["metadata"].get("generation", 1), "replicas": len(pods),
            "readyReplicas": ready, "availableReplicas": ready, "currentReplicas": updated,
            "updatedReplicas": updated, "currentRevision": revision, "updateRevision": revision,
        })

    def _daemonset(self, ds: dict[str, Any]) -> None:
        name = ds["metadata"]["name"]
        revision = template_hash(ds["spec"]["template"])
        pods = self._owned(ds)
        active = [p for p in pods if not terminating(p)]
        for p in active:
            if p["metadata"]["labels"].get("controller-revision-hash") != revision:
                self._delete_pod(p)
        if not any(p["metadata"]["labels"].get("controller-revision-hash") == revision for p in active) \
                and not any(terminating(p) for p in pods):
            self._create_pod(ds, f"{name}-{random_suffix(self.rng)}", {
                "controller-revision-hash": revision,
                "pod-template-generation": str(ds["metadata"].get("generation", 1))})
        pods = [p for p in self._owned(ds) if not terminating(p)]
        ready = sum(1 for p in pods if pod_ready(p))
        self._write_status("daemonsets", ds, {
            "observedGeneration": ds["metadata"].get("generation", 1), "currentNumberScheduled": len(pods),
            "desiredNumberScheduled": 1, "numberMisscheduled": 0, "numberReady": ready,
            "numberAvailable": ready, "updatedNumberScheduled": len(pods),
        })

    # ---- EndpointSlices --------------------------------------------------------------------------------

    def _endpoint_slices(self, svc: dict[str, Any]) -> None:
        spec, meta = svc["spec"], svc["metadata"]
        if not spec.get("selector"):
            return
        ns, name = meta["namespace"], meta["name"]
        groups: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]] = {}
        for pod in self.kube.list("pods", ns):
            ip = (pod.get("status") or {}).get("podIP")
            if not ip or not _selects({"matchLabels": spec["selector"]}, pod["metadata"].get("labels") or {}):
                continue
            ports = [self._slice_port(p, pod) for p in spec.get("ports") or ()]
            if None in ports:
                continue
            serving = pod_ready(pod) or bool(spec.get("publishNotReadyAddresses"))
            endpoint = {
                "addresses": [ip],
                "conditions": {"ready": serving and not terminating(pod), "serving": serving,
                               "terminating": terminating(pod)},
                "targetRef": {"kind": "Pod", "namespace": ns, "name": pod["metadata"]["name"],
                              "uid": pod["metadata"]["uid"]},
                "nodeName": NODE,
            }
            groups.setdefault(json.dumps(ports, sort_keys=True), (ports, []))[1].append(endpoint)  # type: ignore[arg-type]
        existing = self.kube.list("endpointslices", ns, f"kubernetes.io/service-name={name}")
        labels = {**(meta.get("labels") or {}), "kubernetes.io/service-name": name,
                  "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io"}
        wanted = list(groups.values()) or [([], [])]
        for i, (ports, endpoints) in enumerate(wanted):
            body = {"addressType": "IPv4", "endpoints": endpoints, "ports": ports}
            if i < len(existing):
                current = existing[i]
                if {k: current.get(k) for k in body} == body and current["metadata"].get("labels") == labels:
                    continue
                updated = copy.deepcopy(current)
                updated.update(body)
                updated["metadata"]["labels"] = labels
                self.kube.update("endpointslices", updated, namespace=ns)
            else:
                self.kube.create("endpointslices", {
                    "metadata": {"name": f"{name}-{random_suffix(self.rng)}", "namespace": ns, "labels": labels,
                                 "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": name,
                                                      "uid": meta["uid"], "controller": True,
                                                      "blockOwnerDeletion": True}]},
                    **body}, namespace=ns)
        for extra in existing[len(wanted):]:
            self.kube.delete("endpointslices", extra["metadata"]["name"], namespace=ns)

    @staticmethod
    def _slice_port(port: dict[str, Any], pod: dict[str, Any]) -> dict[str, Any] | None:
        target = port.get("targetPort", port["port"])
        if isinstance(target, str) and not target.isdigit():
            number = next((p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or ()
                           if p.get("name") == target), None)
            if number is None:
                return None  # the controller leaves out a pod without the named port
        else:
            number = int(target)
        out = {"name": port.get("name", ""), "port": int(number), "protocol": port.get("protocol", "TCP")}
        if port.get("appProtocol"):
            out["appProtocol"] = port["appProtocol"]
        return out

