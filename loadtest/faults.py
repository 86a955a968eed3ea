"""Fault-matrix soak: one fault at a time under steady mixed load, and what each one cost the clients.

    python -m loadtest.faults                         # every fault, about 2.5 minutes
    python -m loadtest.faults --faults kill,hang --hold 3 --settle 3 --rate 8      # a smoke run

A fleet of three `fleetroute sim --fault-injection` replicas (H100 profile, time-scale 4), the third one
reached through a fault-injecting TCP proxy (loadtest/faultproxy.py), behind two `fleetroute router`
processes sharing a Redis (loadtest/redis_server.py), as two router replicas behind a Service. An open-loop
client sends `--rate` requests a second, half of them streamed, to the live routers in turn. After a warm-up,
each fault of `--faults` is injected for `--hold` seconds, cleared, and followed by `--settle` seconds:

    netem    the path to sim-2 gets 100 ms of delay per piece of data and 5% "loss" (a 1 s retransmission
             pause; loadtest/faultproxy.py says why loss is modelled as latency)
    kill     sim-0 is SIGKILLed, and restarted on its port when the hold ends
    hang     sim-1 is SIGSTOPped (a wedged process: the kernel still accepts connections), SIGCONT at the end
    5xx      sim-2 answers every inference request 500
    redis    Redis is SIGKILLed, and restarted (empty) when the hold ends
    kube     the Kubernetes API server goes away (connections refused, watches cut) and comes back: with this
             fault the routers discover the replicas from EndpointSlices served by tests/fake_kube.py (the
             fake API server the tests use, in this process) instead of a static list
    sigterm  router-a gets SIGTERM under load; the client stops sending it new requests at that moment (as
             the Service's endpoints drop a terminating pod), and it is started again once it has exited

For each fault, over the requests sent from its injection to the end of its settle period:
- **lost**: failed with nothing delivered to the client (a non-streamed request that failed, a stream that
  failed before its first token). A router that retries correctly loses none of these.
- **cut mid-stream**: streams that ended with an error after tokens were delivered (never retryable);
- **slow**: took over `--slow` seconds (default 10);
- **recovered after**: seconds from clearing the fault until the faulted part serves again (the faulted
  replica answers a client's request, Redis answers, both routers watch the API server again, the
  restarted router answers), watched in the
  background while the next faults go on (an ejected replica sits out its ejection time, 30 s at first).

Faults go to different replicas in turn, so each starts from a healthy one.

The routers run with the soak's settings (health checks every 1 s, `firstByte` 5 s, `idle` 3 s, 3 attempts);
everything else at its defaults. Every process is stopped by its PID in `finally`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import yaml

from loadtest.faultproxy import FaultProxy
from loadtest.host import free_port
from loadtest.processes import Child, ProcessGroup
from loadtest.redis_server import RedisServer
from loadtest.router_overhead import machine
from loadtest.soak import rss_mib, start_sim

FAULTS = ("netem", "kill", "hang", "5xx", "redis", "kube", "sigterm")
NAMESPACE, SERVICE = "inference", "sims"
MODEL = "llama-3-8b"


@dataclass
class Outcome:
    sent: float  # seconds since the run's start
    stream: bool
    router: str
    ended: float = 0.0
    status: int = 0
    endpoint: str = ""
    started: bool = False  # a stream delivered a token (or a non-streamed answer arrived)
    error: str | None = None


@dataclass
class Window:
    fault: str
    injected: float
    cleared: float = 0.0
    end: float = 0.0
    recovered: float | None = None  # seconds after `cleared`
    note: str = ""


@dataclass
class Fleet:
    group: ProcessGroup
    sims: dict[str, Child]
    ports: dict[str, int]
    proxy: FaultProxy
    redis: RedisServer
    routers: dict[str, Child] = field(default_factory=dict)
    router_ports: dict[str, int] = field(default_factory=dict)
    live: list[str] = field(default_factory=list)  # routers the "Service" sends new requests to
    kube: Any = None  # tests.fake_kube.FakeKube, with the `kube` fault
    kube_mark: int = 0  # its request log's length when it came back
    config_path: Path | None = None
    seed: int = 1

    def url(self, router: str) -> str:
        return f"http://127.0.0.1:{self.router_ports[router]}"


async def send(http: aiohttp.ClientSession, fleet: Fleet, outcome: Outcome, t0: float, timeout: float) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 16,
            "stream": outcome.stream}
    try:
        async with asyncio.timeout(timeout), http.post(fleet.url(outcome.router) + "/v1/chat/completions",
                                                       data=orjson.dumps(body),
                                                       headers={"Content-Type": "application/json"}) as resp:
            outcome.status = resp.status
            outcome.endpoint = resp.headers.get("x-fleetroute-endpoint", "")
            if resp.status != 200:
                await resp.read()
                outcome.error = f"http_{resp.status}"
            elif not outcome.stream:
                answer = await resp.json()
                outcome.started = bool(answer.get("choices"))
                outcome.error = None if outcome.started else "empty_answer"
            else:
                done, buffer = False, b""
                async for chunk in resp.content.iter_any():
                    buffer += chunk
                    while b"\n\n" in buffer:
                        raw, buffer = buffer.split(b"\n\n", 1)
                        data = raw.removeprefix(b"data: ")
                        if data == b"[DONE]":
                            done = True
                        elif data.startswith(b"{"):
                            event = orjson.loads(data)
                            if "error" in event:  # the router ended a broken stream with an error event
                                outcome.error = "stream_error"
                            elif any((c.get("delta") or {}).get("content") for c in event.get("choices") or ()):
                                outcome.started = True  # a token reached the client
                if outcome.error is None and not done:
                    outcome.error = "truncated"
    except TimeoutError:
        outcome.error = "timeout"
    except aiohttp.ClientConnectorError:
        outcome.error = "connect"
    except aiohttp.ClientError as exc:
        outcome.error = type(exc).__name__
    outcome.ended = time.monotonic() - t0


async def load(fleet: Fleet, rate: float, stop: asyncio.Event, t0: float, outcomes: list[Outcome],
               timeout: float) -> None:
    """Open loop: `rate` requests a second until `stop`, half streamed, to the live routers in turn."""
    loop = asyncio.get_running_loop()
    tasks: list[asyncio.Task[None]] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as http:
        for i in range(1_000_000):  # bounded: `stop` comes first
            await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
            if stop.is_set():
                break
            router = fleet.live[i % len(fleet.live)]
            outcome = Outcome(sent=time.monotonic() - t0, stream=i % 2 == 0, router=router)
            outcomes.append(outcome)
            tasks.append(loop.create_task(send(http, fleet, outcome, t0, timeout)))
        await asyncio.gather(*tasks)


async def start_router(fleet: Fleet, name: str) -> Child:
    assert fleet.config_path is not None
    path = fleet.config_path.with_name(f"{name}.yaml")
    config = yaml.safe_load(fleet.config_path.read_text())
    config["listen"]["port"] = fleet.router_ports[name]
    path.write_text(yaml.safe_dump(config))
    return await fleet.group.start(name, ["router", "--config", str(path)], "router listening", timeout=60)


async def until(check: Callable[[], Awaitable[bool]], limit: float, stop: asyncio.Event) -> float | None:
    """Seconds until `check()` holds, polled every 100 ms; None past `limit` or once `stop` is set."""
    began = time.monotonic()
    while time.monotonic() - began < limit and not stop.is_set():
        if await check():
            return time.monotonic() - began
        await asyncio.sleep(0.1)
    return None


async def answers(http: aiohttp.ClientSession, url: str) -> bool:
    try:
        async with asyncio.timeout(1), http.get(url) as resp:
            return resp.status == 200
    except (TimeoutError, aiohttp.ClientError):
        return False


async def served_by(outcomes: list[Outcome], endpoint: str, after: float) -> bool:
    return any(o.endpoint == endpoint and o.error is None and o.sent >= after for o in outcomes)


TARGETS = {"kill": "sim-0", "hang": "sim-1", "5xx": "sim-2", "netem": "sim-2"}  # each replica healthy again first


async def inject(fault: str, fleet: Fleet, window: Window, hold: float, t0: float, http: aiohttp.ClientSession,
                 time_scale: float) -> None:
    """Inject `fault`, hold it, and clear it."""
    target = TARGETS.get(fault, "")
    sim = fleet.sims.get(target)
    if fault == "kill":
        os.kill(sim.process.pid, signal.SIGKILL)
        await fleet.group.stop(sim, grace=0.1)  # reaped (already dead: no SIGTERM reaches it first)
        await asyncio.sleep(hold)
        fleet.sims[target] = await start_sim(fleet.group, target, fleet.ports[target], fleet.seed, time_scale)
    elif fault == "hang":
        os.kill(sim.process.pid, signal.SIGSTOP)
        await asyncio.sleep(hold)
        os.kill(sim.process.pid, signal.SIGCONT)
    elif fault == "5xx":
        async with http.post(f"http://127.0.0.1:{fleet.ports[target]}/sim/faults", json={"error_rate": 1.0}):
            pass
        await asyncio.sleep(hold)
        async with http.delete(f"http://127.0.0.1:{fleet.ports[target]}/sim/faults"):
            pass
    elif fault == "redis":
        fleet.redis.kill()
        await asyncio.sleep(hold)
        await asyncio.to_thread(fleet.redis.start)
    elif fault == "netem":
        fleet.proxy.delay, fleet.proxy.loss = 0.1, 0.05
        await asyncio.sleep(hold)
        fleet.proxy.delay = fleet.proxy.loss = 0.0
    elif fault == "kube":
        await fleet.kube.stop()  # watches cut, connections refused
        await asyncio.sleep(hold)
        window.note = f"watch requests before the outage: {sum(r.watch for r in fleet.kube.requests)}"
        fleet.kube_mark = len(fleet.kube.requests)
        await fleet.kube.start()  # the same port
    elif fault == "sigterm":
        old = fleet.routers["router-a"]
        fleet.live.remove("router-a")  # the Service stops sending it new requests
        os.kill(old.process.pid, signal.SIGTERM)
        began = time.monotonic()
        await old.process.wait()  # its drain: in-flight requests finish first
        window.note = f"router-a drained and exited in {time.monotonic() - began:.1f}s"
        await fleet.group.stop(old, grace=1)
        fleet.routers["router-a"] = await start_router(fleet, "router-a")
        fleet.live.append("router-a")
    window.cleared = time.monotonic() - t0


async def watch_recovery(fault: str, fleet: Fleet, window: Window, outcomes: list[Outcome],
                         http: aiohttp.ClientSession, stop: asyncio.Event) -> None:
    """Time from clearing `fault` until the faulted part serves again (into `window`), in the background: an
    ejected replica may take its ejection time (30 s) to come back, while the next fault goes on."""
    check: Callable[[], Awaitable[bool]]
    if fault in TARGETS:
        check = lambda: served_by(outcomes, TARGETS[fault], window.cleared)  # noqa: E731
    elif fault == "redis":
        check = lambda: asyncio.to_thread(redis_answers, fleet.redis.port)  # noqa: E731
    elif fault == "kube":
        check = lambda: kube_watched_again(fleet)  # noqa: E731
    else:
        check = lambda: answers(http, fleet.url("router-a") + "/v1/models")  # noqa: E731
    window.recovered = await until(check, 120.0, stop)


async def kube_watched_again(fleet: Fleet) -> bool:
    """Both routers have opened a new EndpointSlice watch since the API server came back."""
    return sum(r.watch for r in fleet.kube.requests[fleet.kube_mark:]) >= len(fleet.routers)


async def start_kube(fleet: Fleet, urls: dict[str, int], directory: Path) -> dict[str, Any]:
    """The fake API server with one Pod and one EndpointSlice per replica; the routers' discovery config."""
    from tests.fake_kube import FakeKube, endpoint_slice, pod, slice_endpoint  # a test helper, run from the repo

    fleet.kube = kube = await FakeKube().start()
    for rid, port in urls.items():
        kube.create("pods", pod(rid, annotations={"fleetroute.io/models": MODEL}), namespace=NAMESPACE)
        kube.create("endpointslices", endpoint_slice(f"{SERVICE}-{rid}", service=SERVICE, port=port,
                                                     endpoints=[slice_endpoint(rid, namespace=NAMESPACE)]),
                    namespace=NAMESPACE)
    kubeconfig = kube.write_kubeconfig(directory / "kubeconfig", namespace=NAMESPACE)
    return {"kubernetes": {"service": SERVICE, "kubeconfig": str(kubeconfig), "initialBackoff": "100ms",
                           "maxBackoff": "1s"}}


