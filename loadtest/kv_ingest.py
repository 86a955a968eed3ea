"""KV-event ingestion at fleet scale: what the router's subscriber costs at 10, 100 and 1,000 engines.

    python -m loadtest.kv_ingest --json docs/results/kv-ingest.json     # about 2 minutes
    python -m loadtest.kv_ingest --quick                                # a few seconds (the test runs this)
    python -m loadtest.publish                                          # the table in docs/benchmarks.md

The real path, on real sockets: one process runs the router's subscriber (router/routing/prefix/kv_events.py
`KVEvents`, one ZMQ SUB socket and task per engine, feeding `KVBlockIndex`) exactly as a router replica does;
other processes play the engines, each engine a socket on 127.0.0.1 sending what vLLM's `ZmqEventPublisher`
sends (three frames: topic, 8-byte sequence number, the msgpack `EventBatch` that the simulator's
worker/sim/kv_events.py `encode_events` writes: `BlockStored` runs with token ids and parent hash, one
`BlockRemoved` per evicted block, as the simulator and vLLM emit them). Engines bind (as vLLM does for a
wildcard endpoint) and the subscriber connects, so N engines need no port planning. The engine sockets are
XPUB rather than PUB only so a publisher can see the subscription arrive before it starts sending (PUB
would drop what it sent before); what goes out is the same.

The rate (per engine, `--tokens-per-s`, `--block-size`, `--step`): an engine computing 5,000 new KV tokens/s
(uncached prompt tokens plus generated ones: a Llama-3-8B H100 at moderate chat load, ~10 requests/s of
~1k-token prompts half served from its prefix cache, plus their output) fills 5,000 / 16 = ~312 blocks/s at
vLLM's GPU block size of 16. With its cache full (it is, minutes into serving) every new block evicts one:
~312 `BlockRemoved` too, so ~625 block events/s per engine, in one batch per engine step (25 steps/s: 40 ms
steps). 1,000 engines: 625k block events/s in 25k batches/s. Each engine's blocks are its own (distinct
token ids): the worst case for the index's memory, as no key is shared between engines. Hashes are 32-byte
bytes like vLLM's default sha256 (`--int-hashes`: the simulator's ints).

Measured in the ingesting process, from the moment every engine starts sending until the index has applied
all they sent (the drain): CPU seconds (getrusage: every thread, ZMQ's I/O thread included) over that wall
time, block events applied per second, CPU per block event, the lag from an engine's send time (the batch's
`ts`) to its application (sampled, 1 batch in 8), batches dropped or lost (sequence gaps, resyncs), and
memory: RSS growth per block held, and the index's own bytes per block under tracemalloc (a separate,
exact count). The run's engines hold `--cache-blocks` blocks each (the eviction steady state comes fast);
the total at 1,000 engines is then computed for full-size caches (`--engine-cache-blocks`, 27,250: the
simulator's H100 with Llama-3-8B, 436k tokens in 16-token blocks) from the measured bytes per block.

If the engines' processes cannot offer the full rate (they are Python too, on the same machine), the result
says what they did offer; CPU per block event is the figure that scales.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import resource
import sys
import time
import tracemalloc
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
import zmq

from loadtest.router_overhead import machine
from router.model import Endpoint
from router.routing.prefix.kv_block_index import KVBlockIndex
from router.routing.prefix.kv_events import KVEvents, KVEventSource, KVEventsSettings, decode_batch
from router.runtime.metrics import RouterMetrics
from worker.sim.kv_events import encode_events

LAG_SAMPLE = 8  # every 8th batch's send time is read for the lag (a partial decode: the events stay raw)
_TS = msgspec.msgpack.Decoder(tuple[float, msgspec.Raw, int])


@dataclass(frozen=True)
class Load:
    engines: int
    tokens_per_s: float = 5000.0  # new KV tokens computed per second per engine
    block_size: int = 16
    step: float = 0.04  # one batch per engine step
    cache_blocks: int = 1000  # blocks each engine holds before every new one evicts one (in this run)
    prompt_blocks: int = 64  # blocks per request's chain (a 1k-token prompt): a BlockStored run's parent
    duration: float = 10.0
    publishers: int = 2
    int_hashes: bool = False

    @property
    def blocks_per_s(self) -> float:
        return self.tokens_per_s / self.block_size


# ---- the engines ---------------------------------------------------------------------------------------


class EngineEvents:
    """One engine's KV events: chains of new blocks (requests' prompts), the oldest evicted once full."""

    def __init__(self, engine: int, load: Load) -> None:
        self.engine = engine
        self.load = load
        self.next = 0  # blocks created so far
        self.chain_left = 0
        self.parent: Any = None
        self.held: list[Any] = []  # FIFO of held hashes (eviction order)
        self.head = 0
        self.credit = 0.0
        self.stored = self.removed = 0

    def _hash(self, n: int) -> Any:
        if self.load.int_hashes:
            return (self.engine << 40) | n
        return self.engine.to_bytes(8, "big") + n.to_bytes(24, "big")

    def step(self) -> list[tuple[Any, ...]]:
        load = self.load
        self.credit += load.blocks_per_s * load.step
        count = int(self.credit)
        self.credit -= count
        events: list[tuple[Any, ...]] = []
        bs = load.block_size
        while count:
            if self.chain_left == 0:
                self.chain_left, self.parent = load.prompt_blocks, None
            run = min(count, self.chain_left)
            hashes = [self._hash(self.next + i) for i in range(run)]
            # Token ids unique to this engine and block: no two engines (or blocks) share a key.
            base = (self.engine * 1_000_003 + self.next) * bs
            tokens = [(base + i) % 2_000_000_000 for i in range(run * bs)]
            events.append(("stored", hashes, self.parent, tokens))
            self.held.extend(hashes)
            self.next += run
            self.stored += run
            self.parent = hashes[-1]
            self.chain_left -= run
            count -= run
        while len(self.held) - self.head > load.cache_blocks:
            events.append(("removed", [self.held[self.head]]))
            self.head += 1
            self.removed += 1
        if self.head > 4096:
            del self.held[:self.head]
            self.head = 0
        return events


def _publisher(engine_ids: list[int], load: Load, conn: Any) -> None:
    """A process playing `engine_ids`: bind, report the addresses, wait for every subscription, then send
    one batch per engine per step for `duration`."""
    ctx = zmq.Context()
    socks, addresses = [], []
    for _ in engine_ids:
        s = ctx.socket(zmq.XPUB)
        s.setsockopt(zmq.LINGER, 0)
        port = s.bind_to_random_port("tcp://127.0.0.1")
        socks.append(s)
        addresses.append(f"tcp://127.0.0.1:{port}")
    conn.send(addresses)
    poller = zmq.Poller()
    for s in socks:
        poller.register(s, zmq.POLLIN)
    waiting = set(range(len(socks)))
    deadline = time.monotonic() + 60
    while waiting and time.monotonic() < deadline:
        for s, _ in poller.poll(1000):
            s.recv()  # the subscription message (b"\x01" + topic)
            waiting.discard(socks.index(s))
    conn.send(len(waiting))
    start = conn.recv()  # the common start time (time.time())
    gens = [EngineEvents(e, load) for e in engine_ids]
    seqs = [0] * len(socks)
    batches = dropped = late_steps = steps = 0
    cpu0 = time.process_time()
    tick = start
    while tick < start + load.duration:
        now = time.time()
        if tick > now:
            time.sleep(tick - now)
        elif now - tick > load.step:
            late_steps += 1
        for i, (s, gen) in enumerate(zip(socks, gens, strict=True)):
            events = gen.step()
            if not events:
                continue
            payload = encode_events(events, load.block_size, time.time())
            try:
                s.send_multipart((b"", seqs[i].to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
                batches += 1
            except zmq.Again:
                dropped += 1  # numbered and lost, as the simulator's and vLLM's PUB do at the high-water mark
            seqs[i] += 1
        steps += 1
        tick += load.step
    cpu = time.process_time() - cpu0
    conn.send({"batches": batches, "dropped": dropped, "stored": sum(g.stored for g in gens),
               "removed": sum(g.removed for g in gens), "steps": steps, "late_steps": late_steps,
               "cpu_s": cpu, "sent_until": time.time()})
    conn.recv()  # keep the sockets open until the subscriber has drained
    for s in socks:
        s.close(linger=0)
    ctx.term()


# ---- the router's side ---------------------------------------------------------------------------------


class MeasuredKVEvents(KVEvents):
    """The router's subscriber, counting batches and sampling their lag; the work per batch is unchanged."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches = 0
        self.lags: list[float] = []

    async def _frames(self, source: KVEventSource, stream: Any, frames: list[bytes]) -> None:
        await super()._frames(source, stream, frames)
        self.batches += 1
        if self.batches % LAG_SAMPLE == 0 and len(frames) == 3:
            self.lags.append(time.time() - _TS.decode(frames[2])[0])


