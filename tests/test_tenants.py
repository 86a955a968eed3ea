"""Tenants: the `tenancy:` block, API keys that name their tenant (the old key format still read), the header
when keys are off, and per-tenant metrics whose labels only ever hold configured names.

Configuration tests call `parse_settings`; the rest go through a real router and a fake engine on 127.0.0.1.
"""

from __future__ import annotations

import hmac
from pathlib import Path
from typing import Any

import pytest

from router.config.settings import ConfigError, parse_settings
from router.server import auth
from router.traffic.tenants import DEFAULT_TENANT, TenancySettings, Tenant
from tests.conftest import MODEL

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello there, how are you today?"}]}
KEY_ACME = "sk-acme-0123456789abcdef"
KEY_ACME_2 = "sk-acme-second-0000000000"
KEY_BETA = "sk-beta-fedcba9876543210"
KEY_OLD = "sk-old-format-5555555555"
TENANTS = [{"name": "acme", "weight": 3}, {"name": "beta", "requestsPerMinute": None}]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys"
    path.write_text(f"# tenants' keys\n{KEY_ACME} tenant=acme\n{KEY_BETA} explain tenant=beta, {KEY_ACME_2} tenant=acme\n"
                    f"{KEY_OLD}\n")
    return path


# ---- configuration ---------------------------------------------------------------------------------------


def test_without_a_tenancy_block_there_are_no_tenants() -> None:
    assert parse_settings({}).tenancy is None


def test_the_defaults_and_a_full_block() -> None:
    t = parse_settings({"tenancy": {}}).tenancy
    assert t == TenancySettings()
    assert t.names() == (DEFAULT_TENANT,) and t.header == "x-tenant-id" and t.fairness
    assert t.budget_fail_mode == "open" and t.budget_timeout == 0.1 and not t.budgets
    t = parse_settings({"redis": {"url": "redis://127.0.0.1:1"}, "tenancy": {
        "header": "X-Team", "fairness": False, "budgetFailMode": "closed", "budgetTimeout": "250ms",
        "tenants": [{"name": "acme", "weight": 3, "requestsPerMinute": 600, "tokensPerMinute": 100000},
                    {"name": "default", "weight": 0.5}]}}).tenancy
    assert t.header == "x-team" and not t.fairness and t.budget_fail_mode == "closed" and t.budget_timeout == 0.25
    assert t.tenants == (Tenant("acme", 3.0, 600, 100000), Tenant("default", 0.5))  # default listed: its settings
    assert t.budgets and t.tenant("nobody") == Tenant("default", 0.5)
    assert parse_settings({"tenancy": {"header": None}}).tenancy.header is None


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"tenant": []}, "tenancy.tenant: unknown field (expected one of: budgetFailMode, budgetTimeout, fairness, "
                         "header, tenants)"),
        ({"tenants": [{"name": "Acme Corp"}]}, "tenancy.tenants[0].name: tenant names must be lower-case"),
        ({"tenants": [{"weight": 2}]}, "tenancy.tenants[0].name: is required"),
        ({"tenants": [{"name": "a"}, {"name": "a"}]}, "tenancy.tenants[1].name: duplicate tenant 'a'"),
        ({"tenants": [{"name": "a", "weight": 0}]}, "tenancy.tenants[0].weight: must be > 0.0 and <= 1000.0"),
        ({"tenants": [{"name": "a", "requestsPerMinute": 0}]}, "tenancy.tenants[0].requestsPerMinute: must be between 1"),
        ({"tenants": [{"name": "a", "tokensPerMinute": "lots"}]}, "tenancy.tenants[0].tokensPerMinute: must be an integer"),
        ({"tenants": [{"name": "a", "rpm": 5}]}, "tenancy.tenants[0].rpm: unknown field"),
        ({"tenants": [{"name": f"t{i}"} for i in range(65)]}, "tenancy.tenants: at most 64 tenants, got 65"),
        ({"header": "x tenant"}, "tenancy.header: must be an HTTP header name"),
        ({"fairness": "yes"}, "tenancy.fairness: must be true or false"),
        ({"budgetFailMode": "maybe"}, "tenancy.budgetFailMode: must be one of open, closed"),
        ({"tenants": [{"name": "a", "requestsPerMinute": 5}]}, "tenancy.tenants: tenant 'a' has a budget, and budgets "
                                                               "need redis"),
        ("on", "tenancy: must be a mapping, got 'on'"),
    ],
    ids=lambda v: str(v)[:40],
)
def test_bad_tenancy_fields_are_named(block: Any, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_settings({"tenancy": block, "redis": {"url": None}})
    assert message in str(info.value)


def test_keys_name_their_tenant_and_the_old_format_still_reads(keys_file: Path) -> None:
    settings = parse_settings({"auth": {"apiKeysFile": str(keys_file)}, "tenancy": {"tenants": TENANTS}})
    a = settings.auth
    assert a is not None and len(a.api_key_digests) == 4
    tenants = dict(zip(a.api_key_digests, a.api_key_tenants, strict=True))
    assert [tenants[auth._digest(k)] for k in (KEY_ACME, KEY_BETA, KEY_ACME_2, KEY_OLD)] == [
        "acme", "beta", "acme", "default"]
    assert a.explain_key_digests == (auth._digest(KEY_BETA),)  # flags combine, in any order
    # A file in the old format, without any tenancy block: every key belongs to `default`.
    (keys_file.parent / "old").write_text(f"{KEY_OLD}, {KEY_BETA} explain\n")
    old = parse_settings({"auth": {"apiKeysFile": str(keys_file.parent / "old")}}).auth
    assert old.api_key_tenants == ("default", "default") and len(old.explain_key_digests) == 1


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (f"{KEY_ACME} tenant=umbrella", "key 1 names tenant 'umbrella', which tenancy.tenants does not list "
                                        "(listed: default, acme, beta)"),
        (f"{KEY_OLD}\n{KEY_ACME} tenant=acme tenant=beta", "key 2 is followed by something other than a flag"),
        (f"{KEY_ACME} tenant=acme\n{KEY_ACME} tenant=beta", "a key is listed twice with different tenants "
                                                            "(acme, beta); the second time as key 2"),
        (f"{KEY_ACME} team=acme", "key 1 is followed by something other than a flag (a key may be followed by: "
                                  "explain, tenant=<name>)"),
    ],
    ids=["unlisted tenant", "two tenants", "one key two tenants", "unknown flag"],
)
def test_bad_key_tenants_are_named_and_never_quote_a_key(tmp_path: Path, text: str, message: str) -> None:
    (tmp_path / "keys").write_text(text)
    with pytest.raises(ConfigError) as info:
        parse_settings({"auth": {"apiKeysFile": str(tmp_path / "keys")}, "tenancy": {"tenants": TENANTS}})
    assert message in str(info.value) and "sk-" not in str(info.value)


