"""Parsing NVIDIA dcgm-exporter's Prometheus `/metrics` page into per-pod GPU readings (pure, no I/O).

dcgm-exporter (github.com/NVIDIA/dcgm-exporter; the GPU Operator installs it on every GPU node) writes one
series per GPU (or MIG instance) and field (internal/pkg/rendermetrics/render_metrics.go):

    # HELP DCGM_FI_DEV_GPU_UTIL GPU utilization (in %).
    # TYPE DCGM_FI_DEV_GPU_UTIL gauge
    DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-...",pci_bus_id="00000000:18:00.0",device="nvidia0",
        modelName="NVIDIA H100 80GB HBM3",Hostname="...",DCGM_FI_DRIVER_VERSION="...",container="vllm",
        namespace="inference",pod="llama-7d9c-x2"} 37

With its Kubernetes mapping on (DCGM_EXPORTER_KUBERNETES=true, the default of its chart and of the GPU
Operator) it asks the kubelet's PodResources API which pod holds which GPU and adds `pod`, `namespace` and
`container` to that GPU's series (`pod_name`, `pod_namespace`, `container_name` with --use-old-namespace;
`uuid` instead of `UUID` too). A GPU no pod holds carries no pod labels. MIG instances add `GPU_I_PROFILE`
and `GPU_I_ID`. `Hostname` (`hostname` on some series and releases; both are read) names where the series
were collected (internal/pkg/hostname): `$NODE_NAME` where the exporter's pod sets it (its chart does, and
the GPU Operator's recent releases; the Kubernetes node name), else the container's host name (the exporter
pod's name, or the node's host name on the host network), or the remote host engine's address. The node
agent checks it against its own node (worker/node_sources.py).

Fields read (etc/default-counters.csv and etc/dcp-metrics-included.csv, the GPU Operator's set):

    DCGM_FI_PROF_SM_ACTIVE          ratio   SMs with a warp resident (not in the default set)   -> util
    DCGM_FI_PROF_GR_ENGINE_ACTIVE   ratio   time the graphics/compute engine is active          -> util
    DCGM_FI_DEV_GPU_UTIL            %       NVML's utilisation counter                          -> util
    DCGM_FI_DEV_FB_USED / _FREE / _RESERVED  MiB   memory; total = used + free + reserved (as NVML v2)
    DCGM_FI_DEV_GPU_TEMP            C       DCGM_FI_DEV_POWER_USAGE  W
    DCGM_FI_DEV_CLOCKS_EVENT_REASONS (older DCGM: DCGM_FI_DEV_CLOCK_THROTTLE_REASONS)  NVML's bit mask
    DCGM_FI_DEV_ECC_DBE_VOL_TOTAL   volatile double-bit (uncorrectable) ECC errors
    DCGM_FI_DEV_RETIRED_SBE + _DBE  retired pages (pending ones included, as NVML counts them)
    DCGM_FI_DEV_XID_ERRORS          the code of the LAST XID error (a gauge, not a count: see node_sources)

The busy fraction prefers SM activity (it grows with batch size, like NVML's GPM SM activity), then the
engine-active ratio (the only one a MIG instance has), then the utilisation counter (`util_kind` says
which). A value DCGM could not read is sent as one of its "blank" sentinels (dcgm_structs.h:
DCGM_INT32_BLANK 0x7ffffff0, DCGM_INT64_BLANK 0x7ffffffffffffff0, DCGM_FP64_BLANK 2**47, and the error
codes just above them); such a value is treated as absent, never as a reading.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from worker.protocol import GpuSample

SM_ACTIVE = "DCGM_FI_PROF_SM_ACTIVE"
GR_ENGINE_ACTIVE = "DCGM_FI_PROF_GR_ENGINE_ACTIVE"
GPU_UTIL = "DCGM_FI_DEV_GPU_UTIL"
FB_USED = "DCGM_FI_DEV_FB_USED"
FB_FREE = "DCGM_FI_DEV_FB_FREE"
FB_RESERVED = "DCGM_FI_DEV_FB_RESERVED"
GPU_TEMP = "DCGM_FI_DEV_GPU_TEMP"
POWER = "DCGM_FI_DEV_POWER_USAGE"
CLOCK_REASONS = ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "DCGM_FI_DEV_CLOCK_THROTTLE_REASONS")
ECC_DBE_VOLATILE = "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"
RETIRED = ("DCGM_FI_DEV_RETIRED_SBE", "DCGM_FI_DEV_RETIRED_DBE")
XID = "DCGM_FI_DEV_XID_ERRORS"
FIELDS = frozenset({SM_ACTIVE, GR_ENGINE_ACTIVE, GPU_UTIL, FB_USED, FB_FREE, FB_RESERVED, GPU_TEMP, POWER,
                    *CLOCK_REASONS, ECC_DBE_VOLATILE, *RETIRED, XID})

# The smallest of DCGM's blank sentinels: no real reading of these fields comes near it (2**31 MiB is 2 PiB).
BLANK = 0x7FFFFFF0
MIB = 1024 * 1024


@dataclass(frozen=True)
class DcgmGpu:
    """One GPU (or MIG instance) held by one pod's container, as one scrape reported it."""

    namespace: str  # "" (and pod, container "") for a GPU no pod holds
    pod: str
    container: str
    uuid: str  # the GPU's UUID; a MIG instance is "<GPU UUID>/<GPU_I_ID>"
    sample: GpuSample
    last_xid: int | None  # DCGM_FI_DEV_XID_ERRORS: the code of the last XID, 0 (or None) before any
    hostname: str = ""  # the exporter's Hostname label: where it collected this GPU; "" when absent


