"""Where the node agent gets each endpoint's GPU numbers: NVML + the kubelet's PodResources, or dcgm-exporter.

Both sources answer the same question every round: for each pod of the fleet on this node, the readings of
the GPUs it holds. An endpoint is a pod (the router's Kubernetes discovery names endpoints after their
pods), so the endpoint id is the pod's name.

- `NvmlNodeSource` (source `nvml`) is dcgm-exporter's own design: it sees every GPU of the node through NVML
  (the container runs with NVIDIA_VISIBLE_DEVICES=all), asks the kubelet's PodResources API which
  container holds which GPU (by UUID, or index with the device plugin's deviceIDStrategy=index; a
  time-slicing replica suffix `::N` is dropped, so pods sharing a GPU each get the whole GPU's numbers),
  and samples each held GPU once. MIG instances are not sampled this way (NVML's utilisation is per GPU):
  use the `dcgm` source for MIG.
- `DcgmNodeSource` (source `dcgm`) reads the node's dcgm-exporter, which has already mapped GPUs to pods
  (worker/dcgm_metrics.py). It needs no GPU access, socket or privilege of its own. DCGM reports only the
  code of the last XID error, so XIDs are counted as changes of that code between scrapes (the same code
  twice in a row is seen once), and a GPU is reported lost while its last XID is 79 ("fallen off the
  bus"): DCGM keeps that code until another XID or until its host engine restarts. Series whose `Hostname`
  names another node are left out (counted, and warned about once): a URL that reaches another node's
  exporter (a Service without `internalTrafficPolicy: Local` spreads scrapes over every node's) would
  otherwise publish that node's GPUs for pods that only share a name with ours, or records for pods this
  node does not run.

Which pods: only those of the given namespaces (the router's) and, where given, whose GPU-holding
container has one of the given names (the chart's engine container is `vllm`); other GPU pods of the node
are never published.

Several GPUs behind one endpoint (tensor parallelism) are aggregated (`aggregate`) into one reading:

    util           mean over the GPUs (a TP engine's GPUs run in lockstep; the mean is its busy fraction)
    memory         the fullest GPU's used and total bytes (the engine runs out when its fullest GPU does)
    temperature    the hottest; power: the sum (the endpoint's draw)
    throttle       the union of the reasons (bit OR)
    XID, ECC, retired pages   sums
    lost           if any GPU is lost (a TP engine cannot run without all of its GPUs); the other
                   fields then describe the GPUs that still answer
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, replace
from statistics import fmean
from typing import TYPE_CHECKING, Protocol

import aiohttp

from router.config.redaction import redact_url
from worker.dcgm_metrics import parse_dcgm_metrics
from worker.protocol import GpuSample

if TYPE_CHECKING:  # imported when used: the `fleetroute` command line need not load gRPC or NVML
    from worker.nvml import NvmlSampler
    from worker.podresources import PodResourcesClient

log = logging.getLogger("fleetroute.node_agent")

NODE_SOURCES = ("nvml", "dcgm")
XID_FALLEN_OFF_THE_BUS = 79


class SourceUnavailable(Exception):
    """The source could not be read this round (no NVML, no PodResources answer, no dcgm-exporter).

    `stage` says which part failed (nvml, pod_resources, dcgm); str() is a one-line reason."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage


@dataclass(frozen=True)
class PodFilter:
    namespaces: frozenset[str] = frozenset()  # empty: every namespace
    containers: frozenset[str] = frozenset()  # empty: any container

    def admits(self, namespace: str, container: str) -> bool:
        return ((not self.namespaces or namespace in self.namespaces)
                and (not self.containers or container in self.containers))


@dataclass(frozen=True)
class EndpointGpus:
    """One endpoint's GPUs, as one round read them."""

    endpoint_id: str  # the pod's name
    namespace: str
    gpu_ids: tuple[str, ...]
    samples: tuple[GpuSample, ...]


class NodeSource(Protocol):
    name: str  # nvml | dcgm, written into each record

    @property
    def gpus(self) -> int:
        """GPUs the source showed on the node in its last read."""
        ...

    @property
    def other_node_gpus(self) -> int:
        """GPU readings the last read left out because they were collected on another node."""
        ...

    async def read(self) -> list[EndpointGpus]:
        """This round's endpoints. Raises SourceUnavailable."""
        ...

    async def close(self) -> None: ...


