"""The node's GPUs, for a cluster started with `gpus=N`: what the NVIDIA driver, device plugin and container
runtime and the kubelet's PodResources API give the pods, so the chart's GPU telemetry (`gpuTelemetry.source:
nvml`: the node agent DaemonSet) runs as rendered.

- **The driver**: tests/fake_nvml's library (compiled with gcc), found through LD_LIBRARY_PATH by the real
  `pynvml`, with N devices whose state (utilisation, memory, ...) a test changes with `set()`.
- **The device plugin**: a container whose limits ask for `nvidia.com/gpu: k` gets k free GPUs (by UUID,
  lowest index first) when its pod starts, in `NVIDIA_VISIBLE_DEVICES`; they are free again once the pod is
  gone. A pod asking for more than is free fails with the scheduler's message (a real one stays Pending).
- **The kubelet's PodResources API**: tests/fake_kubelet.py's gRPC server (the kubelet's wire format) lists
  the allocations, on a socket in a node directory that a `hostPath` volume of its directory mounts.
- **The NVIDIA container runtime**: a container that sets `NVIDIA_VISIBLE_DEVICES` gets the driver library
  (`all` sees every GPU of the node, as the node agent asks). The runtime class is not checked.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from tests.fake_kubelet import FakePodResources
from tests.fake_nvml import compile_fake
from tests.nvml_fixtures import FakeGpu

GPU_RESOURCE = "nvidia.com/gpu"
POD_RESOURCES_DIR = "/var/lib/kubelet/pod-resources"  # the kubelet's default


def uuid(index: int) -> str:
    return f"GPU-fa4e0000-0000-0000-0000-{index:012d}"  # the fake library's default UUIDs


class NoGpuFree(Exception):
    pass


class NodeGpus:
    def __init__(self, root: Path, count: int) -> None:
        self.root, self.count = root, count
        self.library_dir = compile_fake(root / "nvml-driver").parent
        self.gpu = FakeGpu(root / "nvml-driver")
        self.gpu.set(count=count)
        # A short directory: a unix socket's path may not exceed 107 bytes, and pytest's tmp_path can.
        self.pod_resources_dir = Path(tempfile.mkdtemp(prefix="fr-node-", dir="/tmp"))
        self.pod_resources = FakePodResources(self.pod_resources_dir / "kubelet.sock")
        self.allocated: dict[str, tuple[str, str]] = {}  # uuid -> (namespace, pod)

    async def start(self) -> NodeGpus:
        await self.pod_resources.start()
        return self

    async def close(self) -> None:
        await self.pod_resources.stop()
        os.rmdir(self.pod_resources_dir)

    def set(self, **values: Any) -> None:
        """Change the GPUs (fake_nvml.c's state keys; `key.N` for device N): seen at the next NVML call."""
        self.gpu.set(**values)

    def host_path(self, path: str) -> Path | None:
        return self.pod_resources_dir if path.rstrip("/") == POD_RESOURCES_DIR else None

    def allocate(self, namespace: str, pod: str, container: dict[str, Any]) -> list[str]:
        wanted = int(((container.get("resources") or {}).get("limits") or {}).get(GPU_RESOURCE, 0))
        if not wanted:
            return []
        free = [uuid(i) for i in range(self.count) if uuid(i) not in self.allocated]
        if len(free) < wanted:
            raise NoGpuFree(f"0/1 nodes are available: 1 Insufficient {GPU_RESOURCE} (container {container['name']!r} "
                            f"asks for {wanted}, {len(free)} of {self.count} free)")
        ids = free[:wanted]
        for gpu in ids:
            self.allocated[gpu] = (namespace, pod)
        self.pod_resources.assign(namespace, pod, container["name"], ids)
        return ids

    def release(self, namespace: str, pod: str) -> None:
        for gpu, owner in list(self.allocated.items()):
            if owner == (namespace, pod):
                del self.allocated[gpu]
        if self.pod_resources.has(namespace, pod):
            self.pod_resources.remove(namespace, pod)

    def of(self, namespace: str, pod: str) -> list[int]:
        """The indexes of the GPUs a pod holds."""
        return sorted(int(gpu.rsplit("-", 1)[1]) for gpu, owner in self.allocated.items() if owner == (namespace, pod))

    def runtime_env(self) -> dict[str, str]:
        return {"LD_LIBRARY_PATH": str(self.library_dir), "FAKE_NVML_STATE": str(self.gpu.state_path)}