def _label(labels: dict[str, str], *names: str) -> str:
    for name in names:
        if labels.get(name):
            return labels[name]
    return ""


def _wanted_lines(text: str) -> str:
    """Only the families read here (a dcgm-exporter page also carries NVLink, PCIe, clocks...)."""
    keep = []
    for line in text.splitlines():
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[2] in FIELDS:
                keep.append(line)
        elif line.split("{", 1)[0].split(" ", 1)[0] in FIELDS:
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_dcgm_metrics(text: str) -> list[DcgmGpu]:
    """Every (GPU, pod, container) on the page, with its fields; a GPU no pod holds has pod "".

    Raises ValueError if the page is not Prometheus text."""
    series: dict[tuple[str, str, str, str, str], dict[str, float]] = {}
    for family in text_string_to_metric_families(_wanted_lines(text)):
        for sample in family.samples:
            if sample.name not in FIELDS:
                continue
            labels = sample.labels
            pod = _label(labels, "pod", "pod_name")
            uuid = _label(labels, "UUID", "uuid")
            if not uuid:
                continue
            if labels.get("GPU_I_ID"):
                uuid = f"{uuid}/{labels['GPU_I_ID']}"
            key = (_label(labels, "namespace", "pod_namespace"), pod,
                   _label(labels, "container", "container_name"), uuid, _label(labels, "Hostname", "hostname"))
            if sample.value == sample.value and 0 <= sample.value < BLANK:  # NaN, negatives, blanks: absent
                series.setdefault(key, {})[sample.name] = sample.value
            else:
                series.setdefault(key, {})
    return [DcgmGpu(namespace, pod, container, uuid, _sample(fields), _int(fields.get(XID)), hostname)
            for (namespace, pod, container, uuid, hostname), fields in series.items()]


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


def _float(value: float | None) -> float | None:
    return None if value is None else float(value)


def _first(fields: dict[str, float], names: Iterable[str]) -> float | None:
    return next((fields[n] for n in names if n in fields), None)


def _sample(fields: dict[str, float]) -> GpuSample:
    if SM_ACTIVE in fields:
        util, kind = min(1.0, fields[SM_ACTIVE]), "dcgm_sm_active"
    elif GR_ENGINE_ACTIVE in fields:
        util, kind = min(1.0, fields[GR_ENGINE_ACTIVE]), "dcgm_gr_engine_active"
    elif GPU_UTIL in fields:
        util, kind = min(1.0, fields[GPU_UTIL] / 100.0), "utilization"
    else:
        util, kind = None, "utilization"
    used, free = fields.get(FB_USED), fields.get(FB_FREE)
    total = used + free + fields.get(FB_RESERVED, 0.0) if used is not None and free is not None else None
    retired = [fields[n] for n in RETIRED if n in fields]
    return GpuSample(
        util=util,
        util_kind=kind,
        mem_used_bytes=int(used * MIB) if used is not None else None,
        mem_total_bytes=int(total * MIB) if total else None,
        temperature_c=_float(fields.get(GPU_TEMP)),
        power_w=_float(fields.get(POWER)),
        throttle_reasons=_int(_first(fields, CLOCK_REASONS)),
        ecc_uncorrected=_int(fields.get(ECC_DBE_VOLATILE)),
        retired_pages=int(sum(retired)) if retired else None,
    )