def redis_answers(port: int) -> bool:
    import redis

    try:
        return bool(redis.Redis(port=port, socket_timeout=0.5).ping())
    except redis.RedisError:
        return False


def tally(window: Window, outcomes: list[Outcome], slow: float) -> dict[str, Any]:
    inside = [o for o in outcomes if window.injected <= o.sent < window.end]
    failed = [o for o in inside if o.error is not None]
    lost = [o for o in failed if not o.started]
    return {
        "fault": window.fault, "injected_s": round(window.injected, 1), "cleared_s": round(window.cleared, 1),
        "requests": len(inside), "streams": sum(o.stream for o in inside),
        "lost": len(lost), "lost_non_streaming": sum(not o.stream for o in lost),
        "cut_mid_stream": len(failed) - len(lost), "slow": sum(o.ended - o.sent > slow for o in inside),
        "errors": {e: sum(o.error == e for o in failed) for e in sorted({o.error for o in failed if o.error})},
        "recovered_after_s": None if window.recovered is None else round(window.recovered, 1),
        "note": window.note,
        # Each failure: when it was sent and ended (seconds since the start), where, and what the client saw.
        "failures": [{"sent_s": round(o.sent, 2), "ended_s": round(o.ended, 2), "stream": o.stream,
                      "router": o.router, "endpoint": o.endpoint, "error": o.error} for o in failed],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    group = ProcessGroup()
    tmp = tempfile.TemporaryDirectory()
    redis = RedisServer(Path(tmp.name) / "redis")
    proxy: FaultProxy | None = None
    fleet: Fleet | None = None
    try:
        await asyncio.to_thread(redis.start)
        ports = {f"sim-{i}": free_port() for i in range(3)}
        sims = {rid: await start_sim(group, rid, port, args.seed + i, args.time_scale)
                for i, (rid, port) in enumerate(ports.items())}
        proxy = await FaultProxy.start(ports["sim-2"])
        fleet = Fleet(group, sims, ports, proxy, redis, seed=args.seed)
        urls = {"sim-0": ports["sim-0"], "sim-1": ports["sim-1"], "sim-2": proxy.port}
        config: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0}, "admin": {"host": "127.0.0.1", "port": 0},
            "policies": [{"name": "faults", "models": ["*"], "strategy": "least-connections",
                          "health": {"interval": "1s", "timeout": "500ms"},
                          "timeouts": {"firstByte": "5s", "idle": "3s"}, "retries": {"attempts": 3}}],
            "telemetry": {"interval": "500ms"}, "redis": {"url": redis.url},
            "logging": {"accessLog": False}, "shutdownGrace": 10,
        }
        if "kube" in args.faults:
            config["discovery"] = await start_kube(fleet, urls, Path(tmp.name))
        else:
            config["endpoints"] = [{"id": rid, "url": f"http://127.0.0.1:{port}", "models": [MODEL]}
                                   for rid, port in urls.items()]
        fleet.config_path = Path(tmp.name) / "router.yaml"
        fleet.config_path.write_text(yaml.safe_dump(config))
        for name in ("router-a", "router-b"):
            fleet.router_ports[name] = free_port()
            fleet.routers[name] = await start_router(fleet, name)
            fleet.live.append(name)
        rss_start = {name: round(rss_mib(r.process.pid), 1) for name, r in fleet.routers.items()}
        outcomes: list[Outcome] = []
        t0, started = time.monotonic(), time.time()
        stop = asyncio.Event()
        traffic = asyncio.create_task(load(fleet, args.rate, stop, t0, outcomes, args.timeout))
        windows: list[Window] = []
        watches: list[asyncio.Task[None]] = []
        async with aiohttp.ClientSession() as http:
            await asyncio.sleep(args.warmup)
            for fault in args.faults:
                window = Window(fault, injected=time.monotonic() - t0)
                print(f"{window.injected:6.1f}s  {fault}", file=sys.stderr, flush=True)
                await inject(fault, fleet, window, args.hold, t0, http, args.time_scale)
                watches.append(asyncio.create_task(watch_recovery(fault, fleet, window, outcomes, http, stop)))
                await asyncio.sleep(max(0.0, t0 + window.cleared + args.settle - time.monotonic()))
                window.end = time.monotonic() - t0
                windows.append(window)
            # The last windows' recoveries, for at most `--tail` more seconds of load.
            await asyncio.wait(watches, timeout=args.tail)
            stop.set()
            await asyncio.gather(*watches)
            await traffic
        baseline = [o for o in outcomes if o.sent < args.warmup]
        rows = [tally(w, outcomes, args.slow) for w in windows]
        return {
            "benchmark": "faults", "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
            "machine": machine(),
            "settings": {"rate": args.rate, "hold_s": args.hold, "settle_s": args.settle, "warmup_s": args.warmup,
                         "slow_s": args.slow, "time_scale": args.time_scale, "replicas": 3, "routers": 2,
                         "router_config": config},
            "requests": len(outcomes), "failed": sum(o.error is not None for o in outcomes),
            "lost": sum(o.error is not None and not o.started for o in outcomes),
            "baseline": {"requests": len(baseline), "failed": sum(o.error is not None for o in baseline)},
            "faults": rows,
            "router_rss_mib": {"start": rss_start,
                               "end": {n: round(rss_mib(r.process.pid), 1) for n, r in fleet.routers.items()}},
        }
    finally:
        await group.stop_all()
        if proxy is not None:
            await proxy.close()
        if fleet is not None and fleet.kube is not None:
            await fleet.kube.stop()
        redis.kill()
        tmp.cleanup()


