"""NetworkPolicy semantics (networking.k8s.io/v1), evaluated over a model of pods and outside addresses, so that
tests can ask what a set of rendered policies lets through.

As the API documents it (kubernetes.io/docs/concepts/services-networking/network-policies):
- a pod that no policy of a direction selects is open in that direction; once one selects it, only what some
  rule of those policies allows gets through, and a connection needs both the sender's egress and the
  receiver's ingress;
- a rule with no ports allows every port, one with no peers (`from`/`to` absent) every peer;
- a peer is a podSelector (pods of the policy's namespace), a namespaceSelector (every pod of the selected
  namespaces), both (the selected pods of the selected namespaces) or an ipBlock (addresses outside the cluster
  here: pod addresses are not modelled, as the documentation advises against relying on them);
- a port is a number or the name of a container port of the receiving pod; the protocol defaults to TCP;
- traffic from the pod's own node (kubelet probes) is never subject to policies, so it is not modelled.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: dict[str, str]
    ports: dict[str, int] = field(default_factory=dict)  # named container ports


@dataclass(frozen=True)
class Address:
    """A place outside the cluster's pods: the API server's endpoints, the Internet."""

    name: str
    ip: str


Place = Pod | Address


def selects(selector: dict | None, labels: dict[str, str]) -> bool:
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or ():
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        present = key in labels
        ok = {"In": present and labels.get(key) in values, "NotIn": not present or labels[key] not in values,
              "Exists": present, "DoesNotExist": not present}[op]
        if not ok:
            return False
    return True


def _peer_matches(peer: dict, place: Place, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        if not isinstance(place, Address):
            return False
        ip = ipaddress.ip_address(place.ip)
        block = peer["ipBlock"]
        return ip in ipaddress.ip_network(block["cidr"]) and not any(
            ip in ipaddress.ip_network(e) for e in block.get("except") or ())
    if not isinstance(place, Pod):
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": place.namespace}):
            return False
    elif place.namespace != policy_namespace:
        return False
    return "podSelector" not in peer or selects(peer["podSelector"], place.labels)


def _port_matches(ports: list[dict] | None, receiver: Place, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        want = p.get("port")
        if want is None:
            return True
        if isinstance(want, str):
            want = receiver.ports.get(want) if isinstance(receiver, Pod) else None
        if want is not None and (want == port or want <= port <= p.get("endPort", want)):
            return True
    return False


class Network:
    def __init__(self, policies: list[dict]) -> None:
        self.policies = policies

    def _selecting(self, pod: Pod, direction: str) -> list[dict]:
        return [p for p in self.policies
                if p["metadata"]["namespace"] == pod.namespace and direction in p["spec"].get("policyTypes", ["Ingress"])
                and selects(p["spec"].get("podSelector"), pod.labels)]

    def _side_allows(self, pod: Pod, direction: str, other: Place, receiver: Place, port: int, protocol: str) -> bool:
        policies = self._selecting(pod, direction)
        if not policies:
            return True
        key, peers_key = ("ingress", "from") if direction == "Ingress" else ("egress", "to")
        for policy in policies:
            for rule in policy["spec"].get(key) or ():
                peers = rule.get(peers_key)
                if _port_matches(rule.get("ports"), receiver, port, protocol) and (
                        not peers or any(_peer_matches(p, other, policy["metadata"]["namespace"]) for p in peers)):
                    return True
        return False

    def allows(self, sender: Place, receiver: Place, port: int, protocol: str = "TCP") -> bool:
        if isinstance(sender, Pod) and not self._side_allows(sender, "Egress", receiver, receiver, port, protocol):
            return False
        return not isinstance(receiver, Pod) or self._side_allows(receiver, "Ingress", sender, receiver, port, protocol)
