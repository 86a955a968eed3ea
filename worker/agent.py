"""`fleetroute agent`: the sidecar beside each engine. Every interval it samples the GPU and the engine's
`/metrics`, and publishes one record to Redis for every router.

GPU sources: `node` on Kubernetes, where the sidecar cannot see its pod's GPUs (the device plugin gives them
only to the engine's container): it merges the GPU record that the node agent (`fleetroute node-agent`,
worker/node_agent.py) publishes for this endpoint, see worker/node_gpu.py. `nvml` where the sidecar does see
the engine's GPU (a host or VM with the engine's GPU at `--gpu-index`). `sim`: a simulator's `/sim/gpu`.

It never crash-loops on its environment: no NVIDIA driver gives one clear log line and engine-only
telemetry; an unreachable engine publishes `engine_up=0` (routers then see the endpoint's engine signals as
unknown); an unreachable Redis is logged once and retried every interval until it answers.

Redis is reached as the router reaches it (router/runtime/redis_client.py): a standalone server or a cluster node by
URL, or a Sentinel-watched master, with the password from an environment variable or a file. The flags
mirror the router's `redis:` block and are checked by the same parser.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import aiohttp
from redis.exceptions import RedisError

from router.config.redaction import redact_url
from worker.collect import EngineCollector, GpuSampler, SimGpuSampler
from worker.node_gpu import NodeGpuReader, merge
from worker.publisher import RedisPublisher

if TYPE_CHECKING:
    from router.runtime.redis_client import RedisClient, RedisSettings

log = logging.getLogger("fleetroute.agent")

GPU_SOURCES = ("node", "nvml", "sim", "none")


@dataclass(frozen=True)
class AgentSettings:
    engine_url: str
    redis: RedisSettings
    endpoint_id: str
    gpu_source: str = "nvml"
    gpu_index: int = 0
    interval: float = 1.0
    timeout: float = 0.5

    @property
    def ttl(self) -> float:
        # A few intervals: long enough to ride out one slow publish, short enough that a dead agent's
        # numbers are gone before routers would trust them anyway.
        return 3 * self.interval


def open_gpu(settings: AgentSettings, session: aiohttp.ClientSession) -> tuple[GpuSampler | None, str]:
    if settings.gpu_source == "sim":
        return SimGpuSampler(session, settings.engine_url, settings.timeout), "sim"
    if settings.gpu_source == "nvml":
        from worker.nvml import NvmlSampler, NvmlUnavailable

        try:
            sampler = NvmlSampler(settings.gpu_index)
        except NvmlUnavailable as exc:
            log.warning("no GPU telemetry: %s; publishing engine-only telemetry", exc,
                        extra={"endpoint": settings.endpoint_id})
            return None, "none"
        log.info("reading GPU through NVML", extra={"gpu": sampler.name, "uuid": sampler.uuid})
        return sampler, "nvml"
    return None, "none"


class Agent:
    def __init__(self, settings: AgentSettings, session: aiohttp.ClientSession, client: RedisClient) -> None:
        self.settings = settings
        self._gpu, gpu_source = open_gpu(settings, session)
        self._collector = EngineCollector(
            session=session, endpoint_id=settings.endpoint_id, engine_url=settings.engine_url, gpu=self._gpu,
            gpu_source=gpu_source, interval=settings.interval, timeout=settings.timeout,
        )
        # The node agent's record for this endpoint, read beside the engine scrape (collector.gpu is then None).
        self._node_gpu = NodeGpuReader(client, settings.endpoint_id) if settings.gpu_source == "node" else None
        self._publisher = RedisPublisher(client, ttl=settings.ttl)
        self._redis_down = False
        self.published = 0

    async def tick(self) -> None:
        if self._node_gpu is not None:
            record, gpu = await asyncio.gather(self._collector.collect(), self._node_gpu.read())
            record = merge(record, gpu)
        else:
            record = await self._collector.collect()
        try:
            await self._publisher.publish(record)
        except (RedisError, OSError) as exc:
            if not self._redis_down:
                log.warning("redis unreachable; will keep retrying every interval",
                            extra={"endpoint": self.settings.endpoint_id, "error": f"{type(exc).__name__}: {exc}"})
            self._redis_down = True
            return
        if self._redis_down:
            log.info("redis reachable again", extra={"endpoint": self.settings.endpoint_id})
            self._redis_down = False
        self.published += 1

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        next_tick = loop.time()
        while True:
            try:
                await self.tick()
            except Exception:  # a bug in one sample must not silence the agent for good
                log.exception("telemetry sample failed; the agent goes on",
                              extra={"endpoint": self.settings.endpoint_id})
            # After a stall, skip the missed ticks instead of firing them back to back.
            next_tick = max(next_tick + self.settings.interval, loop.time())
            await asyncio.sleep(max(0.0, next_tick - loop.time()))

    def close(self) -> None:
        if self._gpu is not None:
            self._gpu.close()


async def run_agent(settings: AgentSettings) -> None:
    from router.runtime.redis_client import connect

    client = connect(settings.redis, timeout=settings.timeout)
    async with aiohttp.ClientSession() as session:
        agent = Agent(settings, session, client)
        log.info("agent started", extra={"endpoint": settings.endpoint_id, "engine": redact_url(settings.engine_url),
                                         "interval_s": settings.interval, "redis": settings.redis.describe()})
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
            agent.close()
            await client.aclose()


def add_redis_arguments(p: argparse.ArgumentParser) -> None:
    """The --redis* flags of the agents (this one and the node agent): the router's `redis:` block as flags."""
    r = p.add_argument_group("Redis", "where to write: a URL, or sentinels (the same choices as the router's "
                             "redis: block, docs/configuration.md)")
    r.add_argument("--redis", metavar="URL", help="redis://, rediss:// or unix:// URL of a server, or of any node "
                   "with --redis-cluster (default: $REDIS_URL unless --redis-sentinel is given)")
    r.add_argument("--redis-cluster", action="store_true", help="--redis names a node of a Redis Cluster")
    r.add_argument("--redis-username", metavar="NAME", help="ACL user name (Redis 6+)")
    r.add_argument("--redis-password-env", metavar="VAR", help="read the password from this environment variable")
    r.add_argument("--redis-password-file", metavar="PATH", help="read the password from this file (a mounted "
                   "Secret)")
    r.add_argument("--redis-sentinel", metavar="HOST:PORT,...", help="Redis Sentinel addresses, comma-separated")
    r.add_argument("--redis-sentinel-master", metavar="NAME", help="the master name the sentinels watch")
    r.add_argument("--redis-sentinel-db", type=int, metavar="N", help="database number on the master (default 0)")
    r.add_argument("--redis-sentinel-tls", action="store_true", help="reach the sentinels and the master over TLS")
    r.add_argument("--redis-sentinel-password-env", metavar="VAR", help="the sentinels' own password, from this "
                   "environment variable")
    r.add_argument("--redis-sentinel-password-file", metavar="PATH", help="the sentinels' own password, from this "
                   "file")


