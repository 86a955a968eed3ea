"""Load telemetry for the policies: read per-endpoint records from a store, judge their age, feed the balancer.

Two stores with one interface (`read(ids) -> {id: hash fields}`), both holding `worker.protocol` records:

- `RedisStore`: the production path. Each worker pod's agent writes its endpoint's record every interval
  and PUBLISHes the endpoint's id; every router replica reads, with one pipelined HGETALL each, the records
  announced since its last round (and new endpoints'). Refreshes happen every `interval` and early when an
  announcement arrives. Pub/sub is lossy, so a round reads every record when the announcements cannot be
  trusted (the first round, after the subscription or Redis broke) and once `full_read_every` seconds have passed.
- `MemoryStore` + `EmbeddedCollection`: with no Redis configured (`fleetroute demo`, local runs) the router
  collects the records itself, scraping each engine's `/metrics` (and a simulator's `/sim/gpu` with
  `gpuSource: sim`), through the same collector code the agent uses.

`TelemetryFeed.refresh` joins records to known endpoints by id, admits each through `admit_record` (the
trust boundary: sizes, schema, ranges, timestamps; router/runtime/redis_input.py), converts the reporter's
wall-clock time to the router's monotonic clock, and has the balancer apply the round once
(`refresh_telemetry`: a full rebuild only when GPU health may have changed; otherwise only the endpoints whose
view changed are touched). A record read again unchanged, field for field (a full read, or an announcement of
a record a round had already read), is not handed on, so such a round costs the balancer nothing for that endpoint.
A refused record is counted by reason and logged (a schema version once per endpoint, the rest at most once
a minute per reason) and leaves the endpoint as if it had not reported; a missing or stale record leaves the
endpoint "unknown" (neutral score). If Redis is unreachable, routing goes on with the last records until they
go stale (then least-connections-like behaviour through the in-flight term), with a metric and one log line,
and recovers by itself when Redis answers again. No request ever waits on Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Protocol

import aiohttp
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import RedisError, ResponseError

from router.config.settings import TelemetrySettings
from router.model import Endpoint, Telemetry
from router.routing.balancer import Balancer
from router.runtime.background import contained, raise_if_cancelled
from router.runtime.metrics import RouterMetrics
from router.runtime.redis_client import RedisClient
from router.runtime.redis_input import MAX_CLOCK_SKEW, Rejected, RejectionLog, text
from worker.collect import EngineCollector, SimGpuSampler
from worker.protocol import (
    ADAPTER_FIELD_BYTES,
    ADAPTER_FIELD_NAMES,
    FIELD_NAMES,
    UPDATES_CHANNEL,
    SchemaMismatch,
    TelemetryRecord,
    decode,
    encode,
    out_of_range,
    telemetry_key,
)

log = logging.getLogger("fleetroute.telemetry")

MAX_VALUE_BYTES = 256  # per field; numbers need ~25, an endpoint id at most 253 (a DNS name)
MAX_FIELDS = 2 * len(FIELD_NAMES)  # room for fields a newer agent adds within the schema version
_LONG_FIELDS = {name.encode(): ADAPTER_FIELD_BYTES for name in ADAPTER_FIELD_NAMES}
MAX_ANNOUNCED = 100_000  # endpoint ids noted between two rounds; beyond, the next round reads every record
# A record as a store returns it: field -> raw value, or the error Redis answered for the key (WRONGTYPE).
RawRecord = Mapping[bytes, bytes] | ResponseError


class TelemetryStore(Protocol):
    async def read(self, endpoint_ids: list[str]) -> dict[str, RawRecord]: ...

    def take_changes(self) -> set[str] | None:
        """The endpoints whose records changed since the last call, or None: read them all."""
        ...


class MemoryStore:
    """The embedded store: the newest record per endpoint, in this process."""

    def __init__(self) -> None:
        self._records: dict[str, dict[bytes, bytes]] = {}

    def put(self, record: TelemetryRecord) -> None:
        self._records[record.endpoint_id] = {k.encode(): v.encode() for k, v in encode(record).items()}

    async def read(self, endpoint_ids: list[str]) -> dict[str, RawRecord]:
        return {i: self._records[i] for i in endpoint_ids if i in self._records}

    def take_changes(self) -> set[str] | None:
        return None  # collected in this process every round: reading them all is free

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        for endpoint_id in gone:
            self._records.pop(endpoint_id, None)


class _Silent(Exception):
    """The subscription answered nothing, not even a ping, for two silence periods."""


class RedisStore:
    """Reads each endpoint's hash (HGETALL, pipelined; on a Redis Cluster the pipeline is split by node).
    The client comes from router.runtime.redis_client.connect: binary, so `admit_record` sees the bytes and bounds
    them before anything is decoded. (HMGET of the schema's fields would bound the field count on the wire
    too, but packing its ~30 arguments per endpoint made every refresh markedly dearer, and one value can be
    512 MB either way; `admit_record` refuses a record with more than MAX_FIELDS fields.)"""

    def __init__(self, client: RedisClient) -> None:
        self.client = client
        # The endpoints agents announced since the last round. Trusted only while the subscription has been up
        # without a break since the last full read (`_gap` False): a message lost while it was down, or before
        # it was first up, would leave an endpoint's new record unread until the next full read.
        self._announced: set[str] = set()
        self._gap = True

    def take_changes(self) -> set[str] | None:
        if self._gap:
            self._gap = False
            self._announced = set()
            return None
        changed, self._announced = self._announced, set()
        return changed

    async def read(self, endpoint_ids: list[str]) -> dict[str, RawRecord]:
        async with self.client.pipeline(transaction=False) as pipe:
            for endpoint_id in endpoint_ids:
                pipe.hgetall(telemetry_key(endpoint_id))
            # A key of another type answers WRONGTYPE for that endpoint alone; a broken connection still raises.
            results = await pipe.execute(raise_on_error=False)
        out: dict[str, RawRecord] = {}
        for endpoint_id, values in zip(endpoint_ids, results, strict=True):
            if isinstance(values, ResponseError):
                out[endpoint_id] = values
            elif isinstance(values, BaseException):
                raise values
            elif values:
                out[endpoint_id] = values
        return out

    async def listen(self, wake: asyncio.Event, retry_after: float, metrics: RouterMetrics) -> None:
        """Note each endpoint an agent announces (the message is its id) and set `wake`; reconnect after
        failures. A message is only a hint of which key to read: what is read is admitted like any record,
        and an id that is no endpoint's is never read (`TelemetryFeed.refresh` intersects with members).

        A connection that hangs (a dead node, a partition: no error, no close) would lose announcements
        silently, so after `retry_after` without a message the subscription is pinged, and one that has not
        answered by the next `retry_after` is dropped and made again (the next round then reads everything)."""
        while True:
            with contained("telemetry_pubsub", metrics):
                try:
                    if isinstance(self.client, RedisCluster):
                        await self.client.initialize()  # its pub/sub picks a node from the slot map
                    async with self.client.pubsub() as pubsub:
                        await pubsub.subscribe(UPDATES_CHANNEL)
                        await self._follow(pubsub, wake, retry_after)
                except _Silent:
                    metrics.telemetry_subscription_restarts.labels("silent").inc()
                    log.warning("telemetry subscription silent past a ping; subscribing again",
                                extra={"silence_s": 2 * retry_after})
                except (RedisError, OSError):
                    metrics.telemetry_subscription_restarts.labels("error").inc()  # outages: the refresh loop says
            raise_if_cancelled()
            self._gap = True
            await asyncio.sleep(retry_after)

    async def _follow(self, pubsub: Any, wake: asyncio.Event, silence: float) -> None:
        """Read the subscription (a blocking read of its own) and watch it: after `silence` with nothing heard it
        is pinged, and after another `silence` still with nothing (not even the pong) it is given up."""
        heard = [0]
        reader = asyncio.create_task(self._read(pubsub, wake, heard))
        try:
            seen, pinged = heard[0], False
            while True:
                raise_if_cancelled()
                await asyncio.wait({reader}, timeout=silence)
                if reader.done():
                    reader.result()  # its error ends the subscription
                    return
                if heard[0] != seen:  # a message, or the pong of the last ping (counted against the count before it)
                    seen, pinged = heard[0], False
                elif pinged:
                    raise _Silent
                else:
                    await asyncio.wait_for(pubsub.ping(), silence)
                    pinged = True
        finally:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)

    async def _read(self, pubsub: Any, wake: asyncio.Event, heard: list[int]) -> None:
        async for message in pubsub.listen():
            heard[0] += 1
            kind = message.get("type")
            if kind == "subscribe":
                self._gap = True  # messages may have been missed before: the next round reads all
            elif kind == "message":
                self._announce(message.get("data"))
                wake.set()

    def _announce(self, data: object) -> None:
        if isinstance(data, bytes) and len(data) <= MAX_VALUE_BYTES and len(self._announced) < MAX_ANNOUNCED:
            with contextlib.suppress(UnicodeDecodeError):
                self._announced.add(data.decode())
                return
        self._gap = True  # not an endpoint id, or more than any round should see: read everything next round

    async def close(self) -> None:
        await self.client.aclose()


def admit_record(endpoint_id: str, raw: RawRecord, *, wall_now: float) -> TelemetryRecord:
    """The one way a telemetry record enters the router: at most MAX_FIELDS fields, each name and value at
    most MAX_VALUE_BYTES (checked before decoding) and printable UTF-8, the schema version this router
    reads, the endpoint the key names, every number finite and within the schema's ranges
    (worker.protocol.LIMITS), and `reported_at` no further ahead of this router's clock than MAX_CLOCK_SKEW
    (a future-dated record would never go stale). Raises Rejected."""
    if isinstance(raw, ResponseError):
        raise Rejected("wrong_type", f"the key is not a hash ({raw})")
    fields = _texts(raw)
    try:
        record = decode(fields)
    except SchemaMismatch as exc:
        raise Rejected("schema", str(exc)) from None
    except (KeyError, ValueError, TypeError) as exc:
        raise Rejected("malformed", repr(exc)) from None
    if record.endpoint_id != endpoint_id:
        raise Rejected("wrong_endpoint", f"the record names endpoint {record.endpoint_id[:64]!r}")
    problem = out_of_range(record)
    if problem is not None:
        raise Rejected("out_of_range", problem)
    if record.reported_at > wall_now + MAX_CLOCK_SKEW:
        raise Rejected("future", f"reported_at is {record.reported_at - wall_now:.1f}s ahead of this router's clock")
    return record


def _texts(raw: Mapping[bytes, bytes]) -> dict[str, str]:
    """Every field name and value as printable UTF-8 of at most MAX_VALUE_BYTES (the adapter lists: more), sizes
    checked before anything is decoded (router.runtime.redis_input.text, with a fast path for the printable
    ASCII agents write: this runs for every field of every endpoint every refresh)."""
    if len(raw) > MAX_FIELDS:
        raise Rejected("oversize", f"the record has {len(raw)} fields, at most {MAX_FIELDS} expected")
    longest = max(max(map(len, raw.values()), default=0), max(map(len, raw), default=0))
    if longest <= MAX_VALUE_BYTES:
        try:
            fields = {name.decode("ascii"): value.decode("ascii") for name, value in raw.items()}
        except UnicodeDecodeError:
            pass
        else:
            if all(map(str.isprintable, fields.values())) and all(map(str.isprintable, fields)):
                return fields
    # Not all printable ASCII, or a long value: the general check says what is wrong, or admits printable UTF-8.
    # Only the LoRA adapter lists may be longer than MAX_VALUE_BYTES (worker/protocol.py ADAPTER_FIELD_BYTES).
    return {text(name, max_bytes=MAX_VALUE_BYTES, what="a field name"): text(
                value, max_bytes=_LONG_FIELDS.get(name, MAX_VALUE_BYTES), what=name.decode("utf-8", "replace"))
            for name, value in raw.items()}


def to_telemetry(record: TelemetryRecord, *, wall_now: float, mono_now: float) -> Telemetry:
    age = max(0.0, wall_now - record.reported_at)  # a clock slightly ahead (< MAX_CLOCK_SKEW) reads as fresh
    gpu, engine = record.gpu, record.engine
    return Telemetry(
        reported_at=mono_now - age,
        gpu_util=gpu.util,
        gpu_mem_util=gpu.mem_util,
        kv_cache_usage=engine.kv_cache_usage,
        num_waiting=engine.num_waiting,
        num_running=engine.num_running,
        prefix_cache_hit_rate=record.prefix_cache_hit_rate,
        prefix_cache_queries=engine.prefix_cache_queries,
        prefix_cache_hits=engine.prefix_cache_hits,
        kv_capacity_tokens=engine.kv_capacity_tokens,
        lora_running=None if engine.lora_running is None else frozenset(engine.lora_running),
        lora_waiting=None if engine.lora_waiting is None else frozenset(engine.lora_waiting),
        max_lora=engine.max_lora,
        gpu_lost=gpu.lost,
        gpu_xid_errors=gpu.xid_errors,
        gpu_ecc_uncorrected=gpu.ecc_uncorrected,
        gpu_throttle_reasons=gpu.throttle_reasons,
        source=record.gpu_source if record.gpu_source != "none" else "engine",
    )


class TelemetryFeed:
    def __init__(
        self,
        *,
        store: TelemetryStore,
        balancer: Balancer,
        metrics: RouterMetrics,
        wall_clock: Callable[[], float] = time.time,
        mono_clock: Callable[[], float] = time.monotonic,
        full_read_every: float = 0.0,
    ) -> None:
        self._store = store
        self._balancer = balancer
        self._metrics = metrics
        self._wall = wall_clock
        self._mono = mono_clock
        self._store_down = False
        self._schema_warned: set[str] = set()
        self._read_members: set[str] = set()  # the members as of the last round: a newcomer is read at once
        self._applied: dict[str, TelemetryRecord] = {}  # per endpoint: the record last handed to the balancer
        self._full_read_every = full_read_every
        self._last_full_read = float("-inf")
        self._rejected = RejectionLog(what="telemetry record", logger=log,
                                      count=lambda reason: metrics.telemetry_rejected.labels(reason).inc())

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        self._schema_warned -= gone
        self._read_members -= gone
        for endpoint_id in gone:
            self._applied.pop(endpoint_id, None)

    def _to_read(self) -> tuple[list[str], str]:
        """The endpoints this round reads, and which kind of round it is: `full` (every member: the first
        round, after the subscription broke, or `full_read_every` seconds after the last full one, which is
        what catches a lost message), else `changed` (those announced since the last round, and members new
        since then)."""
        members = [ep.id for ep in self._balancer.endpoints()]
        changes = self._store.take_changes()
        now = self._mono()
        if changes is None or now - self._last_full_read >= self._full_read_every:
            self._last_full_read = now
            self._read_members = set(members)
            return members, "full"
        new = [m for m in members if m not in self._read_members]
        self._read_members.update(new)
        return [m for m in members if m in changes] + new, "changed"

    async def refresh(self) -> None:
        ids, kind = self._to_read()
        self._metrics.telemetry_reads.labels(kind).inc()
        self._metrics.telemetry_records_read.inc(len(ids))
        try:
            raw = await self._store.read(ids) if ids else {}
        except (RedisError, OSError) as exc:
            self._metrics.store_errors.inc()
            self._metrics.store_up.set(0)
            if not self._store_down:
                log.warning("telemetry store unreachable; routing on the last known telemetry until it goes stale",
                            extra={"error": f"{type(exc).__name__}: {exc}"})
            self._store_down = True
            self._last_full_read = float("-inf")  # what was announced meanwhile was not read: read all next time
            self._balancer.refresh_telemetry()  # ages out what has gone stale
            return
        if self._store_down:
            log.info("telemetry store reachable again")
            self._store_down = False
        self._metrics.store_up.set(1)
        wall, mono = self._wall(), self._mono()
        for endpoint_id, fields in raw.items():
            if not self._balancer.is_member(endpoint_id):
                continue  # it left while the store was read
            try:
                record = admit_record(endpoint_id, fields, wall_now=wall)
            except Rejected as exc:
                if exc.reason != "schema":
                    self._rejected(exc, endpoint=endpoint_id)
                    continue
                self._metrics.telemetry_rejected.labels("schema").inc()
                if endpoint_id not in self._schema_warned:  # a rollout to do, not an attack: say it per endpoint
                    self._schema_warned.add(endpoint_id)
                    log.error("telemetry record ignored: unknown schema version (upgrade the router or the agent)",
                              extra={"endpoint": endpoint_id, "error": exc.detail})
                continue
            if self._applied.get(endpoint_id) == record:
                continue  # the record the balancer already has, field for field (its age is judged there)
            self._applied[endpoint_id] = record
            self._balancer.report_telemetry(endpoint_id, to_telemetry(record, wall_now=wall, mono_now=mono))
        self._balancer.refresh_telemetry()


class EmbeddedCollection:
    """The router collects records itself (no Redis): one collector per endpoint, all in parallel."""

    def __init__(self, *, session: aiohttp.ClientSession, store: MemoryStore, settings: TelemetrySettings,
                 metrics: RouterMetrics) -> None:
        self._session = session
        self._metrics = metrics
        self._store = store
        self._settings = settings
        self._collectors: dict[str, tuple[str, EngineCollector]] = {}

    def _collector(self, endpoint: Endpoint) -> EngineCollector:
        known = self._collectors.get(endpoint.id)
        if known is not None and known[0] == endpoint.url:
            return known[1]
        s = self._settings
        gpu = SimGpuSampler(self._session, endpoint.url, s.timeout) if s.gpu_source == "sim" else None
        collector = EngineCollector(session=self._session, endpoint_id=endpoint.id, engine_url=endpoint.url, gpu=gpu,
                                    gpu_source=s.gpu_source, interval=s.interval, timeout=s.timeout)
        self._collectors[endpoint.id] = (endpoint.url, collector)
        return collector

    def forget_endpoints(self, gone: frozenset[str]) -> None:
        """Endpoints that left: their scrapers and their last records go."""
        for endpoint_id in gone:
            self._collectors.pop(endpoint_id, None)
        self._store.forget_endpoints(gone)

    async def collect(self, endpoints: Iterable[Endpoint]) -> None:
        collectors = [self._collector(ep) for ep in endpoints]
        records = await asyncio.gather(*(c.collect() for c in collectors))
        for collector, record in zip(collectors, records, strict=True):
            known = self._collectors.get(record.endpoint_id)
            if known is None or known[1] is not collector:
                continue  # the endpoint left (or moved) during the scrape: the record is of no one now
            if not record.engine.up:
                self._metrics.scrape_errors.labels(record.endpoint_id).inc()
            if record.engine.up or record.gpu_source != "none":
                self._store.put(record)


async def run_feed(
    feed: TelemetryFeed,
    *,
    interval: float,
    wake: asyncio.Event,
    before_refresh: Callable[[], object] | None = None,
    on_round: Callable[[], None] | None = None,
    metrics: RouterMetrics,
) -> None:
    """Refresh every `interval`, or earlier when `wake` is set, but at most every interval/4: agents
    publishing at spread-out moments must not cause one full refresh (and rebuild) each."""
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        with contained("telemetry", metrics):
            if before_refresh is not None:
                result = before_refresh()
                if asyncio.iscoroutine(result):
                    await result
            await feed.refresh()
            if on_round is not None:
                on_round()
        await asyncio.sleep(max(0.0, started + interval / 4 - loop.time()))
        if wake.is_set():  # updates arrived meanwhile: one refresh covers them all
            wake.clear()
            continue
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(max(0.0, started + interval - loop.time())):
                await wake.wait()
        wake.clear()
