"""NetworkPolicy enforcement for the cluster in a box: every connection a pod makes, and every connection a
Service carries, is let through only if the NetworkPolicies stored in the API server allow it (evaluated by
tests/netpol.py: a connection needs the sender's egress and the receiver's ingress).

Where each connection is checked, as a CNI would see its packets:

- **Through a Service**: kube-proxy (tests/cluster/kube_proxy.py) checks the connection's source address
  against the endpoint it picked, after the translation (a policy sees the endpoint's address and port, not
  the ClusterIP's), and resets a connection no policy allows.
- **To an address directly** (routers to the workers' pod addresses, any pod to the API server): the pod's
  own process checks before it connects (tests/cluster/sitecustomize/) and gets ECONNREFUSED.

The source identifies the sender: pod processes bind their outgoing sockets to their pod address (what their
network namespace would give them), and kube-proxy connects to the endpoint from the client's address, as
iptables' translation keeps it. Everything else is outside the cluster: the test process (127.0.0.1), the
node's address (kubelet probes, and the tests' `kubectl port-forward` stand-in), which policies never block
("Pods cannot block access from their resident node"), and the API server (its own address and port 6443,
the usual endpoint port that the chart's rule names).

Emulated, not real: a CNI drops what no policy allows, so a real client waits for its connect timeout; here
it is reset or refused at once, with the check's reason logged (`denied`). Not modelled: UDP (the cluster's
DNS is a file here), SCTP, and `ipBlock` rules matching pod addresses (tests/netpol.py: discouraged by the
API documentation). A pod's connections to itself are always allowed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from tests.netpol import Address, Network, Pod

TABLE_ENV = "FLEETROUTE_TEST_CLUSTER_NETPOL"  # the table's path, for pod processes
POD_IP_ENV = "FLEETROUTE_TEST_POD_IP"


def model(*, pods: list[dict[str, Any]], policies: list[dict[str, Any]], services: list[str], node: str,
          api_server: str) -> dict[str, Any]:
    """The table (JSON-able) the checks read: pods by address, the policies, the Services' ClusterIPs."""
    table: dict[str, Any] = {}
    for pod in pods:
        ip = (pod.get("status") or {}).get("podIP")
        if not ip:
            continue
        ports = {p["name"]: int(p["containerPort"]) for c in pod["spec"]["containers"] for p in c.get("ports") or ()
                 if p.get("name")}
        table[ip] = {"name": pod["metadata"]["name"], "namespace": pod["metadata"]["namespace"],
                     "labels": pod["metadata"].get("labels") or {}, "ports": ports}
    return {"node": node, "api_server": api_server, "services": sorted(services), "pods": table,
            "policies": [{"metadata": p["metadata"], "spec": p["spec"]} for p in policies]}


def _place(table: dict[str, Any], ip: str) -> Pod | Address:
    pod = table["pods"].get(ip)
    if pod is not None:
        return Pod(pod["name"], pod["namespace"], pod["labels"], pod["ports"])
    return Address("api-server" if ip == table["api_server"] else "outside the cluster", ip)


def _describe(place: Pod | Address) -> str:
    return f"pod {place.namespace}/{place.name}" if isinstance(place, Pod) else f"{place.name} ({place.ip})"


def refusal(table: dict[str, Any], source: str, destination: str, port: int) -> str | None:
    """Why no NetworkPolicy lets a TCP connection from `source` to `destination:port` through; None if one
    does (or none applies). A ClusterIP is not judged here: kube-proxy judges the endpoint it picks."""
    if source in (table["node"], destination) or destination in table["services"]:
        return None
    sender, receiver = _place(table, source), _place(table, destination)
    if Network(table["policies"]).allows(sender, receiver, port):
        return None
    return f"NetworkPolicy: {_describe(sender)} -> {_describe(receiver)} port {port}/TCP is not allowed"


class PolicyTable:
    """The harness's side: the table, rewritten when the pods or policies change, and checked in process."""

    def __init__(self, path: Path, *, node: str, api_server: str) -> None:
        self.path, self.node, self.api_server = path, node, api_server
        self.table = model(pods=[], policies=[], services=[], node=node, api_server=api_server)
        self.denied: list[str] = []  # kube-proxy's refusals (pods log their own, in `denied_by_pods`)
        self._text = ""
        self._write()

    @property
    def denied_log(self) -> Path:
        return self.path.with_suffix(".denied")

    def update(self, *, pods: list[dict[str, Any]], policies: list[dict[str, Any]], services: list[str]) -> None:
        self.table = model(pods=pods, policies=policies, services=services, node=self.node,
                           api_server=self.api_server)
        self._write()

    def _write(self) -> None:
        text = json.dumps(self.table, sort_keys=True)
        if text == self._text:
            return
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)  # readers see the old table or the new one, never half of one
        self._text = text

    def refusal(self, source: str, destination: str, port: int) -> str | None:
        why = refusal(self.table, source, destination, port)
        if why is not None:
            self.denied.append(why)
        return why

    def denied_by_pods(self) -> list[str]:
        return self.denied_log.read_text().splitlines() if self.denied_log.exists() else []
