"""Protection: client API keys, the admin token, HTTP header limits, and keeping secrets out of logs.

- **Client API keys** (`auth.apiKeysFile`, `auth.apiKeysEnv`): when configured, every ingress request
  (`/v1/*`, unknown paths included, so routes cannot be probed) needs `Authorization: Bearer <key>`.
  The presented token is hashed (SHA-256) and compared with `hmac.compare_digest` against *every* key's
  hash, without stopping at a match: the time taken depends neither on which key matched nor on how much of
  a key an attacker guessed, and hashing first makes the lengths equal too. A missing or wrong key gets 401
  in the OpenAI shape (`invalid_api_key`, as OpenAI's own API answers) with `WWW-Authenticate: Bearer`.
- **Credentials upstream**: with client keys on, the client's `Authorization` is not forwarded (an
  engine must never see, or log, the router's client keys). `auth.upstreamApiKeyEnv` names a variable
  holding the key the engines expect (vLLM `--api-key`); when set it is sent instead, whatever the client
  sent. With neither, `Authorization` passes through untouched, as before.
- **Tenants** (router/traffic/tenants.py): a key followed by `tenant=<name>` (`sk-acme-1 tenant=acme`) belongs to
  that tenant, which `tenancy.tenants` must list; other keys belong to `default`. The key check finds the
  matching key's index without a branch on the match (`_match_index`) and records its tenant on the request
  (`KEY_TENANT`), where router/traffic/tenants.py reads it.
- **Explanations** (router/server/explain.py): a key followed by the flag `explain` (`sk-alice explain`) may ask
  for routing explanations with `x-fleetroute-explain: 1`; the admin token may too, as that header's value.
  Nobody else can: their header is ignored (`explain_permission`).
- **Admin token** (`admin.tokenEnv`, default `FLEETROUTE_ADMIN_TOKEN`): when the variable is set, every
  admin route except the probes and the scrape (`/metrics`, `/healthz`, `/readyz`) needs
  `Authorization: Bearer <token>`. Deny by default: a route added later is protected without a change here.
  The status page (router/server/status/) adds one alternative for its own routes only: a session cookie its login
  form issues after checking the token, with a CSRF token for POSTs (`BrowserAccess`).
- **Header limits**: aiohttp's parser limits, set explicitly (`limits.maxHeaderBytes` per header line and
  for the request line, 128 header lines). Past them the client gets a 400 before any handler runs (in the
  OpenAI shape, without the offending bytes: router/server/connections.py).
- **No secrets in logs**: keys are held only as hashes or with `repr=False`, never logged, never echoed in
  an error. aiohttp logs a request it cannot parse with a traceback quoting the offending bytes (an
  oversized or malformed `Authorization` header among them); `ProtocolLog` logs one line with the error's
  class and status instead.

Secrets are read when the config is loaded, so a missing variable or an empty key file fails start-up
(exit code 2) instead of silently leaving the router open. Rotating keys needs a restart (a rolling one in
Kubernetes).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import urlsplit

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict

from router.config.fields import NOT_SHOWN, ConfigError, Fields, _show
from router.runtime.errors import error_response
from router.runtime.metrics import RouterMetrics
from router.traffic.tenants import DEFAULT_TENANT, KEY_TENANT

ADMIN_TOKEN_ENV = "FLEETROUTE_ADMIN_TOKEN"
DEFAULT_MAX_HEADER_BYTES = 8190  # aiohttp's (and nginx's large_client_header_buffers) default line size
MAX_HEADERS = 128
OPEN_ADMIN_PATHS = frozenset({"/metrics", "/healthz", "/readyz"})  # kubelet and Prometheus carry no token
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_TOKEN = re.compile(r"^[\x21-\x7e]+$")  # visible ASCII, no spaces: what fits in `Bearer <token>`
KEY_FLAGS = ("explain", "tenant=<name>")  # what may follow a key in a key file or variable
EXPLAIN_ON = frozenset({"1", "true", "yes", "on"})  # x-fleetroute-explain values that ask with an API key

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True)
class AuthSettings:
    """Secrets are kept as SHA-256 digests or hidden from repr: printing settings never shows them."""

    api_key_digests: tuple[bytes, ...] = field(default=(), repr=False)
    explain_key_digests: tuple[bytes, ...] = field(default=(), repr=False)  # keys marked `explain`
    api_key_tenants: tuple[str, ...] = ()  # the tenant of each key, in the order of api_key_digests
    api_key_sources: tuple[str, ...] = ()  # where the keys came from ("file /x", "$VAR"), for humans
    upstream_authorization: str | None = field(default=None, repr=False)  # "Bearer <engine key>"
    admin_token_digest: bytes | None = field(default=None, repr=False)
    admin_token_env: str = ADMIN_TOKEN_ENV

    @property
    def client_keys(self) -> bool:
        return bool(self.api_key_digests)


def parse_auth(top: Fields, tenants: tuple[str, ...] = (DEFAULT_TENANT,)) -> AuthSettings | None:
    """The `auth:` block and `admin.tokenEnv`, with the secrets they point to read now; None if none is set.
    `tenants`: the tenant names keys may name (`tenancy.tenants`)."""
    f = top.sub("auth")
    keys: list[_Key] = []
    sources: list[str] = []
    path = f.get("apiKeysFile")
    if path is not None:
        path = f.string("apiKeysFile")
        where = f.at("apiKeysFile")
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ConfigError(where, f"cannot read the file it names: {reason} {NOT_SHOWN}") from None
        keys += _keys(text, where, tenants)
        sources.append(f"file {path}")
    env = _env_name(f, "apiKeysEnv")
    if env is not None:
        keys += _keys(_required_env(env, f.at("apiKeysEnv")), f"${env}", tenants)
        sources.append(f"${env}")
    upstream = None
    upstream_env = _env_name(f, "upstreamApiKeyEnv")
    if upstream_env is not None:
        value = _required_env(upstream_env, f.at("upstreamApiKeyEnv")).strip()
        if not _TOKEN.match(value):
            raise ConfigError(f"${upstream_env}", "must be one token of visible ASCII characters")
        upstream = f"Bearer {value}"
    f.done()
    admin = top.raw.get("admin")
    admin_fields = Fields(admin if isinstance(admin, Mapping) else None, "admin")
    token_env = _env_name(admin_fields, "tokenEnv")  # admin's other fields are read by settings._address
    explicit = token_env is not None
    token_env = token_env or ADMIN_TOKEN_ENV
    token = os.environ.get(token_env, "").strip()
    if explicit and not token:
        # Asked for by name: an unset variable must fail start-up, not leave /admin open.
        raise ConfigError("admin.tokenEnv", f"the environment variable it names is not set or empty {NOT_SHOWN}")
    if token and not _TOKEN.match(token):
        raise ConfigError(f"${token_env}", "must be one token of visible ASCII characters")
    if not keys and upstream is None and not token:
        return None  # nothing configured: no middleware, no header rewriting
    by_digest: dict[bytes, str] = {}  # each key once, with its tenant
    for key in keys:
        digest = _digest(key.key)
        if by_digest.setdefault(digest, key.tenant) != key.tenant:
            # Never quote the key: config errors end up in logs.
            raise ConfigError(key.where, f"a key is listed twice with different tenants ({by_digest[digest]}, "
                                         f"{key.tenant}); the second time as key {key.number}")
    return AuthSettings(
        api_key_digests=tuple(by_digest),
        api_key_tenants=tuple(by_digest.values()),
        explain_key_digests=tuple(dict.fromkeys(_digest(k.key) for k in keys if k.explain)),
        api_key_sources=tuple(sources),
        upstream_authorization=upstream,
        admin_token_digest=_digest(token) if token else None,
        admin_token_env=token_env,
    )


def _env_name(f: Fields, key: str) -> str | None:
    if f.get(key) is None:
        return None
    name = f.string(key)
    if not _ENV_NAME.match(name):
        raise ConfigError(f.at(key), f"must be an environment variable name (letters, digits, _) {NOT_SHOWN}")
    return name


def _required_env(name: str, where: str) -> str:
    value = os.environ.get(name, "")
    if not value.strip():
        raise ConfigError(where, f"the environment variable it names is not set or empty {NOT_SHOWN}")
    return value


@dataclass(frozen=True)
class _Key:
    key: str = field(repr=False)
    explain: bool  # may ask for routing explanations
    tenant: str
    where: str  # the source, for errors
    number: int  # its position in the source, for errors (never the key itself)


def _keys(text: str, where: str, tenants: tuple[str, ...] = (DEFAULT_TENANT,)) -> list[_Key]:
    """Keys separated by commas or newlines; blank lines and lines starting with `#` are skipped. A key may
    be followed, after spaces, by flags: `explain` (its holder may ask for routing explanations) and
    `tenant=<name>` (the tenant it belongs to, one of `tenants`; without it, `default`)."""
    keys: list[_Key] = []
    for line in text.splitlines():
        if line.strip().startswith("#"):
            continue
        for item in line.split(","):
            if not item.strip():
                continue
            key, *flags = item.split()
            number = len(keys) + 1
            if not _TOKEN.match(key):
                # Never quote the key itself: config errors end up in logs.
                raise ConfigError(where, f"key {number} contains spaces or non-ASCII characters")
            tenant = DEFAULT_TENANT
            named = [flag.removeprefix("tenant=") for flag in flags if flag.startswith("tenant=")]
            if any(flag != "explain" and not flag.startswith("tenant=") for flag in flags) or len(named) > 1:
                # Nor the flag: a missing comma between two keys would make the second one look like a flag.
                raise ConfigError(where, f"key {number} is followed by something other than a flag "
                                         f"(a key may be followed by: {', '.join(KEY_FLAGS)})")
            if named:
                tenant = named[0]
                if tenant not in tenants:
                    # A tenant name is a metric label value: only names the configuration lists.
                    raise ConfigError(where, f"key {number} names tenant {_show(tenant[:40])}, which tenancy.tenants "
                                             f"does not list (listed: {', '.join(tenants)})")
            keys.append(_Key(key, "explain" in flags, tenant, where, number))
    if not keys:
        raise ConfigError(where, "contains no API keys")
    return keys


def _digest(secret: str | bytes) -> bytes:
    data = secret.encode("utf-8", "surrogateescape") if isinstance(secret, str) else secret
    return hashlib.sha256(data).digest()


def _bearer(header: str | None) -> str | None:
    """The token of `Authorization: Bearer <token>` (scheme case-insensitive), or None."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def _matches(token: str, digests: tuple[bytes, ...]) -> bool:
    presented = _digest(token)
    ok = False
    for digest in digests:  # no early exit: every key is compared every time
        ok |= hmac.compare_digest(presented, digest)
    return ok


