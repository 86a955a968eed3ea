"""GPU telemetry on Kubernetes, end to end on one machine: the node agent (`fleetroute node-agent`) reads a
node's GPUs, finds their pods, and writes a GPU record per endpoint to a real Redis; each endpoint's sidecar
(`fleetroute agent --gpu-source node`) merges it into its telemetry beside a fake engine's metrics; a real
router's telemetry feed reads the result.

Two sources, each through its real protocol: NVML (the fake libnvidia-ml.so.1 of tests/fake_nvml, several
GPUs) with the kubelet's PodResources API (a real gRPC server, tests/fake_kubelet.py), the node agent as a
child process; and dcgm-exporter (tests/fake_dcgm.py), the node agent in this process and stepped round by
round. No sleeps: the child announces each round on the GPU updates channel, and the tests wait for rounds
that began after each change.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace

import aiohttp
import pytest
import redis.asyncio as aioredis

from router.model import Telemetry
from router.runtime.redis_client import RedisSettings, connect
from router.telemetry.feed import RedisStore, TelemetryFeed
from tests import fake_dcgm
from tests.fake_dcgm import dcgm_exporter  # noqa: F401 - fixture
from tests.fake_engine import EngineLoad
from tests.fake_kubelet import pod_resources  # noqa: F401 - fixture
from tests.nvml_fixtures import FakeGpu as FakeNvmlGpu
from tests.nvml_fixtures import fake_nvml_dir  # noqa: F401 - fixture: the fake driver, compiled once per session
from tests.redis_server import redis_url  # noqa: F401 - fixture
from worker.agent import Agent, AgentSettings
from worker.node_agent import NodeAgent, NodeAgentSettings, build_http_app, open_source
from worker.node_sources import PodFilter, aggregate, same_host
from worker.protocol import (
    GPU_UPDATES_CHANNEL,
    GpuRecord,
    GpuSample,
    decode,
    encode_gpu_record,
    gpu_key,
    telemetry_key,
)

GIB = 1024**3
MIB = 1024**2
FB_TOTAL_MIB = 81_559  # fake_dcgm's used + free + reserved


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"  # tests share one Redis: names never collide


class Fleet:
    """Two endpoints (pods) with a fake engine and a sidecar each, and a router reading their telemetry."""

    def __init__(self, redis_url: str, session: aiohttp.ClientSession, client: aioredis.Redis) -> None:  # noqa: F811
        self.redis_url = redis_url
        self.session = session
        self.client = client  # the test's own reads and writes, as text
        # What the agents and the router use: the project's client factory (binary replies), as in production.
        self.redis = connect(RedisSettings(url=redis_url), timeout=1.0)
        self.namespace = unique("inference")
        self.pods = [unique("llama-a"), unique("llama-b")]
        self.sidecars: dict[str, Agent] = {}
        self.feed: TelemetryFeed | None = None
        self.router = None

    async def start(self, make_engine, make_router) -> None:
        engines = []
        for i, pod in enumerate(self.pods):
            engine = await make_engine(pod, load=EngineLoad(waiting=i + 1, running=4, kv_usage=0.25 * (i + 1)))
            engines.append(engine)
            settings = AgentSettings(engine_url=engine.url, redis=RedisSettings(url=self.redis_url), endpoint_id=pod,
                                     gpu_source="node", interval=1.0)
            self.sidecars[pod] = Agent(settings, self.session, self.redis)
        # Endpoint ids are pod names, as the router's Kubernetes discovery names them.
        self.router = await make_router(engines, telemetry={"enabled": False}, redis={"url": self.redis_url})
        self.store = RedisStore(self.redis)
        self.feed = TelemetryFeed(store=self.store, balancer=self.router.ctx.balancer, metrics=self.router.ctx.metrics)

    async def sidecar_round(self) -> None:
        for sidecar in self.sidecars.values():
            await sidecar.tick()

    async def router_view(self) -> dict[str, Telemetry | None]:
        """What the routers see: a refresh of the real telemetry feed after one round of every sidecar."""
        await self.sidecar_round()
        await self.feed.refresh()
        by_id = self.router.ctx.balancer.snapshot.by_id
        return {pod: by_id[pod].telemetry for pod in self.pods}

    async def record(self, pod: str):
        return decode(await self.client.hgetall(telemetry_key(pod)))

    async def close(self) -> None:
        await self.store.close()


@pytest.fixture
async def fleet(redis_url, make_engine, make_router) -> AsyncIterator[Fleet]:  # noqa: F811
    client = aioredis.from_url(redis_url, decode_responses=True)
    async with aiohttp.ClientSession() as session:
        fleet = Fleet(redis_url, session, client)
        await fleet.start(make_engine, make_router)
        try:
            yield fleet
        finally:
            await fleet.close()
            await client.aclose()


# ---- aggregation -----------------------------------------------------------------------------------------


def gpu(util=None, used=None, total=80 * GIB, **kw) -> GpuSample:
    return GpuSample(util=util, mem_used_bytes=used, mem_total_bytes=total if used is not None else None, **kw)


@pytest.mark.parametrize(
    ("samples", "expected"),
    [
        pytest.param([gpu(0.3, 10 * GIB, temperature_c=50.0, power_w=300.0, xid_errors=0)],
                     gpu(0.3, 10 * GIB, temperature_c=50.0, power_w=300.0, xid_errors=0, count=1), id="one-gpu-as-is"),
        # Tensor parallelism: mean busy fraction, the fullest GPU's memory, the hottest, the summed draw.
        pytest.param([gpu(0.6, 20 * GIB, temperature_c=60.0, power_w=400.0, throttle_reasons=0x4),
                      gpu(0.9, 70 * GIB, temperature_c=70.0, power_w=500.0, throttle_reasons=0x20)],
                     gpu(0.75, 70 * GIB, temperature_c=70.0, power_w=900.0, throttle_reasons=0x24, count=2),
                     id="tp2-mean-util-fullest-memory"),
        # One GPU lost: the endpoint is lost; the numbers are the live GPU's; XIDs of the lost one still count.
        pytest.param([gpu(0.5, 30 * GIB, xid_errors=0), GpuSample(lost=True, xid_errors=1)],
                     gpu(0.5, 30 * GIB, xid_errors=1, lost=True, count=2), id="any-gpu-lost"),
        pytest.param([gpu(0.5, util_kind="gpm_sm_activity"), gpu(0.7)], gpu(0.6, count=2), id="mixed-kinds-say-utilization"),
    ],
)
def test_an_endpoints_gpus_aggregate_into_one_reading(samples, expected) -> None:
    assert aggregate(samples) == expected


# ---- the dcgm source, in process ------------------------------------------------------------------------


def dcgm_agent(fleet: Fleet, exporter, session, *, node_name: str | None = None, **settings) -> NodeAgent:
    """A node agent reading `exporter`, on the node the exporter names in its Hostname label (it sets NODE_NAME,
    as its chart does) unless `node_name` says otherwise."""
    pods = PodFilter(frozenset({fleet.namespace}), frozenset({"vllm"}))
    node = NodeAgentSettings(source="dcgm", redis=RedisSettings(url=fleet.redis_url),
                             node=node_name or exporter.hostname, pods=pods, dcgm_url=exporter.url, interval=1.0,
                             metrics_port=0, **settings)
    return NodeAgent(node, open_source(node, session), fleet.redis)


async def test_dcgm_source_gives_each_endpoint_its_own_gpu_numbers(fleet, dcgm_exporter, caplog) -> None:  # noqa: F811
    caplog.set_level(logging.INFO, logger="fleetroute")
    a, b = fleet.pods
    ns = fleet.namespace
    F = fake_dcgm.FakeGpu  # noqa: N806
    dcgm_exporter.gpus = [
        F(0, "GPU-00000000-0000-0000-0000-00000000a000", fake_dcgm.default_fields(util=30, fb_used=60_000), pod=(ns, a, "vllm")),
        F(1, "GPU-00000000-0000-0000-0000-00000000b001", fake_dcgm.default_fields(util=70, fb_used=20_000), pod=(ns, b, "vllm")),
        F(2, "GPU-00000000-0000-0000-0000-00000000b002", fake_dcgm.default_fields(util=90, fb_used=70_000), pod=(ns, b, "vllm")),
        F(3, "GPU-00000000-0000-0000-0000-00000000c003", fake_dcgm.default_fields(util=99), pod=(ns, "trainer-0", "trainer")),
        F(4, "GPU-00000000-0000-0000-0000-00000000d004", fake_dcgm.default_fields(util=50), pod=("other", b, "vllm")),
        F(5, "GPU-00000000-0000-0000-0000-00000000e005", fake_dcgm.default_fields(util=0)),  # no pod holds it
    ]
    async with aiohttp.ClientSession() as session:
        node = dcgm_agent(fleet, dcgm_exporter, session)
        await node.tick()
        view = await fleet.router_view()
        assert view[a].gpu_util == pytest.approx(0.30) and view[b].gpu_util == pytest.approx(0.80)  # b: mean of 0.7, 0.9
        assert view[a].gpu_mem_util == pytest.approx(60_000 / FB_TOTAL_MIB)
        assert view[b].gpu_mem_util == pytest.approx(70_000 / FB_TOTAL_MIB)  # b's fullest GPU
        assert (view[a].source, view[a].num_waiting, view[b].num_waiting) == ("dcgm", 1, 2)  # engine signals too
        # Only the fleet's pods: not another container's GPU, not a namespace the routers do not watch.
        assert not await fleet.client.exists(gpu_key("trainer-0"))
        record = await fleet.record(b)
        assert record.gpu.count == 2 and record.gpu_source == "dcgm"
        assert node.metrics.gpus._value.get() == 6 and node.metrics.endpoints._value.get() == 2

        # GPU 2 falls off the bus: XID 79, then DCGM reads nothing else from it. Only b's endpoint is lost.
        dcgm_exporter.gpus[2].fields["DCGM_FI_DEV_XID_ERRORS"] = 79
        dcgm_exporter.gpus[2].lost = True
        await node.tick()
        view = await fleet.router_view()
        assert view[b].gpu_lost and not view[a].gpu_lost
        assert view[b].gpu_xid_errors == 1 and view[a].gpu_xid_errors == 0
        assert view[b].gpu_util == pytest.approx(0.70)  # the GPU that still answers

        # Pod a leaves the node: its GPU record goes at once, and its sidecar stops passing GPU numbers on.
        dcgm_exporter.gpus[0].pod = None
        await node.tick()
        assert not await fleet.client.exists(gpu_key(a))
        view = await fleet.router_view()
        assert view[a].gpu_util is None and view[a].source == "engine" and view[a].num_waiting == 1
        assert "no GPU record from the node agent" not in caplog.text  # a new pod's record may be a round away
        await fleet.sidecar_round()
        await fleet.sidecar_round()  # ... but three reads without one are worth a warning
        assert caplog.text.count("no GPU record from the node agent") == 1

        # dcgm-exporter fails: one warning, no crash, nothing published; then it recovers.
        caplog.clear()
        dcgm_exporter.status = 503
        for _ in range(3):
            await node.tick()
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "fleetroute.node_agent"]
        assert len(warnings) == 1 and "GPU source unreadable" in warnings[0].getMessage()
        assert warnings[0].stage == "dcgm" and "503" in warnings[0].error
        assert node.metrics.source_up._value.get() == 0
        assert node.metrics.source_errors.labels("dcgm")._value.get() == 3
        dcgm_exporter.status = 200
        await node.tick()
        assert "GPU telemetry flowing again" in caplog.text and node.metrics.source_up._value.get() == 1


async def test_dcgm_series_collected_on_another_node_are_left_out(fleet, dcgm_exporter, caplog) -> None:  # noqa: F811
    # --dcgm-url reaches another node's exporter (a Service spreading scrapes over every node's): its pods may
    # share names with ours, and its GPUs are not theirs. Left out, counted, warned about once.
    caplog.set_level(logging.INFO, logger="fleetroute")
    a, b = fleet.pods
    ns = fleet.namespace
    dcgm_exporter.gpus = [
        fake_dcgm.FakeGpu(0, "GPU-00000000-0000-0000-0000-0000000aa000", fake_dcgm.default_fields(util=30), pod=(ns, a, "vllm")),
        fake_dcgm.FakeGpu(1, "GPU-00000000-0000-0000-0000-0000000bb001", fake_dcgm.default_fields(util=70), pod=(ns, b, "vllm")),
    ]
    dcgm_exporter.hostname = "gpu-node-2"
    async with aiohttp.ClientSession() as session:
        node = dcgm_agent(fleet, dcgm_exporter, session, node_name="gpu-node-1")
        for _ in range(3):
            await node.tick()
        assert not await fleet.client.exists(gpu_key(a)) and not await fleet.client.exists(gpu_key(b))
        assert node.metrics.dcgm_other_node_gpus._value.get() == 6  # 2 GPUs x 3 rounds
        assert (node.metrics.gpus._value.get(), node.metrics.endpoints._value.get()) == (0, 0)
        warnings = [r for r in caplog.records if r.getMessage().startswith("dcgm-exporter reports GPUs of another host")]
        assert len(warnings) == 1 and warnings[0].hostnames == ["gpu-node-2"] and warnings[0].node == "gpu-node-1"

        # The scrape lands on this node's exporter (a short host name, as read on the host network): published.
        dcgm_exporter.hostname = "GPU-NODE-1.cluster.local"
        await node.tick()
        assert await fleet.client.exists(gpu_key(a)) and await fleet.client.exists(gpu_key(b))
        assert node.metrics.endpoints._value.get() == 2 and node.metrics.dcgm_other_node_gpus._value.get() == 6

    # An exporter that names its own pod (no NODE_NAME, as older GPU Operators run it): the check can be turned off.
    dcgm_exporter.hostname = "nvidia-dcgm-exporter-7x2kq"
    async with aiohttp.ClientSession() as session:
        node = dcgm_agent(fleet, dcgm_exporter, session, node_name="gpu-node-1", dcgm_hostname_check=False)
        await node.tick()
        assert node.metrics.endpoints._value.get() == 2 and node.metrics.dcgm_other_node_gpus._value.get() == 0


@pytest.mark.parametrize(("hostname", "node", "same"), [
    ("gpu-node-1", "gpu-node-1", True),
    ("GPU-Node-1", "gpu-node-1", True),
    ("gpu-node-1", "gpu-node-1.ec2.internal", True),  # the host's short name beside the node's FQDN
    ("gpu-node-1.ec2.internal.", "gpu-node-1.ec2.internal", True),
    ("gpu-node-1.a.internal", "gpu-node-1.b.internal", False),
    ("gpu-node-2", "gpu-node-1", False),
    ("nvidia-dcgm-exporter-7x2kq", "gpu-node-1", False),
])
def test_which_exporter_hostnames_name_this_node(hostname: str, node: str, same: bool) -> None:
    assert same_host(hostname, node) is same


async def test_the_merged_record_is_as_old_as_its_gpu_reading_and_stale_gpu_data_is_dropped(fleet, caplog) -> None:
    a, _ = fleet.pods
    gpu_time = time.time() - 1.5  # the node agent sampled 1.5 s ago
    record = GpuRecord(endpoint_id=a, reported_at=gpu_time, interval=1.0, source="nvml",
                       gpu=GpuSample(util=0.4, count=1), node="n1", namespace=fleet.namespace, gpu_uuids=("GPU-x",))
    await fleet.client.hset(gpu_key(a), mapping=encode_gpu_record(record))
    await fleet.client.pexpire(gpu_key(a), 10_000)
    await fleet.sidecar_round()
    merged = await fleet.record(a)
    # The record is dated by its older part, so a router judges the GPU reading's age; the GPU time travels too.
    assert merged.reported_at == gpu_time and merged.gpu.reported_at == gpu_time
    assert merged.gpu.util == 0.4 and merged.gpu_source == "nvml" and merged.engine.num_waiting == 1

    # A GPU record older than three node intervals is not merged: fresh engine numbers, no GPU ones.
    stale = replace(record, reported_at=time.time() - 4.0)
    await fleet.client.hset(gpu_key(a), mapping=encode_gpu_record(stale))
    await fleet.sidecar_round()
    merged = await fleet.record(a)
    assert merged.gpu.util is None and merged.gpu_source == "none" and time.time() - merged.reported_at < 1.0
    assert "GPU record is stale" in caplog.text
    await fleet.client.delete(gpu_key(a))


# ---- the nvml source: NVML + PodResources, the node agent as its own process ------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcessLog:
    """The child's stderr, read as it comes (so its pipe never fills), with a way to await a line."""

    def __init__(self, stream: asyncio.StreamReader) -> None:
        self.lines: list[str] = []
        self._new = asyncio.Condition()
        self._task = asyncio.create_task(self._read(stream))

    async def _read(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            async with self._new:
                self.lines.append(line.decode())
                self._new.notify_all()

    async def wait_for(self, text: str, timeout: float = 20.0) -> str:
        async with asyncio.timeout(timeout), self._new:
            await self._new.wait_for(lambda: any(text in line for line in self.lines))
        return next(line for line in self.lines if text in line)


async def rounds(pubsub, node: str, count: int) -> None:
    """Wait for `count` more rounds of the node agent (it announces each; the first may have begun earlier)."""
    async with asyncio.timeout(20):
        async for message in pubsub.listen():
            if message["type"] == "message" and message["data"] == node:
                count -= 1
                if count == 0:
                    return


@pytest.fixture
async def start_node_agent(fake_nvml_dir, tmp_path, redis_url) -> AsyncIterator[Callable[..., Awaitable]]:  # noqa: F811
    procs = []

    async def start(*args: str, gpu: FakeNvmlGpu):
        env = {**os.environ, "LD_LIBRARY_PATH": str(fake_nvml_dir), "FAKE_NVML_STATE": str(gpu.state_path),
               "PYTHONWARNINGS": "error"}
        proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "router", "node-agent", "--redis", redis_url,
                                                    *args, stderr=asyncio.subprocess.PIPE, env=env)
        procs.append(proc)
        return proc, ProcessLog(proc.stderr)

    yield start
    for proc in procs:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0  # a clean stop