def http_url_problem(text: str) -> str | None:
    """Why `text` is not a usable http(s) base URL (scheme, host, port 1-65535), or None; without credentials."""
    try:
        parts = urlsplit(text)
    except ValueError:  # an unclosed IPv6 bracket
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        return f"must be an http:// or https:// URL with a host, got {redact_url(text)!r}"
    try:
        port = parts.port
    except ValueError:  # not a number, or above 65535
        port = 0
    if port == 0:
        return f"has an invalid port (want 1 to 65535), got {redact_url(text)!r}"
    return None


def engine_url(text: str) -> str:
    """argparse type of --engine-url: checked at once (exit 2), not at the first scrape."""
    problem = http_url_problem(text.strip())
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text.strip().rstrip("/")


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("agent", help="run the telemetry sidecar beside one engine (vLLM metrics + GPU -> Redis)",
                       description="Sample the engine's /metrics and its GPU every interval and publish one "
                       "telemetry record to Redis for the routers (schema: worker/protocol.py, docs/telemetry.md). "
                       "On Kubernetes the GPU numbers come from the node agent (--gpu-source node).")
    p.add_argument("--engine-url", required=True, type=engine_url,
                   help="the engine's base URL (http or https, a host, a port 1-65535), e.g. http://127.0.0.1:8000")
    add_redis_arguments(p)
    p.add_argument("--endpoint-id", required=True, help="the endpoint id routers know this engine by")
    p.add_argument("--gpu-source", choices=GPU_SOURCES, default="nvml",
                   help="node (on Kubernetes: the GPU record `fleetroute node-agent` publishes for this endpoint), "
                   "nvml (a GPU this process sees, at --gpu-index), sim (a fleetroute sim's /sim/gpu) or none "
                   "(default nvml)")
    p.add_argument("--gpu-index", type=int, default=0, help="NVML device index (default 0)")
    p.add_argument("--interval", default="1s", help="sampling interval, e.g. 1s or 500ms (default 1s)")
    p.set_defaults(func=main)


