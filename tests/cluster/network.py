"""Pod and Service addresses on the loopback network, and the cluster DNS table.

A pod's network namespace gives it its own IP, `localhost`, and every port. Here each pod gets its own
loopback address instead (Linux routes all of 127.0.0.0/8 to `lo`), and each Service a loopback "ClusterIP",
from one 127.N.0.0/16 block per cluster (N random, so concurrent test runs do not meet): the node
127.N.0.1, the API server 127.N.0.2 (port 6443), pods in 127.N.1-9.x, Services in 127.N.10-19.x. What a namespace would give is rewritten where a container asks for
it (tests/cluster/kubelet.py): a bind to 0.0.0.0 or a connection to 127.0.0.1/localhost inside a pod becomes
the pod's address. Network namespaces (`ip netns`) would be more faithful but need root, veth pairs and
non-loopback addresses for the test to reach the pods, and leave kernel state behind a crashed test; the
loopback block needs none of that.

DNS: a Service is `<svc>.<ns>.svc.cluster.local`; the table (FQDN -> ClusterIP, JSON) is read by the
pod processes' sitecustomize (tests/cluster/sitecustomize/), with the namespace's search list.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

SITECUSTOMIZE = Path(__file__).resolve().parent / "sitecustomize"
CLUSTER_DOMAIN = "cluster.local"


def search_list(namespace: str) -> str:
    """resolv.conf's search line of a pod in `namespace` (ClusterFirst DNS policy)."""
    return f"{namespace}.svc.{CLUSTER_DOMAIN} svc.{CLUSTER_DOMAIN} {CLUSTER_DOMAIN}"


class Network:
    def __init__(self, root: Path, block: int | None = None) -> None:
        self.block = block if block is not None else random.Random().randint(20, 250)
        self._next_pod = 0
        self._next_service = 0
        self.dns_table = root / "cluster-dns.json"
        self.names: dict[str, str] = {}
        self._write()

    @property
    def node_ip(self) -> str:
        return f"127.{self.block}.0.1"

    @property
    def api_server_ip(self) -> str:
        return f"127.{self.block}.0.2"

    def pod_ip(self) -> str:
        n, self._next_pod = self._next_pod, self._next_pod + 1
        if n >= 9 * 250:
            raise RuntimeError("out of pod addresses")
        return f"127.{self.block}.{1 + n // 250}.{2 + n % 250}"

    def service_ip(self) -> str:
        n, self._next_service = self._next_service, self._next_service + 1
        return f"127.{self.block}.{10 + n // 250}.{2 + n % 250}"

    def add_service(self, name: str, namespace: str, ip: str) -> None:
        self.names[f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"] = ip
        self._write()

    def remove_service(self, name: str, namespace: str) -> None:
        self.names.pop(f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}", None)
        self._write()

    def _write(self) -> None:
        tmp = self.dns_table.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.names))
        os.replace(tmp, self.dns_table)  # readers see the old table or the new one, never half of one