def table(result: dict[str, Any]) -> str:
    """The markdown table docs/benchmarks.md shows."""
    lines = ["| fault | requests (streams) | lost before any token | cut mid-stream | slow | recovered after | "
             "errors seen |", "|---|---|---|---|---|---|---|"]
    for row in result["faults"]:
        errors = ", ".join(f"{k} {v}" for k, v in row["errors"].items()) or "none"
        recovered = "-" if row["recovered_after_s"] is None else f"{row['recovered_after_s']} s"
        lines.append(f"| {row['fault']} | {row['requests']} ({row['streams']}) | **{row['lost']}** "
                     f"| {row['cut_mid_stream']} | {row['slow']} | {recovered} | {errors} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.faults", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--faults", type=lambda s: s.split(","), default=list(FAULTS),
                        help=f"comma-separated, in order (default {','.join(FAULTS)})")
    parser.add_argument("--rate", type=float, default=12.0, help="requests a second (default 12)")
    parser.add_argument("--hold", type=float, default=6.0, help="seconds each fault lasts (default 6)")
    parser.add_argument("--settle", type=float, default=6.0, help="seconds after clearing a fault (default 6)")
    parser.add_argument("--warmup", type=float, default=4.0, help="seconds before the first fault (default 4)")
    parser.add_argument("--tail", type=float, default=20.0,
                        help="at most this many more seconds of load for the last recoveries (default 20)")
    parser.add_argument("--slow", type=float, default=10.0, help="a request over this many seconds is slow")
    parser.add_argument("--timeout", type=float, default=60.0, help="client timeout per request (default 60)")
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    unknown = set(args.faults) - set(FAULTS)
    if unknown:
        parser.error(f"unknown faults {sorted(unknown)}; known: {','.join(FAULTS)}")
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    print(table(result), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
