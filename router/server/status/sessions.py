"""Browser sessions for the status page: a cookie instead of the `Authorization` header a navigation cannot send.

- **Login.** `POST /status/login` with the admin token in a form field. The token is checked like every other
  admin credential (router/server/auth.py: SHA-256, constant-time compare). On success the answer sets a session
  cookie and redirects to the page; on failure it is the login form again, 401. Both are logged (rate-limited:
  a flood of guesses writes a line per 10 s with the count left out) and counted in
  `fleetroute_status_logins_total{result}`.
- **The cookie** is not the token and does not reveal it: `<expiry>.<nonce>.<mac>`, where the MAC is
  HMAC-SHA256 under a key derived from the admin token's digest. Every worker process (and every replica
  sharing the token) derives the same key, so a session works whichever process answers; changing the token
  ends every session. It lasts `SESSION_SECONDS`; logging out clears it in the browser (sessions are not
  stored, so a copied cookie stays valid until it expires, like a signed token).
  Attributes: `HttpOnly` (no script can read it), `SameSite=Strict` (no other site's page sends it),
  `Path=/status` (cookies are per host, not per port: scoped so, the browser never sends it to the ingress on
  the same host, which would forward it to the engines). The admin listener speaks plain HTTP, so `Secure` is
  set only for requests that arrived over TLS.
- **What the cookie opens**: the page's own routes under `/status/` (its data feed, decision details, drain
  and resume, logout), never the `/admin/*` API, which keeps needing the header.
- **CSRF.** Besides `SameSite=Strict`, every POST authenticated by the cookie must carry `X-Fleetroute-CSRF`
  with a token derived from the cookie (HMAC under the same key), which the page reads from its feed. A form
  or script on another origin can neither read the feed nor set that header without a CORS preflight the
  router never grants.
- **Without an admin token** the admin listener has no authentication (it binds 127.0.0.1 by default), and
  neither has the page: no login, no cookie. Its POSTs still need the `X-Fleetroute-CSRF` header (any value),
  so a page on another origin cannot make the browser drain an endpoint.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Callable

from aiohttp import web

from router.server.auth import AuthSettings

PREFIX = "/status"
COOKIE = "fleetroute_status"
CSRF_HEADER = "X-Fleetroute-CSRF"
SESSION_SECONDS = 12 * 3600
MAX_COOKIE_CHARS = 128  # ours are about 90; anything longer is not ours
_SAFE_METHODS = frozenset({"GET", "HEAD"})
# Routes that show no data: the page (it serves the login form to whoever has no session), its assets, login.
_PUBLIC_GET = frozenset({PREFIX})
_ASSETS = PREFIX + "/assets/"
_LOGIN = PREFIX + "/login"


class BrowserSessions:
    """Issues and checks the page's session cookies and CSRF tokens (`router.server.auth.BrowserAccess`)."""

    def __init__(self, auth: AuthSettings | None, *, wall: Callable[[], float] = time.time) -> None:
        digest = auth.admin_token_digest if auth is not None else None
        self.auth = auth
        self.required = digest is not None  # False: no admin token, the admin listener is open
        # Derived from the token (not random per process): every worker and replica accepts the others' cookies.
        secret = digest if digest is not None else secrets.token_bytes(32)
        self._key = hmac.new(secret, b"fleetroute status-page sessions v1", hashlib.sha256).digest()
        self._wall = wall

    # ---- router.server.auth.BrowserAccess ------------------------------------------------------------------------

    def public(self, request: web.Request) -> bool:
        path = request.path
        if request.method in _SAFE_METHODS:
            return path in _PUBLIC_GET or path.startswith(_ASSETS)
        return request.method == "POST" and path == _LOGIN

    def authenticated(self, request: web.Request) -> bool:
        if not request.path.startswith(PREFIX + "/"):
            return False  # the cookie opens the page's routes only, never /admin/*
        cookie = request.cookies.get(COOKIE)
        if not self.valid(cookie):
            return False
        if request.method in _SAFE_METHODS:
            return True
        assert cookie is not None
        presented = request.headers.get(CSRF_HEADER, "")
        return hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), self.csrf(cookie).encode())

    # ---- cookies ------------------------------------------------------------------------------------------

    def issue(self) -> str:
        """A new session cookie's value."""
        payload = f"{int(self._wall()) + SESSION_SECONDS}.{secrets.token_hex(8)}"
        return f"{payload}.{self._mac(payload)}"

    def valid(self, value: str | None) -> bool:
        if not self.required or not value or len(value) > MAX_COOKIE_CHARS:
            return False
        payload, _, mac = value.rpartition(".")
        expiry, _, _nonce = payload.partition(".")
        if not (expiry.isascii() and expiry.isdigit()) or not hmac.compare_digest(mac.encode("ascii", "replace"),
                                                                                  self._mac(payload).encode()):
            return False
        return int(expiry) > self._wall()

    def csrf(self, cookie: str) -> str:
        """The CSRF token that goes with a session cookie (the page gets it from its feed)."""
        return self._mac("csrf." + cookie)

    def session_of(self, request: web.Request) -> str | None:
        """The request's valid session cookie, or None (no session, or authenticated by the header)."""
        cookie = request.cookies.get(COOKIE)
        return cookie if self.valid(cookie) else None

    def set_cookie(self, request: web.Request, response: web.StreamResponse, value: str) -> None:
        response.set_cookie(COOKIE, value, max_age=SESSION_SECONDS, path=PREFIX, httponly=True, samesite="Strict",
                            secure=request.secure or None)

    def clear_cookie(self, response: web.StreamResponse) -> None:
        response.del_cookie(COOKIE, path=PREFIX, samesite="Strict")

    def _mac(self, text: str) -> str:
        return hmac.new(self._key, text.encode("utf-8", "surrogateescape"), hashlib.sha256).hexdigest()
