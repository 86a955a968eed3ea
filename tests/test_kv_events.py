"""KV-cache events: vLLM's wire format decoded, the precise block index, sequence numbers (gap, replay,
restart), and prefix-aware's `index: precise` routing on what simulated engines publish."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web

from loadtest.host import free_port
from router.config.settings import ConfigError, parse_settings
from router.routing.prefix.kv_block_index import KVBlockIndex, chain_keys, request_token_ids
from router.routing.prefix.kv_events import Cleared, Rejected, Removed, Stored, decode_batch
from router.server.app import RunningRouter, build_context, start_router
from router.server.proxy import ENDPOINT_HEADER
from worker.sim.engine import EngineConfig, EngineCore
from worker.sim.kv_events import KVEventsConfig
from worker.sim.profiles import profile
from worker.sim.server import SimServer, SimSettings

MODEL = "sim-model"
BS = 16  # the simulator's block size (vLLM's on GPUs)


# ---- the wire -------------------------------------------------------------------------------------------


def vllm_payload(events: list[Any]) -> bytes:
    """What vLLM 0.32's publisher sends: EventBatch array-like, events as maps tagged by "type" (checked against
    vllm.distributed.kv_events with msgspec in vLLM's venv: this is the same msgpack)."""
    return msgspec.msgpack.encode([1.5, events, None])


def test_a_vllm_batch_decodes_into_stored_removed_and_cleared_in_order() -> None:
    payload = vllm_payload([
        {"type": "BlockStored", "block_hashes": [b"\x01" * 32, b"\x02" * 32], "parent_block_hash": None,
         "token_ids": list(range(2 * BS)), "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None},
        {"type": "BlockStored", "block_hashes": [3], "parent_block_hash": None, "token_ids": list(range(BS)),
         "block_size": BS, "lora_id": None, "medium": "GPU", "lora_name": None,
         "extra_keys": [None]},  # vLLM 0.32 sends one None per plain block: a plain block still
        {"type": "BlockRemoved", "block_hashes": [7], "medium": "GPU"},
        {"type": "BlockStored", "block_hashes": [9], "parent_block_hash": None, "token_ids": list(range(BS)),
         "block_size": BS, "lora_id": None, "medium": "CPU", "lora_name": None},  # offloaded: not a GPU hit
        {"type": "SomethingNewer", "x": 1},  # a kind this router does not know: skipped
        {"type": "AllBlocksCleared"},
    ])
    events = decode_batch(payload)
    assert [type(e) for e in events] == [Stored, Stored, Removed, Cleared]
    first, plain = events[0], events[1]
    assert isinstance(first, Stored) and first.block_hashes == [b"\x01" * 32, b"\x02" * 32]
    assert first.extras is None
    assert isinstance(plain, Stored) and plain.extras is None


def test_older_array_like_events_decode_too() -> None:
    payload = msgspec.msgpack.encode([0.0, [["BlockStored", [5], None, list(range(BS)), BS, None, None],
                                            ["BlockRemoved", [5], None], ["AllBlocksCleared"]]])
    assert [type(e) for e in decode_batch(payload)] == [Stored, Removed, Cleared]


@pytest.mark.parametrize("payload", [
    b"\xc1",  # not msgpack
    msgspec.msgpack.encode({"ts": 1}),  # not an EventBatch
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": "x"}]]),
    msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                                   "token_ids": [1], "block_size": 0}]]),
], ids=["not-msgpack", "not-a-batch", "hashes-not-a-list", "block-size-zero"])
def test_malformed_batches_are_rejected(payload: bytes) -> None:
    with pytest.raises(Rejected):
        decode_batch(payload)


# ---- the index ------------------------------------------------------------------------------------------


def stored(hashes: list[Any], parent: Any, tokens: list[int], extras: list[bytes] | None = None) -> Stored:
    return Stored(hashes, parent, tokens, BS, extras)


