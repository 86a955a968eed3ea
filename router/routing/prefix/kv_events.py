"""KV-cache events: one ZMQ subscription per engine, decoded into the precise prefix index.

The wire (vLLM `vllm/distributed/kv_events.py`, `ZmqEventPublisher`; the simulator publishes the same): each
message is three frames, (topic, sequence number as 8 bytes big-endian, msgpack payload). The payload is an
`EventBatch`, a msgspec struct encoded as an array `[ts, events, data_parallel_rank]`; each event is a tagged
struct encoded as a map with `"type"`: `BlockStored` (block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, extra_keys, ...), `BlockRemoved` (block_hashes, medium, ...) or
`AllBlocksCleared`. Older vLLM encoded events as arrays with the tag first; both are read. Hashes are bytes
(sha256) or ints (Python's hash; the simulator). Only blocks on the GPU (`medium` GPU or unset) are indexed:
an offloaded copy is not a prefix-cache hit without a transfer.

Where it runs, and why here: in each router replica, one SUB socket per engine. A ZMQ PUB socket fans out to
any number of subscribers, so n replicas cost the engine n copies of a few KB/s, and each replica's index is
exact without a shared store (sharing it through Redis, as the approximate index is, would add a hop and a
staleness the events exist to remove). The cost is CPU per replica: an engine prefilling 5k tokens/s in
16-token blocks stores ~300 blocks/s and evicts as many, ~600 block events/s; decoding and indexing
measured ~9 us per block event (docs/benchmarks.md, "KV-event ingestion at 1,000 engines"), so 100 engines
take ~0.45 of a core per replica, one core ~180 engines, and 1,000 engines (600k block events/s) ~5.6 cores:
past ~150 engines per replica this belongs in a component of its own (an indexer sharded by engine, as
llm-d's kv-cache-manager), which this module's index could become.

Sequence numbers (per engine, from 0 at the engine's start):
    next expected          applied
    lower than expected    the engine restarted: its blocks are cleared, then the batch applied
    a gap                  replayed from the engine's replay endpoint when one is configured (vLLM's ROUTER
                           socket: send (b"", start seq), receive (b"", topic, seq, payload) up to seq -1);
                           otherwise, or if the replay does not cover the gap, a resync: the engine's blocks
                           are dropped and it counts as approximate until `warmup` has passed, so that the
                           blocks it still holds from before are learnt or evicted.
An engine first heard at sequence 0 is precise at once (its cache is empty); one first heard mid-stream warms
up like a resync. An engine silent for `silentAfter` counts as approximate (its publisher may be gone) until
it speaks again.

Untrusted input (anyone who can reach the socket): frames are size-checked before decoding, a batch that does
not decode into the shapes above is counted in `fleetroute_kv_events_rejected_total` and skipped (and counts
as a gap, since what it said is unknown).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec
import zmq
import zmq.asyncio

from router.config.fields import ConfigError, Fields
from router.model import Endpoint
from router.routing.prefix.kv_block_index import DEFAULT_MAX_BLOCKS, KVBlockIndex
from router.runtime.background import contained
from router.runtime.metrics import RouterMetrics

log = logging.getLogger("fleetroute.kv_events")

MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
END_SEQ = -1
GPU_MEDIA = (None, "GPU")


# ---- settings -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVEventSource:
    endpoint_id: str
    address: str  # a ZMQ address: tcp://host:port, ipc://path
    bind: bool = False  # bind instead of connect (vLLM connects when its endpoint is not a wildcard)
    replay: str | None = None  # the engine's replay (ROUTER) address, if any


@dataclass(frozen=True)
class KVEventsSettings:
    sources: tuple[KVEventSource, ...] = ()
    port: int | None = None  # for endpoints not listed: tcp://<endpoint host>:port
    topic: str = ""  # subscription prefix ("" takes every topic)
    max_blocks: int = DEFAULT_MAX_BLOCKS
    warmup: float = 30.0
    silent_after: float = 60.0
    replay_timeout: float = 1.0
    tokenizer: str | None = None  # a tokenizer.json (the `tokenizers` library): text prompts match exactly


def parse_kv_events(f: Fields) -> KVEventsSettings:
    d = KVEventsSettings()
    sources: list[KVEventSource] = []
    for path, raw in f.items("endpoints"):
        s = Fields(raw, path)
        address = s.string("address")
        if not address.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(s.at("address"), f"must be a ZMQ address (tcp://, ipc://), got {address!r}")
        replay = s.get("replay")
        if replay is not None and not (isinstance(replay, str) and replay.startswith(("tcp://", "ipc://"))):
            raise ConfigError(s.at("replay"), f"must be a ZMQ address (tcp://, ipc://), got {replay!r}")
        sources.append(KVEventSource(endpoint_id=s.string("endpoint"), address=address,
                                     bind=s.boolean("bind", False), replay=replay))
        s.done()
    port = f.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise ConfigError(f.at("port"), f"must be a port number, got {port!r}")
    tokenizer = f.get("tokenizer")
    if tokenizer is not None and not isinstance(tokenizer, str):
        raise ConfigError(f.at("tokenizer"), f"must be the path of a tokenizer.json, got {tokenizer!r}")
    settings = KVEventsSettings(
        sources=tuple(sources), port=port, topic=str(f.get("topic", "")),
        max_blocks=f.integer("maxBlocksPerEndpoint", d.max_blocks, minimum=64, maximum=10_000_000),
        warmup=f.duration("warmup", d.warmup), silent_after=f.duration("silentAfter", d.silent_after),
        replay_timeout=f.duration("replayTimeout", d.replay_timeout), tokenizer=tokenizer,
    )
    f.done()
    return settings


def load_tokenizer(path: str | None) -> Callable[[str], list[int]] | None:
    """A text -> token ids function from a tokenizer.json, when the `tokenizers` library is installed (it
    comes with vLLM and transformers); None (the approximate index for text) otherwise, with a warning."""
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer  # optional: not a dependency of the router
    except ImportError:
        log.warning("kvEvents.tokenizer is set but the tokenizers library is not installed: text prompts use "
                    "the approximate prefix index", extra={"tokenizer": path})
        return None
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:  # whatever the library raises for a missing or malformed file
        raise ConfigError("kvEvents.tokenizer", f"cannot load {path!r}: {exc}") from None
    return lambda text: tok.encode(text, add_special_tokens=True).ids


# ---- decoding -------------------------------------------------------------------------------------------


class Rejected(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class Stored:
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    extras: list[bytes] | None
    kind: str = "stored"


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[Any]
    kind: str = "removed"


@dataclass(frozen=True, slots=True)
class Cleared:
    kind: str = "cleared"


_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys")
_REMOVED_FIELDS = ("block_hashes", "medium")


def _hashes(value: Any) -> list[Any]:
    if not isinstance(value, list) or not all(isinstance(h, (bytes, int)) and not isinstance(h, bool)
                                              for h in value):
        raise Rejected("block_hashes must be a list of bytes or ints")
    return value


def _event(raw: Any) -> Stored | Removed | Cleared | None:
    if isinstance(raw, list) and raw and isinstance(raw[0], str):  # array-like tagged struct (older vLLM)
        tag = raw[0]
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:], strict=False))
    elif isinstance(raw, dict) and isinstance(raw.get("type"), str):
        tag = raw["type"]
        fields = raw
    else:
        raise Rejected("an event must be a tagged struct")
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag == "BlockRemoved":
        return Removed(_hashes(fields.get("block_hashes"))) if fields.get("medium") in GPU_MEDIA else None
    if tag != "BlockStored":
        return None  # an event kind this router does not know: ignored, so newer engines still work
    if fields.get("medium") not in GPU_MEDIA:
        return None
    hashes = _hashes(fields.get("block_hashes"))
    parent = fields.get("parent_block_hash")
    tokens = fields.get("token_ids")
    size = fields.get("block_size")
    if parent is not None and not isinstance(parent, (bytes, int)):
        raise Rejected("parent_block_hash must be bytes, an int or nil")
    if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
        raise Rejected("token_ids must be a list of ints")
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise Rejected("block_size must be a positive int")
    lora = fields.get("lora_name") or fields.get("lora_id")
    extra_keys = fields.get("extra_keys")
    per_block = extra_keys if isinstance(extra_keys, list) else []
    extras = None
    # vLLM sends extra_keys as one entry per block, None for a plain block: only real extras change the key.
    if lora is not None or any(k is not None for k in per_block):
        extras = [repr((lora, per_block[i] if i < len(per_block) else None)).encode() for i in range(len(hashes))]
    return Stored(hashes, parent, tokens, size, extras)


def decode_batch(payload: bytes) -> list[Stored | Removed | Cleared]:
    """The events of one EventBatch payload, in order; raises Rejected for anything else."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise Rejected(f"payload of {len(payload)} bytes")
    try:
        batch = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise Rejected(f"not msgpack: {exc}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise Rejected("an EventBatch is [ts, events, data_parallel_rank]")
    return [e for raw in batch[1] if (e := _event(raw)) is not None]


# ---- one engine's stream --------------------------------------------------------------------------------


class EngineStream:
    """Sequence tracking for one engine (no I/O): what to do with the next batch's sequence number."""

    def __init__(self, endpoint_id: str, index: KVBlockIndex, metrics: RouterMetrics, warmup: float) -> None:
        self.endpoint_id = endpoint_id
        self.index = index
        self.metrics = metrics
        self.warmup = warmup
        self.warm_at: float | None = None  # approximate until then (None: not warming up)
        self.heard_at: float | None = None
        self.silent = False  # approximate because it went quiet (its sequence, when it resumes, says if lost)

    @property
    def expected(self) -> int | None:
        last = self.index.engine(self.endpoint_id).last_seq
        return None if last is None else last + 1

    def check(self, seq: int, now: float) -> str:
        """'next', 'restart', 'gap' or 'first' for a batch numbered `seq`; applies restart and first-contact
        rules (a gap is for the caller: replay, then `resync`)."""
        engine = self.index.engine(self.endpoint_id)
        expected = self.expected
        if expected is None:
            if seq == 0:
                engine.precise = True
            else:
                self._warm(now, "joined_mid_stream")
            return "first"
        if seq == expected:
            return "next"
        if seq < expected:
            dropped = self.index.clear(self.endpoint_id)
            self.metrics.kv_event_resyncs.labels(self.endpoint_id, "restart").inc()
            log.info("engine's KV event sequence restarted: its blocks are cleared",
                     extra={"endpoint": self.endpoint_id, "seq": seq, "expected": expected, "blocks": dropped})
            if seq == 0:
                engine.precise = True
                self.warm_at = None
            else:
                self._warm(now, "restart")
            return "restart"
        return "gap"

    def resync(self, seq: int, now: float, reason: str) -> None:
        dropped = self.index.clear(self.endpoint_id)
        log.warning("KV events lost: the engine's blocks are dropped and it uses the approximate index until the "
                    "warm-up passes", extra={"endpoint": self.endpoint_id, "seq": seq, "expected": self.expected,
                                             "reason": reason, "blocks": dropped})
        self._warm(now, reason)

    def _warm(self, now: float, reason: str) -> None:
        self.index.engine(self.endpoint_id).precise = False
        self.silent = False
        self.warm_at = now + self.warmup
        self.metrics.kv_event_resyncs.labels(self.endpoint_id, reason).inc()

    def apply(self, seq: int, payload: bytes, now: float) -> None:
        engine = self.index.engine(self.endpoint_id)
        engine.last_seq = seq
        self.heard_at = now
        if self.silent:
            self.silent = False
            engine.precise = self.warm_at is None
        try:
            events = decode_batch(payload)
        except Rejected as exc:
            self.metrics.kv_events_rejected.labels(self.endpoint_id).inc()
            self.resync(seq, now, "rejected")
            log.warning("KV event batch rejected", extra={"endpoint": self.endpoint_id, "error": str(exc)})
            return
        done = self.index.apply(self.endpoint_id, events)
        m = self.metrics.kv_events
        for kind, n in (("stored", done.stored), ("removed", done.removed), ("cleared", done.cleared),
                        ("orphan", done.orphans), ("evicted", done.evicted)):
            if n:
                m.labels(self.endpoint_id, kind).inc(n)
        if done.cleared:
            log.info("engine cleared its KV cache", extra={"endpoint": self.endpoint_id})

    def tick(self, now: float, silent_after: float) -> None:
        """Warm-up ends; silence makes the engine approximate."""
        engine = self.index.engine(self.endpoint_id)
        if self.warm_at is not None and now >= self.warm_at:
            self.warm_at = None
            engine.precise = True
            log.info("KV event warm-up passed: the engine uses the precise index", extra={"endpoint": self.endpoint_id})
        if engine.precise and self.heard_at is not None and now - self.heard_at > silent_after:
            engine.precise = False
            self.silent = True
            self.metrics.kv_event_resyncs.labels(self.endpoint_id, "silent").inc()
            # Speaking again with the next sequence number (nothing lost) makes it precise again (`apply`).
        self.metrics.kv_index_blocks.labels(self.endpoint_id).set(self.index.size(self.endpoint_id))
        self.metrics.kv_index_precise.labels(self.endpoint_id).set(1 if engine.precise else 0)


# ---- the subscriber -------------------------------------------------------------------------------------


def source_for(endpoint: Endpoint, settings: KVEventsSettings) -> KVEventSource | None:
    for source in settings.sources:
        if source.endpoint_id == endpoint.id:
            return source
    if settings.port is None:
        return None
    host = urlsplit(endpoint.url).hostname
    if not host:
        return None
    host = f"[{host}]" if ":" in host else host
    return KVEventSource(endpoint.id, f"tcp://{host}:{settings.port}")


class KVEvents:
    """The subscriptions, one task per engine, following the fleet's membership (`reconcile`)."""

    def __init__(self, settings: KVEventsSettings, index: KVBlockIndex, metrics: RouterMetrics,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.index = index
        self.metrics = metrics
        self.clock = clock
        self.ctx = zmq.asyncio.Context()
        self.streams: dict[str, EngineStream] = {}
        self._tasks: dict[str, tuple[KVEventSource, asyncio.Task[None]]] = {}
        self.applied = asyncio.Condition()  # notified after each batch: tests wait on it, never sleep

    def reconcile(self, endpoints: Mapping[str, Endpoint]) -> None:
        wanted = {e.id: s for e in endpoints.values() if (s := source_for(e, self.settings)) is not None}
        for endpoint_id, (source, task) in list(self._tasks.items()):
            if wanted.get(endpoint_id) != source:
                task.cancel()
                del self._tasks[endpoint_id]
                self.streams.pop(endpoint_id, None)
                self.index.forget(endpoint_id)
                for gauge in (self.metrics.kv_index_blocks, self.metrics.kv_index_precise):
                    with contextlib.suppress(KeyError):
                        gauge.remove(endpoint_id)
        for endpoint_id, source in wanted.items():
            if endpoint_id not in self._tasks:
                stream = self.streams[endpoint_id] = EngineStream(endpoint_id, self.index, self.metrics,
                                                                  self.settings.warmup)
                task = asyncio.create_task(self._run(source, stream), name=f"fleetroute-kv-events-{endpoint_id}")
                self._tasks[endpoint_id] = (source, task)

    async def close(self) -> None:
        tasks = [task for _, task in self._tasks.values()]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        self.ctx.term()

    async def _run(self, source: KVEventSource, stream: EngineStream) -> None:
        sock = self.ctx.socket(zmq.SUB)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)
            sock.setsockopt(zmq.SUBSCRIBE, self.settings.topic.encode())
            (sock.bind if source.bind else sock.connect)(source.address)
            log.info("subscribed to KV events", extra={"endpoint": source.endpoint_id, "address": source.address,
                                                       "bind": source.bind})
            poll_ms = int(min(1.0, self.settings.warmup / 4, self.settings.silent_after / 4) * 1000) or 1
            while True:
                if await sock.poll(poll_ms):
                    frames = await sock.recv_multipart()
                    await self._frames(source, stream, frames)
                    continue
                was = self.index.is_precise(source.endpoint_id)
                stream.tick(self.clock(), self.settings.silent_after)
                if self.index.is_precise(source.endpoint_id) != was:
                    async with self.applied:
                        self.applied.notify_all()
        finally:
            sock.close(linger=0)

    async def _frames(self, source: KVEventSource, stream: EngineStream, frames: list[bytes]) -> None:
        now = self.clock()
        if len(frames) != 3 or len(frames[1]) != 8:
            self.metrics.kv_events_rejected.labels(source.endpoint_id).inc()
            return
        seq = int.from_bytes(frames[1], "big", signed=True)
        verdict = stream.check(seq, now)
        if verdict == "gap":
            expected = stream.expected
            assert expected is not None
            replayed = await self._replay(source, stream, expected, seq) if source.replay else False
            if replayed:
                self.metrics.kv_event_resyncs.labels(source.endpoint_id, "replayed").inc()
            else:
                stream.resync(seq, now, "gap")
        stream.apply(seq, frames[2], now)
        stream.tick(now, self.settings.silent_after)
        async with self.applied:
            self.applied.notify_all()

    async def _replay(self, source: KVEventSource, stream: EngineStream, start: int, upto: int) -> bool:
        """Ask the engine's replay socket for batches start..upto-1 and apply them; True if they all came."""
        assert source.replay is not None
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(source.replay)
            await sock.send_multipart((b"", start.to_bytes(8, "big")))
            want = start
            deadline = self.clock() + self.settings.replay_timeout
            while True:
                left = deadline - self.clock()
                if left <= 0 or not await sock.poll(int(left * 1000) or 1):
                    return False
                frames = await sock.recv_multipart()
                if len(frames) != 4 or len(frames[2]) != 8:
                    return False
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return want == upto
                if seq < want:
                    continue
                if seq != want or seq >= upto:
                    return want == upto
                stream.apply(seq, frames[3], self.clock())
                want += 1
        finally:
            sock.close(linger=0)


RECONCILE_INTERVAL = 1.0


async def run_kv_events(events: KVEvents, balancer: Any, metrics: RouterMetrics,
                        interval: float = RECONCILE_INTERVAL) -> None:
    """Keep one subscription per member endpoint with a source (members, not only healthy ones: an ejected
    engine comes back with its index current)."""
    while True:
        with contained("kv_events", metrics):
            events.reconcile({e.id: e for e in balancer.endpoints()})
        await asyncio.sleep(interval)
