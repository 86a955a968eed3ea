"""Explained routing decisions through a real router (aiohttp) and fake engines on 127.0.0.1: who may ask,
what the response carries (streamed or not), sampled log lines, /admin/decisions, retries, stickiness,
admission and the pool's exclusions."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from router.config.settings import ConfigError, parse_settings
from router.model import Endpoint, EndpointState
from router.runtime.logs import JsonFormatter
from router.server.app import apply_settings
from router.server.explain import DECISION_ID_HEADER, EXPLAIN_HEADER, EXPLANATION_HEADER, MAX_HEADER_BYTES
from tests.conftest import MODEL, router_config

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
ADMIN_TOKEN = "admin-token-explain-0123456789"
DEBUG_KEY = "sk-debug-0123456789abcdef"
PLAIN_KEY = "sk-plain-fedcba9876543210"
ASK = {EXPLAIN_HEADER: ADMIN_TOKEN}


@pytest.fixture
def admin_token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("FLEETROUTE_ADMIN_TOKEN", ADMIN_TOKEN)
    return ADMIN_TOKEN


def _admin() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def explanation(resp: aiohttp.ClientResponse) -> dict[str, Any]:
    raw = resp.headers[EXPLANATION_HEADER]
    assert raw.isascii() and len(raw) <= MAX_HEADER_BYTES
    return json.loads(raw)


async def chat(http: aiohttp.ClientSession, router: Any, body: dict[str, Any] | None = None,
               headers: dict[str, str] | None = None) -> tuple[aiohttp.ClientResponse, bytes]:
    async with http.post(router.ingress_url + "/v1/chat/completions", json=body or CHAT, headers=headers) as resp:
        return resp, await resp.read()


async def metric(http: aiohttp.ClientSession, router: Any, series: str) -> float:
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    for line in text.splitlines():
        key, _, value = line.rpartition(" ")
        if key == series:
            return float(value)
    return 0.0


def assert_least_loaded(expl: dict[str, Any]) -> None:
    """The explanation re-derives the choice: the endpoint it names has the least load it lists."""
    loads = {c["id"]: c["load"] for c in expl["candidates"]}
    assert loads[expl["endpoint"]] == min(loads.values()), loads


# ---- asking ----------------------------------------------------------------------------------------------


async def test_an_operator_gets_the_explanation_of_the_endpoint_that_served_it(
    make_engine, make_router, http, admin_token
) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    router = await make_router(engines)
    with router.ctx.loads.track("gpu-0"):  # a request in flight at gpu-0, as the proxy marks one
        resp, body = await chat(http, router, headers=ASK)
    assert resp.status == 200 and orjson.loads(body)["choices"]
    expl = explanation(resp)
    assert expl["endpoint"] == resp.headers["x-fleetroute-endpoint"] != "gpu-0"
    assert expl["reason"] == "least_loaded" and expl["policy"] == "default"
    assert expl["why"].startswith("least load in flight (0 requests) of 3 candidates, a tie of 2 broken at random")
    assert expl["strategy"] == "least-connections"
    assert_least_loaded(expl)
    by_id = {c["id"]: c for c in expl["candidates"]}
    assert by_id["gpu-0"]["in_flight"] == 1 and by_id["gpu-0"]["load"] == 1
    assert {c["breaker"] for c in expl["candidates"]} == {"closed"} and by_id["gpu-0"]["slow_start_weight"] == 1
    assert by_id["gpu-0"]["telemetry"] == "none"  # telemetry is off in this router
    assert expl["pool"] == {"routable": 3, "left_out": {}, "panic": False}
    assert expl["attempts"] == [{"endpoint": expl["endpoint"], "reason": "least_loaded", "outcome": "sent"}]
    assert all(EXPLAIN_HEADER not in {k.lower() for k in r["headers"]} for e in engines for r in e.requests)
    # The full record, by the id in the response, now with the final status and outcome.
    decision_id = resp.headers[DECISION_ID_HEADER]
    async with http.get(router.admin_url + f"/admin/decisions/{decision_id}", headers=_admin()) as got:
        record = await got.json()
    assert record["endpoint"] == expl["endpoint"] and record["status"] == 200 and record["recorded"] == ["requested"]
    assert record["attempts"][0]["outcome"] == "answered" and record["attempts"][0]["status"] == 200
    assert record["model"] == MODEL and record["request_id"] == resp.headers["X-Request-Id"]
    assert await metric(http, router, 'fleetroute_explain_requests_total{outcome="explained"}') == 1


async def test_a_streamed_answer_carries_the_explanation_before_its_first_token(
    make_engine, make_router, http, admin_token
) -> None:
    engine = await make_engine("gpu-0")
    engine.gate = asyncio.Event()
    router = await make_router([engine, await make_engine("gpu-1", models=("other",))])
    async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                         headers=ASK) as resp:
        await engine.first_token_sent.wait()  # headers are here while the stream is still held open
        expl = explanation(resp)
        assert expl["endpoint"] == resp.headers["x-fleetroute-endpoint"] == "gpu-0"
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        # While it streams, the record is already there (no status yet).
        async with http.get(router.admin_url + f"/admin/decisions/{expl['decision_id']}", headers=_admin()) as got:
            assert (await got.json())["status"] is None
        engine.gate.set()
        body = await resp.read()
    assert body.rstrip().endswith(b"data: [DONE]")
    assert [c["id"] for c in expl["candidates"]] == ["gpu-0"]  # gpu-1 does not serve the model


@pytest.mark.parametrize(
    "keys, admin, headers, explained",
    [
        pytest.param(None, False, {EXPLAIN_HEADER: "1"}, False, id="no credential configured: nobody may ask"),
        pytest.param(None, True, {EXPLAIN_HEADER: "1"}, False, id="1 without a debug key"),
        pytest.param(None, True, {EXPLAIN_HEADER: "not-the-token"}, False, id="a wrong admin token"),
        pytest.param(None, True, ASK, True, id="the admin token"),
        pytest.param(f"{DEBUG_KEY} explain\n{PLAIN_KEY}\n", False,
                     {EXPLAIN_HEADER: "1", "Authorization": f"Bearer {PLAIN_KEY}"}, False,
                     id="a client key not marked explain"),
        pytest.param(f"{DEBUG_KEY} explain\n{PLAIN_KEY}\n", False,
                     {EXPLAIN_HEADER: "true", "Authorization": f"Bearer {DEBUG_KEY}"}, True,
                     id="a client key marked explain"),
        pytest.param(f"{DEBUG_KEY} explain\n{PLAIN_KEY}\n", False,
                     {EXPLAIN_HEADER: DEBUG_KEY, "Authorization": f"Bearer {PLAIN_KEY}"}, False,
                     id="a debug key as the header value is not the admin token"),
        pytest.param(f"{PLAIN_KEY}\n", True,
                     {EXPLAIN_HEADER: ADMIN_TOKEN, "Authorization": f"Bearer {PLAIN_KEY}"}, True,
                     id="the admin token beside a client key"),
    ],
)
async def test_only_authorised_clients_are_explained_and_everyone_is_served(
    make_engine, make_router, http, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    keys: str | None, admin: bool, headers: dict[str, str], explained: bool,
) -> None:
    if admin:
        monkeypatch.setenv("FLEETROUTE_ADMIN_TOKEN", ADMIN_TOKEN)
    else:
        monkeypatch.delenv("FLEETROUTE_ADMIN_TOKEN", raising=False)
    auth = {}
    if keys is not None:
        (tmp_path / "keys").write_text(keys)
        auth = {"auth": {"apiKeysFile": str(tmp_path / "keys")}}
    engine = await make_engine("gpu-0")
    router = await make_router([engine], **auth)
    resp, body = await chat(http, router, headers=headers)
    assert resp.status == 200 and orjson.loads(body)["choices"]  # served normally either way
    assert (EXPLANATION_HEADER in resp.headers) is explained
    assert (DECISION_ID_HEADER in resp.headers) is explained
    assert EXPLAIN_HEADER not in {k.lower() for k in engine.requests[-1]["headers"]}  # never forwarded
    outcome = "explained" if explained else "denied"
    assert await metric(http, router, f'fleetroute_explain_requests_total{{outcome="{outcome}"}}') == 1
    assert len(router.ctx.decisions) == (1 if explained else 0)


async def test_an_unasked_request_records_nothing(make_engine, make_router, http) -> None:
    router = await make_router([await make_engine("gpu-0")])
    resp, _ = await chat(http, router)
    assert resp.status == 200 and EXPLANATION_HEADER not in resp.headers
    assert len(router.ctx.decisions) == 0


# ---- sampling and the log --------------------------------------------------------------------------------


async def test_sampled_decisions_are_logged_one_json_line_each(
    make_engine, make_router, http, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="fleetroute.decisions")
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    router = await make_router(engines, explain={"sampleRate": 1.0, "recent": 16})
    served = []
    for i in range(3):
        resp, _ = await chat(http, router, headers={"x-request-id": f"req-{i}"})
        assert resp.status == 200 and EXPLANATION_HEADER not in resp.headers  # sampled, not asked: no header
        served.append(resp.headers["x-fleetroute-endpoint"])
    lines = [r for r in caplog.records if r.name == "fleetroute.decisions"]
    assert [r.getMessage() for r in lines] == ["routing decision"] * 3
    assert [r.request_id for r in lines] == ["req-0", "req-1", "req-2"]
    assert [r.endpoint for r in lines] == served
    for record in lines:
        assert record.recorded == ["sampled"] and record.status == 200 and record.reason == "least_loaded"
        assert record.attempts[0]["outcome"] == "answered" and record.duration_ms > 0
    parsed = orjson.loads(JsonFormatter().format(lines[0]))  # one JSON object per line, as the router writes it
    assert parsed["logger"] == "fleetroute.decisions" and parsed["decision_id"] == lines[0].decision_id
    assert await metric(http, router, "fleetroute_decisions_sampled_total") == 3
    assert await metric(http, router, "fleetroute_decisions_kept") == 3
    # Sampling is turned off by a live reload: no more lines.
    apply_settings(router.ctx, parse_settings(router_config(engines, explain={"sampleRate": 0})))
    await chat(http, router)
    assert len([r for r in caplog.records if r.name == "fleetroute.decisions"]) == 3
    assert len(router.ctx.decisions) == 3  # what was kept stays


# ---- /admin/decisions ------------------------------------------------------------------------------------


async def test_admin_decisions_filters_and_keeps_only_the_newest(make_engine, make_router, http, admin_token) -> None:
    a = await make_engine("gpu-a", models=("model-a",))
    b = await make_engine("gpu-b", models=("model-b",))
    router = await make_router([a, b], explain={"recent": 5})
    for i in range(8):
        model = "model-a" if i % 2 == 0 else "model-b"
        resp, _ = await chat(http, router, body={"model": model, "messages": [{"role": "user", "content": "x"}]},
                             headers={**ASK, "x-request-id": f"r{i}"})
        assert resp.status == 200
    url = router.admin_url + "/admin/decisions"
    async with http.get(url) as resp:
        assert resp.status == 401  # the admin token guards it like every /admin route
    async with http.get(url, headers=_admin()) as resp:
        listing = await resp.json()
    assert [d["request_id"] for d in listing["decisions"]] == ["r7", "r6", "r5", "r4", "r3"]  # newest first, 5 kept
    assert listing["kept"] == 5 and listing["recent"] == 5
    first = listing["decisions"][0]
    assert {"decision_id", "time", "model", "policy", "endpoint", "reason", "attempts"} <= set(first)
    assert first["attempts"][0]["candidates"][0]["id"] == first["endpoint"] == "gpu-b"
    for query, expected in [
        ("?model=model-a", ["r6", "r4"]),
        ("?endpoint=gpu-b", ["r7", "r5", "r3"]),
        ("?model=model-a&endpoint=gpu-b", []),
        ("?limit=2", ["r7", "r6"]),
        ("?reason=least_loaded&policy=default&limit=1", ["r7"]),
        ("?reason=prefix_hit", []),
    ]:
        async with http.get(url + query, headers=_admin()) as resp:
            assert [d["request_id"] for d in (await resp.json())["decisions"]] == expected, query
    async with http.get(url + "?limit=" + "9" * 5000, headers=_admin()) as resp:
        assert resp.status == 200 and len((await resp.json())["decisions"]) == 5  # clamped to what is kept
    for query, param in [("?limit=0", "limit"), ("?limit=ten", "limit"), ("?limit=%C2%B2", "limit"),
                         ("?modle=x", "modle")]:
        async with http.get(url + query, headers=_admin()) as resp:
            error = (await resp.json())["error"]
            assert resp.status == 400 and error["code"] == "invalid_query" and error["param"] == param
    async with http.get(url + "/no-such-decision", headers=_admin()) as resp:
        assert resp.status == 404 and (await resp.json())["error"]["code"] == "decision_not_found"


# ---- what explanations show ------------------------------------------------------------------------------


async def test_a_retry_shows_both_attempts(make_engine, make_router, http, admin_token) -> None:
    dead = await make_engine("gpu-dead")
    await dead.stop()  # its port now refuses connections: the request never left, so it is retried
    live = await make_engine("gpu-live")
    router = await make_router([dead, live], policies=[{
        "name": "p", "strategy": "least-connections", "outlierDetection": {"enabled": False}}])
    for _ in range(10):  # ties are broken at random (seeded): a few requests meet the dead endpoint first
        resp, _ = await chat(http, router, headers=ASK)
        assert resp.status == 200 and resp.headers["x-fleetroute-endpoint"] == "gpu-live"
        expl = explanation(resp)
        if len(expl["attempts"]) == 2:
            break
    else:
        pytest.fail("no request met gpu-dead first")
    first, second = expl["attempts"]
    assert first["endpoint"] == "gpu-dead" and first["outcome"] == "connect" and "error" in first
    assert second == {"endpoint": "gpu-live", "reason": "least_loaded", "outcome": "sent"}
    assert expl["endpoint"] == "gpu-live" and expl["excluded"] == {"gpu-dead": "failed_attempt"}
    assert [c["id"] for c in expl["candidates"]] == ["gpu-live"]
    async with http.get(router.admin_url + f"/admin/decisions/{expl['decision_id']}", headers=_admin()) as got:
        record = await got.json()
    assert [a["outcome"] for a in record["attempts"]] == ["connect", "answered"]
    assert {c["id"] for c in record["attempts"][0]["candidates"]} == {"gpu-dead", "gpu-live"}


async def test_left_out_endpoints_and_a_ramping_one_are_shown(make_engine, make_router, http, admin_token) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(4)]
    router = await make_router(engines[:3])
    async with http.post(router.admin_url + "/admin/endpoints/gpu-2/drain", headers=_admin()) as resp:
        assert resp.status == 200
    # gpu-3 joins now: slow start ramps it from its minimum weight (0.1).
    balancer = router.ctx.balancer
    balancer.set_endpoints([*balancer.endpoints(), Endpoint("gpu-3", engines[3].url, (MODEL,))])
    balancer.rebuild()
    resp, _ = await chat(http, router, headers=ASK)
    expl = explanation(resp)
    assert expl["pool"]["left_out"] == {"gpu-2": "draining"} and expl["pool"]["routable"] == 3
    ramping = {c["id"]: c for c in expl["candidates"]}["gpu-3"]
    assert 0 < ramping["slow_start_weight"] < 1
    assert ramping["load"] == pytest.approx(1 / ramping["slow_start_weight"] - 1, abs=1e-3)
    assert_least_loaded(expl)
    assert expl["endpoint"] in ("gpu-0", "gpu-1")


async def test_no_endpoint_is_explained_too(make_engine, make_router, http, admin_token) -> None:
    router = await make_router([await make_engine("gpu-0")])
    router.ctx.balancer.set_state("gpu-0", EndpointState.DRAINING)
    resp, _ = await chat(http, router, headers=ASK)
    assert resp.status == 503
    expl = explanation(resp)
    assert expl["endpoint"] is None and expl["reason"] == "no_candidate"
    assert expl["pool"] == {"routable": 0, "left_out": {"gpu-0": "draining"}, "panic": False}


async def test_stickiness_is_explained(make_engine, make_router, http, admin_token) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    router = await make_router(engines, policies=[{
        "name": "p", "strategy": "least-connections", "stickiness": {"ttl": "10m"}}])
    session = {**ASK, "x-session-id": "conversation-7"}
    resp, _ = await chat(http, router, headers=session)
    first = explanation(resp)
    assert first["stickiness"] == {"session": True, "pinned": None, "outcome": "new"}
    assert first["reason"] == "least_loaded"
    resp, _ = await chat(http, router, headers=session)
    second = explanation(resp)
    assert second["endpoint"] == first["endpoint"] == resp.headers["x-fleetroute-endpoint"]
    assert second["reason"] == "sticky_hit" and second["why"].startswith("the session's pinned endpoint")
    assert second["stickiness"] == {"session": True, "pinned": first["endpoint"], "outcome": "hit"}
    pinned = {c["id"]: c for c in second["candidates"]}[first["endpoint"]]
    assert pinned["sticky"] == "hit" and pinned["cluster_in_flight"] < pinned["sticky_bound"]
    assert "conversation-7" not in resp.headers[EXPLANATION_HEADER]  # the session key itself never shows


async def test_admission_class_queueing_and_shedding_are_explained(make_engine, make_router, http, admin_token) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], policies=[{
        "name": "p", "strategy": "round-robin", "admission": {"maxConcurrentPerEndpoint": 1, "maxQueue": 0}}])
    resp, _ = await chat(http, router, headers={**ASK, "x-priority": "high"})
    admitted = explanation(resp)
    assert admitted["admission"]["class"] == "high" and admitted["admission"]["queued_ms"] < 1000
    assert admitted["reason"] == "rotation" and "shed" not in admitted["admission"]
    with router.ctx.loads.track("gpu-0"):  # gpu-0 at its cap of 1, and the queue holds nobody
        resp, body = await chat(http, router, headers=ASK)
    assert resp.status == 429 and orjson.loads(body)["error"]["code"] == "queue_full"
    expl = explanation(resp)
    assert expl["admission"]["class"] == "normal" and expl["admission"]["shed"] == "queue_full"
    assert expl["attempts"] == [] and expl["reason"] == "no_attempt"


async def test_the_header_stays_bounded_on_a_large_pool(make_engine, make_router, http, admin_token) -> None:
    engine = await make_engine("gpu-0")
    endpoints = [{"id": f"gpu-{i:03d}", "url": engine.url, "models": [MODEL]} for i in range(120)]
    router = await make_router([engine], endpoints=endpoints, explain={"headerCandidates": 8})
    resp, _ = await chat(http, router, headers=ASK)
    expl = explanation(resp)
    assert len(expl["candidates"]) == 8 and expl["candidates_omitted"] == 120 - 8
    assert expl["candidates"][0]["id"] == expl["endpoint"] == resp.headers["x-fleetroute-endpoint"]
    assert expl["detail"]["tied"] == 120 and len(expl["detail"]["tied_with"]) == 16  # all idle: a random one
    async with http.get(router.admin_url + f"/admin/decisions/{expl['decision_id']}", headers=_admin()) as got:
        record = await got.json()
    attempt = record["attempts"][0]
    assert len(attempt["candidates"]) == 64 and attempt["candidates_omitted"] == 120 - 64  # memory bound


async def test_candidates_carry_the_telemetry_the_picker_saw_and_its_age(make_engine, make_router, http,
                                                                           admin_token) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(2)]
    engines[1].load.waiting = 3
    engines[1].load.kv_usage = 0.5
    router = await make_router(engines, telemetry={"enabled": True, "interval": "1s"})  # embedded scraping
    ctx = router.ctx
    while any(v.telemetry is None for v in ctx.balancer.snapshot.views):
        await asyncio.wait_for(ctx.telemetry_round.wait(), 10)  # the first round runs at start-up
    resp, _ = await chat(http, router, headers=ASK)
    gpu1 = {c["id"]: c for c in explanation(resp)["candidates"]}["gpu-1"]
    assert gpu1["num_waiting"] == 3 and gpu1["kv_cache_usage"] == 0.5 and gpu1["telemetry_age_s"] >= 0


# ---- configuration ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block, message",
    [
        ({"sampleRate": 2}, "explain.sampleRate: must be >= 0 and <= 1, got 2"),
        ({"sampleRate": "often"}, "explain.sampleRate: must be a number, got 'often'"),
        ({"recent": -1}, "explain.recent: must be between 0 and 10000, got -1"),
        ({"headerCandidates": 0}, "explain.headerCandidates: must be between 1 and 64, got 0"),
        ({"sampleRat": 0.1}, "explain.sampleRat: unknown field (expected one of: headerCandidates, recent, sampleRate)"),
        ("on", "explain: must be a mapping, got 'on'"),
    ],
)
def test_bad_explain_config_names_the_field(block: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings({"explain": block})
    assert str(info.value) == message


def test_explain_defaults_and_marked_keys(tmp_path: Path) -> None:
    assert parse_settings({}).explain is None  # the defaults: nothing sampled, the newest 256 kept
    settings = parse_settings({"explain": {"sampleRate": 0.01}})
    assert settings.explain is not None and settings.explain.sample_rate == 0.01 and settings.explain.recent == 256
    (tmp_path / "keys").write_text(f"{DEBUG_KEY} explain, {PLAIN_KEY}\n")
    auth = parse_settings({"auth": {"apiKeysFile": str(tmp_path / "keys")}}).auth
    assert auth is not None and len(auth.api_key_digests) == 2 and len(auth.explain_key_digests) == 1
    assert DEBUG_KEY not in repr(auth)