def test_the_same_key_twice_for_one_tenant_is_one_key(tmp_path: Path) -> None:
    (tmp_path / "keys").write_text(f"{KEY_ACME} tenant=acme\n{KEY_ACME} tenant=acme explain\n")
    a = parse_settings({"auth": {"apiKeysFile": str(tmp_path / "keys")}, "tenancy": {"tenants": TENANTS}}).auth
    assert a.api_key_tenants == ("acme",) and len(a.explain_key_digests) == 1


def test_finding_the_key_compares_every_key_every_time(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append(len(a) + len(b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    digests = tuple(auth._digest(k) for k in (KEY_ACME, KEY_BETA, KEY_OLD))
    assert [auth._match_index(k, digests) for k in (KEY_ACME, KEY_BETA, KEY_OLD, "sk-guess")] == [0, 1, 2, -1]
    assert calls == [64] * 12  # no early exit, whichever key matched (or none)


# ---- identification, end to end --------------------------------------------------------------------------


async def _metrics(http: Any, router: Any) -> str:
    async with http.get(router.admin_url + "/metrics") as resp:
        return await resp.text()


async def test_a_requests_tenant_is_its_keys_and_the_header_is_ignored_with_keys(
        make_engine, make_router, http, keys_file: Path) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], auth={"apiKeysFile": str(keys_file)}, tenancy={"tenants": TENANTS})
    url = router.ingress_url + "/v1/chat/completions"
    for key, claimed in ((KEY_ACME, None), (KEY_ACME_2, "beta"), (KEY_BETA, "acme"), (KEY_OLD, "acme")):
        headers = {**_bearer(key), **({"x-tenant-id": claimed} if claimed else {})}
        async with http.post(url, json={**CHAT, "stream": True}, headers=headers) as resp:
            assert resp.status == 200
            await resp.read()
    text = await _metrics(http, router)
    # The key decides: a client holding a key cannot claim another tenant with the header.
    for line in ['fleetroute_tenant_admitted_total{model="llama-3-8b",tenant="acme"} 2.0',
                 'fleetroute_tenant_admitted_total{model="llama-3-8b",tenant="beta"} 1.0',
                 'fleetroute_tenant_admitted_total{model="llama-3-8b",tenant="default"} 1.0']:
        assert line in text, line
    # Tokens per tenant: prompt tokens estimated at admission, completion tokens counted from the streams (the
    # fake engine answers 4 tokens).
    assert 'fleetroute_tenant_tokens_total{kind="completion",tenant="acme"} 8.0' in text
    assert 'fleetroute_tenant_tokens_total{kind="prompt",tenant="beta"}' in text


async def test_without_keys_the_header_names_only_listed_tenants(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine], tenancy={"tenants": TENANTS, "header": "X-Team"})
    url = router.ingress_url + "/v1/chat/completions"
    for value in ("acme", " BETA ", "umbrella", "x" * 300, None):
        async with http.post(url, json=CHAT, headers={"x-team": value} if value else {}) as resp:
            assert resp.status == 200
    text = await _metrics(http, router)
    counts = {line.split("tenant=")[1].split('"')[1]: float(line.rsplit(" ", 1)[1])
              for line in text.splitlines() if line.startswith("fleetroute_tenant_admitted_total{")}
    # Unlisted values are `default`: client strings never become label values.
    assert counts == {"acme": 1.0, "beta": 1.0, "default": 3.0}
    assert "umbrella" not in text and "xxxx" not in text


async def test_tenants_cost_nothing_when_not_configured(make_engine, make_router, http) -> None:
    engine = await make_engine("gpu-0")
    router = await make_router([engine])
    async with http.post(router.ingress_url + "/v1/chat/completions", json=CHAT,
                         headers={"x-tenant-id": "acme"}) as resp:
        assert resp.status == 200
    text = await _metrics(http, router)
    assert "fleetroute_tenant_admitted_total{" not in text and "fleetroute_cost_outcomes_total{" not in text
