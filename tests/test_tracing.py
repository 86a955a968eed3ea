"""OpenTelemetry tracing (router/server/tracing.py): W3C trace context reaches the engine, spans arrive with the right
parents (in process and over real OTLP/HTTP), tracing is off by default, and a TTFT exemplar links to the trace."""

from __future__ import annotations

import asyncio
import io
import json
import random
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from multidict import CIMultiDict
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from router.config.settings import ConfigError, parse_settings
from router.server.access_log import AccessLog
from router.server.app import RunningRouter, build_context, start_router
from router.server.tracing import NO_TRACE
from tests.conftest import MODEL, router_config
from tests.fake_engine import FakeEngine
from tests.otlp_receiver import Receiver, otlp_receiver

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_PARENT}-01"  # sampled


def _traceparent(engine: FakeEngine, index: int = -1) -> tuple[str, str, str] | None:
    """(trace id, parent span id, flags) of the traceparent an engine received, or None."""
    headers = {k.lower(): v for k, v in engine.requests[index]["headers"].items()}
    value = headers.get("traceparent")
    if value is None:
        return None
    version, trace_id, parent, flags = value.split("-")
    assert version == "00"
    return trace_id, parent, flags


def _hex(span_id: int) -> str:
    return f"{span_id:016x}"


def _by_name(spans: list[ReadableSpan]) -> dict[str, list[ReadableSpan]]:
    out: dict[str, list[ReadableSpan]] = {}
    for span in spans:
        out.setdefault(span.name, []).append(span)
    return out


@pytest.fixture
async def traced() -> AsyncIterator[Any]:
    """Start routers whose spans go to an InMemorySpanExporter (the test hook), closed after the test."""
    started: list[RunningRouter] = []

    async def start(engines: list[FakeEngine], tracing: dict[str, Any] | None = None,
                    exporter: InMemorySpanExporter | None = None, **overrides: Any) -> RunningRouter:
        config = router_config(engines, **overrides)
        if tracing is not None:
            config["tracing"] = tracing
        ctx = build_context(parse_settings(config), rng=random.Random(7), span_exporter=exporter)
        running = await start_router(ctx)
        started.append(running)
        return running

    yield start
    for running in started:
        await running.close()