def _match_index(token: str, digests: tuple[bytes, ...]) -> int:
    """The index of the digest `token` hashes to, or -1. Like `_matches`, every digest is compared every time,
    and the match is added in, not branched on (the digests are distinct, so at most one matches)."""
    presented = _digest(token)
    found = 0
    for i, digest in enumerate(digests, 1):
        found += i * hmac.compare_digest(presented, digest)
    return found - 1


def _unauthorized(metrics: RouterMetrics, *, reason: str, missing: bool, what: str) -> web.Response:
    metrics.rejected.labels(reason).inc()
    if missing:
        message = f"You didn't provide an {what}. Send it in an Authorization header: `Authorization: Bearer <key>`."
        challenge = 'Bearer realm="fleetroute"'
    else:
        message = f"Incorrect {what} provided."
        challenge = 'Bearer realm="fleetroute", error="invalid_token"'
    return error_response(401, message, code=reason, headers={"WWW-Authenticate": challenge})


def client_auth_middleware(settings: AuthSettings, metrics: RouterMetrics) -> Any:
    """Ingress middleware requiring one of the client API keys (install it only when keys are set)."""
    digests = settings.api_key_digests
    tenants = settings.api_key_tenants

    @web.middleware
    async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
        token = _bearer(request.headers.get("Authorization"))
        index = _match_index(token, digests) if token is not None else -1
        if index < 0:
            return _unauthorized(metrics, reason="invalid_api_key", missing=token is None, what="API key")
        request[KEY_TENANT] = tenants[index]  # router/traffic/tenants.py: the request's tenant
        return await handler(request)

    return require_api_key