def _rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _counts(metrics: RouterMetrics) -> dict[str, float]:
    """The subscriber's own counters, summed over engines: events by type, resyncs by reason, rejections."""
    out: dict[str, float] = {}
    for family, label in ((metrics.kv_events, "type"), (metrics.kv_event_resyncs, "reason"),
                          (metrics.kv_events_rejected, None)):
        for metric in family.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels[label] if label else "rejected"
                    out[key] = out.get(key, 0.0) + sample.value
    return out


async def _ingest(addresses: list[str], load: Load, conn: Any) -> None:
    metrics = RouterMetrics()
    index = KVBlockIndex(max_blocks=max(64, load.cache_blocks * 2))
    sources = tuple(KVEventSource(f"engine-{i}", a) for i, a in enumerate(addresses))
    # Long warm-up and silence limits: nothing in this run should make an engine approximate.
    settings = KVEventsSettings(sources=sources, warmup=3600.0, silent_after=3600.0)
    events = MeasuredKVEvents(settings, index, metrics)
    events.reconcile({s.endpoint_id: Endpoint(s.endpoint_id, f"http://127.0.0.1:1/{s.endpoint_id}", ("m",))
                      for s in sources})
    loop = asyncio.get_running_loop()
    conn.send("subscribed")
    await loop.run_in_executor(None, conn.recv)  # go
    rss0, cpu0, t0 = _rss_bytes(), _cpu_s(), time.monotonic()
    expected = await loop.run_in_executor(None, conn.recv)  # the publishers' totals, once they stopped
    # A subscriber that cannot keep up would take minutes to drain: what it applied by then is the result.
    deadline = time.monotonic() + max(20.0, load.duration * 3)
    while events.batches < expected["batches"] and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # polling the count: the drain's end is what is measured, to 20 ms
    t1, cpu1 = time.monotonic(), _cpu_s()
    held = sum(index.size(s.endpoint_id) for s in sources)
    counts = _counts(metrics)
    lags = sorted(events.lags)
    conn.send({
        "wall_s": t1 - t0, "cpu_s": cpu1 - cpu0, "batches_applied": events.batches,
        "stored_applied": counts.get("stored", 0.0), "removed_applied": counts.get("removed", 0.0),
        "orphans": counts.get("orphan", 0.0), "evicted_by_cap": counts.get("evicted", 0.0),
        "resyncs": {k: v for k, v in counts.items() if k in ("gap", "restart", "rejected", "joined_mid_stream",
                                                                 "silent")},
        "precise_engines": sum(1 for s in sources if index.is_precise(s.endpoint_id)),
        "blocks_held": held, "rss_growth_bytes": _rss_bytes() - rss0,
        "lag_s": {"p50": lags[len(lags) // 2] if lags else None,
                  "p99": lags[min(len(lags) - 1, int(len(lags) * 0.99))] if lags else None,
                  "max": lags[-1] if lags else None, "samples": len(lags)},
    })
    await events.close()


def _ingester(addresses: list[str], load: Load, conn: Any) -> None:
    asyncio.run(_ingest(addresses, load, conn))


# ---- one size, and the whole benchmark -----------------------------------------------------------------


def run_size(load: Load) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    shares = [list(range(p, load.engines, load.publishers)) for p in range(min(load.publishers, load.engines))]
    pubs = []
    for share in shares:
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_publisher, args=(share, load, theirs), daemon=True)
        proc.start()
        pubs.append((proc, ours, share))
    addresses = [""] * load.engines
    for _, conn, share in pubs:
        for engine, address in zip(share, conn.recv(), strict=True):
            addresses[engine] = address
    ours, theirs = ctx.Pipe()
    ingester = ctx.Process(target=_ingester, args=(addresses, load, theirs), daemon=True)
    ingester.start()
    try:
        if ours.recv() != "subscribed":
            raise RuntimeError("the ingester did not start")
        unsubscribed = sum(conn.recv() for _, conn, _ in pubs)
        if unsubscribed:
            raise RuntimeError(f"{unsubscribed} engines never saw the subscriber connect")
        start = time.time() + 0.2
        ours.send("go")
        for _, conn, _ in pubs:
            conn.send(start)
        sent = [conn.recv() for _, conn, _ in pubs]
        totals = {k: sum(s[k] for s in sent) for k in ("batches", "dropped", "stored", "removed", "steps",
                                                       "late_steps", "cpu_s")}
        ours.send(totals)
        got = ours.recv()
    finally:
        for proc, conn, _ in pubs:
            if proc.is_alive():
                conn.send("done")
            proc.join(10)
        ingester.join(10)
    block_events = got["stored_applied"] + got["removed_applied"]
    sending = max(load.duration, max(s["sent_until"] for s in sent) - start)  # late publishers send for longer
    return {
        "engines": load.engines,
        "offered": {
            "target_block_events_per_s": 2 * load.blocks_per_s * load.engines,
            "sending_s": sending,
            "block_events_per_s": (totals["stored"] + totals["removed"]) / sending,
            "batches_per_s": totals["batches"] / sending,
            "batches": totals["batches"], "dropped_batches": totals["dropped"],
            "stored_blocks": totals["stored"], "removed_blocks": totals["removed"],
            "publisher_cpu_s": totals["cpu_s"],
            "late_step_share": totals["late_steps"] / max(1, totals["steps"]),
        },
        "ingest": {
            **got,
            "cpu_cores": got["cpu_s"] / got["wall_s"],
            "block_events_per_s": block_events / got["wall_s"],
            "applied_share": block_events / max(1, totals["stored"] + totals["removed"]),
            "cpu_us_per_block_event": 1e6 * got["cpu_s"] / max(1.0, block_events),
            "rss_bytes_per_block": got["rss_growth_bytes"] / max(1, got["blocks_held"]),
            "all_applied": (got["batches_applied"] == totals["batches"] and totals["dropped"] == 0
                            and got["stored_applied"] == totals["stored"]
                            and got["removed_applied"] == totals["removed"] and not got["orphans"]
                            and not any(got["resyncs"].values()) and got["precise_engines"] == load.engines),
        },
    }


