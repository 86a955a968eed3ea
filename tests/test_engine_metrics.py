"""Engine telemetry from vLLM's own /metrics: parsing across vLLM versions, and the adaptive policy acting on
it through a real router whose embedded collector scrapes real (fake-engine) HTTP endpoints."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from router.model import Telemetry
from tests.conftest import MODEL
from tests.fake_engine import EngineLoad
from tests.redis_server import redis_url  # noqa: F401 - fixture
from worker.vllm_metrics import parse_vllm_metrics

# Shaped like vLLM v1's page: labels, data-parallel engines, histograms and counters around the gauges.
VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama-3-8b"} 3.0
vllm:num_requests_running{engine="1",model_name="llama-3-8b"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama-3-8b"} 4.0
vllm:num_requests_waiting{engine="1",model_name="llama-3-8b"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama-3-8b"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="llama-3-8b"} 0.25
# HELP vllm:prefix_cache_queries_total Prefix cache queries.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama-3-8b"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="llama-3-8b"} 1.7e9
# HELP vllm:prefix_cache_hits_total Prefix cache hits.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama-3-8b"} 250.0
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="llama-3-8b"} 7.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="llama-3-8b"} 0.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="+Inf",model_name="llama-3-8b"} 10.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="llama-3-8b"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="llama-3-8b"} 1.5
"""

VLLM_V0 = """\
# HELP vllm:num_requests_running Number of requests currently running on GPU.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{model_name="m"} 7.0
# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{model_name="m"} 0.9
"""


def test_vllm_v1_page_sums_counts_and_averages_usage_across_engines() -> None:
    e = parse_vllm_metrics(VLLM_V1)
    assert (e.num_running, e.num_waiting, e.kv_cache_usage) == (5.0, 5.0, 0.375)
    assert (e.prefix_cache_queries, e.prefix_cache_hits, e.preemptions_total) == (1000.0, 250.0, 7.0)
    assert e.up


def test_vllm_v0_names_are_understood_and_missing_series_stay_unknown() -> None:
    e = parse_vllm_metrics(VLLM_V0)
    assert e.kv_cache_usage == 0.9 and e.num_running == 7.0
    assert e.num_waiting is None and e.prefix_cache_queries is None


def test_a_page_without_vllm_series_gives_unknown_signals() -> None:
    e = parse_vllm_metrics("# just a comment\nsome_other_metric 1\n")
    assert (e.kv_cache_usage, e.num_waiting, e.num_running) == (None, None, None)


