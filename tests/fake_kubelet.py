"""A fake kubelet PodResources endpoint: a real gRPC server (grpcio) on a unix socket, serving the
`v1.PodResourcesLister` service (its `List`, the method the node agent calls) from worker/podresources/api.proto,
on the kubelet's wire format.

Tests say which pod's container holds which devices (`assign`), take pods away (`remove`), and stop or
start the server (a kubelet restart recreates its socket). `List` answers every pod of the node, as the kubelet
does.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from worker.podresources import api_pb2, api_pb2_grpc

GPU = "nvidia.com/gpu"


class FakePodResources(api_pb2_grpc.PodResourcesListerServicer):
    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        # (namespace, pod) -> {container: [(resource, device ids)]}, in insertion order
        self._pods: dict[tuple[str, str], dict[str, list[tuple[str, list[str]]]]] = {}
        self._server: grpc.aio.Server | None = None
        self.list_calls = 0

    def assign(self, namespace: str, pod: str, container: str, device_ids: list[str], resource: str = GPU) -> None:
        self._pods.setdefault((namespace, pod), {}).setdefault(container, []).append((resource, list(device_ids)))

    def has(self, namespace: str, pod: str) -> bool:
        return (namespace, pod) in self._pods

    def remove(self, namespace: str, pod: str) -> None:
        del self._pods[(namespace, pod)]

    def _pod(self, namespace: str, pod: str) -> api_pb2.PodResources:
        return api_pb2.PodResources(
            name=pod, namespace=namespace,
            containers=[
                api_pb2.ContainerResources(name=container, devices=[
                    api_pb2.ContainerDevices(resource_name=resource, device_ids=ids) for resource, ids in devices
                ])
                for container, devices in self._pods[(namespace, pod)].items()
            ],
        )

    async def List(self, request, context):  # noqa: N802 - the gRPC method's name
        self.list_calls += 1
        return api_pb2.ListPodResourcesResponse(pod_resources=[self._pod(ns, pod) for ns, pod in self._pods])

    async def start(self) -> None:
        self._server = grpc.aio.server()
        api_pb2_grpc.add_PodResourcesListerServicer_to_server(self, self._server)
        self._server.add_insecure_port(f"unix:{self.socket_path}")
        await self._server.start()

    async def stop(self) -> None:
        if self._server is not None:
            await self._server.stop(grace=None)
            self._server = None
        self.socket_path.unlink(missing_ok=True)


@pytest.fixture
async def pod_resources() -> AsyncIterator[FakePodResources]:
    # A short directory: a unix socket path may not exceed 107 bytes, and pytest's tmp_path can.
    directory = Path(tempfile.mkdtemp(prefix="fr-kubelet-", dir="/tmp"))
    fake = FakePodResources(directory / "kubelet.sock")
    await fake.start()
    try:
        yield fake
    finally:
        await fake.stop()
        os.rmdir(directory)