class BrowserAccess(Protocol):
    """The status page's browser sessions (router/server/status/sessions.py), as the admin middleware sees them."""

    def public(self, request: web.Request) -> bool:
        """A route that shows no data and needs no credentials (the login form and its assets)."""
        ...

    def authenticated(self, request: web.Request) -> bool:
        """A valid session cookie on one of the page's own routes (and, for a POST, its CSRF token)."""
        ...


def admin_auth_middleware(settings: AuthSettings, metrics: RouterMetrics, browser: BrowserAccess | None = None) -> Any:
    """Admin middleware requiring the admin token on everything but the probes and `/metrics`; the status
    page's routes also take its session cookie instead (`browser`)."""
    digest = settings.admin_token_digest
    assert digest is not None

    @web.middleware
    async def require_admin_token(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path not in OPEN_ADMIN_PATHS and not (browser is not None and browser.public(request)):
            token = _bearer(request.headers.get("Authorization"))
            if (token is None or not _matches(token, (digest,))) and not (
                    browser is not None and browser.authenticated(request)):
                return _unauthorized(metrics, reason="invalid_admin_token", missing=token is None,
                                     what="admin token")
        return await handler(request)

    return require_admin_token


def is_admin_token(settings: AuthSettings | None, presented: str) -> bool:
    """Is `presented` the admin token? Constant time, like every other check here; False when none is set."""
    digest = settings.admin_token_digest if settings is not None else None
    return digest is not None and bool(presented) and _matches(presented, (digest,))


def upstream_credentials(settings: AuthSettings | None) -> Callable[[CIMultiDict[str]], None] | None:
    """What the proxy does to `Authorization` on its way to an engine; None: pass it through."""
    if settings is None:
        return None
    replacement = settings.upstream_authorization
    if replacement is not None:
        def send_engine_key(headers: CIMultiDict[str]) -> None:
            headers.popall("Authorization", None)
            headers["Authorization"] = replacement

        return send_engine_key
    if settings.client_keys:
        def drop_client_key(headers: CIMultiDict[str]) -> None:
            headers.popall("Authorization", None)

        return drop_client_key
    return None


def explain_permission(settings: AuthSettings | None) -> Callable[[str, str | None], bool] | None:
    """Who may ask for a routing explanation (router/server/explain.py), given `x-fleetroute-explain`'s value and the
    request's `Authorization`; None when nobody can (no admin token, no key marked `explain`).

    - the admin token as the header's value (an operator, with a client key as well if the ingress needs
      one): `x-fleetroute-explain: <admin token>`;
    - `x-fleetroute-explain: 1` from a client whose API key (already checked by `require_api_key`) is marked
      `explain` in the key file or variable.

    Anything else is no permission: the request is served without an explanation. Comparisons are constant
    time, as for every other secret here."""
    if settings is None:
        return None
    admin = settings.admin_token_digest
    keys = settings.explain_key_digests
    if admin is None and not keys:
        return None

    def permitted(value: str, authorization: str | None) -> bool:
        value = value.strip()
        if admin is not None and value and _matches(value, (admin,)):
            return True
        if keys and value.lower() in EXPLAIN_ON:
            token = _bearer(authorization)
            return token is not None and _matches(token, keys)
        return False

    return permitted


class ProtocolLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's per-connection logger, minus the bytes of requests it could not parse.

    aiohttp logs a malformed request (a header over the size limit, a NUL in a header value, a bad request
    line) at error level with a traceback whose message quotes the offending line, which may be an
    `Authorization` header. Those become one warning with the error class and status; everything else
    passes through unchanged.
    """

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info")
        if isinstance(exc, HttpProcessingError):
            remote = args[0] if args else None
            self.logger.log(
                min(level, logging.WARNING),  # aiohttp logs a first-line BadHttpMethod (TLS, scanners) at debug
                "malformed HTTP request rejected",
                extra={"error": type(exc).__name__, "status": exc.code, "client": remote},
            )
            return
        self.logger.log(level, msg, *args, **kwargs)


def server_options(max_header_bytes: int) -> dict[str, Any]:
    """Keyword arguments for `web.AppRunner` (passed on to aiohttp's request handler)."""
    return {
        "max_line_size": max_header_bytes,
        "max_field_size": max_header_bytes,
        "max_headers": MAX_HEADERS,
        "logger": ProtocolLog(logging.getLogger("aiohttp.server"), {}),
    }


def ingress_middlewares(settings: AuthSettings | None, metrics: RouterMetrics) -> list[Any]:
    """Middlewares for the ingress app, after `openai_errors` (none when there are no client keys)."""
    if settings is None or not settings.client_keys:
        return []
    return [client_auth_middleware(settings, metrics)]


_UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _host_is_literal(host: str) -> bool:
    """Is a Host header's host an IP address or `localhost` (a name no DNS answer can rebind)?"""
    try:
        name = urlsplit("//" + host).hostname or ""
    except ValueError:  # an unbalanced bracket
        return False
    if name in ("localhost", "localhost."):
        return True
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _cross_site(request: web.Request) -> bool:
    """Did a browser send this on behalf of another site? Browsers say so in `Sec-Fetch-Site` (anything but
    same-origin, or none for what the user typed); an older one only in `Origin` (a sandboxed page's is "null";
    a page of the same origin may send "null" too, but those browsers send Sec-Fetch-Site). Tools send neither."""
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site is not None:
        return fetch_site not in ("same-origin", "none")
    origin = request.headers.get("Origin")
    return origin is not None and (origin == "null" or urlsplit(origin).netloc.lower() != request.host.lower())


def browser_guard_middleware(metrics: RouterMetrics, *, token_set: bool) -> Any:
    """Admin middleware that keeps other web sites out, for an operator's browser is also on the network.

    - A state-changing request (POST: drain, resume) that a browser marks as coming from another site or
      origin (`Sec-Fetch-Site` other than same-origin, or an `Origin` that is not the request's) gets 403: a page
      elsewhere cannot drain an endpoint through the operator's browser (cross-site request forgery), with or
      without an admin token (a form post carries no token, but the status page's cookie would ride along).
    - Without an admin token, only requests addressed to an IP address or `localhost` are answered, but for the
      probes and `/metrics`: a page elsewhere that makes its own name resolve to 127.0.0.1 (DNS rebinding)
      cannot read or change the admin API. With a token, such a page has no token and no cookie of this host.
    """

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.method in _UNSAFE_METHODS and _cross_site(request):
            metrics.rejected.labels("cross_site").inc()
            return error_response(403, "cross-site requests may not change the router's state", code="cross_site")
        if not token_set and request.path not in OPEN_ADMIN_PATHS and not _host_is_literal(request.host):
            metrics.rejected.labels("untrusted_host").inc()
            return error_response(403, "without an admin token the admin API answers only requests addressed to "
                                       "an IP address or localhost", code="untrusted_host")
        return await handler(request)

    return guard


def admin_middlewares(settings: AuthSettings | None, metrics: RouterMetrics,
                      browser: BrowserAccess | None = None) -> list[Any]:
    """Middlewares for the admin app, after `openai_errors`: the browser guard, then the admin token (when one
    is set)."""
    token_set = settings is not None and settings.admin_token_digest is not None
    guard = browser_guard_middleware(metrics, token_set=token_set)
    if settings is None or settings.admin_token_digest is None:
        return [guard]
    return [guard, admin_auth_middleware(settings, metrics, browser)]
