"""Every mechanism shows up in Prometheus metrics and in structured access logs."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path

import pytest

from router.runtime.logs import JsonFormatter
from router.server.access_log import AccessLog
from tests.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def test_metrics_cover_requests_latency_decisions_and_rejections(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], policies=[{"name": "main", "strategy": "consistent-hash"}])
    for stream in (False, True):
        async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
            await resp.read()
    async with http.post(router.ingress_url + "/v1/chat/completions", json={"model": "nope"}) as resp:
        assert resp.status == 404
    async with http.get(router.admin_url + "/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    expected = [
        'fleetroute_requests_total{endpoint="gpu-0",model="llama-3-8b",status="200"} 2.0',
        'fleetroute_requests_total{endpoint="",model="",status="404"} 1.0',  # client input never becomes a label
        'fleetroute_request_duration_seconds_count{endpoint="gpu-0",model="llama-3-8b"} 2.0',
        'fleetroute_time_to_first_byte_seconds_count{endpoint="gpu-0",model="llama-3-8b"} 2.0',
        'fleetroute_endpoint_in_flight_requests{endpoint="gpu-0"} 0.0',
        'fleetroute_policy_decisions_total{endpoint="gpu-0",policy="main",strategy="consistent-hash"} 2.0',
        # No x-session-id header was sent: both requests fell back to least-connections, and we can see it.
        'fleetroute_policy_events_total{event="hash_key_missing",policy="main"} 2.0',
        'fleetroute_rejected_requests_total{reason="model_not_found"} 1.0',
        'fleetroute_endpoints{state="serving"} 1.0',
    ]
    for line in expected:
        assert line in text, line


async def test_access_log_is_one_structured_record_per_request(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    router.ctx.access_log = AccessLog(stream := io.BytesIO())
    async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True},
                         headers={"X-Request-Id": "req-1"}) as resp:
        await resp.read()
    assert stream.getvalue() == b""  # batched: written on the next flush, not per request
    router.ctx.access_log.flush()
    (line,) = stream.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["logger"] == "fleetroute.access" and entry["ts"].endswith("Z")
    assert entry["request_id"] == "req-1" and entry["model"] == MODEL and entry["endpoint"] == "gpu-0"
    assert entry["status"] == 200 and entry["attempts"] == 1 and entry["path"] == "/v1/chat/completions"
    assert 0 < entry["ttfb_ms"] <= entry["duration_ms"]
    assert entry["level"] == "info" and entry["msg"] == "request"


async def test_probes_and_endpoint_listing(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    async with http.get(router.admin_url + "/healthz") as resp:
        assert resp.status == 200
    async with http.get(router.admin_url + "/readyz") as resp:
        assert resp.status == 200 and (await resp.json())["status"] == "ready"
    async with http.get(router.admin_url + "/admin/endpoints") as resp:
        (endpoint,) = (await resp.json())["endpoints"]
    assert endpoint["id"] == "gpu-0" and endpoint["state"] == "serving" and endpoint["in_flight"] == 0
    assert endpoint["models"] == [MODEL] and endpoint["telemetry"] is None
    router.ctx.draining = True  # what SIGTERM does first: readiness fails so the Service stops sending
    async with http.get(router.admin_url + "/readyz") as resp:
        assert resp.status == 503


def test_json_formatter_keeps_extra_fields_and_exceptions() -> None:
    logger = logging.getLogger("t")
    try:
        raise ValueError("boom")
    except ValueError:
        import sys
        record = logger.makeRecord("t", logging.ERROR, "f", 1, "failed %s", ("x",), sys.exc_info(), extra={"endpoint": "gpu-3"})
    entry = json.loads(JsonFormatter().format(record))
    assert entry["msg"] == "failed x" and entry["endpoint"] == "gpu-3" and "ValueError: boom" in entry["exc"]


@pytest.mark.parametrize("level", ["debug", "warning"])
def test_configure_logging_sets_the_level(level: str) -> None:
    from router.runtime.logs import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging(level)
        assert root.level == getattr(logging, level.upper())
    finally:
        root.handlers[:], _ = saved
        root.setLevel(saved[1])


def test_every_metric_has_a_row_in_the_architecture_metrics_table() -> None:
    from router.runtime.metrics import RouterMetrics
    from worker.node_metrics import NodeAgentMetrics

    root = Path(__file__).resolve().parent.parent
    rows = set(re.findall(r"^\| `(fleetroute_[a-z0-9_]+)`", (root / "docs" / "architecture.md").read_text(), re.M))
    defined = {m.name + ("_total" if m.type == "counter" else "")
               for registry in (RouterMetrics().registry, NodeAgentMetrics().registry) for m in registry.collect()}
    assert defined - rows == set(), "metrics without a row in docs/architecture.md#metrics"
    # ... and no row for a metric that is gone (the RoutingPolicy controller registers its own when it starts).
    in_code = {name for path in [*root.glob("router/**/*.py"), *root.glob("worker/**/*.py")]
               for name in re.findall(r'"(fleetroute_[a-z0-9_]+)"', path.read_text())}
    assert {row.removesuffix("_total") for row in rows} - in_code == set(), "rows for metrics no code defines"


def test_every_error_code_the_router_writes_has_a_row_in_the_architecture_errors_table() -> None:
    root = Path(__file__).resolve().parent.parent
    doc = (root / "docs" / "architecture.md").read_text()
    table = doc[doc.index("## Errors and statuses"):doc.index("### After the headers are sent")]
    rows = set(re.findall(r"`([a-z_]+)`", " ".join(line.split("|")[2] for line in table.splitlines()
                                                     if line.startswith("| ") and line.count("|") > 4)))
    written = {code for path in root.glob("router/**/*.py") for code in re.findall(r'code="([a-z_]+)"', path.read_text())}
    assert written - rows == set(), "error codes without a row in docs/architecture.md#errors-and-statuses"


async def test_the_event_loop_lag_probe_samples_the_loop_and_sees_a_blocked_one() -> None:
    # router/server/loop_lag.py: a callback that hogs the loop for 300 ms shows as a sample over 100 ms.
    import asyncio
    import time

    from router.runtime.metrics import RouterMetrics
    from router.server.loop_lag import watch_loop_lag

    metrics = RouterMetrics()
    probe = asyncio.create_task(watch_loop_lag(metrics, interval=0.01))

    def count(bucket: str) -> float:
        return metrics.registry.get_sample_value("fleetroute_event_loop_lag_seconds_bucket", {"le": bucket}) or 0.0

    try:
        async with asyncio.timeout(5):
            while count("+Inf") < 3:
                await asyncio.sleep(0.01)
        before = count("+Inf") - count("0.25")
        time.sleep(0.3)  # the loop blocked, as by a hogging callback (the point of the test)
        async with asyncio.timeout(5):
            while count("+Inf") - count("0.1") < 1:
                await asyncio.sleep(0.01)
        assert count("+Inf") - count("0.25") >= before + 1  # the blocked wake-up: over 250 ms late
    finally:
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