async def test_traceparent_reaches_the_engine_under_the_attempt_span_and_spans_link_up(
        make_engine, traced, http) -> None:
    engine = await make_engine("gpu-0")
    exporter = InMemorySpanExporter()
    policy = {"name": "main", "models": ["*"], "strategy": "least-connections",
              "admission": {"maxConcurrentPerEndpoint": 4}}
    router = await traced([engine], {"enabled": True}, exporter, policies=[policy])
    async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                         headers={"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}) as resp:
        assert resp.status == 200
        await resp.read()
    spans = _by_name(list(exporter.get_finished_spans()))
    (server,) = spans["POST /v1/chat/completions"]
    (admission,) = spans["admission"]
    (pick,) = spans["pick"]
    (attempt,) = spans["attempt"]
    # The client's trace is continued: same trace id, the client's span is the server span's parent.
    assert _hex(server.parent.span_id) == CLIENT_PARENT and server.parent.is_remote
    assert server.kind == SpanKind.SERVER and attempt.kind == SpanKind.CLIENT
    for child in (admission, pick, attempt):
        assert f"{child.context.trace_id:032x}" == CLIENT_TRACE
        assert child.parent.span_id == server.context.span_id
    # The engine sees the client's trace, with the attempt's span as its parent; the client's tracestate is kept.
    assert _traceparent(engine) == (CLIENT_TRACE, _hex(attempt.context.span_id), "01")
    assert {k.lower(): v for k, v in engine.requests[-1]["headers"].items()}["tracestate"] == "vendor=abc"
    # The decision summary on the pick, the attempt's outcome and first byte, the end on the server span.
    assert pick.attributes["fleetroute.policy"] == "main"
    assert pick.attributes["fleetroute.strategy"] == "least-connections"
    assert pick.attributes["fleetroute.endpoint"] == "gpu-0" and pick.attributes["fleetroute.pick.reason"]
    assert admission.attributes["fleetroute.admission.outcome"] == "admitted"
    assert attempt.attributes["fleetroute.endpoint"] == "gpu-0"
    assert attempt.attributes["fleetroute.outcome"] == "answered"
    assert attempt.attributes["http.response.status_code"] == 200
    assert [e.name for e in attempt.events] == ["first_byte"]
    assert attempt.start_time <= attempt.events[0].timestamp <= attempt.end_time
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["fleetroute.endpoint"] == "gpu-0" and server.attributes["gen_ai.request.model"] == MODEL
    assert server.attributes["fleetroute.attempts"] == 1
    assert server.start_time <= admission.start_time <= pick.start_time <= attempt.start_time
    assert attempt.end_time <= server.end_time


async def test_a_retried_request_has_two_attempt_spans_and_a_new_trace_without_a_client_header(
        make_engine, traced, http) -> None:
    bad = await make_engine("gpu-0", fail_status=500)
    good = await make_engine("gpu-1")
    exporter = InMemorySpanExporter()
    policy = {"name": "p", "models": ["*"], "strategy": "round-robin", "outlierDetection": {"enabled": False}}
    router = await traced([bad, good], {"enabled": True}, exporter, policies=[policy])
    for _ in range(4):  # round-robin: within two requests one starts on gpu-0 and is retried on gpu-1
        exporter.clear()
        async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200
            await resp.read()
        spans = _by_name(list(exporter.get_finished_spans()))
        if len(spans["attempt"]) == 2:
            break
    else:
        pytest.fail("no request was retried")
    (server,) = spans["POST /v1/chat/completions"]
    assert server.parent is None  # the client sent no traceparent: the trace starts here
    first, second = sorted(spans["attempt"], key=lambda s: s.start_time)
    assert [len(spans["pick"]), server.attributes["fleetroute.attempts"]] == [2, 2]
    for span in (*spans["pick"], first, second):
        assert span.parent.span_id == server.context.span_id
    assert (first.attributes["fleetroute.endpoint"], first.attributes["fleetroute.outcome"]) == ("gpu-0", "http_5xx")
    assert first.events == () or [e.name for e in first.events] == []
    assert (second.attributes["fleetroute.endpoint"], second.attributes["fleetroute.outcome"]) == ("gpu-1", "answered")
    # Each engine saw its own attempt as parent, in the router's trace.
    trace_id = f"{server.context.trace_id:032x}"
    assert _traceparent(bad)[:2] == (trace_id, _hex(first.context.span_id))
    assert _traceparent(good)[:2] == (trace_id, _hex(second.context.span_id))


async def test_a_malformed_traceparent_starts_a_new_trace_and_its_tracestate_is_dropped(
        make_engine, traced, http) -> None:
    engine = await make_engine("gpu-0")
    exporter = InMemorySpanExporter()
    router = await traced([engine], {"enabled": True}, exporter)
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT,
                         headers={"traceparent": "00-not-a-trace-01", "tracestate": "vendor=stale"}) as resp:
        assert resp.status == 200
        await resp.read()
    (server,) = _by_name(list(exporter.get_finished_spans()))["POST /v1/chat/completions"]
    assert server.parent is None  # W3C: an unparsable traceparent is ignored, a new trace starts
    (attempt,) = _by_name(list(exporter.get_finished_spans()))["attempt"]
    trace_id, parent, flags = _traceparent(engine)
    assert (trace_id, parent) == (f"{server.context.trace_id:032x}", _hex(attempt.context.span_id))
    assert int(flags, 16) & 1  # sampled (bit 1 may say the router drew a random trace id)
    assert "tracestate" not in {k.lower() for k in engine.requests[-1]["headers"]}  # it went with the bad parent


async def test_tracing_is_off_by_default_and_the_client_header_passes_untouched(make_engine, traced, http) -> None:
    engine = await make_engine("gpu-0")
    router = await traced([engine])
    assert not router.ctx.tracing.enabled
    # The no-op path: every request shares one object that records nothing.
    assert router.ctx.tracing.begin(CIMultiDict(), "POST", "/v1/completions", "r") is NO_TRACE
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        await resp.read()
    assert _traceparent(engine) is None  # nothing added
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT,
                         headers={"traceparent": TRACEPARENT}) as resp:
        await resp.read()
    assert _traceparent(engine) == (CLIENT_TRACE, CLIENT_PARENT, "01")  # the router is not in the trace
    async with http.get(router.admin_url + "/metrics") as resp:
        assert "fleetroute_tracing_requests_total{" not in await resp.text()


