"""Concurrent streams: how many slow streams one router process holds, and what each one costs.

    python -m loadtest.streams                       # 1,000 -> 12,000 streams, about 3 minutes
    python -m loadtest.streams --steps 200,400 --hold 2 --json out.json     # a smoke run

One `fleetroute router` process (its defaults: uvloop, `listen.maxConnections: auto`, access log on) in front
of the zero-latency fake backend (`loadtest/backend.py`: `--backends` processes of two ports = two endpoints
each) set to trickle one SSE
token per second per stream, as an engine does for a long generation under load. Streams are opened in
steps (`--steps`) and all held open; each step holds for `--hold` seconds, then measures:

- the router's RSS, and RSS per stream: (RSS now - RSS before the first stream) / streams held;
- its open file descriptors (`/proc/PID/fd`: one per client connection, one per engine connection);
- its CPU (utime+stime over the hold, in cores);
- event-loop lag, from its own `fleetroute_event_loop_lag_seconds` histogram (router/server/loop_lag.py), the
  samples of this hold only: p99 (bucket upper bound) and samples over 100 ms;
- what clients see: the longest gap between two tokens of any stream (ideally 1 s) and errors (a status
  other than 200, or a stream that ended).

The ramp stops at the first step with errors (the point where it stops, with the reason seen: a 503
`too_many_connections` is the router's own cap, `listen.maxConnections`), or after the last step.

The load generator is this process: one raw asyncio protocol per stream (uvloop when installed), so it
costs far less than the router per stream. Processes are pinned when the machine has two cores (unless
`--no-pin`): the router on core 0, the backend and this generator on core 1. The soft descriptor limit is
raised to the hard one first (children inherit it). Ephemeral ports: each stream takes two on loopback
(client -> router, router -> engine) of the 28,232 Linux gives by default (`net.ipv4.ip_local_port_range`),
so about 14,000 streams is the generator's own ceiling on one machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from loadtest.host import cpu_seconds, pin_tree
from loadtest.processes import ProcessGroup, listener_url
from loadtest.router_overhead import machine, start_backend

MODEL = "llama-3-8b"
LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, float("inf"))
BODY = b'{"model": "llama-3-8b", "stream": true, "messages": [{"role": "user", "content": "hello"}]}'


def request_bytes(host: str) -> bytes:
    return (b"POST /v1/chat/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (host.encode(), len(BODY), BODY))


@dataclass
class Tally:
    """What every stream reports, in one place (one event loop: no locks)."""

    open: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    max_gap: float = 0.0  # the longest wait between two tokens of one stream, since the last reset
    tokens: int = 0
    samples: list[str] = field(default_factory=list)  # the first error answers' bodies

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class StreamClient(asyncio.Protocol):
    """One streaming request held open: counts tokens (`data:` events) and the gaps between them."""

    def __init__(self, tally: Tally, request: bytes) -> None:
        self.tally, self.request = tally, request
        self.head = b""
        self.streaming = False
        self.last = 0.0
        self.closing = False
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.request)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        if not self.streaming:
            self.head += data
            end = self.head.find(b"\r\n\r\n")
            if end < 0:
                return
            status = self.head[9:12].decode(errors="replace")
            if status != "200":
                code = b"too_many_connections" if b"too_many_connections" in self.head else b""
                self.tally.error(f"http_{status}" + (f"_{code.decode()}" if code else ""))
                if len(self.tally.samples) < 5:
                    self.tally.samples.append(self.head[end + 4:end + 400].decode(errors="replace"))
                self.closing = True
                assert self.transport is not None
                self.transport.close()
                return
            self.streaming, self.last = True, now
            self.tally.open += 1
            data = self.head[end + 4:]
        events = data.count(b"data:")
        if events:
            self.tally.tokens += events
            self.tally.max_gap = max(self.tally.max_gap, now - self.last)
            self.last = now

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming:
            self.tally.open -= 1
        if not self.closing:
            self.tally.error("stream_ended" if self.streaming else "closed_before_answer")
        if not self.done.done():
            self.done.set_result(None)

    def close(self) -> None:
        self.closing = True
        if self.transport is not None:
            self.transport.close()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def lag_buckets(http: aiohttp.ClientSession, admin: str) -> list[float]:
    """The router's loop-lag histogram, cumulative counts per bucket of LAG_BUCKETS."""
    async with http.get(admin + "/metrics") as resp:
        text = await resp.text()
    counts = {}
    for line in text.splitlines():
        if line.startswith("fleetroute_event_loop_lag_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            counts[float(le)] = float(line.rsplit(" ", 1)[1])
    return [counts.get(b, 0.0) for b in LAG_BUCKETS]


def lag_summary(before: list[float], after: list[float]) -> dict[str, Any]:
    """p99 (the upper bound of its bucket), max (likewise) and samples over 100 ms, between two scrapes."""
    cumulative = [a - b for a, b in zip(after, before, strict=True)]
    total = cumulative[-1]
    if total <= 0:
        return {"samples": 0, "p99_s": None, "max_s": None, "over_100ms": 0}
    p99 = next(b for b, c in zip(LAG_BUCKETS, cumulative, strict=True) if c >= 0.99 * total)
    top = next(b for b, c in zip(LAG_BUCKETS, cumulative, strict=True) if c >= total)
    over = total - cumulative[LAG_BUCKETS.index(0.1)]
    return {"samples": int(total), "p99_s": p99, "max_s": top, "over_100ms": int(over)}


async def open_streams(count: int, host: str, port: int, tally: Tally, clients: list[StreamClient],
                       rate: float) -> None:
    """Open `count` more streams, at most `rate` new connections a second (a ramp, not a SYN flood)."""
    loop = asyncio.get_running_loop()
    request = request_bytes(host)
    batch = max(1, int(rate / 20))
    async def one() -> None:
        client = StreamClient(tally, request)
        try:
            await loop.create_connection(lambda: client, host, port)
        except OSError as exc:
            tally.error(f"connect_{exc.errno}")
            return
        clients.append(client)

    for start in range(0, count, batch):
        began = loop.time()
        await asyncio.gather(*(one() for _ in range(min(batch, count - start))))
        await asyncio.sleep(max(0.0, began + batch / rate - loop.time()))


async def run(args: argparse.Namespace) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the router and the backend inherit it
    two_cores = (os.cpu_count() or 1) >= 2 and args.pin
    if two_cores:
        os.sched_setaffinity(0, {1})
    backends, ports = [], []
    for _ in range(args.backends):  # several processes: one Python process accepting and feeding thousands of
        # streams is the first thing to give way (its accept queue overflows: connect timeouts at the router)
        backend, more = start_backend("1" if two_cores else None, chunks=100_000,
                                      interval_ms=args.token_interval * 1000)
        backends.append(backend)
        ports += more
    group = ProcessGroup()
    steps: list[dict[str, Any]] = []
    clients: list[StreamClient] = []
    tally = Tally()
    stopped = "the last step"
    try:
        config = {
            "listen": {"host": "127.0.0.1", "port": 0}, "admin": {"host": "127.0.0.1", "port": 0},
            "endpoints": [{"id": f"gpu-{i}", "url": f"http://127.0.0.1:{p}", "models": [MODEL]}
                          for i, p in enumerate(ports)],
            "policies": [{"name": "streams", "models": ["*"], "strategy": "least-connections"}],
            "redis": {"url": None},
        }
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "router.yaml"
            path.write_text(yaml.safe_dump(config))
            router = await group.start("router", ["router", "--config", str(path)], "router listening")
        pid = router.process.pid
        if two_cores:
            pin_tree(pid, {0})
        ingress, admin = (listener_url(router, name) for name in ("ingress", "admin"))
        host, port = ingress.removeprefix("http://").rsplit(":", 1)
        async with aiohttp.ClientSession() as http:
            async with http.post(ingress + "/v1/chat/completions", data=BODY.replace(b"true", b"false"),
                                 headers={"Content-Type": "application/json"}) as resp:
                assert resp.status == 200, resp.status  # warm: the engine connection pool, the first pick
                await resp.read()
            await asyncio.sleep(1.0)
            rss0, fds0 = rss_mib(pid), descriptors(pid)
            print(f"router pid {pid}: {rss0:.1f} MiB, {fds0} descriptors, max_connections "
                  f"{router.ready.get('max_connections')}, descriptor limit {router.ready.get('descriptor_limit')}",
                  file=sys.stderr, flush=True)
            began, started = time.monotonic(), time.time()
            for target in args.steps:
                if time.monotonic() - began > args.budget:
                    stopped = f"the time budget ({args.budget:g}s)"
                    break
                errors_before = sum(tally.errors.values())
                await open_streams(target - len(clients), host, int(port), tally, clients, args.open_rate)
                await asyncio.sleep(args.token_interval * 2)  # every new stream has its head and a token
                lag0 = await lag_buckets(http, admin)
                cpu0, wall0 = cpu_seconds(pid), time.monotonic()
                tally.max_gap, tokens0 = 0.0, tally.tokens
                await asyncio.sleep(args.hold)
                cpu = (cpu_seconds(pid) - cpu0) / (time.monotonic() - wall0)
                tokens = (tally.tokens - tokens0) / (time.monotonic() - wall0)
                lag = lag_summary(lag0, await lag_buckets(http, admin))
                rss, fds = rss_mib(pid), descriptors(pid)
                held = tally.open
                step = {"target": target, "streams": held, "rss_mib": round(rss, 1),
                        "rss_per_stream_kib": round((rss - rss0) * 1024 / held, 1) if held else None,
                        "descriptors": fds, "router_cpu_cores": round(cpu, 3),
                        "tokens_per_s": round(tokens), "max_token_gap_s": round(tally.max_gap, 3),
                        "loop_lag": lag, "errors": dict(tally.errors)}
                steps.append(step)
                print(json.dumps(step), file=sys.stderr, flush=True)
                if sum(tally.errors.values()) > errors_before:
                    stopped = f"errors at {target} streams: {dict(tally.errors)}"
                    break
        if tally.samples or tally.errors:
            print("router log tail:\n" + "\n".join(router.log_tail), file=sys.stderr, flush=True)
        return {"benchmark": "streams", "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
                "machine": {**machine(), "memory_gib": round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
                                                              / 2**30, 1)},
                "settings": {"token_interval_s": args.token_interval, "hold_s": args.hold,
                             "open_rate": args.open_rate, "endpoints": len(ports),
                             "backend_processes": args.backends, "pinned": two_cores,
                             "descriptor_limit": hard, "soft_limit_before": soft,
                             "router_max_connections": router.ready.get("max_connections")},
                "baseline": {"rss_mib": round(rss0, 1), "descriptors": fds0}, "steps": steps, "stopped": stopped,
                "error_samples": tally.samples}
    finally:
        for client in clients:
            client.close()
        await group.stop_all()
        for backend in backends:
            backend.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.streams", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=lambda s: [int(x) for x in s.split(",")],
                        default=[1000, 2000, 3000, 4000, 5000, 6000, 8000, 10000, 12000],
                        help="streams held at each step (default 1000,...,12000)")
    parser.add_argument("--hold", type=float, default=6.0, help="seconds measured at each step (default 6)")
    parser.add_argument("--token-interval", type=float, default=1.0, help="seconds between two tokens (default 1)")
    parser.add_argument("--open-rate", type=float, default=500.0, help="new connections a second (default 500)")
    parser.add_argument("--backends", type=int, default=3,
                        help="fake backend processes, two endpoints each (default 3)")
    parser.add_argument("--budget", type=float, default=180.0, help="no new step after this many seconds")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="leave the processes to the scheduler (on a machine shared with other jobs, pinning the "
                             "router to one core makes it share that core's queue only)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        result = asyncio.run(run(args))
    else:
        result = uvloop.run(run(args))
    text = json.dumps(result, indent=2)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def render_markdown(result: dict[str, Any]) -> str:
    """docs/benchmarks.md's table for one run."""
    m, s = result["machine"], result["settings"]
    lines = [f"Run {result['started_utc']} on {m.get('nproc')} cores ({m.get('cpu_model')}), "
             f"{m.get('memory_gib')} GiB, commit {m.get('commit')}, Python {m.get('python')}, "
             f"aiohttp {m.get('aiohttp')}, uvloop {m.get('uvloop')}; "
             f"descriptor limit {s['descriptor_limit']:,}, `maxConnections: auto` = "
             f"{s['router_max_connections']['ingress']:,}; {s['endpoints']} endpoints in "
             f"{s['backend_processes']} backend processes; one token every {s['token_interval_s']:g} s per stream. "
             f"Router baseline: {result['baseline']['rss_mib']} MiB, {result['baseline']['descriptors']} descriptors.",
             "",
             "| streams held | router RSS | RSS per stream | descriptors | router CPU (cores) | tokens/s | "
             "loop lag p99 (bucket) | lag samples > 100 ms | longest token gap | errors |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for step in result["steps"]:
        lag = step["loop_lag"]
        p99 = ("-" if lag["p99_s"] is None else "> 2.5 s" if lag["p99_s"] == float("inf")
               else f"≤ {lag['p99_s'] * 1000:g} ms")
        errors = ", ".join(f"{k} {v}" for k, v in step["errors"].items()) or "0"
        lines.append(f"| {step['streams']:,} | {step['rss_mib']} MiB | {step['rss_per_stream_kib']} KiB "
                     f"| {step['descriptors']:,} | {step['router_cpu_cores']} | {step['tokens_per_s']:,} | {p99} "
                     f"| {lag['over_100ms']} of {lag['samples']} | {step['max_token_gap_s']} s | {errors} |")
    lines += ["", f"Stopped: {result['stopped']}."]
    return "\n".join(lines) + "\n"


def write_plot(result: dict[str, Any], out_dir: Path) -> Path:
    """RSS and loop-lag p99 against streams held (PNG)."""
    from loadtest.plots import _pyplot

    plt = _pyplot()
    steps = result["steps"]
    x = [s["streams"] for s in steps]
    fig, left = plt.subplots(figsize=(7, 4.2))
    left.plot(x, [s["rss_mib"] for s in steps], "o-", color="tab:blue", label="router RSS (MiB)")
    left.set_xlabel("concurrent streams held by one router process")
    left.set_ylabel("RSS (MiB)", color="tab:blue")
    right = left.twinx()
    lag = [min(s["loop_lag"]["p99_s"] or 0.0, 2.5) * 1000 for s in steps]
    right.plot(x, lag, "s--", color="tab:red", label="loop lag p99 (ms, bucket bound)")
    right.set_ylabel("event-loop lag p99 (ms)", color="tab:red")
    right.axhline(100, color="tab:red", linewidth=0.5, linestyle=":")
    fig.suptitle("Concurrent slow streams through one router process")
    fig.tight_layout()
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "streams-rss-and-loop-lag.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
