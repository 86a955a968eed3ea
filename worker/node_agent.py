"""`fleetroute node-agent`: GPU telemetry for every fleet endpoint of one Kubernetes node (a DaemonSet).

Why a node agent: with NVIDIA's device plugin only the container that requests `nvidia.com/gpu` (the
engine) sees its GPUs, so the telemetry sidecar beside it cannot read them, and a container that sees all
of a node's GPUs cannot tell which one is its pod's. dcgm-exporter solves this with one agent per node that
reads every GPU and asks the kubelet which pod holds which; the node agent does the same (source `nvml`),
or reads the GPU Operator's dcgm-exporter, which has done it already (source `dcgm`); see
worker/node_sources.py.

Every interval it reads its source and writes one GPU record per endpoint to Redis
(`fleetroute:v1:gpu:{pod name}`, worker/protocol.py, TTL three intervals; a pod that left has its record
deleted). The endpoint's sidecar (`fleetroute agent --gpu-source node`) merges that record into the
telemetry record it publishes for the routers, so the routers' read path is unchanged: one hash per
endpoint. It serves `/metrics` (worker/node_metrics.py) and `/healthz` on `--metrics-port`.

It never crash-loops on its environment: no NVML, a silent kubelet socket, an unreachable dcgm-exporter or
Redis are each one warning (and a recovery line), counted in metrics and retried every interval; nothing is
published for a round whose source failed, so the sidecars drop the GPU numbers once the records expire
rather than pass on old ones.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from redis.exceptions import RedisError

from router.config.redaction import redact_url
from worker.agent import add_redis_arguments, command_error, http_url_problem, interval_and_redis
from worker.node_metrics import NodeAgentMetrics
from worker.node_sources import (
    NODE_SOURCES,
    DcgmNodeSource,
    EndpointGpus,
    NodeSource,
    NvmlNodeSource,
    PodFilter,
    SourceUnavailable,
    aggregate,
)
from worker.protocol import GpuRecord
from worker.publisher import GpuRecordPublisher

if TYPE_CHECKING:
    from router.runtime.redis_client import RedisClient, RedisSettings

log = logging.getLogger("fleetroute.node_agent")

DEFAULT_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"  # the kubelet's PodResources socket
DEFAULT_DCGM_URL = "http://127.0.0.1:9400/metrics"
DEFAULT_METRICS_PORT = 9402


@dataclass(frozen=True)
class NodeAgentSettings:
    source: str  # nvml | dcgm
    redis: RedisSettings
    node: str
    pods: PodFilter = PodFilter()
    pod_resources_socket: str = DEFAULT_SOCKET
    dcgm_url: str = DEFAULT_DCGM_URL
    dcgm_hostname_check: bool = True  # leave out dcgm-exporter series whose Hostname names another node
    interval: float = 1.0
    timeout: float = 1.0
    metrics_host: str = "0.0.0.0"
    metrics_port: int = DEFAULT_METRICS_PORT  # 0: no HTTP server

    @property
    def ttl(self) -> float:
        return 3 * self.interval  # as the sidecar's records: rides out one slow round, no longer


def open_source(settings: NodeAgentSettings, session: aiohttp.ClientSession) -> NodeSource:
    if settings.source == "dcgm":
        return DcgmNodeSource(session, settings.dcgm_url, settings.pods, timeout=settings.timeout,
                              node=settings.node if settings.dcgm_hostname_check else None)
    from worker.podresources import PodResourcesClient  # gRPC: loaded only by the nvml source

    return NvmlNodeSource(PodResourcesClient(settings.pod_resources_socket, timeout=settings.timeout),
                          settings.pods)


class NodeAgent:
    def __init__(self, settings: NodeAgentSettings, source: NodeSource, client: RedisClient,
                 metrics: NodeAgentMetrics | None = None, clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.source = source
        self.metrics = metrics or NodeAgentMetrics()
        self._publisher = GpuRecordPublisher(client, ttl=settings.ttl, node=settings.node)
        self._clock = clock
        self._published: set[str] = set()  # endpoints whose records the last successful round wrote
        self._failing: str | None = None  # the failing stage (a source stage, or "redis")
        self._duplicates_warned: set[str] = set()
        self.last_round: float | None = None  # loop time the last round ended

    def _fail(self, stage: str, message: str, error: str) -> None:
        if self._failing != stage:  # once per outage, not once per round
            hint = {"pod_resources": f"is {self.settings.pod_resources_socket} mounted, and the agent root?",
                    "nvml": "does the pod run with the NVIDIA runtime and NVIDIA_VISIBLE_DEVICES=all?",
                    "dcgm": "is dcgm-exporter running on this node, and the URL reaching this node's?",
                    "redis": "retrying every interval"}[stage]
            log.warning(message, extra={"node": self.settings.node, "stage": stage, "error": error, "hint": hint})
        self._failing = stage

    def _records(self, now: float, endpoints: list[EndpointGpus]) -> list[GpuRecord]:
        records: dict[str, GpuRecord] = {}
        for e in endpoints:
            if e.endpoint_id in records:  # the same pod name in two watched namespaces: the router cannot tell
                if e.endpoint_id not in self._duplicates_warned:
                    self._duplicates_warned.add(e.endpoint_id)
                    log.warning("two pods of the same name in watched namespaces; publishing the first only",
                                extra={"endpoint": e.endpoint_id, "namespaces": [records[e.endpoint_id].namespace,
                                                                                 e.namespace]})
                continue
            records[e.endpoint_id] = GpuRecord(
                endpoint_id=e.endpoint_id, reported_at=now, interval=self.settings.interval, source=self.source.name,
                gpu=aggregate(e.samples), node=self.settings.node, namespace=e.namespace, gpu_uuids=e.gpu_ids)
        return list(records.values())

    async def tick(self) -> None:
        m = self.metrics
        start = time.perf_counter()
        try:
            try:
                endpoints = await self.source.read()
            except SourceUnavailable as exc:
                m.rounds.labels("source_error").inc()
                m.source_errors.labels(exc.stage).inc()
                m.source_up.set(0)
                self._fail(exc.stage, "GPU source unreadable; publishing nothing until it answers", str(exc))
                return
            m.source_up.set(1)
            m.gpus.set(self.source.gpus)
            if self.source.other_node_gpus:
                m.dcgm_other_node_gpus.inc(self.source.other_node_gpus)
            records = self._records(self._clock(), endpoints)
            ids = {r.endpoint_id for r in records}
            gone = self._published - ids
            try:
                await self._publisher.publish(records, gone)
            except (RedisError, OSError) as exc:
                m.rounds.labels("redis_error").inc()
                m.redis_up.set(0)
                self._fail("redis", "redis unreachable; GPU records not written", f"{type(exc).__name__}: {exc}")
                return
            m.rounds.labels("ok").inc()
            m.redis_up.set(1)
            m.endpoints.set(len(records))
            m.endpoints_gpu_lost.set(sum(1 for r in records if r.gpu.lost))
            if self._failing is not None:
                log.info("GPU telemetry flowing again", extra={"node": self.settings.node, "was": self._failing})
                self._failing = None
            for r in records:
                if r.endpoint_id not in self._published:
                    log.info("publishing GPU telemetry for an endpoint",
                             extra={"endpoint": r.endpoint_id, "namespace": r.namespace, "gpus": list(r.gpu_uuids)})
            for endpoint_id in sorted(gone):
                log.info("endpoint left this node; its GPU record is deleted", extra={"endpoint": endpoint_id})
            self._published = ids
        finally:
            m.round_duration.observe(time.perf_counter() - start)
            m.last_round.set(time.time())
            self.last_round = asyncio.get_running_loop().time()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        if self.last_round is None:
            self.last_round = next_tick  # a first round that never ends is unhealthy too
        while True:
            try:
                await self.tick()
            except Exception:  # a bug in one round must not silence the node for good
                log.exception("GPU telemetry round failed; the node agent goes on", extra={"node": self.settings.node})
            next_tick = max(next_tick + self.settings.interval, loop.time())
            await asyncio.sleep(max(0.0, next_tick - loop.time()))

    def healthy(self) -> bool:
        """Whether rounds keep ending (whatever their result): false once none has for 10 intervals."""
        if self.last_round is None:
            return True  # not running yet
        limit = 10 * self.settings.interval + self.settings.timeout
        return asyncio.get_running_loop().time() - self.last_round <= limit


def build_http_app(agent: NodeAgent) -> web.Application:
    async def metrics(_: web.Request) -> web.Response:
        return web.Response(body=generate_latest(agent.metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def healthz(_: web.Request) -> web.Response:
        if agent.healthy():
            return web.Response(text="ok\n")
        return web.Response(status=503, text="no round has ended for 10 intervals\n")

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    return app


async def run_node_agent(settings: NodeAgentSettings) -> None:
    from router.runtime.redis_client import connect

    client = connect(settings.redis, timeout=settings.timeout)
    async with aiohttp.ClientSession() as session:
        agent = NodeAgent(settings, open_source(settings, session), client)
        runner: web.AppRunner | None = None
        if settings.metrics_port:
            runner = web.AppRunner(build_http_app(agent), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, settings.metrics_host, settings.metrics_port).start()
        log.info("node agent started", extra={
            "node": settings.node, "source": settings.source, "interval_s": settings.interval,
            "namespaces": sorted(settings.pods.namespaces) or "all",
            "containers": sorted(settings.pods.containers) or "any",
            "pod_resources": settings.pod_resources_socket if settings.source == "nvml" else None,
            "dcgm_url": redact_url(settings.dcgm_url) if settings.source == "dcgm" else None,
            "dcgm_hostname_check": settings.dcgm_hostname_check if settings.source == "dcgm" else None,
            "metrics_port": settings.metrics_port or None})
        task = asyncio.create_task(agent.run())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if runner is not None:
                await runner.cleanup()
            await agent.source.close()
            await client.aclose()
            log.info("node agent stopped", extra={"node": settings.node})


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "node-agent",
        help="run the GPU telemetry agent of one Kubernetes node (a DaemonSet: NVML or dcgm-exporter -> Redis)",
        description="Every interval, read the GPUs of this node's fleet pods and publish one GPU record per endpoint "
        "(pod) to Redis, for the endpoint's `fleetroute agent --gpu-source node` to merge into its telemetry. "
        "Source nvml: NVML for every GPU of the node (run with NVIDIA_VISIBLE_DEVICES=all) mapped to pods through "
        "the kubelet's PodResources socket (root can read it). Source dcgm: the node's dcgm-exporter, whose series "
        "already name each GPU's pod. See docs/telemetry.md#gpu-telemetry-on-kubernetes.")
    p.add_argument("--source", required=True, choices=NODE_SOURCES, help="nvml (NVML + PodResources) or dcgm")
    add_redis_arguments(p)
    p.add_argument("--node-name", default=os.environ.get("NODE_NAME") or socket.gethostname(),
                   help="this node's name, for logs and records (default: $NODE_NAME, else the host name)")
    p.add_argument("--namespace", action="append", default=[], metavar="NS",
                   help="publish pods of this namespace (repeat for more; default: every namespace). Use the "
                   "routers' namespace: their endpoint ids are pod names")
    p.add_argument("--container", action="append", default=[], metavar="NAME",
                   help="count only GPUs held by containers of this name (repeat for more; default: any)")
    p.add_argument("--pod-resources-socket", default=DEFAULT_SOCKET,
                   help=f"the kubelet's PodResources socket (source nvml; default {DEFAULT_SOCKET})")
    p.add_argument("--dcgm-url", default=DEFAULT_DCGM_URL,
                   help=f"this node's dcgm-exporter metrics URL (source dcgm; default {DEFAULT_DCGM_URL})")
    p.add_argument("--dcgm-hostname-check", action=argparse.BooleanOptionalAction, default=True,
                   help="leave out series whose Hostname label names another node than --node-name (default on; "
                   "turn off for an exporter that names its own pod instead, as older GPU Operators' do)")
    p.add_argument("--interval", default="1s", help="sampling interval, e.g. 1s or 500ms (default 1s)")
    p.add_argument("--metrics-host", default="0.0.0.0", help="address of /metrics and /healthz (default 0.0.0.0)")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_METRICS_PORT,
                   help=f"port of /metrics and /healthz; 0 turns them off (default {DEFAULT_METRICS_PORT})")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from router.runtime.logs import configure_logging
    from router.runtime.loop import run_event_loop

    def fail(message: str) -> int:
        return command_error("node-agent", message)

    try:
        interval, redis = interval_and_redis(args)
    except ValueError as exc:
        return fail(str(exc))
    if args.source == "dcgm" and (problem := http_url_problem(args.dcgm_url)) is not None:
        return fail(f"--dcgm-url {problem}")
    if not 0 <= args.metrics_port <= 65535:
        return fail(f"--metrics-port must be 0..65535, got {args.metrics_port}")
    configure_logging("info")
    settings = NodeAgentSettings(
        source=args.source, redis=redis, node=args.node_name,
        pods=PodFilter(frozenset(args.namespace), frozenset(args.container)),
        pod_resources_socket=args.pod_resources_socket, dcgm_url=args.dcgm_url,
        dcgm_hostname_check=args.dcgm_hostname_check, interval=interval,
        timeout=min(1.0, interval), metrics_host=args.metrics_host, metrics_port=args.metrics_port)
    try:
        run_event_loop(run_node_agent(settings))
    except OSError as exc:
        print(f"fleetroute node-agent: cannot listen on {args.metrics_host}:{args.metrics_port}: {exc}",
              file=sys.stderr)
        return 1
    return 0
