"""Protection: client API keys, the engines' own key, the admin token, header limits, no secrets in logs and
no client control over upstream addresses. Real routers and fake engines on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hmac
import io
import logging
from pathlib import Path
from typing import Any

import orjson
import pytest

from router.config.settings import ConfigError, parse_settings
from router.runtime.logs import JsonFormatter
from router.server import auth
from router.server.access_log import AccessLog
from tests.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
KEY_A = "sk-fleet-alpha-0123456789abcdef"
KEY_B = "sk-fleet-bravo-fedcba9876543210"
ENV_KEY = "sk-from-env-5555555555555555"
ENGINE_KEY = "engine-secret-42"
ADMIN_TOKEN = "admin-token-7777777777777777"
SECRETS = (KEY_A, KEY_B, ENV_KEY, ENGINE_KEY, ADMIN_TOKEN, "sk-wrong-key-guess-000000000")


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"# production keys\n{KEY_A}, {KEY_B}\n\n")
    return path


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def _raw(url: str, data: bytes) -> tuple[int, bytes]:
    """Send raw bytes to the router's address; the status code and the whole answer (the server closes)."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(data)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return int(answer.split(b" ", 2)[1]), answer


def _post(path: str, headers: bytes = b"", body: bytes = b"") -> bytes:
    return (b"POST " + path.encode() + b" HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
            + b"Content-Length: %d\r\n" % len(body) + headers + b"Connection: close\r\n\r\n" + body)


# ---- configuration ---------------------------------------------------------------------------------------