async def test_an_unsampled_trace_exports_nothing_but_still_propagates(make_engine, traced, http) -> None:
    engine = await make_engine("gpu-0")
    exporter = InMemorySpanExporter()
    router = await traced([engine], {"enabled": True, "sampleRatio": 0}, exporter)
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        await resp.read()
    assert exporter.get_finished_spans() == ()
    trace_id, _, flags = _traceparent(engine)
    # Downstream knows the trace and that it was not sampled (flag bit 0; bit 1 is W3C level 2's "random").
    assert int(flags, 16) & 1 == 0 and trace_id != "0" * 32
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT,
                         headers={"traceparent": TRACEPARENT}) as resp:
        await resp.read()
    assert len(exporter.get_finished_spans()) == 3  # parent-based: the client's sampled flag wins over the ratio
    async with http.get(router.admin_url + "/metrics") as resp:
        text = await resp.text()
    assert 'fleetroute_tracing_requests_total{sampled="false"} 1.0' in text
    assert 'fleetroute_tracing_requests_total{sampled="true"} 1.0' in text
    assert 'fleetroute_tracing_spans_exported_total{result="success"} 3.0' in text


async def test_ttft_exemplar_and_access_log_carry_the_trace_id(make_engine, traced, http) -> None:
    engine = await make_engine("gpu-0")
    exporter = InMemorySpanExporter()
    router = await traced([engine], {"enabled": True}, exporter)
    router.ctx.access_log = AccessLog(stream := io.BytesIO())
    async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                         headers={"traceparent": TRACEPARENT}) as resp:
        await resp.read()
    router.ctx.access_log.flush()
    assert json.loads(stream.getvalue())["trace_id"] == CLIENT_TRACE
    async with http.get(router.admin_url + "/metrics",
                        headers={"Accept": "application/openmetrics-text; version=1.0.0"}) as resp:
        assert resp.headers["Content-Type"].startswith("application/openmetrics-text")
        text = await resp.text()
    exemplars = [line for line in text.splitlines()
                 if line.startswith("fleetroute_time_to_first_byte_seconds_bucket") and " # " in line]
    assert exemplars, "no exemplar on the TTFT histogram"
    assert all(f'# {{trace_id="{CLIENT_TRACE}"}}' in line for line in exemplars)
    async with http.get(router.admin_url + "/metrics") as resp:  # a classic scraper: the text format, as before
        assert resp.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert "trace_id" not in await resp.text()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    async with otlp_receiver() as running:
        yield running


async def test_spans_arrive_over_real_otlp_http_at_a_local_receiver(
        make_engine, traced, http, receiver, monkeypatch) -> None:
    monkeypatch.setenv("FLEETROUTE_TEST_OTLP_HEADERS", "x-api-key=secret-1")
    engine = await make_engine("gpu-0")
    router = await traced([engine], {"enabled": True, "endpoint": receiver.url, "serviceName": "router-test",
                                     "headersEnv": "FLEETROUTE_TEST_OTLP_HEADERS"})
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT,
                         headers={"traceparent": TRACEPARENT}) as resp:
        await resp.read()
    await router.close()  # shutdown sends what the batch processor holds
    await asyncio.wait_for(receiver.got.wait(), 10)
    spans = receiver.spans()
    by_name = {span.name: span for span, _ in spans}
    assert set(by_name) == {"POST /v1/chat/completions", "pick", "attempt"}
    server = by_name["POST /v1/chat/completions"]
    assert server.trace_id.hex() == CLIENT_TRACE and server.parent_span_id.hex() == CLIENT_PARENT
    for name in ("pick", "attempt"):
        assert by_name[name].parent_span_id == server.span_id and by_name[name].trace_id == server.trace_id
    assert _traceparent(engine)[1] == by_name["attempt"].span_id.hex()
    assert {a.key: a.value.string_value for a in spans[0][1].attributes}["service.name"] == "router-test"
    assert receiver.headers[0].get("x-api-key") == "secret-1"


async def test_a_router_process_with_two_workers_exports_every_span_by_shutdown(
        tmp_path, make_engine, http, receiver) -> None:
    """The real `fleetroute router` with two workers: the exporter thread starts in the worker that serves, and what
    it holds is sent when SIGTERM stops it. OpenMetrics scrapes work in multi-process mode (without exemplars)."""
    import signal

    from tests.test_serve_process import start_process

    engine = await make_engine("gpu-0")
    proc, ingress, admin, _ = await start_process(tmp_path, [engine], workers=2,
                                                  tracing={"enabled": True, "endpoint": receiver.url})
    try:
        sent = set()
        for i in range(10):
            trace_id = f"{i + 1:032x}"
            sent.add(trace_id)
            async with http.post(ingress + "/v1/chat/completions", json=CHAT,
                                 headers={"Connection": "close", "traceparent": f"00-{trace_id}-{CLIENT_PARENT}-01"}
                                 ) as resp:
                assert resp.status == 200
        async with http.get(admin + "/metrics", headers={"Accept": "application/openmetrics-text"}) as resp:
            assert resp.status == 200 and resp.headers["Content-Type"].startswith("application/openmetrics-text")
            assert "fleetroute_time_to_first_byte_seconds_bucket" in await resp.text()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 20) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    servers = [span for span, _ in receiver.spans() if span.name == "POST /v1/chat/completions"]
    assert {span.trace_id.hex() for span in servers} == sent
    assert _traceparent(engine)[0] in sent