async def test_nvml_source_maps_each_pods_gpus_through_pod_resources(fleet, pod_resources, start_node_agent, tmp_path) -> None:  # noqa: F811
    a, b = fleet.pods
    ns = fleet.namespace
    gpu = FakeNvmlGpu(tmp_path)
    uuids = [f"GPU-fa4e0000-0000-0000-0000-{i:012d}" for i in range(4)]  # the fake's default UUIDs
    gpu.set(count=4, **{"util_gpu.0": 20, "mem_used.0": 40 * GIB, "util_gpu.1": 60, "mem_used.1": 10 * GIB,
                        "util_gpu.2": 90, "mem_used.2": 60 * GIB, "util_gpu.3": 99})
    pod_resources.assign(ns, a, "vllm", [uuids[0]])
    pod_resources.assign(ns, b, "vllm", [uuids[1], uuids[2]])  # tensor parallel over two GPUs
    pod_resources.assign(ns, "trainer-0", "trainer", [uuids[3]])  # not an engine container
    node, port = unique("gpu-node"), free_port()
    pubsub = fleet.client.pubsub()
    await pubsub.subscribe(GPU_UPDATES_CHANNEL)
    proc, log = await start_node_agent(
        "--source", "nvml", "--node-name", node, "--namespace", ns, "--container", "vllm",
        "--pod-resources-socket", str(pod_resources.socket_path), "--interval", "200ms",
        "--metrics-host", "127.0.0.1", "--metrics-port", str(port), gpu=gpu)
    try:
        await rounds(pubsub, node, 1)
        view = await fleet.router_view()
        assert view[a].gpu_util == pytest.approx(0.20) and view[b].gpu_util == pytest.approx(0.75)
        assert view[a].gpu_mem_util == pytest.approx(0.5) and view[b].gpu_mem_util == pytest.approx(0.75)
        assert view[a].source == view[b].source == "nvml"
        assert (await fleet.record(b)).gpu.count == 2
        assert not await fleet.client.exists(gpu_key("trainer-0"))
        assert "publishing GPU telemetry for an endpoint" in await log.wait_for(b)

        # GPU 1 (one of b's) falls off the bus: only b's endpoint is marked.
        gpu.set(**{"lost.1": 1})
        await rounds(pubsub, node, 2)
        view = await fleet.router_view()
        assert view[b].gpu_lost and not view[a].gpu_lost
        assert view[b].gpu_util == pytest.approx(0.90)  # the GPU that still answers

        # Pod a leaves: its record is deleted, and its sidecar publishes engine-only telemetry.
        pod_resources.remove(ns, a)
        await rounds(pubsub, node, 2)
        assert not await fleet.client.exists(gpu_key(a))
        view = await fleet.router_view()
        assert view[a].gpu_util is None and view[a].num_waiting == 1 and view[b].gpu_lost
        await log.wait_for("endpoint left this node")

        # The kubelet's socket goes away: one clear warning, the agent keeps running and says so in metrics.
        await pod_resources.stop()
        entry = json.loads(await log.wait_for("GPU source unreadable"))
        assert entry["level"] == "warning" and entry["stage"] == "pod_resources"
        assert "UNAVAILABLE" in entry["error"] and str(pod_resources.socket_path) in entry["hint"]
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as resp:
            text = await resp.text()
        assert "fleetroute_node_agent_source_up 0.0" in text
        assert 'fleetroute_node_agent_source_errors_total{stage="pod_resources"}' in text
        assert proc.returncode is None
        await pod_resources.start()
        await log.wait_for("GPU telemetry flowing again")
        await rounds(pubsub, node, 1)
        async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/healthz") as resp:
            assert resp.status == 200
    finally:
        await pubsub.aclose()