def index_bytes_per_block(blocks: int = 50_000, block_size: int = 16, int_hashes: bool = False) -> float:
    """The index's own memory per block held (tracemalloc), through the real decode and apply."""
    load = Load(engines=1, tokens_per_s=block_size * 2000, block_size=block_size,
                cache_blocks=blocks, int_hashes=int_hashes, step=1.0)
    gen = EngineEvents(7, load)
    payloads = []
    while gen.stored < blocks:
        payloads.append(encode_events(gen.step(), block_size, 0.0))
    index = KVBlockIndex(max_blocks=blocks * 2)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for payload in payloads:
        index.apply("e", decode_batch(payload))
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    return (after - before) / index.size("e")


def run(sizes: list[int], base: Load, engine_cache_blocks: int) -> dict[str, Any]:
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    per_block = index_bytes_per_block(int_hashes=base.int_hashes)
    runs = []
    for n in sizes:
        load = Load(**{**asdict(base), "engines": n})
        print(f"kv-ingest: {n} engines, {load.duration:g} s ...", file=sys.stderr, flush=True)
        runs.append(run_size(load))
    biggest = max(sizes)
    return {
        "benchmark": "kv-ingest", "started_utc": started, "machine": machine(), "settings": asdict(base),
        "sizes": sizes, "runs": runs,
        "memory": {"index_bytes_per_block": per_block, "engine_cache_blocks": engine_cache_blocks,
                   "engines": biggest, "full_index_bytes": per_block * engine_cache_blocks * biggest},
    }