def aggregate(samples: Iterable[GpuSample]) -> GpuSample:
    """One endpoint's reading from its GPUs' (see the module docstring)."""
    samples = list(samples)
    live = [s for s in samples if not s.lost]

    def values(name: str) -> list:
        return [v for s in live if (v := getattr(s, name)) is not None]

    def total(name: str, among: list[GpuSample]) -> int | None:
        found = [v for s in among if (v := getattr(s, name)) is not None]
        return sum(found) if found else None

    utils = values("util")
    kinds = {s.util_kind for s in live if s.util is not None}
    with_memory = [s for s in live if s.mem_util is not None]
    fullest = max(with_memory, key=lambda s: s.mem_util or 0.0) if with_memory else None
    temperatures, powers, reasons = values("temperature_c"), values("power_w"), values("throttle_reasons")
    throttle = None
    for mask in reasons:
        throttle = mask if throttle is None else throttle | mask
    return GpuSample(
        util=fmean(utils) if utils else None,
        util_kind=kinds.pop() if len(kinds) == 1 else "utilization",
        mem_used_bytes=fullest.mem_used_bytes if fullest else None,
        mem_total_bytes=fullest.mem_total_bytes if fullest else None,
        temperature_c=max(temperatures) if temperatures else None,
        power_w=sum(powers) if powers else None,
        throttle_reasons=throttle,
        xid_errors=total("xid_errors", samples),  # a lost GPU's count is still known
        ecc_uncorrected=total("ecc_uncorrected", live),
        retired_pages=total("retired_pages", live),
        lost=len(live) < len(samples),
        count=len(samples),
    )


class _Once:
    """Log a condition once per key (a lasting state is one line, not one per round)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def first(self, key: str) -> bool:
        if key in self._seen:
            return False
        self._seen.add(key)
        return True


class NvmlNodeSource:
    """Every GPU of the node through NVML, mapped to pods by the kubelet's PodResources API."""

    name = "nvml"
    other_node_gpus = 0  # NVML sees this node's GPUs only

    def __init__(self, pod_resources: PodResourcesClient, pods: PodFilter) -> None:
        self._pod_resources = pod_resources
        self._pods = pods
        self._samplers: dict[int, NvmlSampler] = {}  # by index, opened on first use (NVML is imported then)
        self._count: int | None = None
        self._warned = _Once()

    @property
    def gpus(self) -> int:
        """GPUs NVML showed when last counted (0 before)."""
        return self._count or 0

    def _open(self) -> None:
        """Open a sampler for every GPU not open yet (a GPU lost at start is tried again next round)."""
        from worker.nvml import NvmlSampler, NvmlUnavailable, gpu_count

        if self._count is not None and len(self._samplers) == self._count:
            return
        try:
            self._count = gpu_count()
        except NvmlUnavailable as exc:
            raise SourceUnavailable("nvml", str(exc)) from exc
        for index in range(self._count):
            if index in self._samplers:
                continue
            try:
                self._samplers[index] = NvmlSampler(index)
            except NvmlUnavailable as exc:
                if self._warned.first(f"open:{index}"):
                    log.warning("cannot read a GPU of this node; trying again every round",
                                extra={"gpu_index": index, "error": str(exc)})

    async def read(self) -> list[EndpointGpus]:
        from worker.podresources import PodResourcesUnavailable

        self._open()
        try:
            devices = await self._pod_resources.devices()
        except PodResourcesUnavailable as exc:
            raise SourceUnavailable("pod_resources", str(exc)) from exc
        held: dict[tuple[str, str], list[str]] = {}
        for device in devices:
            if self._pods.admits(device.namespace, device.container):
                ids = held.setdefault((device.namespace, device.pod), [])
                if device.gpu_id not in ids:
                    ids.append(device.gpu_id)
        by_id: dict[str, NvmlSampler] = {}
        for index, sampler in self._samplers.items():
            by_id[sampler.uuid] = by_id[str(index)] = sampler
        readings: dict[int, GpuSample] = {}  # by GPU index: a GPU that pods share (time-slicing) is sampled once
        out = []
        for (namespace, pod), ids in held.items():
            known: list[str] = []
            samples: list[GpuSample] = []
            for gpu_id in ids:
                sampler = by_id.get(gpu_id)
                if sampler is None:
                    self._unknown(pod, gpu_id)
                    continue
                if sampler.index not in readings:
                    readings[sampler.index] = await sampler.sample()
                known.append(sampler.uuid)
                samples.append(readings[sampler.index])
            if known:
                out.append(EndpointGpus(pod, namespace, tuple(known), tuple(samples)))
        return out

    def _unknown(self, pod: str, gpu_id: str) -> None:
        if not self._warned.first(f"unknown:{gpu_id}"):
            return
        if gpu_id.startswith("MIG-"):
            log.warning("a pod holds a MIG instance, which NVML cannot sample per instance; use the dcgm source "
                        "for MIG", extra={"pod": pod, "device": gpu_id})
        else:
            log.warning("a pod holds a device NVML does not show (not a GPU UUID or index of this node); "
                        "its GPU numbers are left out", extra={"pod": pod, "device": gpu_id})

    async def close(self) -> None:
        for sampler in self._samplers.values():
            sampler.close()
        self._samplers.clear()
        await self._pod_resources.close()


