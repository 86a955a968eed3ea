"""A local simulated GPU fleet for load tests: `fleetroute sim` replicas, their `fleetroute agent` sidecars
publishing to Redis (or none: the router then scrapes the engines itself), and a router in front.

Everything is a child process in one `ProcessGroup`, started on free 127.0.0.1 ports and stopped by PID.
Time-scaled: a replica runs `time_scale` times slower than the GPU it models, and every interval that is
meant in simulated time (the agents' sampling, the router's telemetry refresh and staleness, its timeouts)
is stretched by the same factor, so telemetry is exactly as fresh relative to the traffic as it would be
on real GPUs.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.host import pin_tree
from loadtest.processes import Child, ProcessGroup, listener_url
from loadtest.scenario import FleetSpec


def busy_fractions(before: Mapping[str, tuple[float, float]],
                   after: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """Per replica, the share of simulated time its GPU was busy between two `Fleet.gpu_busy` samples."""
    return {rid: (after[rid][0] - before[rid][0]) / max(after[rid][1] - before[rid][1], 1e-9) for rid in after}


async def _all(starts: list[Coroutine[Any, Any, Child]]) -> list[Child]:
    """Start children together; if one fails the others are cancelled (a TaskGroup), and every process that
    was spawned is in the ProcessGroup already, for the caller's stop_all()."""
    async with asyncio.TaskGroup() as tasks:
        running = [tasks.create_task(start) for start in starts]
    return [task.result() for task in running]


@dataclass
class Fleet:
    spec: FleetSpec
    group: ProcessGroup
    seed: int = 0
    redis_url: str | None = None
    urls: dict[str, str] = field(default_factory=dict)  # replica id -> base URL
    children: list[Child] = field(default_factory=list)

    async def start(self) -> None:
        s = self.spec
        faulty = {f.replica for f in s.faults}
        starts = []
        for i, (rid, gpu) in enumerate(s.replica_ids()):
            args = ["sim", "--port", "0", "--gpu", gpu, "--model", s.model, "--seed", str(self.seed * 1000 + i),
                    "--time-scale", f"{s.time_scale:g}", "--max-num-seqs", str(s.max_num_seqs),
                    "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--max-model-len", str(s.max_model_len)]
            if not s.prefix_caching:
                args.append("--no-prefix-caching")
            if rid in faulty:
                args.append("--fault-injection")
            starts.append(self.group.start(rid, args, "sim listening", timeout=60))
        for (rid, _), child in zip(s.replica_ids(), await _all(starts), strict=True):
            self.urls[rid] = child.ready["url"]
            self.children.append(child)
        if self.redis_url is not None:
            interval = f"{s.telemetry_interval * s.time_scale:g}s"
            agents = [
                self.group.start(f"agent-{rid}", ["agent", "--engine-url", url, "--redis", self.redis_url,
                                                  "--endpoint-id", rid, "--gpu-source", "sim", "--interval", interval],
                                 "agent started", timeout=60)
                for rid, url in self.urls.items()
            ]
            self.children += await _all(agents)
        async with aiohttp.ClientSession() as session:
            for fault in s.faults:
                async with session.post(self.urls[fault.replica] + "/sim/faults",
                                        json={"slowdown": fault.slowdown}) as resp:
                    resp.raise_for_status()

    async def gpu_busy(self, session: aiohttp.ClientSession) -> dict[str, tuple[float, float]]:
        """Per replica: (simulated GPU-busy seconds so far, simulated clock) from `/sim/gpu`."""
        async def one(url: str) -> tuple[float, float]:
            async with session.get(url + "/sim/gpu") as resp:
                sample = await resp.json()
            return sample["busy_seconds_total"], sample["sim_time"]

        values = await asyncio.gather(*(one(u) for u in self.urls.values()))
        return dict(zip(self.urls, values, strict=True))

    async def engine_counters(self, session: aiohttp.ClientSession) -> dict[str, dict[str, float]]:
        """Per replica: the vLLM counters the reports use (prefix-cache queries and hits, preemptions)."""
        from worker.vllm_metrics import parse_vllm_metrics

        async def one(url: str) -> dict[str, float]:
            async with session.get(url + "/metrics") as resp:
                sample = parse_vllm_metrics(await resp.text())
            return {"prefix_cache_queries": sample.prefix_cache_queries or 0.0,
                    "prefix_cache_hits": sample.prefix_cache_hits or 0.0,
                    "preemptions": sample.preemptions_total or 0.0}

        values = await asyncio.gather(*(one(u) for u in self.urls.values()))
        return dict(zip(self.urls, values, strict=True))