async def test_an_unreachable_collector_costs_requests_nothing_and_is_counted(make_engine, traced, http) -> None:
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    engine = await make_engine("gpu-0")
    router = await traced([engine], {"enabled": True, "endpoint": f"http://127.0.0.1:{port}/v1/traces",
                                     "timeout": "2s"})
    for _ in range(5):
        async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200  # exports happen on the SDK's thread, never on the request path
    loop = asyncio.get_running_loop()
    began = loop.time()
    await router.close()  # the queued batch is tried once more, then dropped: shutdown is bounded
    assert loop.time() - began < 5
    body, _ = router.ctx.metrics.render()
    assert b'fleetroute_tracing_spans_exported_total{result="failure"} 15.0' in body  # 3 spans x 5 requests


@pytest.mark.parametrize(
    "block, message",
    [
        ({"enabled": "yes"}, "tracing.enabled: must be true or false"),
        ({"enabled": True, "endpoint": "collector:4318"}, "tracing.endpoint: must be an http:// or https:// URL"),
        ({"sampleRatio": 1.5}, "tracing.sampleRatio: must be >= 0.0 and <= 1.0, got 1.5"),
        ({"samplingRatio": 0.5}, "tracing.samplingRatio: unknown field"),
        ({"headersEnv": "FLEETROUTE_TEST_UNSET_VARIABLE"}, "tracing.headersEnv: the environment variable it names is not set"),
        ({"headersEnv": "FLEETROUTE_TEST_BAD_HEADERS"}, "tracing.headersEnv: must hold name=value pairs"),
        ("on", "tracing: must be a mapping"),
    ],
)
def test_bad_tracing_config_is_a_clear_error(block: Any, message: str, monkeypatch) -> None:
    monkeypatch.setenv("FLEETROUTE_TEST_BAD_HEADERS", "just-a-token")
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse_settings({"tracing": block})


def test_tracing_settings_defaults_and_headers_file(tmp_path) -> None:
    assert parse_settings({}).tracing is None
    secret = tmp_path / "headers"
    secret.write_text("authorization=Bearer abc, x-team = infra\n")
    tracing = parse_settings({"tracing": {"enabled": True, "headersFile": str(secret), "sampleRatio": 0.1}}).tracing
    assert tracing is not None and tracing.enabled and tracing.sample_ratio == 0.1
    assert tracing.headers == (("authorization", "Bearer abc"), ("x-team", "infra"))
    assert tracing.endpoint == "http://127.0.0.1:4318/v1/traces" and tracing.service_name == "fleetroute"
    assert not parse_settings({"tracing": {}}).tracing.enabled  # a block alone does not turn it on


async def test_tracing_changes_need_a_restart(make_engine, traced) -> None:
    from router.server.app import ReloadRejected, apply_settings

    engine = await make_engine("gpu-0")
    router = await traced([engine])
    with pytest.raises(ReloadRejected, match="tracing"):
        apply_settings(router.ctx, parse_settings({**router_config([engine]), "tracing": {"enabled": True}}))



def test_an_unimportable_exporter_is_a_config_error_when_tracing_is_on(monkeypatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "opentelemetry.exporter.otlp.proto.http.trace_exporter", None)
    with pytest.raises(ConfigError, match=r"tracing.enabled: tracing needs the OTLP exporter, which cannot be imported"):
        parse_settings({"tracing": {"enabled": True}})
    assert parse_settings({"tracing": {"enabled": False}}).tracing is not None  # off: nothing to import


def test_off_the_tracing_sdk_is_never_imported() -> None:
    """Zero cost off: with tracing off the router imports nothing of OpenTelemetry's tracing SDK or exporter, and no
    OpenTelemetry module beyond those redis-py itself imports when it finds OpenTelemetry installed (its opt-in
    metrics, redis/observability/providers.py)."""
    import subprocess
    import sys

    code = ("import sys, redis; before = {m for m in sys.modules if m.startswith('opentelemetry')}; "
            "import router.server.app, router.server.handlers, router.cli; from router.config.settings import parse_settings; "
            "parse_settings({'tracing': {'enabled': False}}); "
            "after = {m for m in sys.modules if m.startswith('opentelemetry')}; "
            "print(sorted(after - before), sorted(m for m in after if m.startswith(('opentelemetry.sdk.trace', "
            "'opentelemetry.exporter'))))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[] []"