# ---- the table -----------------------------------------------------------------------------------------


def render_markdown(result: dict[str, Any]) -> str:
    s, m, mem = result["settings"], result["machine"], result["memory"]
    lines = [f"Run {result['started_utc']} on {m.get('nproc', '?')} cores ({m.get('cpu_model', '?')}), commit "
             f"{m.get('commit', '?')}; per engine {s['tokens_per_s']:,.0f} new KV tokens/s in "
             f"{s['block_size']}-token blocks ({s['tokens_per_s'] / s['block_size']:,.0f} stored and as many evicted "
             f"per second), one batch per {s['step'] * 1000:.0f} ms step, {s['duration']:g} s of sending; "
             f"{s['publishers']} engine processes. "
             "The router's subscriber (one ZMQ socket and task per engine) in a process of its own.",
             "",
             "| engines | block events/s offered (target) | applied/s | ingest CPU (cores) | CPU per block event "
             "| lag p50 / p99 | drain after the last send | dropped / resyncs | applied of sent |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        o, i = r["offered"], r["ingest"]
        lag = i["lag_s"]
        lag_text = (f"{lag['p50'] * 1000:,.1f} / {lag['p99'] * 1000:,.1f} ms" if lag["p50"] is not None else "-")
        drain = i["wall_s"] - o["sending_s"] - 0.2
        applied = "all" if i["all_applied"] else f"{i['applied_share']:.0%} (still draining)"
        lines.append(
            f"| {r['engines']:,} | {o['block_events_per_s']:,.0f} ({o['target_block_events_per_s']:,.0f}) "
            f"| {i['block_events_per_s']:,.0f} | {i['cpu_cores']:.2f} | {i['cpu_us_per_block_event']:.1f} us "
            f"| {lag_text} | {max(0.0, drain):,.1f} s | {o['dropped_batches']:,} / {sum(i['resyncs'].values()):,.0f} "
            f"| {applied} |")
    biggest = result["runs"][-1]
    # The cost per event from the largest run the subscriber kept up with (a saturated run's CPU per event
    # also counts the time it lost to the engines' processes on the same cores).
    kept = [r for r in result["runs"] if r["ingest"]["all_applied"]] or result["runs"]
    ref = kept[-1]
    us = ref["ingest"]["cpu_us_per_block_event"]
    per_engine = 2 * s["tokens_per_s"] / s["block_size"]
    lines += ["", f"Index memory: {mem['index_bytes_per_block']:,.0f} bytes per block held (tracemalloc, through the "
              f"real decode and apply), so {mem['engines']:,} engines with full caches of "
              f"{mem['engine_cache_blocks']:,} blocks each hold {mem['full_index_bytes'] / 2**30:,.1f} GiB; RSS "
              f"grew {biggest['ingest']['rss_bytes_per_block']:,.0f} bytes per block held in the "
              f"{biggest['engines']:,}-engine run ({biggest['ingest']['blocks_held']:,} blocks).",
              "", f"CPU: {us:.1f} us per block event at {ref['engines']:,} engines (the largest run that kept up), so "
              f"one core applies ~{1e6 / us:,.0f} block events/s, ~{1e6 / us / per_engine:,.0f} engines at this "
              f"rate; {biggest['engines']:,} engines at the full rate ({biggest['engines'] * per_engine:,.0f} block "
              f"events/s) need ~{biggest['engines'] * per_engine * us / 1e6:,.1f} cores."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loadtest.kv_ingest", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="10,100,1000", help="engine counts, comma-separated")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of sending per size")
    p.add_argument("--tokens-per-s", type=float, default=5000.0, help="new KV tokens per second per engine")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--step", type=float, default=0.04, help="seconds per engine step (one batch each)")
    p.add_argument("--cache-blocks", type=int, default=1000, help="blocks each engine holds in the run")
    p.add_argument("--engine-cache-blocks", type=int, default=27250,
                   help="blocks of a full engine cache, for the memory total")
    p.add_argument("--publishers", type=int, default=2, help="processes playing the engines")
    p.add_argument("--int-hashes", action="store_true", help="int block hashes (the simulator's) not 32-byte")
    p.add_argument("--quick", action="store_true", help="a tiny run: 3 engines, 1 s, a low rate")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the result here")
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.duration, args.tokens_per_s, args.cache_blocks = "3", 1.0, 800.0, 40
        args.engine_cache_blocks, args.publishers = 1000, 1
    try:
        sizes = sorted({int(n) for n in args.sizes.split(",")})
    except ValueError:
        p.error(f"--sizes: engine counts like 10,100,1000, got {args.sizes!r}")
    if not sizes or min(sizes) < 1 or args.duration <= 0 or args.tokens_per_s <= 0 or args.step <= 0 \
            or args.block_size < 1 or args.cache_blocks < 1 or args.publishers < 1:
        p.error("sizes, duration, rate, step, block size, cache and publishers must be positive")
    base = Load(engines=sizes[0], tokens_per_s=args.tokens_per_s, block_size=args.block_size, step=args.step,
                cache_blocks=args.cache_blocks, duration=args.duration, publishers=args.publishers,
                int_hashes=args.int_hashes)
    result = run(sizes, base, args.engine_cache_blocks)
    text = json.dumps(result, indent=2) + "\n"
    if args.json:
        args.json.write_text(text)
    print(render_markdown(result))
    for r in result["runs"]:
        if not r["ingest"]["all_applied"]:
            print(f"{r['engines']} engines: not every event was applied (see the JSON)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
