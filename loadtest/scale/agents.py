"""Simulated worker agents: N endpoints' telemetry published to Redis every interval, from one process or a few.

    python -m loadtest.scale.agents --redis redis://127.0.0.1:PORT/0 --agents 1000 [--interval 1]
                                    [--part 0 --parts 1]

Each write is what a real agent writes: a full record (`inputs.agent_record`: NVML and engine fields, as
`worker.protocol.encode` lays them out) through the real publisher, `worker.publisher.RedisPublisher`
(MULTI: DEL, HSET, PEXPIRE 3 intervals, as `worker.agent` sets it; then PUBLISH on the updates channel).
Agent g of N publishes at phase g/N of every interval, so the writes are spread evenly over each second, as
independent agents' are. A process drives every `parts`-th agent over 8 pooled connections
(`--concurrency`): the router sees the same keys, channel and timing as from N agents; only Redis serves a
few clients instead of N. One publish costs this driver about 0.7 ms of CPU (redis-py packing a 25-field
HSET in a transaction), so 1,000 agents at 1 Hz take about 70% of a core: on a larger machine, split them
over a few processes (`--parts`).

Endpoint ids are `inputs.endpoint_ids(N)`, the ids the benchmark's routers are configured with. Prints
`READY` once each of its agents has published once, and `STATS {json}` (publishes, errors, how late they
were against their schedule) when stopped by SIGTERM or SIGINT or after `--duration` seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from loadtest.scale.inputs import agent_record, endpoint_ids
from worker.publisher import RedisPublisher


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


async def drive(redis_url: str, ids: list[str], *, interval: float, duration: float | None, seed: int,
                stop: asyncio.Event, on_ready: Callable[[], None] | None = None, concurrency: int = 8,
                phases: list[float] | None = None) -> dict[str, object]:
    """Publish for every agent on its schedule until `stop` (or `duration`): agent i at `phases[i]` (a
    fraction of the interval; default i/N) of every interval. `concurrency` publishes may be in flight at
    once (each on its own pooled connection), so one slow round trip does not delay the rest."""
    client = aioredis.from_url(redis_url, decode_responses=True)
    publisher = RedisPublisher(client, ttl=3 * interval)
    rng = random.Random(seed)
    loop = asyncio.get_running_loop()
    n = len(ids)
    phase = phases if phases is not None else [i / n for i in range(n)]
    seq = [0] * n
    lag: list[float] = []
    took: list[float] = []
    counts = {"published": 0, "errors": 0, "first_round": 0}
    start = loop.time() + 0.05

    async def worker(first: int) -> None:
        k = first  # the k-th publish overall: agent k % n in round k // n; this worker takes every concurrency-th
        while not stop.is_set():
            due = start + (k // n + phase[k % n]) * interval
            if duration is not None and due - start >= duration:
                return
            delay = due - loop.time()
            if delay > 0:
                try:
                    async with asyncio.timeout(delay):
                        await stop.wait()
                    return
                except TimeoutError:
                    pass
            i = k % n
            began = loop.time()
            lag.append(began - due)
            try:
                await publisher.publish(agent_record(ids[i], rng, reported_at=time.time(), seq=seq[i]))
                counts["published"] += 1
            except (RedisError, OSError):
                counts["errors"] += 1
            took.append(loop.time() - began)
            seq[i] += 1
            if k < n:
                counts["first_round"] += 1
                if counts["first_round"] == n and on_ready is not None:
                    on_ready()
            k += concurrency

    try:
        await asyncio.gather(*(worker(w) for w in range(min(concurrency, n))))
    finally:
        await client.aclose()
    elapsed = loop.time() - start
    ms = [x * 1000 for x in lag]
    return {
        "agents": n, "interval_s": interval, "published": counts["published"], "errors": counts["errors"],
        "elapsed_s": elapsed, "concurrency": concurrency,
        "rate_per_s": counts["published"] / elapsed if elapsed > 0 else 0.0,
        "late_p50_ms": _pct(ms, 50), "late_p99_ms": _pct(ms, 99), "late_max_ms": max(ms) if ms else None,
        "publish_p50_ms": _pct([x * 1000 for x in took], 50), "publish_p99_ms": _pct([x * 1000 for x in took], 99),
    }


async def _main(args: argparse.Namespace) -> dict[str, object]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # This process's share of the fleet: every parts-th agent, at its place in the fleet-wide schedule.
    mine = range(args.part, args.agents, args.parts)
    everyone = endpoint_ids(args.agents)
    return await drive(args.redis, [everyone[g] for g in mine], interval=args.interval, duration=args.duration,
                       seed=args.seed + args.part, stop=stop, on_ready=lambda: print("READY", flush=True),
                       concurrency=args.concurrency, phases=[g / args.agents for g in mine])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--redis", required=True, help="redis:// URL of the server to publish to")
    parser.add_argument("--agents", type=int, default=1000, help="simulated agents (endpoints), default 1000")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between two reports of one agent")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrency", type=int, default=8, help="publishes in flight at once (default 8)")
    parser.add_argument("--part", type=int, default=0,
                        help="with --parts K: this process drives agents part, part+K, ...")
    parser.add_argument("--parts", type=int, default=1, help="driver processes sharing the agents (default 1)")
    args = parser.parse_args(argv)
    if args.agents < 1 or args.interval <= 0:
        parser.error("--agents must be >= 1 and --interval > 0")
    if not 0 <= args.part < args.parts or args.parts > args.agents:
        parser.error("need 0 <= --part < --parts <= --agents")
    stats = asyncio.run(_main(args))
    print("STATS " + json.dumps(stats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