def test_keys_come_from_a_file_and_an_env_var(keys_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEET_KEYS", f"{ENV_KEY}\n")
    settings = parse_settings({"auth": {"apiKeysFile": str(keys_file), "apiKeysEnv": "FLEET_KEYS"}})
    a = settings.auth
    assert a is not None and a.client_keys and len(a.api_key_digests) == 3
    assert a.api_key_sources == (f"file {keys_file}", "$FLEET_KEYS")
    assert a.upstream_authorization is None and a.admin_token_digest is None
    for secret in (KEY_A, KEY_B, ENV_KEY):
        assert secret not in repr(settings)  # settings may be printed or logged: never with secrets


def test_without_auth_config_nothing_is_protected() -> None:
    assert parse_settings({}).auth is None


@pytest.mark.parametrize(
    ("auth_block", "env", "message"),
    [
        ({"apiKeysFile": "/nonexistent/keys"}, {},
         "auth.apiKeysFile: cannot read the file it names: No such file or directory (its value is not repeated"),
        ({"apiKeysEnv": "FLEET_KEYS"}, {}, "auth.apiKeysEnv: the environment variable it names is not set or empty"),
        ({"apiKeysEnv": "FLEET_KEYS"}, {"FLEET_KEYS": " , \n"}, "$FLEET_KEYS: contains no API keys"),
        ({"apiKeysEnv": "FLEET-KEYS"}, {}, "auth.apiKeysEnv: must be an environment variable name"),
        ({"apiKeysEnv": "FLEET_KEYS"}, {"FLEET_KEYS": "good-key, bad key"},
         "$FLEET_KEYS: key 2 is followed by something other than a flag (a key may be followed by: explain, tenant=<name>)"),
        ({"apiKeysEnv": "FLEET_KEYS"}, {"FLEET_KEYS": "good-key, bad\u00e9key"},
         "$FLEET_KEYS: key 2 contains spaces or non-ASCII characters"),
        ({"upstreamApiKeyEnv": "ENGINE_KEY"}, {}, "auth.upstreamApiKeyEnv: the environment variable it names is not set"),
        ({"apiKey": "x"}, {}, "auth.apiKey: unknown field (expected one of: apiKeysEnv, apiKeysFile, upstreamApiKeyEnv)"),
        ("on", {}, "auth: must be a mapping, got 'on'"),
    ],
)
def test_bad_auth_config_is_named_and_never_quotes_a_key(
    auth_block: Any, env: dict[str, str], message: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as info:
        parse_settings({"auth": auth_block})
    assert message in str(info.value)
    assert "bad key" not in str(info.value)


def test_an_empty_keys_file_fails_start_up(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text("# nothing yet\n\n")
    with pytest.raises(ConfigError, match="auth.apiKeysFile: contains no API keys"):
        parse_settings({"auth": {"apiKeysFile": str(tmp_path / "keys")}})


def test_an_admin_token_variable_named_in_the_config_must_be_set(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match=r"admin.tokenEnv: the environment variable it names is not set or empty"):
        parse_settings({"admin": {"host": "127.0.0.1", "tokenEnv": "OPS_TOKEN"}})
    monkeypatch.setenv("OPS_TOKEN", ADMIN_TOKEN)
    settings = parse_settings({"admin": {"host": "127.0.0.1", "port": 9999, "tokenEnv": "OPS_TOKEN"}})
    assert settings.admin.port == 9999 and settings.auth is not None and settings.auth.admin_token_digest
    assert ADMIN_TOKEN not in repr(settings)
    with pytest.raises(ConfigError, match="admin.tokn: unknown field"):
        parse_settings({"admin": {"tokn": "x"}})


def test_max_header_bytes_is_validated() -> None:
    assert parse_settings({"limits": {"maxHeaderBytes": 16384}}).max_header_bytes == 16384
    with pytest.raises(ConfigError, match="limits.maxHeaderBytes: must be between 1024 and 65536, got 100"):
        parse_settings({"limits": {"maxHeaderBytes": 100}})


def test_every_key_is_compared_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    # Constant time: no early exit at the first match, so timing does not reveal which key (or whether an
    # early one) matched. compare_digest itself is constant-time for equal lengths, and digests are equal.
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(len(a) + len(b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    digests = tuple(auth._digest(k) for k in (KEY_A, KEY_B, ENV_KEY))
    assert auth._matches(KEY_A, digests)
    assert not auth._matches("short", digests)
    assert calls == [64] * 6


# ---- client API keys -------------------------------------------------------------------------------------


async def test_requests_need_a_valid_key_when_keys_are_configured(
    make_engine, make_router, http, keys_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEET_KEYS", ENV_KEY)
    engine = await make_engine("gpu-0")
    router = await make_router([engine], auth={"apiKeysFile": str(keys_file), "apiKeysEnv": "FLEET_KEYS"})
    url = router.ingress_url
    refused = [
        ("POST", "/v1/chat/completions", {}, "You didn't provide an API key"),
        ("POST", "/v1/chat/completions", _bearer("sk-wrong-key-guess-000000000"), "Incorrect API key provided."),
        ("POST", "/v1/chat/completions", {"Authorization": f"Basic {KEY_A}"}, "You didn't provide an API key"),
        ("POST", "/v1/chat/completions", {"Authorization": "Bearer "}, "You didn't provide an API key"),
        ("POST", "/v1/chat/completions", _bearer(KEY_A[:-1]), "Incorrect API key provided."),
        ("GET", "/v1/models", {}, "You didn't provide an API key"),
        ("POST", "/v1/images/generations", {}, "You didn't provide an API key"),  # no route probing
    ]
    for method, path, headers, message in refused:
        async with http.request(method, url + path, json=CHAT, headers=headers) as resp:
            assert resp.status == 401, (path, headers)
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            error = (await resp.json())["error"]
        assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert error["message"].startswith(message)
        assert KEY_A not in error["message"] and "sk-wrong" not in error["message"]
    assert engine.requests == []
    for key in (KEY_A, KEY_B, ENV_KEY):
        async with http.post(url + "/v1/chat/completions", json=CHAT, headers=_bearer(key)) as resp:
            assert resp.status == 200
    async with http.post(url + "/v1/chat/completions", json=CHAT, headers={"authorization": f"bearer  {KEY_B} "}) as resp:
        assert resp.status == 200  # the scheme is case-insensitive, spaces around the token are ignored
    async with http.get(url + "/v1/models", headers=_bearer(KEY_A)) as resp:
        assert resp.status == 200
    # The router's client keys never reach an engine.
    assert all("authorization" not in {k.lower() for k in r["headers"]} for r in engine.requests)
    async with http.get(router.admin_url + "/metrics") as resp:
        assert 'fleetroute_rejected_requests_total{reason="invalid_api_key"} 7.0' in await resp.text()


async def test_the_engines_own_key_is_sent_instead_of_the_clients(
    make_engine, make_router, http, keys_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_KEY", ENGINE_KEY)
    engine = await make_engine("gpu-0")
    router = await make_router([engine], auth={"apiKeysFile": str(keys_file), "upstreamApiKeyEnv": "ENGINE_KEY"})
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT, headers=_bearer(KEY_A)) as resp:
        assert resp.status == 200
    (seen,) = [r["headers"] for r in engine.requests]
    assert [v for k, v in seen.items() if k.lower() == "authorization"] == [f"Bearer {ENGINE_KEY}"]


async def test_without_router_keys_the_engine_key_replaces_whatever_the_client_sent(
    make_engine, make_router, http, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENGINE_KEY", ENGINE_KEY)
    engine = await make_engine("gpu-0")
    router = await make_router([engine], auth={"upstreamApiKeyEnv": "ENGINE_KEY"})
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT, headers=_bearer("client-x")) as resp:
        assert resp.status == 200  # no client keys configured: anyone may call
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200
    assert [r["headers"]["Authorization"] for r in engine.requests] == [f"Bearer {ENGINE_KEY}"] * 2


# ---- admin token -----------------------------------------------------------------------------------------


async def test_admin_routes_need_the_token_but_probes_and_metrics_stay_open(
    make_engine, make_router, http, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETROUTE_ADMIN_TOKEN", ADMIN_TOKEN)  # the default admin.tokenEnv
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    admin = router.admin_url
    for method, path, headers in [
        ("GET", "/admin/endpoints", {}),
        ("GET", "/admin/endpoints", _bearer("nope")),
        ("POST", "/admin/endpoints/gpu-0/drain", {}),
        ("GET", "/admin/anything-else", {}),
        ("GET", "/metrics/../admin/endpoints", {}),
    ]:
        async with http.request(method, admin + path, headers=headers) as resp:
            assert resp.status == 401, path
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            assert (await resp.json())["error"]["code"] == "invalid_admin_token"
    for path in ("/metrics", "/healthz", "/readyz"):
        async with http.get(admin + path) as resp:
            assert resp.status == 200, path
    async with http.get(admin + "/admin/endpoints", headers=_bearer(ADMIN_TOKEN)) as resp:
        assert resp.status == 200 and (await resp.json())["endpoints"][0]["state"] == "serving"
    async with http.post(admin + "/admin/endpoints/gpu-0/drain", headers=_bearer(ADMIN_TOKEN)) as resp:
        assert resp.status == 200
    assert router.ctx.balancer.snapshot.views[0].state.value == "draining"
    # The admin token is not a client key: the ingress stays as configured (open here).
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 503  # the only endpoint is drained


async def test_without_a_token_the_admin_routes_stay_open(make_engine, make_router, http, monkeypatch) -> None:
    monkeypatch.delenv("FLEETROUTE_ADMIN_TOKEN", raising=False)
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    async with http.get(router.admin_url + "/admin/endpoints") as resp:
        assert resp.status == 200


EXPOSED = "the admin listener is reachable from other hosts and has no admin token"


@pytest.mark.parametrize(("reachable_elsewhere", "token", "warned"), [
    (False, None, False),  # loopback: only this host's processes reach it (the default)
    (True, None, True),
    (True, ADMIN_TOKEN, False),
], ids=["loopback", "reachable-without-token", "reachable-with-token"])
async def test_an_admin_listener_open_to_other_hosts_without_a_token_is_warned_about(
        make_engine, make_router, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        reachable_elsewhere: bool, token: str | None, warned: bool) -> None:
    # Tests bind loopback only: a non-loopback admin address (admin.host: 0.0.0.0) is what the check is told.
    from router.server import app

    if reachable_elsewhere:
        monkeypatch.setattr(app, "is_loopback", lambda host: False)
    if token is None:
        monkeypatch.delenv("FLEETROUTE_ADMIN_TOKEN", raising=False)
    else:
        monkeypatch.setenv("FLEETROUTE_ADMIN_TOKEN", token)
    router = await make_router([await make_engine("gpu-0")])
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith(EXPOSED)]
    assert len(warnings) == (1 if warned else 0)
    if warned:  # it names the address actually bound (port 0 resolved)
        assert warnings[0].admin == [router.admin_url.removeprefix("http://")]


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.0.0.2", True), ("::1", True), ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("fe80::1%eth0", False),
])
def test_which_admin_addresses_count_as_loopback(host: str, loopback: bool) -> None:
    from router.server.app import is_loopback

    assert is_loopback(host) is loopback


@pytest.mark.parametrize("token", [None, ADMIN_TOKEN], ids=["no-token", "token"])
async def test_another_web_site_cannot_drain_an_endpoint_through_the_operators_browser(
    make_engine, make_router, http, monkeypatch: pytest.MonkeyPatch, token: str | None,
) -> None:
    """A page elsewhere that posts a form (or a fetch) to the admin API from the operator's browser: the
    browser marks it as cross-site, and the router refuses to change anything (with or without a token: the
    status page's cookie would ride along with the post)."""
    if token is None:
        monkeypatch.delenv("FLEETROUTE_ADMIN_TOKEN", raising=False)
    else:
        monkeypatch.setenv("FLEETROUTE_ADMIN_TOKEN", token)
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    auth = _bearer(token) if token else {}
    drain = router.admin_url + "/admin/endpoints/gpu-0/drain"
    # Another site; another port of the same host (same-site, not same-origin); a sandboxed page in an old browser.
    for headers in ({"Origin": "https://evil.example"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site", "Origin": "http://127.0.0.1:1"}, {"Origin": "null"}):
        async with http.post(drain, headers={**auth, **headers}) as resp:
            assert resp.status == 403, headers
            assert (await resp.json())["error"]["code"] == "cross_site"
    assert router.ctx.balancer.snapshot.views[0].state.value == "serving"
    # The same post from the admin listener's own origin (the status page), or from a tool (no Origin), works.
    host = router.admin_url.split("://", 1)[1]
    async with http.post(drain, headers={**auth, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}) as resp:
        assert resp.status == 200
    assert router.ctx.balancer.snapshot.views[0].state.value == "draining"
    registry = router.ctx.metrics.registry
    assert registry.get_sample_value("fleetroute_rejected_requests_total", {"reason": "cross_site"}) == 4


async def test_without_a_token_a_rebound_host_name_reads_nothing(make_engine, make_router, http, monkeypatch) -> None:
    """DNS rebinding: a page at evil.example makes its name resolve to the router's address and reads the admin
    API with its own Host. Without a token the admin API answers only IP addresses and localhost; the probes
    and /metrics stay open to anyone (Prometheus may scrape through a Service name)."""
    monkeypatch.delenv("FLEETROUTE_ADMIN_TOKEN", raising=False)
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    port = router.admin_url.rsplit(":", 1)[1]
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example"):
        async with http.get(router.admin_url + "/admin/endpoints", headers={"Host": host}) as resp:
            assert resp.status == 403, host
            assert (await resp.json())["error"]["code"] == "untrusted_host"
        async with http.get(router.admin_url + "/metrics", headers={"Host": host}) as resp:
            assert resp.status == 200
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "[::1]", "10.1.2.3:9090"):
        async with http.get(router.admin_url + "/admin/endpoints", headers={"Host": host}) as resp:
            assert resp.status == 200, host


# ---- header limits, logs, upstream addresses -------------------------------------------------------------


async def test_an_oversized_header_gets_a_clean_400_and_the_router_keeps_serving(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    body = orjson.dumps(CHAT)
    status, answer = await _raw(router.ingress_url, _post("/v1/chat/completions", b"X-Big: " + b"a" * 9000 + b"\r\n", body))
    assert status == 400 and answer.startswith(b"HTTP/1.")
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(200))  # more header lines than the limit
    status, _ = await _raw(router.ingress_url, _post("/v1/chat/completions", many, body))
    assert status == 400
    status, _ = await _raw(router.ingress_url, _post("/v1/chat/completions", b"X-Fits: " + b"a" * 8000 + b"\r\n", body))
    assert status == 200
    status, _ = await _raw(router.admin_url, b"GET /healthz HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n")
    assert status == 400
    assert len(engine.requests) == 1
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 200


async def test_the_header_limit_is_configurable_for_long_tokens(make_engine, make_router, tmp_path: Path) -> None:
    # A 20 kB bearer token (a JWT with many claims, say) needs a higher limit. The router drops it before
    # forwarding (client keys are on), so the engine's own, default, limit does not matter.
    token = "j" * 20000
    (tmp_path / "keys").write_text(token)
    engine = await make_engine("gpu-0")
    header = b"Authorization: Bearer " + token.encode() + b"\r\n"
    default = await make_router([engine], auth={"apiKeysFile": str(tmp_path / "keys")})
    status, _ = await _raw(default.ingress_url, _post("/v1/chat/completions", header, orjson.dumps(CHAT)))
    assert status == 400
    raised = await make_router([engine], auth={"apiKeysFile": str(tmp_path / "keys")}, limits={"maxHeaderBytes": 32768})
    status, _ = await _raw(raised.ingress_url, _post("/v1/chat/completions", header, orjson.dumps(CHAT)))
    assert status == 200


async def test_no_secret_ever_reaches_a_log_line(
    make_engine, make_router, http, keys_file: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("ENGINE_KEY", ENGINE_KEY)
    monkeypatch.setenv("FLEETROUTE_ADMIN_TOKEN", ADMIN_TOKEN)
    caplog.set_level(logging.DEBUG)  # everything, from every logger (aiohttp's included)
    engine = await make_engine("gpu-0")
    router = await make_router([engine], auth={"apiKeysFile": str(keys_file), "upstreamApiKeyEnv": "ENGINE_KEY"})
    router.ctx.access_log = AccessLog(access_stream := io.BytesIO())
    url = router.ingress_url + "/v1/chat/completions"
    async with http.post(url, json=CHAT, headers=_bearer(KEY_A)) as resp:
        assert resp.status == 200
    async with http.post(url, json={**CHAT, "stream": True}, headers=_bearer(KEY_B)) as resp:
        await resp.read()
    async with http.post(url, json=CHAT, headers=_bearer("sk-wrong-key-guess-000000000")) as resp:
        assert resp.status == 401
    async with http.post(url, data=b"{broken", headers=_bearer(KEY_A)) as resp:
        assert resp.status == 400
    async with http.get(router.admin_url + "/admin/endpoints", headers=_bearer(ADMIN_TOKEN)) as resp:
        assert resp.status == 200
    # Requests aiohttp cannot parse: an oversized Authorization header and a NUL in one. aiohttp would log
    # the offending line (our key in it) with a traceback.
    body = orjson.dumps(CHAT)
    huge = b"Authorization: Bearer " + KEY_A.encode() + b"x" * 9000 + b"\r\n"
    assert (await _raw(router.ingress_url, _post("/v1/chat/completions", huge, body)))[0] == 400
    nul = b"Authorization: Bearer " + KEY_B.encode() + b"\x00\r\n"
    assert (await _raw(router.ingress_url, _post("/v1/chat/completions", nul, body)))[0] == 400
    router.ctx.access_log.flush()
    access_lines = access_stream.getvalue().decode().splitlines()
    lines = [JsonFormatter().format(r) for r in caplog.records] + access_lines
    access = [orjson.loads(line) for line in access_lines]
    assert len(access) == 3 and {a["status"] for a in access} == {200, 400}  # the 401 stops before the handler
    malformed = [orjson.loads(line) for line in lines if "malformed HTTP request rejected" in line]
    assert len(malformed) == 2 and {m["status"] for m in malformed} == {400}
    for line in lines:
        for secret in SECRETS:
            assert secret not in line, (secret, line[:200])
        assert "Bearer" not in line


async def test_clients_cannot_choose_the_upstream_address(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    decoy = await make_engine("decoy")  # a server the client would like the router to call
    router = await make_router([engine])
    body = orjson.dumps(CHAT)
    decoy_host = decoy.url.removeprefix("http://").encode()
    attempts = [
        # An absolute-form request target naming another host.
        b"POST " + decoy.url.encode() + b"/v1/chat/completions HTTP/1.1\r\nHost: " + decoy_host
        + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body,
        # Forwarding headers that some proxies trust.
        _post("/v1/chat/completions", b"X-Forwarded-Host: " + decoy_host + b"\r\nX-Original-URL: " + decoy.url.encode()
              + b"/v1/chat/completions\r\nForwarded: host=" + decoy_host + b"\r\n", body),
        # A query string shaped like a URL with credentials and a host.
        _post("/v1/chat/completions?next=@" + decoy_host.decode() + "/x", b"", body),
    ]
    for data in attempts:
        status, answer = await _raw(router.ingress_url, data)
        assert status == 200 and b"x-fleetroute-endpoint: gpu-0" in answer
    status, _ = await _raw(router.ingress_url, _post("/v1/chat/../../v1/chat/completions", b"", body))
    assert status == 404  # not normalised into a route
    assert decoy.requests == [] and len(engine.requests) == 3
