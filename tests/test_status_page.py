"""The status page (router/server/status/): in a real headless Chromium, in front of a real router and simulated vLLM
engines, it logs in, lists every endpoint with its telemetry and policy, shows an ejection within seconds,
drains from its button, and explains decisions; without the admin token it shows nothing. Around it: the
session cookie's scope and CSRF check, the open (no token) mode, the security headers, and the recorder's
bounded history and percentiles.

Every wait is on the page's DOM (Playwright's `expect`, which polls the DOM) or on an event; nothing sleeps.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import orjson
import pytest

from router.model import Endpoint, EndpointView, Telemetry
from router.server.app import RunningRouter
from router.server.auth import AuthSettings
from router.server.status.history import LATENCY_SAMPLES, POINTS, ClassCounts, StatusHistory
from router.server.status.page import build_feed
from router.server.status.sessions import COOKIE, CSRF_HEADER, BrowserSessions
from tests.browser import Watch, chromium
from tests.sim_server import MODEL, RunningSim

TOKEN = "status-admin-token-0123456789"
MakeRouter = Callable[..., Awaitable[RunningRouter]]
MakeSim = Callable[..., Awaitable[RunningSim]]

# Failures in a row that eject an endpoint; the rest keeps the test quiet and deterministic (round-robin, no
# active probes during the test, every decision recorded so the page lists them).
POLICY = {"name": "chat", "models": ["*"], "strategy": "round-robin", "health": {"interval": "1h"},
          "outlierDetection": {"consecutiveFailures": 2}, "retries": {"attempts": 3, "minRetriesPerSecond": 1000}}


async def fleet(make_sim: MakeSim, make_router: MakeRouter, *, policy: dict[str, Any] = POLICY,
                replicas: int = 3) -> tuple[RunningRouter, dict[str, RunningSim]]:
    sims = {f"sim-{i}": await make_sim(gpu="h100" if i % 2 == 0 else "a100-80g") for i in range(replicas)}
    router = await make_router(
        [], endpoints=[{"id": name, "url": sim.url, "models": [MODEL]} for name, sim in sims.items()],
        policies=[policy], telemetry={"enabled": True, "interval": "100ms", "gpuSource": "sim"},
        explain={"sampleRate": 1.0})
    return router, sims


async def chat(http: aiohttp.ClientSession, router: RunningRouter, *, stream: bool = True) -> int:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6,
            "stream": stream}
    async with http.post(router.ingress_url + "/v1/chat/completions", json=body,
                         timeout=aiohttp.ClientTimeout(total=20)) as resp:
        await resp.read()
        return resp.status


def bearer(token: str = TOKEN) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


# ---- in the browser --------------------------------------------------------------------------------------


@pytest.mark.timeout(90)
async def test_the_page_lists_the_fleet_shows_an_ejection_and_drains(
    make_sim: MakeSim, make_router: MakeRouter, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from playwright.async_api import expect

    monkeypatch.setenv("FLEETROUTE_ADMIN_TOKEN", TOKEN)
    router, sims = await fleet(make_sim, make_router)
    admin = router.admin_url
    async with chromium() as browser:
        page = await browser.new_page()
        watch = Watch(page)
        dialogs: list[str] = []

        async def accept(dialog: Any) -> None:
            dialogs.append(dialog.message)
            await dialog.accept()

        page.on("dialog", accept)
        response = await page.goto(admin + "/status")
        assert response is not None and response.status == 401  # the login form
        await page.fill("#token", TOKEN)
        await page.click("button[type=submit]")
        await page.wait_for_url(admin + "/status")
        # The browser reports the login form's own 401 as a failed load; from here on nothing may fail.
        assert watch.errors == ["Failed to load resource: the server responded with a status of 401 (Unauthorized)"]
        watch.errors.clear()

        # Every endpoint, with the simulated engines' telemetry, under the policy that routes the model.
        rows = page.locator("tr[data-endpoint]")
        await expect(rows).to_have_count(3)
        for name in sims:
            await expect(page.locator(f'tr[data-endpoint="{name}"]')).to_have_attribute("data-state", "serving")
        await expect(page.locator(".policy")).to_have_text("policy chat · round-robin")
        await expect(page.locator('tr[data-endpoint="sim-0"] td').nth(5).locator(".value")).to_have_text(re.compile(r"^\d+%$"))

        # Traffic: its decisions appear, and one opens to its explanation.
        for _ in range(3):
            assert await chat(http, router) == 200
        decisions = page.locator("#decisions details")
        await expect(decisions).to_have_count(3)
        latency = page.locator('tr[data-endpoint="sim-0"] td.latency .value')
        await expect(latency.nth(0)).to_contain_text(re.compile(r"^\d+ ms · "))  # TTFT p50 · p90 · p99
        await expect(latency.nth(1)).to_contain_text(re.compile(r"^\d+ ms · "))  # ITL: the streams' chunk gaps
        await decisions.first.locator("summary").click()
        record = decisions.first.locator(".record")
        await expect(record).to_contain_text("Attempt 1")
        await expect(record).to_contain_text("its turn in the rotation")

        # An engine starts failing: outlier detection ejects it, and the page says so within seconds.
        async with http.post(sims["sim-1"].url + "/sim/faults", json={"error_rate": 1.0}) as resp:
            assert resp.status == 200
        for _ in range(6):  # round-robin hands sim-1 every third try; its 2nd failure in a row ejects it
            assert await chat(http, router) == 200  # each failure is retried elsewhere
        ejected = page.locator('tr[data-endpoint="sim-1"]')
        await expect(ejected).to_have_attribute("data-state", "ejected", timeout=5000)
        await expect(ejected.locator("td.state")).to_contain_text(re.compile(r"ejected \(http 5xx\), \d+ s left"))
        await expect(page.locator(".routable")).to_have_text("2 of 3 routable")

        # The sparklines hold every sample since the page opened, each once: the first feed sent the series
        # whole, every later one only what was new (the in-flight count always has a value: no gaps).
        points = """(least) => {
            const path = document.querySelector('tr[data-endpoint="sim-0"] td:nth-child(3) path');
            const n = path ? (path.getAttribute('d').match(/[ML]/g) || []).length : 0;
            return n >= least ? n : 0;
        }"""
        await page.wait_for_function(points, arg=6, timeout=10_000)
        drawn = await page.evaluate(points, 0)
        kept = len(router.ctx.status_history.series("sim-0")["in_flight"])  # type: ignore[index]
        assert kept - 2 <= drawn <= kept, (drawn, kept)
        assert any("/status/feed?since=" in url for url in watch.requests)

        # The drain button asks, then drains: the admin API agrees.
        await page.click('tr[data-endpoint="sim-0"] button[data-action="drain"]')
        await expect(page.locator('tr[data-endpoint="sim-0"]')).to_have_attribute("data-state", "draining")
        assert dialogs == ["Drain sim-0? New requests stop going to it; requests in flight finish."]
        async with http.get(admin + "/admin/endpoints", headers=bearer()) as resp:
            states = {e["id"]: e["state"] for e in (await resp.json())["endpoints"]}
        assert states == {"sim-0": "draining", "sim-1": "serving", "sim-2": "serving"}
        await expect(page.locator('tr[data-endpoint="sim-0"] button')).to_have_text("Resume")

        # Nothing went wrong in the page, and everything it loaded came from the router's admin listener.
        assert watch.errors == []
        assert watch.requests and all(url.startswith(admin + "/status") for url in watch.requests), watch.requests
        assert any(url.endswith("/status/assets/status.js") for url in watch.requests)
        await page.close()


async def test_without_the_token_the_page_shows_nothing(
    make_sim: MakeSim, make_router: MakeRouter, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEETROUTE_ADMIN_TOKEN", TOKEN)
    router, sims = await fleet(make_sim, make_router, replicas=2)
    admin = router.admin_url
    async with chromium() as browser:
        context = await browser.new_context()
        # A cookie nobody signed (the right shape, a made-up MAC) is no session.
        await context.add_cookies([{"name": COOKIE, "value": "9999999999.00aa11bb22cc33dd." + "0" * 64,
                                    "url": admin + "/status"}])
        page = await context.new_page()
        for attempt in ("no session", "wrong token"):
            if attempt == "wrong token":
                await page.fill("#token", "not-the-token")
                async with page.expect_response(admin + "/status/login") as answer:
                    await page.click("button[type=submit]")
                response = await answer.value
            else:
                response = await page.goto(admin + "/status")
            assert response is not None and response.status == 401, attempt
            html = await page.content()
            assert "sim-0" not in html and "sim-1" not in html and MODEL not in html, attempt
            assert await page.locator("tr[data-endpoint], #models, script").count() == 0, attempt
            assert await page.locator("#token").count() == 1, attempt
        assert "That is not the admin token." in await page.locator(".error").inner_text()
        feed = await page.request.get(admin + "/status/feed")
        assert feed.status == 401 and b"sim-0" not in await feed.body()
        await context.close()
    assert router.ctx.metrics.registry.get_sample_value("fleetroute_status_logins_total", {"result": "failure"}) == 1


# ---- sessions, CSRF and scope, without a browser ---------------------------------------------------------


async def login(http: aiohttp.ClientSession, router: RunningRouter, token: str = TOKEN) -> aiohttp.ClientResponse:
    async with http.post(router.admin_url + "/status/login", data={"token": token}, allow_redirects=False) as resp:
        await resp.read()
        return resp


async def test_the_session_cookie_opens_the_page_only_and_posts_need_its_csrf_token(
    make_sim: MakeSim, make_router: MakeRouter, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="fleetroute.status")
    monkeypatch.setenv("FLEETROUTE_ADMIN_TOKEN", TOKEN)
    router, _ = await fleet(make_sim, make_router, replicas=2)
    admin = router.admin_url
    resp = await login(http, router)
    assert resp.status == 303 and resp.headers["Location"] == "/status"
    set_cookie = resp.headers["Set-Cookie"]
    for attribute in ("HttpOnly", "SameSite=Strict", "Path=/status", "Max-Age=43200"):
        assert attribute in set_cookie
    cookie = resp.cookies[COOKIE].value
    assert TOKEN not in cookie and re.fullmatch(r"\d+\.[0-9a-f]{16}\.[0-9a-f]{64}", cookie)
    jar = {"Cookie": f"{COOKIE}={cookie}"}

    async with http.get(admin + "/status", headers=jar) as page:
        assert page.status == 200 and '<script src="/status/assets/status.js"' in await page.text()
    async with http.get(admin + "/status/feed", headers=jar) as feed:
        assert feed.status == 200
        body = await feed.json()
    csrf = body["session"]["csrf"]
    # A page that holds the series asks only for the samples taken since its last feed, from the same process.
    query = f"?since={body['history']['samples']}&pid={body['pid']}"
    async with http.get(admin + "/status/feed" + query, headers=jar) as feed:
        following = await feed.json()
    new = following["history"]["samples"] - body["history"]["samples"]
    assert following["history"]["series_since"] == body["history"]["samples"]
    assert [len(s["in_flight"]) for s in following["series"].values()] == [new, new]
    async with http.get(admin + f"/status/feed?since=0&pid={body['pid'] + 1}", headers=jar) as feed:
        other = await feed.json()  # from another worker's page: the whole series
    assert other["history"]["series_since"] is None
    assert all(len(s["in_flight"]) == other["history"]["samples"] for s in other["series"].values())
    assert body["session"] == {"required": True, "cookie": True, "csrf": csrf} and len(csrf) == 64
    assert [e["id"] for e in body["models"][0]["endpoints"]] == ["sim-0", "sim-1"]
    # The cookie is no admin token: the API keeps needing the header.
    async with http.get(admin + "/admin/endpoints", headers=jar) as api:
        assert api.status == 401
    # A POST with the cookie alone (what another site's form could make a browser send) is refused.
    drain = admin + "/status/endpoints/sim-0/drain"
    for headers in (jar, {**jar, CSRF_HEADER: "0" * 64}, {CSRF_HEADER: csrf}):
        async with http.post(drain, headers=headers) as refused:
            assert refused.status == 401, headers
    assert router.ctx.balancer.snapshot.by_id["sim-0"].state.value == "serving"
    async with http.post(drain, headers={**jar, CSRF_HEADER: csrf}) as drained:
        assert drained.status == 200 and await drained.json() == {"id": "sim-0", "state": "draining"}
    async with http.post(admin + "/status/endpoints/sim-0/resume", headers=bearer()) as resumed:
        assert resumed.status == 200  # the header alone also does (curl)
    async with http.post(admin + "/status/endpoints/nope/drain", headers=bearer()) as unknown:
        assert unknown.status == 404 and (await unknown.json())["error"]["code"] == "endpoint_not_found"

    async with http.post(admin + "/status/logout", headers={**jar, CSRF_HEADER: csrf}) as out:
        assert out.status == 200 and f"{COOKIE}=\"\"" in out.headers["Set-Cookie"]
    assert (await login(http, router, "wrong")).status == 401
    async with http.post(admin + "/status/login", data="&".join(f"f{i}=x" for i in range(50)),
                         headers={"Content-Type": "application/x-www-form-urlencoded"}) as odd:
        assert odd.status == 401  # not a login form: refused like a wrong token, not a 500
    async with http.post(admin + "/status/login", data=b"token=" + b"x" * 5000) as big:
        assert big.status == 413
    metrics = router.ctx.metrics.registry
    assert metrics.get_sample_value("fleetroute_status_logins_total", {"result": "success"}) == 1
    assert metrics.get_sample_value("fleetroute_status_logins_total", {"result": "failure"}) == 2
    assert metrics.get_sample_value("fleetroute_status_feed_requests_total") == 3
    messages = [r.getMessage() for r in caplog.records if r.name == "fleetroute.status"]
    assert "status page login" in messages
    assert "status page login failed: wrong or missing admin token" in messages
    assert "endpoint state set from the status page" in messages
    assert not any(TOKEN in r.getMessage() or TOKEN in str(r.__dict__) for r in caplog.records)


def test_session_cookies_expire_and_belong_to_one_token() -> None:
    now = [1_000_000.0]
    auth = AuthSettings(admin_token_digest=hashlib.sha256(TOKEN.encode()).digest())
    sessions = BrowserSessions(auth, wall=lambda: now[0])
    cookie = sessions.issue()
    assert sessions.valid(cookie)
    assert not BrowserSessions(AuthSettings(admin_token_digest=hashlib.sha256(b"another-token").digest())).valid(cookie)
    expiry, nonce, mac = cookie.split(".")
    assert not sessions.valid(f"{int(expiry) + 1}.{nonce}.{mac}")  # a longer life is a forgery
    assert not sessions.valid(cookie + "0") and not sessions.valid("") and not sessions.valid("x" * 500)
    now[0] += 12 * 3600 + 1
    assert not sessions.valid(cookie)
    assert sessions.csrf(cookie) != sessions.csrf(sessions.issue())
    assert not BrowserSessions(None).valid(cookie)  # no admin token: no sessions at all


async def test_without_an_admin_token_the_page_is_as_open_as_the_admin_api(
    make_sim: MakeSim, make_router: MakeRouter, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("FLEETROUTE_ADMIN_TOKEN", raising=False)
    router, _ = await fleet(make_sim, make_router, replicas=1)
    admin = router.admin_url
    async with http.get(admin + "/status") as page:
        assert page.status == 200 and "status.js" in await page.text()
    async with http.get(admin + "/status/feed") as feed:
        assert feed.status == 200 and (await feed.json())["session"] == {"required": False, "cookie": False,
                                                                          "csrf": "open"}
    assert (await login(http, router)).status == 303  # nothing to log in to: back to the page
    # Another site's form could post here; the custom header it cannot send without a CORS preflight is required.
    async with http.post(admin + "/status/endpoints/sim-0/drain") as refused:
        assert refused.status == 403 and (await refused.json())["error"]["code"] == "csrf_token_missing"
    async with http.post(admin + "/status/endpoints/sim-0/drain", headers={CSRF_HEADER: "open"}) as drained:
        assert drained.status == 200


async def test_every_answer_is_locked_down_and_the_assets_are_small(
    make_sim: MakeSim, make_router: MakeRouter, http: aiohttp.ClientSession, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEETROUTE_ADMIN_TOKEN", TOKEN)
    router, _ = await fleet(make_sim, make_router, replicas=1)
    admin = router.admin_url
    total = 0
    for path in ("/status", "/status/feed", "/status/assets/status.js", "/status/assets/status.css",
                 "/status/assets/favicon.svg", "/status/assets/nope.js"):
        async with http.get(admin + path, headers=bearer()) as resp:
            body = await resp.read()
            assert resp.headers["Content-Security-Policy"].startswith("default-src 'self';"), path
            assert resp.headers["X-Content-Type-Options"] == "nosniff", path
            if path == "/status/assets/nope.js":
                assert resp.status == 404
                continue
            assert resp.status == 200, path
            total += len(body)
            if "/assets/" in path:
                assert resp.headers["Cache-Control"] == "no-cache"
                async with http.get(admin + path, headers={"If-None-Match": resp.headers["ETag"]}) as again:
                    assert again.status == 304
            else:
                assert resp.headers["Cache-Control"] == "no-store"
            if path == "/status":
                assert not re.search(r"<script(?![^>]*\bsrc=)", body.decode()), "inline script"
                assert not re.search(r"\sstyle=|<style", body.decode()), "inline style"
                assert not re.search(r"(src|href)=\"(https?:)?//", body.decode()), "an asset from elsewhere"
    assert total < 64 * 1024  # the whole page, with its data


# ---- the recorder ----------------------------------------------------------------------------------------


def view(endpoint_id: str, telemetry: Telemetry | None = None) -> EndpointView:
    return EndpointView(Endpoint(endpoint_id, "http://x", (MODEL,)), telemetry)


def as_json(value: Any) -> Any:
    """As the page gets it: NaN (no value) is null."""
    return orjson.loads(orjson.dumps(value))


def test_the_history_is_bounded_and_its_percentiles_cover_the_recent_window() -> None:
    now = [0.0]
    history = StatusHistory(clock=lambda: now[0])
    history.finished("gpu-0", status=200, ttfb=0.1, duration=1.0, chunks=10, streamed=True)
    assert history.series("gpu-0") is None  # not sampled yet: nothing is kept for it
    telemetry = Telemetry(reported_at=0.0, gpu_util=0.5, kv_cache_usage=0.25, num_waiting=3)
    history.sample([view("gpu-0", telemetry), view("gpu-1")], lambda _id: 2, {})
    # Two streams: TTFT 100 and 300 ms; ITL (end - first chunk) / (chunks - 1): 100 ms and 50 ms. Plus a
    # non-streamed answer (TTFT only) and a 500 (counted, but no latency).
    history.finished("gpu-0", status=200, ttfb=0.1, duration=1.0, chunks=10, streamed=True)
    history.finished("gpu-0", status=200, ttfb=0.3, duration=0.8, chunks=11, streamed=True)
    history.finished("gpu-0", status=200, ttfb=0.2, duration=0.2, chunks=3, streamed=False)
    history.finished("gpu-0", status=500, ttfb=0.01, duration=0.01, chunks=1, streamed=False)
    history.sample([view("gpu-0", telemetry), view("gpu-1")], lambda _id: 2, {})
    series = as_json(history.series("gpu-0"))
    assert series["requests_per_s"] == [0.0, 4.0] and series["in_flight"] == [2.0, 2.0]
    assert series["ttft_ms"] == [None, 200.0] and series["itl_ms"] == [None, 75.0]
    assert series["gpu_util"] == [0.5, 0.5] and series["waiting"] == [3.0, 3.0]
    assert as_json(history.series("gpu-1"))["gpu_util"] == [None, None]  # no telemetry: gaps
    assert as_json(history.series("gpu-0", 1))["ttft_ms"] == [200.0]  # the newest only (the feed's `since`)
    latency = history.latency("gpu-0")
    assert latency == {"ttft_ms": {"n": 3, "p50": 200.0, "p90": 300.0, "p99": 300.0},
                       "itl_ms": {"n": 2, "p50": 50.0, "p90": 100.0, "p99": 100.0}}
    now[0] = 301.0  # five minutes later those requests are out of the window
    assert history.latency("gpu-0")["ttft_ms"] == {"n": 0, "p50": None, "p90": None, "p99": None}  # type: ignore[index]

    for i in range(POINTS + 50):  # rings keep the newest POINTS samples and LATENCY_SAMPLES requests
        history.finished("gpu-0", status=200, ttfb=i / 1000, duration=1.0, chunks=1, streamed=True)
        history.sample([view("gpu-0")], lambda _id, i=i: i, {})
    series = history.series("gpu-0")
    assert series is not None and len(series["in_flight"]) == POINTS and series["in_flight"][-1] == POINTS + 49
    assert history.latency("gpu-0")["ttft_ms"]["n"] == min(POINTS + 50, LATENCY_SAMPLES)  # type: ignore[index]

    history.forget_endpoints(frozenset({"gpu-0"}))
    history.finished("gpu-0", status=200, ttfb=0.1, duration=1.0, chunks=10, streamed=True)  # ended after it left
    assert history.series("gpu-0") is None and history.latency("gpu-0") is None
    assert history.series("gpu-1") is not None


def test_admission_rates_come_from_the_counters_per_class() -> None:
    now = [0.0]
    history = StatusHistory(clock=lambda: now[0])
    counts = {"high": ClassCounts(depth=0, admitted=10, shed=0), "low": ClassCounts(depth=4, admitted=5, shed=1)}
    history.sample([], lambda _id: 0, {MODEL: counts})
    now[0] = 2.0
    history.sample([], lambda _id: 0, {MODEL: {"high": ClassCounts(depth=1, admitted=16, shed=0),
                                               "low": ClassCounts(depth=6, admitted=5, shed=5)}})
    report = history.admission(MODEL)
    assert report is not None
    assert report["classes"] == [{"name": "high", "queued": 1, "admitted_per_s": 3.0, "shed_per_s": 0.0},
                                 {"name": "low", "queued": 6, "admitted_per_s": 0.0, "shed_per_s": 2.0}]
    assert as_json(report["series"]) == {"queued": [4.0, 7.0], "admitted_per_s": [None, 6.0], "shed_per_s": [None, 4.0]}
    history.sample([], lambda _id: 0, {})  # the model's policy no longer caps anything
    assert history.admission(MODEL) is None


async def test_the_feed_reports_admission_queues_of_a_capped_model(
    make_sim: MakeSim, make_router: MakeRouter, http: aiohttp.ClientSession,
) -> None:
    capped = {**POLICY, "admission": {"maxConcurrentPerEndpoint": 1, "maxQueue": 8}}
    router, _ = await fleet(make_sim, make_router, policy=capped, replicas=1)
    for _ in range(2):
        assert await chat(http, router) == 200
    from router.server.status.page import sample

    sample(router.ctx)
    model = build_feed(router.ctx)["models"][0]
    assert model["admission"]["max_concurrent_per_endpoint"] == 1
    assert [c["name"] for c in model["admission"]["classes"]] == ["high", "normal", "low"]
    assert router.ctx.status_history.admission(MODEL) is not None


def test_the_status_page_routes_are_registered_on_the_admin_app_only() -> None:
    from router.config.settings import parse_settings
    from router.server.app import build_apps, build_context

    ingress, admin = build_apps(build_context(parse_settings({"redis": {"url": None}})))
    paths = {r.resource.canonical for r in admin.router.routes() if r.resource is not None}
    assert {"/status", "/status/feed", "/status/login", "/status/endpoints/{id}/drain"} <= paths
    assert not any(r.resource.canonical.startswith("/status") for r in ingress.router.routes() if r.resource)
