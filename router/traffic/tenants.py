"""Tenants: who a request belongs to, for fair sharing (router/traffic/fair_queue.py), token budgets
(router/traffic/budgets.py) and per-tenant metrics.

A shared fleet serves many teams or customers. The router names each request's tenant from one of two
sources, and from nothing else:

- **API keys** (`auth.apiKeysFile` / `apiKeysEnv`): a key followed by `tenant=<name>` belongs to that
  tenant (router/server/auth.py records the matching key's tenant on the request). Keys without it, and every key
  of a file in the old format, belong to `default`. With keys on, the header below is ignored: a client
  holding a key cannot claim another tenant's share or budget.
- **A header** (`tenancy.header`, default `x-tenant-id`) when no client keys are configured. Its value
  counts only if it names a tenant listed in the config (case-insensitively); any other value, or none,
  is `default`.

Tenant names therefore always come from the configuration: they are metric label values, and a client
must not be able to grow the label set (or the per-tenant state) by sending new names. The list is
bounded (`MAX_TENANTS`) for the same reason.

Each tenant has a `weight` (its share of a saturated admission class, relative to the others waiting) and
optional budgets (`requestsPerMinute`, `tokensPerMinute`). `default` exists always; listing it sets its
weight and budgets.

Nothing here runs without a `tenancy:` block: no identification, no per-tenant metrics, no cost estimate.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiohttp import web

from router.config.fields import ConfigError, Fields, _show

DEFAULT_TENANT = "default"
MAX_TENANTS = 64  # tenant names are metric label values: keep the cardinality bounded
MAX_WEIGHT = 1000.0
MAX_REQUESTS_PER_MINUTE = 1_000_000
MAX_TOKENS_PER_MINUTE = 10_000_000_000
FAIL_MODES = ("open", "closed")
TENANT_NAME = re.compile(r"^[a-z0-9]([-a-z0-9_]{0,30}[a-z0-9])?$")  # like class names: lower-case, 1-32
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")  # an RFC 9110 token

# The tenant of the API key a request presented (set by router/server/auth.py's key check).
KEY_TENANT = web.RequestKey("fleetroute.key_tenant", str)


@dataclass(frozen=True)
class Tenant:
    name: str
    weight: float = 1.0
    requests_per_minute: int | None = None  # None: no request budget
    tokens_per_minute: int | None = None  # None: no token budget (prompt + completion tokens)

    @property
    def budgeted(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


@dataclass(frozen=True)
class TenancySettings:
    """The `tenancy:` block. `tenants` always holds `default` (first, unless listed elsewhere)."""

    tenants: tuple[Tenant, ...] = (Tenant(DEFAULT_TENANT),)
    header: str | None = "x-tenant-id"  # None: no header (without keys, every request is `default`)
    fairness: bool = True  # weighted fair queueing between tenants inside each admission class
    budget_fail_mode: str = "open"  # while Redis is unreachable: open (let requests through) or closed (503)
    budget_timeout: float = 0.1  # seconds a budget check waits for Redis before the fail mode applies
    _by_name: Mapping[str, Tenant] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tenants})

    def names(self) -> tuple[str, ...]:
        return tuple(t.name for t in self.tenants)

    def tenant(self, name: str) -> Tenant:
        return self._by_name.get(name) or self._by_name[DEFAULT_TENANT]

    def weights(self) -> dict[str, float]:
        return {t.name: t.weight for t in self.tenants}

    @property
    def budgets(self) -> bool:
        return any(t.budgeted for t in self.tenants)

    def identify(self, request: web.Request) -> Tenant:
        """The request's tenant: its API key's (keys on), else the header's when it names a listed tenant,
        else `default`. Never a name the configuration does not hold."""
        keyed = request.get(KEY_TENANT)
        if keyed is not None:
            return self.tenant(keyed)
        if self.header is not None:
            value = request.headers.get(self.header)
            if value:
                found = self._by_name.get(value.strip().lower())
                if found is not None:
                    return found
        return self._by_name[DEFAULT_TENANT]


def parse_tenancy(f: Fields) -> TenancySettings:
    """Parse the `tenancy:` block (settings.py calls this before `auth`, whose keys may name tenants)."""
    d = TenancySettings()
    header: str | None = None
    if not f.has("header") or f.get("header") is not None:
        header = f.string("header", d.header)
        if not _HEADER_NAME.match(header):
            raise ConfigError(f.at("header"), f"must be an HTTP header name, got {header!r}")
        header = header.lower()
    fairness = f.boolean("fairness", d.fairness)
    fail_mode = f.choice("budgetFailMode", d.budget_fail_mode, FAIL_MODES)
    timeout = f.duration("budgetTimeout", d.budget_timeout)
    tenants: dict[str, Tenant] = {}
    items = f.items("tenants")
    if len(items) > MAX_TENANTS:
        raise ConfigError(f.at("tenants"), f"at most {MAX_TENANTS} tenants, got {len(items)}")
    for path, item in items:
        t = Fields(item, path)
        name = t.string("name")
        if not TENANT_NAME.match(name):
            raise ConfigError(t.at("name"), f"tenant names must be lower-case letters, digits, '-' or '_' (1-32), "
                                            f"got {_show(name)}")
        if name in tenants:
            raise ConfigError(t.at("name"), f"duplicate tenant {name!r}")
        rpm = tpm = None
        if t.get("requestsPerMinute") is not None:
            rpm = t.integer("requestsPerMinute", 0, minimum=1, maximum=MAX_REQUESTS_PER_MINUTE)
        if t.get("tokensPerMinute") is not None:
            tpm = t.integer("tokensPerMinute", 0, minimum=1, maximum=MAX_TOKENS_PER_MINUTE)
        weight = t.number("weight", 1.0, minimum=0.0, maximum=MAX_WEIGHT, exclusive_minimum=True)
        t.done()
        tenants[name] = Tenant(name, weight, rpm, tpm)
    f.done()
    if DEFAULT_TENANT not in tenants:
        tenants = {DEFAULT_TENANT: Tenant(DEFAULT_TENANT), **tenants}
    return TenancySettings(tenants=tuple(tenants.values()), header=header, fairness=fairness,
                           budget_fail_mode=fail_mode, budget_timeout=timeout)