def test_the_index_keys_blocks_by_their_token_chain_whatever_the_engines_hash() -> None:
    index = KVBlockIndex()
    tokens = list(range(3 * BS))
    keys = chain_keys(tokens, BS, 64)
    # Two engines hash differently (sha256 bytes, builtin ints) and send the chain in two events each.
    index.apply("a", [stored([b"a1"], None, tokens[:BS]), stored([b"a2", b"a3"], b"a1", tokens[BS:])])
    index.apply("b", [stored([11, 12], None, tokens[:2 * BS])])
    assert index.matched("a", keys) == 3
    assert index.matched("b", keys) == 2
    assert index.holders[keys[0]] == {"a", "b"}
    index.apply("a", [Removed([b"a2"])])
    assert index.matched("a", keys) == 1  # the chain breaks at the evicted block
    # A LoRA block does not match the plain prompt (it would not hit in the engine either).
    index.apply("c", [stored([21], None, tokens[:BS], extras=[b"('sql-lora', None)"])])
    assert index.matched("c", keys) == 0
    # A block whose parent was never seen cannot be keyed.
    applied = index.apply("d", [stored([31], b"unknown", tokens[BS:2 * BS])])
    assert applied.orphans == 1 and index.size("d") == 0
    index.apply("b", [Cleared()])
    assert index.size("b") == 0 and keys[1] not in index.holders


def test_the_cap_per_engine_evicts_its_oldest_blocks() -> None:
    index = KVBlockIndex(max_blocks=64)
    tokens = list(range(100 * BS))
    applied = index.apply("a", [stored(list(range(100)), None, tokens)])
    assert applied.stored == 100 and applied.evicted == 36 and index.size("a") == 64
    assert index.matched("a", chain_keys(tokens, BS, 100)) == 0  # the root went first: the chain is unmatched


@pytest.mark.parametrize(("body", "expected"), [
    ({"prompt": [1, 2, 3]}, [1, 2, 3]),
    ({"prompt": [[1, 2, 3]]}, [1, 2, 3]),
    ({"prompt": "abc"}, None),  # no tokenizer configured
    ({"messages": [{"role": "user", "content": "abc"}]}, None),  # chat: the template is not known here
], ids=["token-ids", "one-batch-of-token-ids", "text-without-tokenizer", "chat"])
def test_the_router_knows_a_requests_token_ids_only_when_it_can(body: dict[str, Any], expected: Any) -> None:
    assert request_token_ids(body, None) == expected


def test_a_text_prompt_with_a_tokenizer_is_tokenized() -> None:
    assert request_token_ids({"prompt": "ab"}, lambda text: [ord(c) for c in text]) == [97, 98]


def test_kv_events_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError) as err:
        parse_settings({"kvEvents": {"endpoints": [{"endpoint": "a", "address": "http://x"}]}})
    assert str(err.value).startswith("kvEvents.endpoints[0].address: must be a ZMQ address")
    with pytest.raises(ConfigError) as err:
        parse_settings({"policies": [{"name": "p", "strategy": "prefix-aware", "prefixAware": {"index": "exact"}}]})
    assert "index" in str(err.value)


