"""Peer routers for the comparative benchmarks: vLLM's and SGLang's Rust routers, LiteLLM's proxy, nginx.

Each one is installed into its own virtualenv (`install-*.sh` here, pinned versions in `versions.env`) and
run against a list of OpenAI-compatible backends (`fleetroute sim` replicas, or the zero-latency
`loadtest.backend`), the same list a fleetroute router would get:

    peer = await start_peer(group, "vllm-router", "cache_aware", [("gpu-0", url0), ("gpu-1", url1)],
                            "llama-3-8b", cpu="0")
    ...  # OpenAI clients at peer.url (+ /v1/chat/completions), sending peer.headers
    await group.stop(peer.child)

The peers are spelled `peer:policy` on command lines (`parse_peer_spec`). One module per peer describes its
command line, configuration, readiness probe and quirks (read them: what each asks of the workers and how
its policies map is written there and in README.md); `start_peer` turns that description into a running
child of the caller's `ProcessGroup`, ready when its own health URL says so (never a fixed sleep).
`unavailable_reason` says, without starting anything, why a peer cannot run and how to install it, so a
benchmark can skip it with that message.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType, ModuleType

import aiohttp

from loadtest.host import free_port
from loadtest.peers import litellm, nginx, sglang_router, vllm_router
from loadtest.peers.base import (
    LaunchPlan,
    PeerError,
    PeerInfo,
    cpu_count_of,
    peers_dir,
    pinned_versions,
)
from loadtest.processes import Child, ChildFailed, ProcessGroup

__all__ = [
    "PEERS", "PeerError", "PeerInfo", "PeerSpec", "StartedPeer", "parse_peer_spec", "parse_peer_specs",
    "peer_version", "plan_peer", "start_peer", "stop_peer", "unavailable_reason", "write_plan_files",
]

_MODULES: Mapping[str, ModuleType] = MappingProxyType({
    m.INFO.name: m for m in (vllm_router, sglang_router, litellm, nginx)
})
PEERS: Mapping[str, PeerInfo] = MappingProxyType({name: m.INFO for name, m in _MODULES.items()})
_PIN_KEYS = {"vllm-router": "VLLM_ROUTER_VERSION", "sglang-router": "SGLANG_ROUTER_VERSION",
             "litellm": "LITELLM_VERSION", "nginx": "NGINX_VERSION"}


@dataclass(frozen=True)
class PeerSpec:
    peer: str
    policy: str

    def __str__(self) -> str:
        return f"{self.peer}:{self.policy}"


def _info(name: str) -> PeerInfo:
    try:
        return PEERS[name]
    except KeyError:
        raise PeerError(f"unknown peer {name!r}; known peers: {', '.join(PEERS)}") from None


def parse_peer_spec(text: str) -> PeerSpec:
    """`vllm-router:cache_aware` -> PeerSpec("vllm-router", "cache_aware"); errors name the known values."""
    peer, sep, policy = text.strip().partition(":")
    peer, policy = peer.strip(), policy.strip()
    if not sep or not peer or not policy:
        raise PeerError(f"peer must be spelled peer:policy (e.g. nginx:least_conn), got {text!r}")
    info = _info(peer)
    if policy not in info.policies:
        raise PeerError(f"unknown policy {policy!r} for {peer}; {peer} policies: {', '.join(info.policies)}")
    return PeerSpec(peer, policy)


def parse_peer_specs(text: str) -> tuple[PeerSpec, ...]:
    """A comma-separated list of `peer:policy`; duplicates are an error (they would be measured twice)."""
    specs = tuple(parse_peer_spec(part) for part in text.split(",") if part.strip())
    if not specs:
        raise PeerError("no peers given (expected e.g. vllm-router:round_robin,nginx:least_conn)")
    seen = [str(s) for s in specs]
    if dupes := sorted({s for s in seen if seen.count(s) > 1}):
        raise PeerError(f"peer given twice: {', '.join(dupes)}")
    return specs


def _pinned(name: str) -> str:
    return pinned_versions()[_PIN_KEYS[name]]


def unavailable_reason(name: str) -> str | None:
    """None when `name` is installed at its pinned version and runnable; otherwise why, and how to install it."""
    _info(name)
    if name == "nginx":
        return nginx.unavailable_reason(_pinned(name))
    return _MODULES[name].unavailable_reason(peers_dir(), _pinned(name))


def peer_version(name: str) -> str:
    _info(name)
    return nginx.version() if name == "nginx" else _MODULES[name].version(peers_dir())


def plan_peer(name: str, policy: str, backends: Sequence[tuple[str, str]], model: str, *, port: int,
              workdir: Path, cpu: str | None = None) -> LaunchPlan:
    """The peer's launch plan (argv prefixed with `taskset -c CPU` when pinned; worker threads/processes
    set to the pinned core count). Writes nothing; `write_plan_files` does."""
    info = _info(name)
    if policy not in info.policies:
        raise PeerError(f"unknown policy {policy!r} for {name}; {name} policies: {', '.join(info.policies)}")
    workers = cpu_count_of(cpu)
    plan = _MODULES[name].plan(policy, list(backends), model, port=port, root=peers_dir(), workdir=workdir,
                               workers=workers)
    if cpu is not None:
        taskset = shutil.which("taskset")
        if taskset is None:
            raise PeerError("cpu pinning needs taskset (util-linux), which is not installed")
        plan = LaunchPlan(argv=(taskset, "-c", cpu, *plan.argv), port=plan.port, probe=plan.probe, env=plan.env,
                          files=plan.files, client_headers=plan.client_headers)
    return plan


def write_plan_files(plan: LaunchPlan, workdir: Path) -> None:
    for name, text in plan.files.items():
        (workdir / name).write_text(text)


@dataclass
class StartedPeer:
    name: str
    policy: str
    version: str
    url: str  # base URL for OpenAI clients: they append /v1/chat/completions
    child: Child  # stop with group.stop(child)
    headers: Mapping[str, str] = field(default_factory=dict)  # every client request must send these
    argv: tuple[str, ...] = ()
    workdir: Path | None = None  # its generated configuration and log, kept for inspection
    log_path: Path | None = None
    owns_workdir: bool = False  # start_peer made workdir, so stop_peer removes it

    @property
    def spec(self) -> str:
        return f"{self.name}:{self.policy}"


async def _poll(plan: LaunchPlan, child: Child, interval: float = 0.1) -> dict[str, str]:
    """GET the plan's probe path until its check passes (the caller bounds the time). Why it is not ready
    yet stays in `child.ready["waiting_for"]`, for the error message if it never is."""
    timeout = aiohttp.ClientTimeout(total=2)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            try:
                async with session.get(plan.url + plan.probe.path, headers=dict(plan.probe.headers)) as r:
                    reason = plan.probe.check(r.status, await r.read())
            except (aiohttp.ClientError, TimeoutError) as exc:
                reason = f"not answering ({type(exc).__name__})"
            if reason is None:
                return {"probe": plan.probe.path, "url": plan.url}
            child.ready["waiting_for"] = f"GET {plan.probe.path} {reason}"
            await asyncio.sleep(interval)


async def start_peer(group: ProcessGroup, name: str, policy: str, backends: Sequence[tuple[str, str]],
                     model: str, *, port: int | None = None, cpu: str | None = None, timeout: float = 60.0,
                     workdir: Path | None = None) -> StartedPeer:
    """Start peer `name` with `policy` in front of `backends` ((endpoint_id, base_url) pairs) serving
    `model`, on 127.0.0.1:`port` (a free one by default), pinned to `cpu` (a taskset list) if given.

    Returns once the peer's own readiness URL says it can route (bounded by `timeout`). Raises PeerError for
    a peer that is not installed or arguments it cannot run with, ChildFailed when it does not come up (with
    its last log lines). Its configuration and log (`peer.log`) are kept in `workdir` (a new temporary
    directory by default, which `stop_peer` removes).
    """
    if reason := unavailable_reason(name):
        raise PeerError(reason)
    owns_workdir = workdir is None
    workdir = workdir or Path(tempfile.mkdtemp(prefix=f"fleetroute-{name}-"))
    plan = plan_peer(name, policy, backends, model, port=port or free_port(), workdir=workdir, cpu=cpu)
    write_plan_files(plan, workdir)
    log_path = workdir / "peer.log"

    async def ready(child: Child) -> dict[str, str]:
        return await _poll(plan, child)

    try:
        child = await group.start_command(f"{name}:{policy}", plan.argv, ready, timeout=timeout,
                                          env={**os.environ, **plan.env}, cwd=workdir, log_path=log_path)
    except ChildFailed as exc:  # the child stays in the group for stop_all; its log stays for reading
        raise ChildFailed(f"{exc} (configuration and full log in {workdir})") from None
    return StartedPeer(name=name, policy=policy, version=peer_version(name), url=plan.url, child=child,
                       headers=dict(plan.client_headers), argv=plan.argv, workdir=workdir, log_path=log_path,
                       owns_workdir=owns_workdir)


async def stop_peer(group: ProcessGroup, peer: StartedPeer) -> None:
    """`group.stop(peer.child)`, then the temporary directory start_peer made, if it made one."""
    await group.stop(peer.child)
    if peer.owns_workdir and peer.workdir is not None:
        shutil.rmtree(peer.workdir, ignore_errors=True)
