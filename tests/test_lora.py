"""LoRA adapters: the simulator serves and schedules them as vLLM does and reports `vllm:lora_requests_info`
as vLLM writes it; the parser reads the engine's state from it and the telemetry record carries it."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
import time

import aiohttp
import pytest

from router.config.settings import ConfigError, parse_settings
from router.model import Telemetry
from router.routing.policies.lora_affinity import ACTIVE, FREE_SLOT, FULL, UNKNOWN, LoraAffinity, keep_out, tier
from router.telemetry.feed import admit_record
from tests.sim_server import MODEL
from worker.protocol import (
    MAX_ADAPTER_NAME,
    MAX_ADAPTERS,
    EngineSample,
    GpuSample,
    TelemetryRecord,
    decode,
    encode,
    out_of_range,
)
from worker.sim.cli import apply_vllm_args, lora_module_specs
from worker.sim.engine import EngineConfig, EngineCore, SimRequest
from worker.sim.profiles import PROFILES
from worker.vllm_metrics import parse_vllm_metrics

EXACT = dataclasses.replace(PROFILES["h100"], jitter=0.0)


def engine(**config: object) -> EngineCore:
    return EngineCore(EXACT, EngineConfig(**config), random.Random(0))  # type: ignore[arg-type]


def request(rid: str, lora: str | None, start: int) -> SimRequest:
    return SimRequest(rid, list(range(start, start + 64)), 4, 0.0, lora=lora)


# ---- the simulated engine -------------------------------------------------------------------------------


def test_a_batch_holds_at_most_max_loras_adapters_and_the_queue_behind_a_skipped_request_moves() -> None:
    e = engine(max_loras=1)
    for rid, lora, start in (("a1", "a", 0), ("b1", "b", 1000), ("a2", "a", 2000), ("base", None, 3000)):
        e.add_request(request(rid, lora, start))
    first = e.step(0.0)
    # vLLM V1: b1 would be a second adapter in the batch, so it is skipped; a2 and the base request behind it
    # are admitted, and b1 waits at the head of the queue.
    assert {r.request_id for r in e._running} == {"a1", "a2", "base"}
    assert [r.request_id for r in e._waiting] == ["b1"]
    running, waiting = e.lora_requests()
    assert running == {"a": 2} and waiting == {"b": 1}
    assert e.lora_loads == 1
    now = first.start + first.duration
    while e.num_running:
        result = e.step(now)
        now = result.start + result.duration
    # With a's requests done, b1 runs, and loading b into the only slot costs the step lora_load_s.
    load_step = e.step(now)
    assert {r.request_id for r in e._running} == {"b1"} and e.lora_loads == 2
    without_load = engine(max_loras=1)
    without_load.add_request(request("b1", None, 1000))
    assert load_step.duration == pytest.approx(without_load.step(0.0).duration + 0.02)


def test_an_adapter_in_a_slot_loads_no_more_and_the_least_recent_is_evicted() -> None:
    e = engine(max_loras=2)
    for i, lora in enumerate(("a", "b", "a", "c", "b")):  # one single-token request per step
        e.add_request(SimRequest(f"r{i}", list(range(i * 100, i * 100 + 16)), 1, 0.0, lora=lora))
        e.step(float(i))
    # a and b load; a is already in a slot; c evicts b (the least recently used); b loads again. Evicting
    # the oldest loaded (a) instead would have left b in its slot: 3 loads.
    assert e.lora_loads == 4


def test_an_adapter_request_to_an_engine_without_lora_is_refused() -> None:
    with pytest.raises(ValueError, match="without LoRA"):
        engine().add_request(request("x", "a", 0))


@pytest.mark.parametrize(("specs", "enabled", "expected"), [
    (["sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat"}'], True,
     (("sql", "/adapters/sql"), ("chat", "/adapters/chat"))),
    ([], False, ()),
])
def test_lora_modules_are_read_in_both_of_vllms_forms(specs, enabled, expected) -> None:
    assert lora_module_specs(specs, enabled=enabled) == expected


@pytest.mark.parametrize(("specs", "enabled", "message"), [
    (["sql=/a"], False, "needs --enable-lora"),
    (["sql"], True, "not NAME=PATH"),
    (["sql=/a", "sql=/b"], True, "given once"),
    (['{"name": "x"}'], True, "JSON object with name and path"),
])
def test_bad_lora_modules_are_named(specs, enabled, message) -> None:
    with pytest.raises(ValueError, match=message):
        lora_module_specs(specs, enabled=enabled)


def test_vllms_lora_arguments_reach_the_simulator() -> None:
    args = argparse.Namespace(max_loras=1)
    not_modelled, ignored = apply_vllm_args(args, [
        "meta-llama/Llama-3.1-8B", "--enable-lora", "--max-loras", "4", "--max-lora-rank", "64",
        "--lora-modules", "sql=/adapters/sql", '{"name": "chat", "path": "/adapters/chat"}'])
    assert args.enable_lora and args.max_loras == 4 and ignored == [] and not_modelled == ["--max-lora-rank"]
    assert lora_module_specs(args.lora_modules, enabled=args.enable_lora) == (
        ("sql", "/adapters/sql"), ("chat", "/adapters/chat"))


async def test_the_simulator_serves_adapters_lists_them_and_reports_them_as_vllm(make_sim) -> None:
    sim = await make_sim(max_loras=1, lora_modules=(("sql", "/adapters/sql"), ("chat", "/adapters/chat")))
    async with aiohttp.ClientSession() as http:
        async with http.get(sim.url + "/v1/models") as resp:
            cards = {card["id"]: card for card in (await resp.json())["data"]}
        assert cards["sql"]["parent"] == MODEL and cards["sql"]["root"] == "/adapters/sql"
        assert cards[MODEL]["parent"] is None
        async with http.post(sim.url + "/v1/completions", json={"model": "sql", "prompt": "hi", "max_tokens": 2}) as r:
            assert r.status == 200
            assert (await r.json())["model"] == "sql"  # vLLM answers with the adapter's name
        async with http.post(sim.url + "/v1/completions", json={"model": "nope", "prompt": "hi"}) as r:
            assert r.status == 404
        async with http.get(sim.url + "/metrics") as resp:
            page = await resp.text()
    assert 'vllm:lora_requests_info{max_lora="1",running_lora_adapters="",waiting_lora_adapters=""}' in page
    sample = parse_vllm_metrics(page)
    assert sample.max_lora == 1 and sample.lora_running == () and sample.lora_waiting == ()


async def test_without_lora_the_page_has_no_lora_series(make_sim) -> None:
    sim = await make_sim()
    async with aiohttp.ClientSession() as http, http.get(sim.url + "/metrics") as resp:
        page = await resp.text()
    assert "lora_requests_info" not in page
    assert parse_vllm_metrics(page).max_lora is None


# ---- parsing and the wire format ------------------------------------------------------------------------


def test_the_newest_lora_series_is_the_state_now() -> None:
    # As vLLM leaves its page: every label set it ever set, each with the time it was last set.
    page = """\
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql,chat",waiting_lora_adapters=""} 1.7641e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="chat",waiting_lora_adapters="sql"} 1.7643e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="",waiting_lora_adapters=""} 1.7642e+09
"""
    sample = parse_vllm_metrics(page)
    assert sample.lora_running == ("chat",) and sample.lora_waiting == ("sql",) and sample.max_lora == 4


def test_the_telemetry_record_carries_the_adapters_and_refuses_absurd_ones() -> None:
    engine_sample = EngineSample(up=True, lora_running=("sql", "chat"), lora_waiting=(), max_lora=4)
    record = TelemetryRecord("e", 1.7e9, 1, 1.0, "none", GpuSample(), engine_sample)
    fields = encode(record)
    assert fields["lora_running_adapters"] == "sql,chat" and fields["lora_waiting_adapters"] == ""
    back = decode(fields)
    assert back.engine == engine_sample and out_of_range(back) is None
    older = decode({k: v for k, v in fields.items() if "lora" not in k})  # an agent from before LoRA
    assert older.engine.lora_running is None and older.engine.max_lora is None
    with pytest.raises(ValueError, match="adapter names"):
        decode({**fields, "lora_running_adapters": ",".join(f"a{i}" for i in range(300))})
    assert out_of_range(decode({**fields, "max_lora": "100000"})) is not None


def test_a_long_adapter_list_passes_the_routers_trust_boundary_and_the_parser_bounds_it() -> None:
    # 40 adapters of 30 characters waiting: a field of 1,239 bytes, past the 256 bytes of every other field. The
    # whole record used to be refused as oversize, taking the engine's load and KV telemetry with it.
    names = [f"customer-adapter-{i:04d}-abcdefgh" for i in range(40)]
    page = ('# TYPE vllm:lora_requests_info gauge\n'
            f'vllm:lora_requests_info{{max_lora="4",running_lora_adapters="{",".join(names[:4])}",'
            f'waiting_lora_adapters="{",".join(names)}"}} 1.7e+09\n'
            '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 40\n')
    sample = parse_vllm_metrics(page)
    assert sample.lora_waiting == tuple(names) and sample.num_waiting == 40
    raw = {k.encode(): v.encode() for k, v in encode(TelemetryRecord("e", time.time(), 1, 1.0, "none", GpuSample(),
                                                                     sample)).items()}
    record = admit_record("e", raw, wall_now=time.time())
    assert record.engine.lora_waiting == tuple(names) and record.engine.num_waiting == 40
    # The parser keeps at most MAX_ADAPTERS names and leaves out any longer than MAX_ADAPTER_NAME.
    many = ",".join([f"a{i}" for i in range(MAX_ADAPTERS + 10)] + ["x" * (MAX_ADAPTER_NAME + 1)])
    bounded = parse_vllm_metrics(page.replace(",".join(names), many))
    assert bounded.lora_waiting == tuple(f"a{i}" for i in range(MAX_ADAPTERS))


# ---- the router: affinity ---------------------------------------------------------------------------------


def t(running: tuple[str, ...] | None, waiting: tuple[str, ...] = (), max_lora: int | None = 1) -> Telemetry:
    return Telemetry(reported_at=0.0, lora_running=None if running is None else frozenset(running),
                     lora_waiting=frozenset(waiting), max_lora=max_lora)


@pytest.mark.parametrize(("telemetry", "expected"), [
    (t(("sql",)), ACTIVE), (t((), waiting=("sql",)), ACTIVE), (t(()), FREE_SLOT), (t(("chat",)), FULL),
    (t(("chat",), max_lora=2), FREE_SLOT), (t(("chat",), waiting=("math",), max_lora=2), FULL),
    (t(None), UNKNOWN), (t(("sql",), max_lora=None), UNKNOWN), (None, UNKNOWN),
])
def test_where_an_adapter_stands_on_an_engine(telemetry, expected) -> None:
    assert tier(telemetry, "sql") == expected


@pytest.mark.parametrize(("engines", "in_flight", "kept"), [
    # active engines only; full ones never while another has room
    ({"a": t(("sql",)), "b": t(()), "c": t(("chat",))}, {}, {"a"}),
    # no engine has it: those with a free slot (and those that report nothing)
    ({"a": t(("math",)), "b": t(()), "c": None}, {}, {"b", "c"}),
    # every engine full: all stay, the policy picks by load
    ({"a": t(("math",)), "b": t(("chat",))}, {}, {"a", "b"}),
    # a hot adapter spreads: its engine has `spillover` (2) more in flight than the idlest with room...
    ({"a": t(("sql",)), "b": t(()), "c": t(("chat",))}, {"a": 2}, {"a", "b"}),
    # ...but not before
    ({"a": t(("sql",)), "b": t(()), "c": t(("chat",))}, {"a": 2, "b": 1}, {"a"}),
])
def test_affinity_keeps_the_best_group_and_spills_a_hot_adapter(engines, in_flight, kept) -> None:
    out, tiers = keep_out(engines.items(), "sql", LoraAffinity(spillover=2), lambda e: in_flight.get(e, 0))
    assert set(engines) - out == kept and set(tiers) == set(engines)


@pytest.mark.parametrize(("block", "message"), [
    (True, "must be a mapping"), ({"spillover": 0}, "integer from 1"), ({"spillover": 2.5}, "integer from 1"),
    ({"slots": 1}, "unknown field"),
])
def test_bad_lora_blocks_are_named(block, message) -> None:
    config = {"endpoints": [{"id": "a", "url": "http://127.0.0.1:9", "models": ["sql"]}],
              "policies": [{"name": "adapters", "models": ["sql"], "strategy": "least-connections", "lora": block}]}
    with pytest.raises(ConfigError, match=message) as caught:
        parse_settings(config)
    assert "policies[0].lora" in str(caught.value)


BASE = "llama"
ADAPTERS = (("sql", "/adapters/sql"), ("chat", "/adapters/chat"), ("math", "/adapters/math"))


async def _hold(http: aiohttp.ClientSession, url: str, model: str) -> aiohttp.ClientResponse:
    """A long stream for `model`, read up to its first token: the adapter is running until it is closed."""
    resp = await http.post(url + "/v1/completions", json={
        "model": model, "prompt": "hold", "max_tokens": 1900, "stream": True})
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    return resp


async def test_the_router_sends_an_adapter_where_it_is_active_else_to_a_free_slot(make_sim, make_router, http) -> None:
    sims = {name: await make_sim(time_scale=1.0, max_loras=1, lora_modules=ADAPTERS) for name in "abc"}
    router = await make_router(
        [], endpoints=[{"id": n, "url": s.url, "models": [MODEL, *(a for a, _ in ADAPTERS)]} for n, s in sims.items()],
        policies=[{"name": "adapters", "models": [a for a, _ in ADAPTERS], "strategy": "least-connections",
                   "lora": {"spillover": 2}},
                  {"name": "base", "models": [MODEL], "strategy": "least-connections"}],
        telemetry={"enabled": True, "interval": "50ms", "staleAfter": "10s"})
    held = [await _hold(http, sims["a"].url, "sql"), await _hold(http, sims["b"].url, "chat")]  # not via the router
    try:
        def seen(name: str) -> frozenset[str] | None:
            view = router.ctx.balancer.snapshot.by_id.get(name)
            return None if view is None or view.telemetry is None else view.telemetry.lora_running

        async with asyncio.timeout(10):
            while (seen("a"), seen("b"), seen("c")) != ({"sql"}, {"chat"}, frozenset()):
                await router.ctx.telemetry_round.wait()

        async def endpoint(model: str) -> str:
            async with http.post(router.ingress_url + "/v1/completions",
                                 json={"model": model, "prompt": "x", "max_tokens": 1}) as resp:
                assert resp.status == 200 and (await resp.json())["model"] == model
                return resp.headers["x-fleetroute-endpoint"]

        # sql is active on a, chat on b (whose only slot it holds), math nowhere: c has the free slot.
        assert {await endpoint("sql") for _ in range(6)} == {"a"}
        assert {await endpoint("chat") for _ in range(6)} == {"b"}
        assert {await endpoint("math") for _ in range(6)} == {"c"}
        # The base model needs no adapter slot: its policy has no affinity, and spreads it by load alone.
        assert len({await endpoint(MODEL) for _ in range(9)}) >= 2
        # A hot adapter spreads: with two sql streams through the router on a, c (free slot) takes the next.
        held += [await _hold(http, router.ingress_url, "sql") for _ in range(2)]
        assert [r.headers["x-fleetroute-endpoint"] for r in held[2:]] == ["a", "a"]
        assert await endpoint("sql") == "c"
        async with http.get(router.admin_url + "/metrics") as resp:
            page = await resp.text()
        assert 'fleetroute_lora_picks_total{policy="adapters",tier="active"} 14.0' in page
        assert 'fleetroute_lora_picks_total{policy="adapters",tier="free_slot"} 7.0' in page
    finally:
        for resp in held:
            resp.close()


def test_a_step_never_evicts_an_adapter_it_needs() -> None:
    # Slots [a, b]; the next step runs a and c: c takes b's slot (the least recently used not needed), a stays.
    e = engine(max_loras=2)
    e._activate_loras({"a"})
    e._activate_loras({"b"})
    loads = e.lora_loads
    e._activate_loras({"c", "a"})
    assert e.lora_loads - loads == 1 and set(e._lora_slots) == {"a", "c"}