async def test_nvml_source_reads_index_ids_and_time_sliced_gpus_and_names_mig_it_cannot_read(
        fleet, pod_resources, start_node_agent, tmp_path) -> None:  # noqa: F811
    a, b = fleet.pods
    ns = fleet.namespace
    gpu = FakeNvmlGpu(tmp_path)
    gpu.set(count=2, **{"util_gpu.0": 40, "util_gpu.1": 80})
    pod_resources.assign(ns, a, "vllm", ["1"])  # the device plugin's deviceIDStrategy=index
    pod_resources.assign(ns, b, "vllm", ["GPU-fa4e0000-0000-0000-0000-000000000000::3"], resource="nvidia.com/gpu.shared")
    pod_resources.assign(ns, b, "vllm", ["MIG-5e1d7a3c-0000-0000-0000-000000000000"], resource="nvidia.com/mig-1g.10gb")
    node = unique("gpu-node")
    pubsub = fleet.client.pubsub()
    await pubsub.subscribe(GPU_UPDATES_CHANNEL)
    _, log = await start_node_agent("--source", "nvml", "--node-name", node, "--namespace", ns, "--metrics-port", "0",
                                    "--pod-resources-socket", str(pod_resources.socket_path), "--interval", "200ms",
                                    gpu=gpu)
    try:
        await rounds(pubsub, node, 1)
        view = await fleet.router_view()
        assert view[a].gpu_util == pytest.approx(0.80) and view[b].gpu_util == pytest.approx(0.40)
        # The records name GPUs by UUID, whatever id the device plugin used.
        assert await fleet.client.hget(gpu_key(a), "gpu_uuids") == "GPU-fa4e0000-0000-0000-0000-000000000001"
        assert await fleet.client.hget(gpu_key(b), "gpu_uuids") == "GPU-fa4e0000-0000-0000-0000-000000000000"
        assert (await fleet.record(b)).gpu.count == 1  # the MIG instance is not sampled...
        entry = json.loads(await log.wait_for("MIG instance"))  # ...and the log says so, naming the pod
        assert entry["pod"] == b and entry["level"] == "warning"
    finally:
        await pubsub.aclose()