async def test_adaptive_routes_by_scraped_engine_load(make_engine, make_router, http) -> None:
    # gpu-0 reports a full KV cache and a long queue, gpu-1 and gpu-2 are idle. With power of two choices
    # gpu-0 has the lowest score of any pair it is drawn into, so it gets nothing.
    busy = await make_engine("gpu-0", load=EngineLoad(waiting=30, running=64, kv_usage=0.95))
    idle = [await make_engine(f"gpu-{i}", load=EngineLoad(kv_usage=0.05, legacy_names=i == 2)) for i in (1, 2)]
    router = await make_router(
        [busy, *idle],
        policies=[{"name": "default", "strategy": "adaptive"}],
        telemetry={"enabled": True, "interval": "50ms", "staleAfter": "10s"},
    )
    await asyncio.wait_for(router.ctx.telemetry_round.wait(), 5)
    served: Counter[str] = Counter()
    for _ in range(30):
        async with http.post(router.ingress_url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as resp:
            served[resp.headers["x-fleetroute-endpoint"]] += 1
    assert served["gpu-0"] == 0
    assert served["gpu-1"] > 5 and served["gpu-2"] > 5
    async with http.get(router.admin_url + "/admin/endpoints") as resp:
        endpoints = {e["id"]: e for e in (await resp.json())["endpoints"]}
    assert endpoints["gpu-0"]["telemetry"]["num_waiting"] == 30
    assert endpoints["gpu-0"]["telemetry"]["kv_cache_usage"] == pytest.approx(0.95)
    assert endpoints["gpu-2"]["telemetry"]["kv_cache_usage"] == pytest.approx(0.05)  # from the v0 series name


async def test_unreachable_metrics_leave_telemetry_unknown_and_are_counted(make_engine, make_router, http) -> None:
    live = await make_engine("gpu-0")
    dead = await make_engine("gpu-1")
    await dead.stop()
    router = await make_router(
        [live, dead],
        policies=[{"name": "default", "strategy": "adaptive"}],
        telemetry={"enabled": True, "interval": "50ms"},
    )
    await asyncio.wait_for(router.ctx.telemetry_round.wait(), 5)
    views = router.ctx.balancer.snapshot.by_id
    assert views["gpu-0"].telemetry is not None and views["gpu-1"].telemetry is None
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert 'fleetroute_engine_scrape_errors_total{endpoint="gpu-1"}' in text
    assert "fleetroute_telemetry_unknown_endpoints 1.0" in text


async def test_stale_telemetry_becomes_unknown(make_engine, make_router) -> None:
    engine = await make_engine("gpu-0", load=EngineLoad(waiting=3))
    now = [100.0]
    router = await make_router(
        [engine], policies=[{"name": "default", "strategy": "adaptive"}],
        telemetry={"enabled": False, "staleAfter": "5s"},
        clock=lambda: now[0],  # fake time: no sleeping
    )
    balancer = router.ctx.balancer
    balancer.report_telemetry("gpu-0", Telemetry(reported_at=100.0, num_waiting=3))
    balancer.rebuild()
    assert balancer.snapshot.by_id["gpu-0"].telemetry is not None
    now[0] = 105.5
    balancer.rebuild()
    assert balancer.snapshot.by_id["gpu-0"].telemetry is None


@pytest.mark.parametrize("labels, tokens", [
    pytest.param('kv_cache_size_tokens="1048576",num_gpu_blocks="8192",block_size="128"', 1048576,
                 id="kv_cache_size_tokens where present"),
    pytest.param('num_gpu_blocks="2048",block_size="16"', 2048 * 16, id="num_gpu_blocks x block_size otherwise"),
    pytest.param('kv_cache_size_tokens="None",num_gpu_blocks="100",block_size="16"', 1600,
                 id="a None size falls back to the blocks"),
    pytest.param('num_gpu_blocks="None",block_size="16"', None, id="unknown blocks: unknown capacity"),
])
def test_kv_capacity_from_cache_config_info(labels: str, tokens: int | None) -> None:
    page = ("# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{engine="0",{labels}}} 1.0\n')
    assert parse_vllm_metrics(page).kv_capacity_tokens == tokens


def test_kv_capacity_sums_data_parallel_engines_and_is_unknown_if_one_is() -> None:
    head = "# HELP vllm:cache_config_info x\n# TYPE vllm:cache_config_info gauge\n"
    two = head + ('vllm:cache_config_info{engine="0",num_gpu_blocks="10",block_size="16"} 1.0\n'
                  'vllm:cache_config_info{engine="1",num_gpu_blocks="10",block_size="16"} 1.0\n')
    assert parse_vllm_metrics(two).kv_capacity_tokens == 320
    broken = two.replace('engine="1",num_gpu_blocks="10"', 'engine="1",num_gpu_blocks="None"')
    assert parse_vllm_metrics(broken).kv_capacity_tokens is None


@pytest.mark.parametrize("name", ["idle", "busy"])
def test_the_captured_vllm_pages_report_their_kv_capacity(name: str) -> None:
    with open(f"tests/data/vllm_metrics_{name}.txt") as f:
        assert parse_vllm_metrics(f.read()).kv_capacity_tokens == 8192 * 128


async def test_the_kv_capacity_and_prefix_counters_reach_the_routers_telemetry(redis_url) -> None:  # noqa: F811
    # Through the wire schema: an agent-style record round-trips via a real Redis into router.model.Telemetry.
    import time
    import uuid

    import redis.asyncio as aioredis

    from router.runtime.redis_client import RedisSettings, connect
    from router.telemetry.feed import RedisStore, admit_record, to_telemetry
    from worker.protocol import EngineSample, GpuSample, TelemetryRecord, decode, encode
    from worker.publisher import RedisPublisher

    endpoint = f"gpu-{uuid.uuid4().hex[:8]}"
    client = aioredis.from_url(redis_url, decode_responses=True)
    store = RedisStore(connect(RedisSettings(url=redis_url), timeout=1.0))
    try:
        record = TelemetryRecord(endpoint_id=endpoint, reported_at=time.time(), seq=1, interval=1.0, gpu_source="none",
                                 gpu=GpuSample(), prefix_cache_hit_rate=0.25,
                                 engine=EngineSample(up=True, prefix_cache_queries=400.0, prefix_cache_hits=100.0,
                                                     kv_capacity_tokens=1048576))
        await RedisPublisher(client, ttl=30).publish(record)
        raw = (await store.read([endpoint]))[endpoint]
        assert raw[b"kv_capacity_tokens"] == b"1048576"
        tel = to_telemetry(admit_record(endpoint, raw, wall_now=time.time()), wall_now=time.time(), mono_now=100.0)
        assert (tel.kv_capacity_tokens, tel.prefix_cache_hit_rate, tel.prefix_cache_queries,
                tel.prefix_cache_hits) == (1048576, 0.25, 400.0, 100.0)
        old_agent = {k: v for k, v in encode(record).items() if k != "kv_capacity_tokens"}
        assert decode(old_agent).engine.kv_capacity_tokens is None  # an older agent: unknown, not an error
    finally:
        await client.delete(f"fleetroute:v1:telemetry:{endpoint}")
        await client.aclose()
        await store.close()