# ---- end to end: simulated engines publish, the router routes on them ---------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Fleet:
    """Simulated engines publishing KV events to a router that binds one SUB socket per engine (vLLM connects
    for a tcp://127.0.0.1 endpoint, so the subscriber binds)."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.ports = {name: free_port() for name in ("a", "b")}
        self.replay = {name: f"tcp://127.0.0.1:{free_port()}" for name in ("a", "b")}
        self.sims: dict[str, tuple[SimServer, web.AppRunner, str]] = {}
        self.router: RunningRouter | None = None

    async def start_sim(self, name: str, *, replay: bool = False, url_port: int = 0) -> None:
        config = EngineConfig()
        events = KVEventsConfig(endpoint=f"tcp://127.0.0.1:{self.ports[name]}", topic="kv",
                                replay_endpoint=self.replay[name] if replay else None)
        server = SimServer(SimSettings(model=MODEL, profile=profile("h100"), engine=config, time_scale=0.02,
                                       max_model_len=4096, kv_events=events),
                           EngineCore(profile("h100"), config, random.Random(0)))
        runner = web.AppRunner(server.build_app(), handler_cancellation=True, shutdown_timeout=0.5)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", url_port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.sims[name] = (server, runner, f"http://127.0.0.1:{port}")

    async def stop_sim(self, name: str) -> None:
        await self.sims.pop(name)[1].cleanup()

    async def start_router(self, index: str = "precise", *, replay: bool = False) -> RunningRouter:
        settings = parse_settings({
            "listen": {"host": "127.0.0.1", "port": 0}, "admin": {"host": "127.0.0.1", "port": 0},
            "endpoints": [{"id": n, "url": self.sims[n][2], "models": [MODEL]} for n in ("a", "b")],
            "policies": [{"name": "cache", "models": ["*"], "strategy": "prefix-aware",
                          "prefixAware": {"index": index}}],
            "telemetry": {"enabled": False}, "redis": {"url": None},
            "kvEvents": {"topic": "kv", "warmup": "30s", "endpoints": [
                {"endpoint": n, "address": f"tcp://127.0.0.1:{self.ports[n]}", "bind": True,
                 **({"replay": self.replay[n]} if replay else {})} for n in ("a", "b")]},
        })
        self.router = await start_router(build_context(settings, rng=random.Random(1), clock=self.clock))
        await self.router.ctx.prefix_upkeep.round()  # type: ignore[union-attr]  # the pools see the index
        return self.router

    @property
    def index(self) -> KVBlockIndex:
        assert self.router is not None
        return self.router.ctx.kv_events.index  # type: ignore[no-any-return]

    async def applied(self, condition: Callable[[], bool], timeout: float = 5.0) -> None:
        """Wait (on the subscriber's notifications, no sleeping) until `condition` holds."""
        assert self.router is not None
        events = self.router.ctx.kv_events
        async with asyncio.timeout(timeout):
            async with events.applied:
                await events.applied.wait_for(condition)

    async def connect(self, name: str, session: aiohttp.ClientSession) -> None:
        """Until the subscription is up, a PUB socket drops what it sends (ZMQ's slow joiner): reset the
        engine's prefix cache (an AllBlocksCleared batch) until the router hears one. If it first hears a later
        sequence number than 0 the engine counts as joined mid-stream; the warm-up is then let pass."""
        assert self.router is not None
        stream = None
        for _ in range(100):
            async with session.post(self.sims[name][2] + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            try:
                await self.applied(lambda: self.index.engine(name).last_seq is not None, timeout=0.1)
            except TimeoutError:
                continue
            stream = self.router.ctx.kv_events.streams[name]
            break
        assert stream is not None, "no KV event reached the router"
        if not self.index.is_precise(name):
            self.clock.now += 31
            stream.tick(self.clock(), 60.0)
        assert self.index.engine(name).precise

    async def complete(self, session: aiohttp.ClientSession, url: str, prompt: list[int]) -> str:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        async with session.post(url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return resp.headers.get(ENDPOINT_HEADER, "")

    def sample(self, name: str, labels: dict[str, str]) -> float:
        assert self.router is not None
        return self.router.ctx.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    f = Fleet()
    try:
        yield f
    finally:
        if f.router is not None:
            await f.router.close()
        for name in list(f.sims):
            await f.stop_sim(name)


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 32000) for _ in range(n)]


async def started(fleet: Fleet, session: aiohttp.ClientSession, **router: Any) -> None:
    replay = router.get("replay", False)
    for name in ("a", "b"):
        await fleet.start_sim(name, replay=replay)
    await fleet.start_router(**router)
    for name in ("a", "b"):
        await fleet.connect(name, session)


async def test_the_precise_index_routes_to_the_engine_that_holds_the_prefix_and_forgets_a_cleared_cache(
        fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        await started(fleet, session)
        shared = prompt(1)
        keys = chain_keys(shared, BS, 64)
        # Served by b directly, behind the router's back: only b's KV events can tell the router.
        await fleet.complete(session, fleet.sims["b"][2], shared)
        await fleet.applied(lambda: fleet.index.matched("b", keys) == len(shared) // BS)
        assert fleet.index.matched("a", keys) == 0
        assert fleet.sample("fleetroute_kv_events_total", {"endpoint": "b", "type": "stored"}) >= len(keys)
        # Every request sharing the prefix goes to b (the approximate index, knowing nothing, would pick by load
        # at random between two idle engines: eight in a row on b would be a 1-in-256 chance).
        for i in range(8):
            follow_up = shared[:192] + prompt(100 + i, 40)
            assert await fleet.complete(session, fleet.router.ingress_url, follow_up) == "b"  # type: ignore[union-attr]
        assert fleet.sample("fleetroute_policy_events_total", {"policy": "cache", "event": "index_precise"}) == 8
        assert fleet.sample("fleetroute_policy_events_total", {"policy": "cache", "event": "prefix_hit"}) == 8
        # AllBlocksCleared (vLLM's reset_prefix_cache) empties b's entries.
        async with session.post(fleet.sims["b"][2] + "/reset_prefix_cache") as resp:
            assert resp.status == 200
        await fleet.applied(lambda: fleet.index.size("b") == 0)
        assert fleet.index.matched("b", keys) == 0


async def test_an_engine_restart_clears_its_entries(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        await started(fleet, session)
        shared = prompt(2)
        await fleet.complete(session, fleet.sims["a"][2], shared)
        await fleet.applied(lambda: fleet.index.size("a") >= len(shared) // BS)
        stream = fleet.router.ctx.kv_events.streams["a"]  # type: ignore[union-attr]
        # The engine restarts (same addresses): its sequence numbers start again at 0.
        url_port = int(fleet.sims["a"][2].rsplit(":", 1)[1])
        await fleet.stop_sim("a")
        await fleet.start_sim("a", url_port=url_port)
        before = fleet.sample("fleetroute_kv_event_resyncs_total", {"endpoint": "a", "reason": "restart"})
        for _ in range(100):  # until the new publisher's first batch (a reset) gets through
            async with session.post(fleet.sims["a"][2] + "/reset_prefix_cache") as resp:
                assert resp.status == 200
            try:
                await fleet.applied(lambda: fleet.sample("fleetroute_kv_event_resyncs_total",
                                                         {"endpoint": "a", "reason": "restart"}) > before, 0.1)
                break
            except TimeoutError:
                continue
        assert fleet.index.size("a") == 0
        assert stream is fleet.router.ctx.kv_events.streams["a"]  # type: ignore[union-attr]


async def test_a_sequence_gap_drops_the_engines_blocks_until_the_warm_up_passes(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        await started(fleet, session)
        lost, later = prompt(3), prompt(4)
        server, _, url = fleet.sims["b"]
        await fleet.complete(session, url, prompt(5))
        await fleet.applied(lambda: fleet.index.size("b") > 0)
        assert server.kv_events is not None
        server.kv_events.skip = 1  # the batch storing `lost` never arrives
        await fleet.complete(session, url, lost)
        await fleet.complete(session, url, later)
        await fleet.applied(lambda: fleet.sample("fleetroute_kv_event_resyncs_total",
                                                 {"endpoint": "b", "reason": "gap"}) == 1)
        assert not fleet.index.is_precise("b")
        assert fleet.sample("fleetroute_kv_index_precise", {"endpoint": "b"}) == 0
        # Meanwhile picks fall back to the approximate index for b and say so.
        await fleet.complete(session, fleet.router.ingress_url, later)  # type: ignore[union-attr]
        assert fleet.sample("fleetroute_policy_events_total", {"policy": "cache", "event": "index_approximate"}) == 1
        # The warm-up passes: b is precise again, with what it stored since.
        fleet.clock.now += 31
        fleet.router.ctx.kv_events.streams["b"].tick(fleet.clock(), 60.0)  # type: ignore[union-attr]
        assert fleet.index.is_precise("b")
        assert fleet.index.matched("b", chain_keys(lost, BS, 64)) == 0  # lost for good: never learnt


async def test_a_sequence_gap_is_filled_from_the_engines_replay_socket(fleet: Fleet) -> None:
    async with aiohttp.ClientSession() as session:
        await started(fleet, session, replay=True)
        lost = prompt(6)
        server, _, url = fleet.sims["b"]
        assert server.kv_events is not None
        server.kv_events.skip = 1
        await fleet.complete(session, url, lost)
        await fleet.complete(session, url, prompt(7))
        await fleet.applied(lambda: fleet.sample("fleetroute_kv_event_resyncs_total",
                                                 {"endpoint": "b", "reason": "replayed"}) == 1)
        assert fleet.index.is_precise("b")
        assert fleet.index.matched("b", chain_keys(lost, BS, 64)) == len(lost) // BS
        assert fleet.sample("fleetroute_kv_event_resyncs_total", {"endpoint": "b", "reason": "gap"}) == 0


def test_the_simulator_reads_vllms_kv_events_config() -> None:
    import argparse

    from worker.sim.cli import _kv_events, apply_vllm_args

    args = argparse.Namespace(no_prefix_caching=False)
    apply_vllm_args(args, ["m", "--kv-events-config", '{"enable_kv_cache_events": true, "publisher": "zmq", '
                                                      '"endpoint": "ipc:///tmp/x.kv", "topic": "kv"}'])
    assert _kv_events(args) == KVEventsConfig(endpoint="ipc:///tmp/x.kv", topic="kv", replay_endpoint=None)
    off = argparse.Namespace(no_prefix_caching=False)
    apply_vllm_args(off, ["m", "--kv-events-config", '{"enable_kv_cache_events": false}'])
    assert _kv_events(off) is None