def same_host(hostname: str, node: str) -> bool:
    """Whether dcgm-exporter's `Hostname` names this node: the same name, ignoring case, or the same host with
    and without its domain (`gpu-1` and `gpu-1.cluster.local`: a host name read on the host network)."""
    a, b = hostname.lower().rstrip("."), node.lower().rstrip(".")
    if a == b:
        return True
    return ("." not in a or "." not in b) and a.split(".", 1)[0] == b.split(".", 1)[0]


class DcgmNodeSource:
    """The node's dcgm-exporter, whose series already carry the pod, namespace and container of each GPU."""

    name = "dcgm"

    def __init__(self, session: aiohttp.ClientSession, url: str, pods: PodFilter, *, timeout: float,
                 node: str | None = None) -> None:
        self._session = session
        self.url = url
        self._shown_url = redact_url(url)  # for messages: without credentials
        self._pods = pods
        self._node = node  # this node's name: series collected elsewhere are left out; None: no check
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._last_xid: dict[str, int] = {}  # GPU -> the last XID code seen
        self._xids: dict[str, int] = {}  # GPU -> XIDs seen since start
        self._warned_other_node = False
        self.gpus = 0
        self.other_node_gpus = 0

    async def read(self) -> list[EndpointGpus]:
        try:
            async with self._session.get(self.url, timeout=self._timeout) as resp:
                resp.raise_for_status()
                text = await resp.text()
        except (TimeoutError, aiohttp.ClientError) as exc:
            raise SourceUnavailable("dcgm", f"dcgm-exporter at {self._shown_url}: {type(exc).__name__}: "
                                            f"{redact_url(str(exc))}") from exc
        try:
            gpus = parse_dcgm_metrics(text)
        except ValueError as exc:
            raise SourceUnavailable("dcgm", f"dcgm-exporter at {self._shown_url} answered no Prometheus text: "
                                            f"{exc}") from exc
        here = [g for g in gpus if self._node is None or not g.hostname or same_host(g.hostname, self._node)]
        self.other_node_gpus = len(gpus) - len(here)
        if self.other_node_gpus and not self._warned_other_node:
            self._warned_other_node = True
            elsewhere = sorted({g.hostname for g in gpus} - {g.hostname for g in here})
            log.warning("dcgm-exporter reports GPUs of another host; leaving them out (every round, counted in "
                        "fleetroute_node_agent_dcgm_other_node_gpus_total)",
                        extra={"node": self._node, "hostnames": elsewhere[:8], "url": self._shown_url,
                               "hint": "does --dcgm-url reach this node's own exporter (a Service needs "
                                       "internalTrafficPolicy: Local)? Does the exporter set NODE_NAME (its chart "
                                       "does; older GPU Operators' name the exporter pod instead)? If it is this "
                                       "node's, --no-dcgm-hostname-check turns the check off"})
        gpus = here
        self.gpus = len({g.uuid for g in gpus})
        held: dict[tuple[str, str], dict[str, GpuSample]] = {}
        for gpu in gpus:
            if not gpu.pod or not self._pods.admits(gpu.namespace, gpu.container):
                continue
            sample = self._with_xids(gpu.uuid, gpu.sample, gpu.last_xid)
            held.setdefault((gpu.namespace, gpu.pod), {})[gpu.uuid] = sample
        return [EndpointGpus(pod, namespace, tuple(samples), tuple(samples.values()))
                for (namespace, pod), samples in held.items()]

    def _with_xids(self, uuid: str, sample: GpuSample, code: int | None) -> GpuSample:
        previous = self._last_xid.get(uuid)
        count = self._xids.setdefault(uuid, 0)
        if code is not None:
            if previous is not None and code != previous and code != 0:
                count = self._xids[uuid] = count + 1
                log.warning("XID error on a GPU (from dcgm-exporter)", extra={"gpu": uuid, "xid": code})
            self._last_xid[uuid] = code
        return replace(sample, xid_errors=count, lost=code == XID_FALLEN_OFF_THE_BUS)

    async def close(self) -> None:
        pass