def command_error(command: str, message: str) -> int:
    """A command-line error, as argparse words it: on stderr, exit code 2."""
    print(f"fleetroute {command}: error: {message}", file=sys.stderr)
    return 2


def interval_and_redis(args: argparse.Namespace) -> tuple[float, RedisSettings]:
    """The `--interval` and `--redis*` flags both agents take. Raises ValueError naming the flag at fault."""
    from router.config.settings import ConfigError, parse_duration

    interval = parse_duration(args.interval)
    if interval is None or interval <= 0:
        raise ValueError(f"--interval must be a positive duration like 1s or 500ms, got {args.interval!r}")
    try:
        return interval, redis_settings(args)
    except ConfigError as exc:
        raise ValueError(str(exc)) from None


def main(args: argparse.Namespace) -> int:
    from router.runtime.logs import configure_logging
    from router.runtime.loop import run_event_loop

    try:
        interval, redis = interval_and_redis(args)
    except ValueError as exc:
        return command_error("agent", str(exc))
    configure_logging("info")
    settings = AgentSettings(engine_url=args.engine_url, redis=redis,
                             endpoint_id=args.endpoint_id, gpu_source=args.gpu_source, gpu_index=args.gpu_index,
                             interval=interval)
    run_event_loop(run_agent(settings))
    return 0


# The router's `redis:` fields each flag sets, so an error names the flag.
_REDIS_FLAGS = {
    "url": "--redis", "cluster": "--redis-cluster", "username": "--redis-username",
    "passwordEnv": "--redis-password-env", "passwordFile": "--redis-password-file",
    "sentinel.addresses": "--redis-sentinel", "sentinel.masterName": "--redis-sentinel-master",
    "sentinel.db": "--redis-sentinel-db", "sentinel.tls": "--redis-sentinel-tls",
    "sentinel.passwordEnv": "--redis-sentinel-password-env", "sentinel.passwordFile": "--redis-sentinel-password-file",
}


def redis_settings(args: argparse.Namespace) -> RedisSettings:
    """The --redis* flags through the router's own `redis:` parser; raises ConfigError naming the flag."""
    from router.config.settings import ConfigError, parse_redis

    block: dict[str, object] = {}
    sentinel: dict[str, object] = {}
    if args.redis_sentinel or args.redis_sentinel_master:
        sentinel["addresses"] = [a.strip() for a in (args.redis_sentinel or "").split(",") if a.strip()]
        for key, value in (("masterName", args.redis_sentinel_master), ("db", args.redis_sentinel_db),
                           ("passwordEnv", args.redis_sentinel_password_env),
                           ("passwordFile", args.redis_sentinel_password_file)):
            if value is not None:
                sentinel[key] = value
        sentinel["tls"] = args.redis_sentinel_tls
        block["sentinel"] = sentinel
    if args.redis is not None or not sentinel:
        block["url"] = args.redis or os.environ.get("REDIS_URL") or None
    for key, value in (("cluster", args.redis_cluster or None), ("username", args.redis_username),
                       ("passwordEnv", args.redis_password_env), ("passwordFile", args.redis_password_file)):
        if value is not None:
            block[key] = value
    try:
        settings = parse_redis(block)
    except ConfigError as exc:
        field = exc.path.removeprefix("redis.").split("[")[0]
        flag = _REDIS_FLAGS.get(field, "--redis")
        raise ConfigError(flag, str(exc).removeprefix(f"{exc.path}: ")) from None
    if not settings.enabled:
        raise ConfigError("--redis", "is required (or set REDIS_URL, or give --redis-sentinel)")
    return settings
