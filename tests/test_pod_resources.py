"""The kubelet PodResources client (worker/podresources) against a real gRPC server serving the real
`v1.PodResourcesLister` service on a unix socket (tests/fake_kubelet.py), and the committed stubs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.fake_kubelet import pod_resources  # noqa: F401 - fixture
from worker.podresources import DeviceAssignment, PodResourcesClient, PodResourcesUnavailable

ROOT = Path(__file__).resolve().parent.parent
STUBS = ("api_pb2.py", "api_pb2.pyi", "api_pb2_grpc.py")


async def test_lists_every_nvidia_device_of_every_pod_with_its_container(pod_resources) -> None:  # noqa: F811
    pod_resources.assign("inference", "llama-0", "vllm", ["GPU-aaa"])
    pod_resources.assign("inference", "llama-1", "vllm", ["GPU-bbb", "GPU-ccc"])
    pod_resources.assign("inference", "llama-1", "vllm", ["0000:3b:00.0"], resource="example.com/nic")  # not a GPU
    pod_resources.assign("batch", "shared", "job", ["GPU-ddd::3"], resource="nvidia.com/gpu.shared")  # time-sliced
    pod_resources.assign("batch", "mig", "job", ["MIG-eee"], resource="nvidia.com/mig-1g.10gb")
    client = PodResourcesClient(str(pod_resources.socket_path), timeout=2.0)
    try:
        devices = await client.devices()
    finally:
        await client.close()
    assert devices == [
        DeviceAssignment("inference", "llama-0", "vllm", "nvidia.com/gpu", "GPU-aaa"),
        DeviceAssignment("inference", "llama-1", "vllm", "nvidia.com/gpu", "GPU-bbb"),
        DeviceAssignment("inference", "llama-1", "vllm", "nvidia.com/gpu", "GPU-ccc"),
        DeviceAssignment("batch", "shared", "job", "nvidia.com/gpu.shared", "GPU-ddd::3"),
        DeviceAssignment("batch", "mig", "job", "nvidia.com/mig-1g.10gb", "MIG-eee"),
    ]
    # A time-slicing replica is its GPU (k8s-device-plugin names replicas <id>::<n>).
    assert [d.gpu_id for d in devices][3] == "GPU-ddd"


async def test_a_silent_socket_is_a_clear_error_and_the_client_recovers(pod_resources) -> None:  # noqa: F811
    pod_resources.assign("inference", "llama-0", "vllm", ["GPU-aaa"])
    client = PodResourcesClient(str(pod_resources.socket_path), timeout=2.0)
    try:
        assert len(await client.devices()) == 1
        await pod_resources.stop()  # the kubelet restarts: its socket disappears
        with pytest.raises(PodResourcesUnavailable, match="UNAVAILABLE.*kubelet.sock"):
            await client.devices()
        await pod_resources.start()
        # gRPC reconnects on its own, its backoff capped at 5 s (not gRPC's default 120 s).
        assert await client.wait_ready(10.0), "the client did not reconnect to the restarted kubelet socket"
        assert len(await client.devices()) == 1
    finally:
        await client.close()


def test_committed_stubs_are_what_the_pinned_compiler_generates(tmp_path: Path) -> None:
    # The command of worker/podresources/__init__.py, into a scratch tree.
    proto = Path("worker/podresources/api.proto")
    (tmp_path / proto.parent).mkdir(parents=True)
    (tmp_path / proto).write_bytes((ROOT / proto).read_bytes())
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", ".", "--python_out=.", "--pyi_out=.",
                    "--grpc_python_out=.", str(proto)], cwd=tmp_path, check=True, capture_output=True, text=True)
    for name in STUBS:
        fresh = (tmp_path / proto.parent / name).read_text()
        assert (ROOT / proto.parent / name).read_text() == fresh, (
            f"worker/podresources/{name} is out of date: regenerate the stubs (see worker/podresources/__init__.py)")