def router_config(fleet: Fleet, policy: Mapping[str, Any], extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The router's config for one policy in front of the fleet, with simulated-time intervals stretched."""
    s = fleet.spec
    scale = s.time_scale
    interval = s.telemetry_interval * scale
    policy = dict(policy)
    timeouts = {"firstByte": f"{300 * scale:g}s", "idle": f"{60 * scale:g}s", **policy.pop("timeouts", {})}
    config: dict[str, Any] = {
        "listen": {"host": "127.0.0.1", "port": 0},
        "admin": {"host": "127.0.0.1", "port": 0},
        "endpoints": [{"id": rid, "url": url, "models": [s.model], "weight": s.weights()[rid]}
                      for rid, url in fleet.urls.items()],
        "policies": [{**policy, "timeouts": timeouts}],
        "telemetry": {"interval": f"{interval:g}s", "staleAfter": f"{5 * interval:g}s",
                      "timeout": f"{max(0.5, 0.5 * interval):g}s",
                      "gpuSource": "none" if fleet.redis_url else "sim"},
        "redis": {"url": fleet.redis_url},
        "logging": {"level": "info", "accessLog": False},
        "shutdownGrace": "5s",
    }
    for key, value in (extra or {}).items():
        config[key] = {**config[key], **value} if isinstance(value, Mapping) and isinstance(config.get(key), dict) \
            else value
    return config


async def start_router(fleet: Fleet, policy: Mapping[str, Any], extra: Mapping[str, Any] | None = None, *,
                       cpus: set[int] | None = None) -> tuple[Child, str, str]:
    """A `fleetroute router` for one policy: (child, ingress URL, admin URL)."""
    with tempfile.NamedTemporaryFile("w", prefix="fleetroute-loadtest-", suffix=".yaml", delete=False) as fh:
        yaml.safe_dump(router_config(fleet, policy, extra), fh)
        path = Path(fh.name)
    try:
        child = await fleet.group.start(f"router-{policy.get('name', 'policy')}", ["router", "--config", str(path)],
                                        "router listening", timeout=60)
    finally:
        path.unlink(missing_ok=True)
    if cpus:
        pin_tree(child.process.pid, cpus)
    return child, listener_url(child, "ingress"), listener_url(child, "admin")


async def start_gateway(fleet: Fleet, policy: Mapping[str, Any], extra: Mapping[str, Any] | None = None, *,
                        cpus: set[int] | None = None) -> tuple[list[Child], str, str]:
    """The other data path for the same policy: real Envoy (loadtest/envoy.py) moving the bytes, `fleetroute
    epp` deciding, with the very config `start_router` would use (its `listen:` block unused). Both on the
    router's cores. Returns ([picker, envoy], Envoy's ingress URL, the picker's admin URL)."""
    from loadtest import envoy

    config = router_config(fleet, policy, extra)
    name = policy.get("name", "policy")
    workdir = Path(tempfile.mkdtemp(prefix="fleetroute-gateway-"))
    try:
        path = workdir / "epp.yaml"
        path.write_text(yaml.safe_dump(config))
        picker = await fleet.group.start(f"epp-{name}", ["epp", "--config", str(path), "--host", "127.0.0.1",
                                                         "--port", "0"], "endpoint picker listening", timeout=60)
        if cpus:
            pin_tree(picker.process.pid, cpus)
        grpc_port = int(picker.ready["grpc"].rsplit(":", 1)[1])
        # No stream may sit idle longer than the router would let it (its `timeouts.idle`, in wall time).
        idle = f"{max(300.0, 60 * fleet.spec.time_scale):g}s"
        proxy = await envoy.start(fleet.group, envoy.bootstrap(grpc_port, idle_timeout=idle), workdir,
                                  name=f"envoy-{name}", keep_log=False,
                                  cpus=",".join(str(c) for c in sorted(cpus)) if cpus else None)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)  # Envoy and the picker read their files at start only
    return [picker, proxy.child], proxy.listeners["main"], str(picker.ready["admin"])


async def wait_for_telemetry(admin_url: str, replicas: int, *, timeout: float) -> bool:
    """Until the router has telemetry for every replica (or `timeout` wall seconds): routing compared from
    the first request on, not from whenever the first reports happen to land."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    async with aiohttp.ClientSession() as session:
        while loop.time() < deadline:
            async with session.get(admin_url + "/admin/endpoints") as resp:
                endpoints = (await resp.json())["endpoints"]
            if len(endpoints) >= replicas and all(e["telemetry"] is not None for e in endpoints):
                return True
            await asyncio.sleep(0.2)
    return False
