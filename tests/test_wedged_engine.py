"""Wedged engines (issue #19): an engine whose HTTP server still answers /health with 200 while its engine loop
makes no progress. The router finds it (silence past the stall threshold, confirmed by a failed probe), ejects
it, sends the requests waiting there elsewhere and ends the streams it had started; an ejection or a failed
health check releases the waiting requests too. Real sockets, fake engines (tests/fake_engine.py).

The headline test runs on real time with every setting at its default: detection then takes minSilence (5 s)
plus up to one check interval (1 s) plus the probe's timeout (3 s)."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from router.config.settings import FALLBACK_POLICY, ConfigError, parse_settings
from router.health.stall import StallDetector, StallSettings
from router.server.app import health_round
from router.server.rescue import stall_round
from tests.conftest import MODEL
from tests.test_resilience import Clock, metric

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
# Defaults: detection within minSilence + one check + probeTimeout (9 s); the rest is re-sending and answering.
WITHIN = 15.0


async def ask(http, router, *, stream: bool) -> tuple[int, str, bytes]:
    async with http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": stream}) as resp:
        return resp.status, resp.headers.get("x-fleetroute-endpoint", ""), await resp.read()


def events(body: bytes) -> list[str]:
    return [line[6:] for line in body.decode().splitlines() if line.startswith("data: ")]


def complete(status: int, body: bytes, stream: bool) -> bool:
    """A whole, successful answer: 6 tokens, and for a stream no error event and a final [DONE]."""
    if status != 200:
        return False
    if not stream:
        return orjson.loads(body)["choices"][0]["message"]["content"].count("tok") == 6
    data = events(body)
    return data[-1] == "[DONE]" and not any("error" in orjson.loads(d) for d in data[:-1]) and len(data) == 8


async def waiting_on(engine, http, router, **kwargs) -> asyncio.Task:
    """A request that the router sent to `engine` and that waits there (others land elsewhere and finish)."""
    for _ in range(30):
        engine.request_received.clear()
        task = asyncio.create_task(ask(http, router, **kwargs))
        received = asyncio.create_task(engine.request_received.wait())
        await asyncio.wait({task, received}, return_when=asyncio.FIRST_COMPLETED)
        if received.done() and not task.done():
            return task
        received.cancel()
        await task
    raise AssertionError(f"no request reached {engine.name} in 30 tries")


async def test_a_wedged_engine_costs_no_request_with_the_default_configuration(make_engine, make_router, http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    wedged = engines[0]
    wedged.wedged = asyncio.Event()  # from now on: no answers, streams get their head only; /health says 200
    router = await make_router(engines, policies=[])  # the built-in policy, every setting at its default
    started = time.monotonic()
    answers = await asyncio.gather(*(ask(http, router, stream=i % 2 == 0) for i in range(12)))
    elapsed = time.monotonic() - started
    print(f"\n12 requests, {sum(r['path'] == '/v1/chat/completions' for r in wedged.requests)} of them sent to the "
          f"wedged engine: all answered in {elapsed:.2f} s")
    assert [complete(status, body, i % 2 == 0) for i, (status, _, body) in enumerate(answers)] == [True] * 12
    assert {endpoint for _, endpoint, _ in answers} <= {"gpu-1", "gpu-2"}
    sent_there = sum(r["path"] == "/v1/chat/completions" for r in wedged.requests)
    assert sent_there >= 1  # some did wait on it (the policy spreads them), and were rescued
    assert elapsed < WITHIN
    assert await metric(http, router, f'fleetroute_rescued_requests_total{{model="{MODEL}",reason="stalled"}}') \
        == sent_there
    assert await metric(http, router, 'fleetroute_endpoint_stalls_total{endpoint="gpu-0"}') == 1
    assert await metric(http, router, 'fleetroute_stall_probes_total{endpoint="gpu-0",result="fail"}') == 1
    assert await metric(http, router, f'fleetroute_outlier_ejections_total{{endpoint="gpu-0",policy="{FALLBACK_POLICY}",'
                                      'reason="stalled"}') == 1
    assert await metric(http, router, f'fleetroute_endpoint_excluded{{endpoint="gpu-0",policy="{FALLBACK_POLICY}",'
                                      'reason="ejected"}') == 1
    wedged.wedged.set()


async def test_a_stream_started_on_an_engine_that_wedges_ends_with_an_error_event(make_engine, make_router,
                                                                                   http) -> None:
    engines = [await make_engine(f"gpu-{i}") for i in range(3)]
    target = engines[0]
    target.gate = asyncio.Event()  # its streams wait after their first token
    router = await make_router(engines, policies=[])
    held = None
    for _ in range(30):  # streams until one lands on gpu-0 (the others finish at once)
        resp = await http.post(router.ingress_url + "/v1/chat/completions", json={**CHAT, "stream": True})
        if resp.headers["x-fleetroute-endpoint"] == "gpu-0":
            held = resp
            break
        await resp.read()
        resp.release()
    assert held is not None, "no stream reached gpu-0 in 30 tries"
    try:
        assert (await held.content.readline()).startswith(b"data: ")  # the first token reached the client
        target.wedged = asyncio.Event()  # the engine loop wedges before the stream's next token
        target.gate.set()
        started = time.monotonic()
        rest = await held.read()  # ends: not a hang until timeouts.idle (60 s)
        elapsed = time.monotonic() - started
    finally:
        held.release()
    print(f"\nthe started stream ended {elapsed:.2f} s after its engine wedged")
    last = orjson.loads(events(rest)[-1])
    assert last["error"]["code"] == "upstream_stream_interrupted"
    assert last["error"]["message"] == "stream from endpoint gpu-0 interrupted: the endpoint stopped making progress"
    assert rest.endswith(b"\n\n")  # a clean end of the event stream, not a cut connection
    assert elapsed < WITHIN
    assert await metric(http, router, 'fleetroute_upstream_errors_total{endpoint="gpu-0",kind="stalled"}') == 1
    assert await metric(http, router, 'fleetroute_endpoint_stalls_total{endpoint="gpu-0"}') == 1
    target.wedged.set()


@pytest.fixture
def checks_by_hand(monkeypatch) -> None:
    """Stall rounds run only when a test calls `stall_round` (the tests that move a fake clock)."""
    monkeypatch.setattr("router.server.rescue.CHECK_INTERVAL", 3600.0)


@pytest.mark.usefixtures("checks_by_hand")
async def test_a_busy_engine_answers_the_probe_and_keeps_its_requests(make_engine, make_router, http) -> None:
    busy = await make_engine("gpu-0", busy=asyncio.Event())  # long generations, but new work is scheduled
    other = await make_engine("gpu-1")
    clock = Clock()
    router = await make_router([busy, other], clock=clock, policies=[])
    task = await waiting_on(busy, http, router, stream=False)
    clock.now += 60  # silent far past minSilence: a suspect
    assert await stall_round(router.ctx) == []  # its probe was answered: busy, not stalled
    assert await metric(http, router, 'fleetroute_stall_probes_total{endpoint="gpu-0",result="pass"}') == 1
    assert await stall_round(router.ctx) == []  # the answer counted as progress: no new probe yet
    assert not task.done()
    busy.busy.set()
    status, endpoint, body = await task
    assert (status, endpoint) == (200, "gpu-0") and complete(status, body, False)  # never taken off it
    assert await metric(http, router, 'fleetroute_endpoint_stalls_total{endpoint="gpu-0"}') == 0


@pytest.mark.usefixtures("checks_by_hand")
async def test_a_probe_that_fails_while_the_endpoint_made_progress_is_no_verdict(make_engine, make_router,
                                                                                http) -> None:
    slow = await make_engine("gpu-0", hang=asyncio.Event())  # everything waits, the probe too
    other = await make_engine("gpu-1")
    clock = Clock()
    router = await make_router([slow, other], clock=clock, policies=[], stallDetection={"probeTimeout": "200ms"})
    task = await waiting_on(slow, http, router, stream=False)
    clock.now += 60
    slow.request_received.clear()
    round_ = asyncio.create_task(stall_round(router.ctx))
    await slow.request_received.wait()  # the probe has reached the engine
    clock.now += 1
    with router.ctx.stalls.track("gpu-0") as other_request:
        other_request.progress()  # a chunk of another request arrives while the probe waits
    assert await round_ == []
    assert await metric(http, router, 'fleetroute_stall_probes_total{endpoint="gpu-0",result="fail"}') == 1
    assert not task.done()
    slow.hang.set()
    assert (await task)[:2] == (200, "gpu-0")


async def test_failing_health_checks_release_the_requests_waiting_there(make_engine, make_router, http) -> None:
    stuck = await make_engine("gpu-0", hang=asyncio.Event())
    other = await make_engine("gpu-1")
    router = await make_router([stuck, other], policies=[{
        "name": "p", "strategy": "round-robin", "health": {"interval": "1h", "unhealthyThreshold": 1}}])
    task = await waiting_on(stuck, http, router, stream=True)
    stuck.unhealthy = True
    await health_round(router.ctx, "p")  # isolated: the request waiting there goes to gpu-1
    status, endpoint, body = await task
    assert (status, endpoint) == (200, "gpu-1") and complete(status, body, True)
    assert await metric(http, router, f'fleetroute_rescued_requests_total{{model="{MODEL}",reason="health_check"}}') == 1
    assert await metric(http, router, f'fleetroute_retries_total{{model="{MODEL}"}}') == 1
    stuck.hang.set()


async def test_an_ejection_releases_the_requests_waiting_there(make_engine, make_router, http) -> None:
    flaky = await make_engine("gpu-0", hang=asyncio.Event())
    other = await make_engine("gpu-1")
    router = await make_router([flaky, other], policies=[{
        "name": "p", "strategy": "round-robin", "health": {"enabled": False},
        "outlierDetection": {"consecutiveFailures": 1}}])
    task = await waiting_on(flaky, http, router, stream=False)
    router.ctx.balancer.report_outcome(router.ctx.balancer.policy_for(MODEL), MODEL, "gpu-0", False, "http_5xx",
                                       probe=False)  # another request's 5xx there tips an ejection
    assert (await task)[:2] == (200, "gpu-1")
    assert await metric(http, router, f'fleetroute_rescued_requests_total{{model="{MODEL}",reason="ejected"}}') == 1
    flaky.hang.set()


@pytest.mark.usefixtures("checks_by_hand")
async def test_a_rescue_with_no_retry_left_is_answered_at_once(make_engine, make_router, http) -> None:
    wedged = await make_engine("gpu-0", wedged=asyncio.Event())
    clock = Clock()
    router = await make_router([wedged], clock=clock, policies=[{
        "name": "p", "strategy": "round-robin", "health": {"enabled": False}}],
        stallDetection={"probeTimeout": "100ms"})
    task = asyncio.create_task(ask(http, router, stream=False))
    await wedged.request_received.wait()
    clock.now += 60
    assert await stall_round(router.ctx) == ["gpu-0"]
    status, _, body = await task  # its only endpoint stalled: 504 now, not after firstByte (300 s)
    assert status == 504 and orjson.loads(body)["error"]["code"] == "upstream_timeout"
    assert "stopped making progress" in orjson.loads(body)["error"]["message"]
    wedged.wedged.set()


async def test_a_stream_head_without_a_body_is_answered_with_a_clean_error(make_engine, make_router, http) -> None:
    # The response head goes to the client with the first chunk: an engine that sends its head and then nothing
    # leaves the client with an error status, not a cut connection.
    wedged = await make_engine("gpu-0", wedged=asyncio.Event())
    router = await make_router([wedged], policies=[{"name": "p", "strategy": "round-robin", "timeouts": {"idle": "200ms"}}],
                               stallDetection={"enabled": False})
    status, _, body = await ask(http, router, stream=True)
    assert status == 504
    assert orjson.loads(body)["error"] == {
        "message": "endpoint gpu-0 sent its response head, then no data for 0.2s", "type": "server_error",
        "param": None, "code": "upstream_timeout"}
    assert await metric(http, router, 'fleetroute_upstream_errors_total{endpoint="gpu-0",kind="idle_timeout"}') == 1
    wedged.wedged.set()


class _Peers:
    def __init__(self, detector: StallDetector, clock: Clock) -> None:
        self.detector, self.clock = detector, clock

    def first_bytes(self, endpoint_id: str, *seconds: float) -> None:
        for s in seconds:
            with self.detector.track(endpoint_id) as waiter:
                self.clock.now += s
                waiter.first_byte()


@pytest.mark.parametrize("own, peers, expected", [
    pytest.param((), {}, 5.0, id="no history: the floor"),
    pytest.param((0.2,) * 10, {"b": (0.3,) * 10}, 5.0, id="fast history: still the floor"),
    pytest.param((3.0,) * 10, {"b": (0.5,) * 10}, 12.0, id="its own history is slower: 4 x its p99"),
    pytest.param((0.1,), {"b": (2.0,), "c": (2.5,), "d": (30.0,)}, 10.0, id="peers: the median of their p99s"),
    pytest.param((1.0,) * 99 + (20.0,), {}, 80.0, id="p99 of 64 recent samples reaches the slow tail"),
])
def test_the_stall_threshold_follows_recent_first_byte_times(own, peers, expected) -> None:
    clock = Clock()
    detector = StallDetector(clock)
    feed = _Peers(detector, clock)
    feed.first_bytes("a", *own)
    for peer, seconds in peers.items():
        feed.first_bytes(peer, *seconds)
    assert detector.threshold("a", {"a", *peers}, StallSettings()) == pytest.approx(expected)


def test_silence_counts_from_the_last_progress_or_from_work_given_to_an_idle_endpoint() -> None:
    clock = Clock()
    detector = StallDetector(clock)
    settings = StallSettings()
    assert detector.silence("a") == 0.0
    with detector.track("a") as first:
        clock.now += 4
        with detector.track("a"):  # joins the silence already running
            clock.now += 2
            assert detector.silence("a") == 6.0
            assert [s.endpoint_id for s in detector.suspects(settings, lambda e: {e})] == ["a"]
            first.progress()
            assert detector.silence("a") == 0.0 and detector.suspects(settings, lambda e: {e}) == []
    clock.now += 100
    assert detector.silence("a") == 0.0  # nothing outstanding: an idle endpoint is not silent


@pytest.mark.parametrize("block, message", [
    ({"minSilence": 0}, "stallDetection.minSilence: must be a positive duration"),
    ({"silenceFactor": 0.5}, "stallDetection.silenceFactor: must be >= 1 and <= 1000, got 0.5"),
    ({"probeTimeout": "soon"}, "stallDetection.probeTimeout: must be a positive duration"),
    ({"enabled": "yes"}, "stallDetection.enabled: must be true or false"),
    ({"threshold": "5s"}, "stallDetection.threshold: unknown field"),
])
def test_bad_stall_detection_settings_are_named(block, message) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings({"stallDetection": block})
    assert message in str(info.value)
