"""The kubelet's PodResources API (v1): which pod and container holds which device on this node.

Every kubelet serves the gRPC service `v1.PodResourcesLister` (api.proto here: fleetroute's own
description of the one method it calls, wire-compatible with k8s.io/kubelet's) on the unix socket
/var/lib/kubelet/pod-resources/kubelet.sock (on by default since Kubernetes 1.15, GA in 1.28: KEP-606).
`List` answers every pod of the node with, per container, the devices that device plugins allocated to it.
For NVIDIA's device plugin (k8s-device-plugin) a device is:

    resource_name  nvidia.com/gpu, a renamed or shared resource (nvidia.com/gpu.shared), or a MIG profile
                   (nvidia.com/mig-1g.10gb)
    device_ids     GPU UUIDs (GPU-...; deviceIDStrategy=uuid, the default), GPU indices (deviceIDStrategy=
                   index), MIG UUIDs (MIG-...), and with time-slicing a replica suffix (GPU-...::3)

which is how dcgm-exporter maps GPUs to pods (internal/pkg/transformation/kubernetes.go, the reference for
this module). GPUs handed out through Dynamic Resource Allocation (ContainerResources.dynamic_resources)
are not mapped here.

Stubs: api_pb2.py, api_pb2.pyi and api_pb2_grpc.py are generated and committed, so installing fleetroute
needs only the grpcio and protobuf runtimes, not the compiler (grpcio-tools, which also pins setuptools).
Regenerate them from the repository root after changing api.proto or the pinned grpcio-tools:

    python -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. worker/podresources/api.proto

tests/test_pod_resources.py fails when the committed stubs differ from what that command writes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc

from worker.podresources import api_pb2
from worker.podresources.api_pb2_grpc import PodResourcesListerStub

NVIDIA_RESOURCE_PREFIX = "nvidia.com/"

# gRPC backs reconnection off up to 120 s by default; a kubelet restart (which recreates the socket) must
# not leave the node agent blind for that long.
_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.min_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


@dataclass(frozen=True)
class DeviceAssignment:
    """One device the kubelet gave one container."""

    namespace: str
    pod: str
    container: str
    resource: str
    device_id: str  # as the device plugin names it (see gpu_id)

    @property
    def gpu_id(self) -> str:
        """The device without a time-slicing replica suffix: `GPU-...::3` -> `GPU-...`."""
        return self.device_id.split("::", 1)[0]


class PodResourcesUnavailable(Exception):
    """The kubelet's socket did not answer. str() is a one-line reason."""


class PodResourcesClient:
    """A client of one kubelet's PodResources socket; create it on the event loop that uses it."""

    def __init__(self, socket_path: str, *, timeout: float = 2.0) -> None:
        self.socket_path = socket_path
        self._timeout = timeout
        self._channel = grpc.aio.insecure_channel(f"unix:{socket_path}", options=_CHANNEL_OPTIONS)
        self._stub = PodResourcesListerStub(self._channel)

    async def devices(self, resource_prefix: str = NVIDIA_RESOURCE_PREFIX) -> list[DeviceAssignment]:
        """Every device whose resource name starts with `resource_prefix`, of every pod on the node."""
        try:
            response = await self._stub.List(api_pb2.ListPodResourcesRequest(), timeout=self._timeout)
        except grpc.aio.AioRpcError as err:
            raise PodResourcesUnavailable(f"{err.code().name}: {err.details()}") from err
        return [
            DeviceAssignment(pod.namespace, pod.name, container.name, device.resource_name, device_id)
            for pod in response.pod_resources
            for container in pod.containers
            for device in container.devices
            if device.resource_name.startswith(resource_prefix)
            for device_id in device.device_ids
        ]

    async def wait_ready(self, timeout: float) -> bool:
        """Whether the socket accepts a connection within `timeout` seconds (gRPC connects with backoff)."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except TimeoutError:
            return False
        return True

    async def close(self) -> None:
        await self._channel.close()