async def test_nvml_source_without_a_driver_says_so_and_keeps_trying(fleet, pod_resources, start_node_agent, tmp_path) -> None:  # noqa: F811
    gpu = FakeNvmlGpu(tmp_path)
    gpu.set(init_error=9)  # NVML_ERROR_DRIVER_NOT_LOADED
    proc, log = await start_node_agent("--source", "nvml", "--node-name", unique("n"), "--metrics-port", "0",
                                       "--pod-resources-socket", str(pod_resources.socket_path), "--interval", "100ms",
                                       gpu=gpu)
    entry = json.loads(await log.wait_for("GPU source unreadable"))
    assert entry["stage"] == "nvml" and "driver not loaded" in entry["error"]
    gpu.set(init_error=0)  # the driver comes up: the agent finds it without a restart
    await log.wait_for("GPU telemetry flowing again")
    assert proc.returncode is None


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(["--source", "nvml", "--interval", "0s"], "--interval must be a positive duration", id="interval"),
        pytest.param(["--source", "nvml", "--redis", "http://x"], "--redis: must be a redis://", id="redis-url"),
        pytest.param(["--source", "dcgm", "--dcgm-url", "localhost:9400"], "--dcgm-url must be an http://", id="dcgm-url"),
        pytest.param(["--source", "dcgm", "--dcgm-url", "ftp://ops:hunter2@dcgm:9400"],
                     "--dcgm-url must be an http:// or https:// URL with a host, got 'ftp://***@dcgm:9400'", id="dcgm-url-credentials"),
        pytest.param(["--source", "dcgm", "--dcgm-url", "http://dcgm:99999/metrics"], "--dcgm-url has an invalid port",
                     id="dcgm-url-port"),
        pytest.param(["--source", "nvml", "--metrics-port", "70000"], "--metrics-port must be 0..65535", id="port"),
    ],
)
def test_bad_command_lines_exit_2_with_the_reason(args, message, redis_url) -> None:  # noqa: F811
    import subprocess

    argv = [sys.executable, "-m", "router", "node-agent", "--redis", redis_url, *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "hunter2" not in proc.stderr  # a URL's credentials are never printed


async def test_healthz_fails_when_rounds_stop(fleet, dcgm_exporter) -> None:  # noqa: F811
    from aiohttp.test_utils import TestClient, TestServer

    async with aiohttp.ClientSession() as session:
        node = dcgm_agent(fleet, dcgm_exporter, session)
        async with TestClient(TestServer(build_http_app(node))) as client:
            await node.tick()
            assert (await client.get("/healthz")).status == 200
            node.last_round = asyncio.get_running_loop().time() - 60  # no round for 60 intervals
            resp = await client.get("/healthz")
            assert resp.status == 503 and "no round has ended" in await resp.text()
            assert "fleetroute_node_agent_rounds_total" in await (await client.get("/metrics")).text()
