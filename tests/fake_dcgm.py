"""A fake NVIDIA dcgm-exporter: an aiohttp server whose `/metrics` is shaped exactly like dcgm-exporter
4.5.3-4.8.2's with its Kubernetes mapping on (DCGM_EXPORTER_KUBERNETES=true, as the GPU Operator runs it).

The page follows dcgm-exporter's template (internal/pkg/rendermetrics/render_metrics.go): per field a HELP
and a TYPE line (the help texts of etc/dcp-metrics-included.csv, the GPU Operator's counter set), then one
series per GPU with the labels gpu, UUID, pci_bus_id, device, modelName, (GPU_I_PROFILE, GPU_I_ID for a MIG
instance), Hostname, the label fields (DCGM_FI_DRIVER_VERSION), then the pod attributes container,
namespace, pod, each group in sorted order. Integers print as %d, doubles as %f (gpu_collector.go
toString); a value DCGM cannot read (a lost GPU's) is left out, as the exporter skips blanks, while the XID
field keeps the last XID code. A GPU no pod holds has no pod labels.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
from aiohttp import web

# (field, Prometheus type, help, int or float) in etc/dcp-metrics-included.csv order (plus SM_ACTIVE,
# which a custom counter set may add).
COUNTERS = [
    ("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz).", int),
    ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz).", int),
    ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C).", int),
    ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C).", int),
    ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W).", float),
    ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "counter", "Total energy consumption since boot (in mJ).", int),
    ("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "Total number of PCIe retries.", int),
    ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %).", int),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %).", int),
    ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.", int),
    ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB).", int),
    ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB).", int),
    ("DCGM_FI_DEV_FB_RESERVED", "gauge", "Framebuffer memory reserved (in MiB).", int),
    ("DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "counter", "Total number of NVLink bandwidth counters for all lanes.", int),
    ("DCGM_FI_PROF_GR_ENGINE_ACTIVE", "gauge", "Ratio of time the graphics engine is active.", float),
    ("DCGM_FI_PROF_SM_ACTIVE", "gauge", "The ratio of cycles an SM has at least 1 warp assigned.", float),
    ("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "gauge", "Ratio of cycles the tensor (HMMA) pipe is active.", float),
    ("DCGM_FI_PROF_DRAM_ACTIVE", "gauge",
     "Ratio of cycles the device memory interface is active sending or receiving data.", float),
]
_KINDS = {name: (kind, help_, typ) for name, kind, help_, typ in COUNTERS}


@dataclass
class FakeGpu:
    index: int
    uuid: str
    fields: dict[str, float]  # DCGM field -> value; a field not here is not exported (e.g. SM_ACTIVE by default)
    pod: tuple[str, str, str] | None = None  # (namespace, pod, container) holding it
    lost: bool = False  # values unreadable (skipped), except the last XID code
    model: str = "NVIDIA H100 80GB HBM3"
    mig: tuple[str, int] | None = None  # (GPU_I_PROFILE, GPU_I_ID) for a MIG instance


def default_fields(util: int = 0, fb_used: int = 0) -> dict[str, float]:
    return {
        "DCGM_FI_DEV_SM_CLOCK": 1980, "DCGM_FI_DEV_MEM_CLOCK": 2619, "DCGM_FI_DEV_MEMORY_TEMP": 40,
        "DCGM_FI_DEV_GPU_TEMP": 45, "DCGM_FI_DEV_POWER_USAGE": 120.5, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": 9_876_543,
        "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": 0, "DCGM_FI_DEV_GPU_UTIL": util, "DCGM_FI_DEV_MEM_COPY_UTIL": 3,
        "DCGM_FI_DEV_XID_ERRORS": 0, "DCGM_FI_DEV_FB_FREE": 81_559 - 512 - fb_used, "DCGM_FI_DEV_FB_USED": fb_used,
        "DCGM_FI_DEV_FB_RESERVED": 512, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": 0,
        "DCGM_FI_PROF_GR_ENGINE_ACTIVE": util / 100, "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.1,
        "DCGM_FI_PROF_DRAM_ACTIVE": 0.2,
    }


@dataclass
class FakeDcgmExporter:
    gpus: list[FakeGpu] = field(default_factory=list)
    # The Hostname label: $NODE_NAME, which the exporter's chart and recent GPU Operators set to the node's name;
    # an exporter without it names its own pod (nvidia-dcgm-exporter-7x2kq).
    hostname: str = "gpu-node-1"
    driver: str = "570.124.06"
    status: int = 200  # answer /metrics with this status
    url: str = ""
    scrapes: int = 0

    def render(self) -> str:
        out = []
        for name, kind, help_, typ in COUNTERS:
            lines = []
            for gpu in self.gpus:
                if name not in gpu.fields or (gpu.lost and name != "DCGM_FI_DEV_XID_ERRORS"):
                    continue
                labels = (f'gpu="{gpu.index}",UUID="{gpu.uuid}",pci_bus_id="00000000:{0x18 + gpu.index:02X}:00.0",'
                          f'device="nvidia{gpu.index}",modelName="{gpu.model}"')
                if gpu.mig:
                    labels += f',GPU_I_PROFILE="{gpu.mig[0]}",GPU_I_ID="{gpu.mig[1]}"'
                labels += f',Hostname="{self.hostname}",DCGM_FI_DRIVER_VERSION="{self.driver}"'
                if gpu.pod:
                    namespace, pod, container = gpu.pod
                    labels += f',container="{container}",namespace="{namespace}",pod="{pod}"'
                value = gpu.fields[name]
                lines.append(f"{name}{{{labels}}} " + (f"{int(value)}" if typ is int else f"{value:f}"))
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", *lines]
        return "\n".join(out) + "\n"

    async def _metrics(self, _: web.Request) -> web.Response:
        self.scrapes += 1
        if self.status != 200:
            return web.Response(status=self.status, text="error\n")
        return web.Response(text=self.render(), content_type="text/plain", charset="utf-8")

    async def _health(self, _: web.Request) -> web.Response:
        return web.Response(text="OK")

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        return app


@pytest.fixture
async def dcgm_exporter() -> AsyncIterator[FakeDcgmExporter]:
    exporter = FakeDcgmExporter()
    runner = web.AppRunner(exporter.app(), access_log=None)
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    site = web.SockSite(runner, sock)
    await site.start()
    exporter.url = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
    try:
        yield exporter
    finally:
        await runner.cleanup()
