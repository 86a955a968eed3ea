"""Client connections on both listeners: connection caps, read timeouts, and clean protocol errors.

aiohttp's server has header size limits and one keep-alive timeout (3,630 s by default), and nothing else:
a client could hold a connection for an hour with half a request head or half a body, and open as many as
the process has file descriptors, until `accept` failed on the admin listener too and the kubelet's
`/healthz` went unanswered. This module adds, with aiohttp's public hooks only:

- **Caps.** Each listener admits at most `maxConnections` client connections (per router process) and, when
  set, `maxConnectionsPerClient` from one client address (an IPv6 client: per /64; trusted proxies are
  exempt, they carry many clients). A connection over a cap is answered at once, without reading its
  request: 503 (the listener is full) or 429 (this client holds too many), OpenAI-shaped, `Connection:
  close`, then closed after at most one second (at once when 16 refusals already linger). The admin
  listener has its own small budget, and the ingress's default cap (`connection_budget`) leaves room for it
  and for the engines' connections, so `/healthz` answers while the ingress is flooded.
- **Timeouts** (`limits.*Timeout`), one timer per connection, by phase:

      accepted --header--> head complete --(body: per read, in the handler)--> response written
          --keepalive--> the next request's first byte --header--> head complete ...

  `header` runs from the connection's opening, or from the first byte of a later request, to the end of the
  request head (nginx's client_header_timeout; a slowloris); `keepalive` while idle between requests; the
  body is timed per read by the only handler that reads one (router/server/request_body.py). A timer that fires
  closes the connection.
- **Protocol errors.** A request aiohttp cannot parse gets an OpenAI-shaped 400 instead of aiohttp's plain
  text, and no response says `Server: Python/x aiohttp/y`.

- **Drain** (router/server/drain.py has the sequence): on shutdown a listener's guard starts draining. Every response
  from then on says `Connection: close` and the connection closes after it; a connection that goes idle
  after a request begun before the drain stays open for its next request, until the drain's end closes it.

Every limit hit is counted (`fleetroute_client_connections_rejected_total{listener,reason}`,
`fleetroute_client_timeouts_total{listener,phase}`) and logged at most once per reason every 10 s.

How: `ListenerSite` creates a `ClientConnection` (a subclass of aiohttp's protocol class, `web.RequestHandler`)
per accepted socket. It overrides public methods only: `connection_made` (the caps), `data_received` (a new
request's first byte), `log_access` (aiohttp calls it once a response is written: idle from then on),
`connection_lost`, `handle_error`. The server's request handler is wrapped to mark a complete request head.
Clients that stop reading a response are timed per write by the proxy (router/server/proxy.py, `limits.writeTimeout`,
counted here as phase `write`); there is no minimum transfer rate.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import resource
from collections.abc import Awaitable, Callable
from typing import Any, cast

import orjson
from aiohttp import StreamReader, hdrs, web
from aiohttp.http_exceptions import HttpProcessingError
from yarl import URL

from router.config.settings import Address, ClientTimeouts
from router.runtime.errors import SERVER_NAME, error_response
from router.runtime.logs import RateLimitedLog
from router.runtime.metrics import RouterMetrics
from router.server.forwarding import Forwarding, parse_ip

log = logging.getLogger("fleetroute.connections")

MAX_AUTO_CONNECTIONS = 10_000  # the default cap, per process, whatever the descriptor limit
RESERVED_DESCRIPTORS = 64  # listeners, Redis, health probes, telemetry, log files: never the clients'
REFUSAL_LINGER = 1.0  # seconds a refused connection may stay open while its request is read and dropped
# Refused connections lingering at once, per listener (within RESERVED_DESCRIPTORS): past it a refusal closes
# at once, so a flood of new connections cannot hold descriptors through the refusals themselves.
MAX_LINGERING = 16
# The listen queue: connections the kernel has completed and the router has not accepted yet. asyncio's default
# (100) overflows when a few thousand clients connect at once (a reconnect storm after a rollout): the kernel
# drops their SYNs and each client waits a retransmission (1 s, then 3 s...). Go asks for net.core.somaxconn
# (4096 on current kernels), which also caps this.
LISTEN_BACKLOG = 4096

# Phases of a connection; the timer running in each is named after it.
HEADER, REQUEST, IDLE, REFUSED = "header", "request", "keepalive", "refused"
# How a connection closed during a drain (fleetroute_client_connections_drained_total{how}).
ANSWERED, BY_CLIENT, BY_TIMEOUT, CLOSED_IDLE, CUT = "connection_close", "client", "timeout", "idle", "cut"


def descriptor_limit() -> int | None:
    """This process's soft RLIMIT_NOFILE; None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return None if soft == resource.RLIM_INFINITY else soft


def raise_descriptor_limit() -> None:
    """Raise the soft descriptor limit to the hard one, as Go's runtime does at start-up: the soft default
    (often 1024) is a relic of select(2), and the connection budget is computed from it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            pass  # not allowed here: the budget is computed from the limit as it is


def connection_budget(descriptors: int | None, admin_connections: int) -> int:
    """The ingress's default `maxConnections`: half the descriptors left after the admin listener's budget
    and a reserve (each proxied request holds a second descriptor, to its engine), at most 10,000."""
    if descriptors is None:
        return MAX_AUTO_CONNECTIONS
    return max(1, min(MAX_AUTO_CONNECTIONS, (descriptors - admin_connections - RESERVED_DESCRIPTORS) // 2))


def client_key(peer: str | None) -> str:
    """Whose connection this is, for the per-client cap: the address, or an IPv6 address's /64 (one host
    commonly has a whole /64 to pick addresses from)."""
    address = parse_ip(peer) if peer else None
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address) if address is not None else (peer or "")


def _refusal(status: int, message: str, code: str) -> bytes:
    """A complete response for a connection refused before its request is read."""
    body = orjson.dumps({"error": {"message": message, "type": "invalid_request_error" if status < 500
                                   else "server_error", "param": None, "code": code}})
    reason = {429: "Too Many Requests", 503: "Service Unavailable"}[status]
    head = (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Retry-After: 1\r\nConnection: close\r\nServer: {SERVER_NAME}\r\n\r\n")
    return head.encode() + body


_REFUSALS = {
    "total": _refusal(503, "the router holds as many client connections as it may; retry shortly",
                      "too_many_connections"),
    "per_client": _refusal(429, "too many connections from your address; close idle ones or retry shortly",
                           "too_many_connections"),
}


class ConnectionGuard:
    """One listener's connection counts, caps and timeouts, shared by its connections."""

    def __init__(self, *, listener: str, max_connections: int, max_per_client: int, timeouts: ClientTimeouts,
                 metrics: RouterMetrics, forwarding: Forwarding | None = None) -> None:
        self.listener = listener
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.timeouts = timeouts
        self._metrics = metrics
        self._forwarding = forwarding or Forwarding()
        self._open = 0
        self.lingering = 0  # refused connections still open (REFUSAL_LINGER)
        self._per_client: dict[str, int] = {}
        self._connections: set[ClientConnection] = set()  # admitted and open
        # Draining (router/server/drain.py): every response says Connection: close. Closing: past the drain period,
        # a connection is closed as soon as it is idle.
        self.draining = False
        self.closing = False
        self.drained: dict[str, int] = {}  # how -> connections closed since the drain began
        self._none_open = asyncio.Event()
        self._none_open.set()
        self._log = RateLimitedLog(log)
        self._gauge = metrics.client_connections.labels(listener)
        self._gauge.set(0)

    @property
    def open(self) -> int:
        return self._open

    def opened(self, connection: ClientConnection) -> None:
        self._connections.add(connection)
        self._none_open.clear()

    def closed(self, connection: ClientConnection, how: str) -> None:
        self._connections.discard(connection)
        if self.draining:
            self.drained[how] = self.drained.get(how, 0) + 1
            self._metrics.client_connections_drained.labels(self.listener, how).inc()
        if not self._connections:
            self._none_open.set()

    # ---- the drain (router/server/drain.py) ---------------------------------------------------------------------

    def start_draining(self) -> None:
        self.draining = True

    async def wait_none_open(self, timeout: float) -> bool:
        """Until every connection of this listener has closed (True), or `timeout` seconds (False)."""
        try:
            await asyncio.wait_for(self._none_open.wait(), max(timeout, 0))
        except TimeoutError:
            return False
        return True

    def close_idle(self) -> int:
        """Close the connections idle now, and from now on each one as soon as it is idle; how many now."""
        self.closing = True
        idle = [c for c in self._connections if c.idle]
        for connection in idle:
            connection.close_drained(CLOSED_IDLE)
        return len(idle)

    def cut(self) -> int:
        """Close every connection still open, cancelling its request (shutdownGrace is over); how many."""
        busy = list(self._connections)
        for connection in busy:
            connection.close_drained(CUT)
        return len(busy)

    def admit(self, peer: str | None) -> str | None:
        """Count a new connection in; or the reason it is refused (`total`, `per_client`), counted and logged."""
        if self._open >= self.max_connections:
            return self._refused("total", peer)
        key = None
        if self.max_per_client and not self._forwarding.trusts(peer):
            key = client_key(peer)
            if self._per_client.get(key, 0) >= self.max_per_client:
                return self._refused("per_client", peer)
            self._per_client[key] = self._per_client.get(key, 0) + 1
        self._open += 1
        self._gauge.inc()
        return None

    def release(self, peer: str | None) -> None:
        self._open -= 1
        self._gauge.dec()
        if self.max_per_client and not self._forwarding.trusts(peer):
            key = client_key(peer)
            held = self._per_client.get(key, 0) - 1
            if held > 0:
                self._per_client[key] = held
            else:
                self._per_client.pop(key, None)

    def _refused(self, reason: str, peer: str | None) -> str:
        self._metrics.client_connections_rejected.labels(self.listener, reason).inc()
        cap = self.max_connections if reason == "total" else self.max_per_client
        self._log.warning((reason,), "client connection refused: over the connection cap", listener=self.listener,
                          reason=reason, cap=cap, client=peer)
        return reason

    def timed_out(self, phase: str, peer: str | None) -> None:
        self._metrics.client_timeouts.labels(self.listener, phase).inc()
        if phase != IDLE:  # an idle keep-alive connection closing is the normal end of one, not news
            seconds = self.timeouts.header if phase == HEADER else self.timeouts.body
            self._log.warning((phase,), "client connection too slow; closing it", listener=self.listener,
                              phase=phase, timeout_s=seconds, client=peer)


class ClientConnection(web.RequestHandler):
    """aiohttp's per-connection protocol, plus the caps and the header and keep-alive timers."""

    __slots__ = ("_guard", "_peer", "_phase", "_timer", "_admitted", "_unread", "_received", "_closed_by")

    def __init__(self, manager: web.Server, *, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard
        self._peer: str | None = None
        self._phase = HEADER
        self._timer: asyncio.TimerHandle | None = None
        self._admitted = False
        self._unread: StreamReader | None = None  # a body left unread by its handler, which aiohttp drains
        self._received = False  # any byte from the client yet
        self._closed_by: str | None = None  # during a drain: why this side closes it (else the client did)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._peer = peer[0] if isinstance(peer, tuple) else None
        refusal = self._guard.admit(self._peer)
        if refusal is not None:
            self._refuse(transport, refusal)
            return
        self._admitted = True
        self._guard.opened(self)
        super().connection_made(transport)
        self._arm(HEADER, self._guard.timeouts.header)

    def data_received(self, data: bytes) -> None:
        if self._phase is REFUSED:
            return  # read and dropped: closing with unread data would reset the connection, losing our answer
        self._received = self._received or bool(data)
        if self._phase is IDLE and data and (self._unread is None or self._unread.is_eof()):
            self._unread = None
            self._arm(HEADER, self._guard.timeouts.header)  # the next request's first byte
        super().data_received(data)

    def eof_received(self) -> None:
        if self._phase is not REFUSED:
            super().eof_received()
        # returning None: the transport closes (the client has nothing more to say)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._cancel()
        if not self._admitted:
            if self._phase == REFUSED:
                self._guard.lingering -= 1
            return  # refused: aiohttp never saw this connection
        self._admitted = False
        self._guard.release(self._peer)
        self._guard.closed(self, self._closed_by or BY_CLIENT)
        super().connection_lost(exc)

    @property
    def guard(self) -> ConnectionGuard:
        return self._guard

    @property
    def idle(self) -> bool:
        """Between two requests (or opened and silent): no byte of a request is unanswered."""
        return self._phase is IDLE or (self._phase is HEADER and not self._received)

    def close_drained(self, how: str) -> None:
        """Close this connection now, for the drain's reason `how`."""
        self._closed_by = how
        self.force_close()

    def closing_after_response(self) -> None:
        """The response being prepared says `Connection: close` because the listener drains."""
        self._closed_by = ANSWERED

    def request_started(self) -> None:
        """A request head is complete and its handler runs: no client timer until its response is written."""
        self._phase = REQUEST
        self._cancel()

    def log_access(self, request: web.BaseRequest, response: web.StreamResponse, time: float | None) -> None:
        # aiohttp calls this once a response has been written (or the client has left): idle from here on.
        # What still arrives of a body the handler did not read (a 401 or a 413 answered without it) is drained
        # by aiohttp, for at most its lingering time: those bytes are not the next request's.
        self._arm(IDLE, self._guard.timeouts.keep_alive)
        self._unread = None if request.content.is_eof() else request.content
        if self._guard.closing and response.keep_alive:
            # Its response began before the drain and promised keep-alive; the drain period is over.
            self._closed_by = CLOSED_IDLE
            self.close()  # aiohttp closes the transport once this request's handling ends
        super().log_access(request, response, time)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # aiohttp's own: one log line (router.server.auth.ProtocolLog: no request bytes), and ConnectionError when the
        # response has already begun. Its plain-text body, which may quote the offending line, is not sent.
        super().handle_error(request, status, exc, message)
        if status == 400:
            name = type(exc).__name__ if isinstance(exc, HttpProcessingError) else "BadRequest"
            response = error_response(400, f"malformed HTTP request ({name}); it is not valid HTTP/1.1, or a "
                                           "header or the request line is over the size limit", code="bad_request")
        elif status == 504:
            response = error_response(504, "the request took too long", code="timeout")
        else:
            response = error_response(status, "internal router error; see the router log", code="internal_error")
        response.headers["Server"] = SERVER_NAME
        response.force_close()
        return response

    # ---- timers and refusals -------------------------------------------------------------------------

    def _arm(self, phase: str, seconds: float) -> None:
        self._cancel()
        self._phase = phase
        self._timer = self._loop.call_later(seconds, self._expired, phase)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, phase: str) -> None:
        self._timer = None
        if self._phase != phase:
            return
        self._guard.timed_out(phase, self._peer)
        self._closed_by = BY_TIMEOUT
        self.force_close()

    def _refuse(self, transport: asyncio.BaseTransport, reason: str) -> None:
        self._phase = REFUSED
        stream = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio.Transport subclasses
        stream.write(_REFUSALS[reason])
        self._guard.lingering += 1
        if self._guard.lingering > MAX_LINGERING or not stream.can_write_eof():
            stream.close()  # after the answer is flushed
            return
        stream.write_eof()  # the answer is complete; the client's request is read and dropped
        self._timer = self._loop.call_later(REFUSAL_LINGER, stream.close)


async def close_when_draining(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: while the listener drains, every response says `Connection: close` and its
    connection closes after it, so a keep-alive client opens its next connection elsewhere (HTTP/1.1's
    graceful close, RFC 9112 section 9.6; Envoy's drain sequence does the same)."""
    protocol = request.protocol
    if isinstance(protocol, ClientConnection) and protocol.guard.draining:
        response.force_close()  # aiohttp closes the connection after this response...
        # ...but has already chosen the headers when this hook runs (an HTTP/1.1 response only names
        # `Connection` when it closes): say it, or the client learns of the close only when it reuses the
        # connection.
        response.headers[hdrs.CONNECTION] = "close"
        protocol.closing_after_response()


def _marking_requests(handler: Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]) -> Any:
    @functools.wraps(handler)
    async def marked(request: web.BaseRequest) -> web.StreamResponse:
        protocol = request.protocol
        if isinstance(protocol, ClientConnection):
            protocol.request_started()
        return await handler(request)

    return marked


class ListenerSite(web.BaseSite):
    """A TCP listener whose connections are `ClientConnection`s (aiohttp's `TCPSite` uses its own class)."""

    def __init__(self, runner: web.AppRunner, address: Address, *, guard: ConnectionGuard,
                 handler_options: dict[str, Any], reuse_port: bool = False) -> None:
        super().__init__(runner)
        self._host = address.host
        self._port = address.port
        self._guard = guard
        self._options = handler_options
        self._reuse_port = reuse_port

    @property
    def name(self) -> str:
        return str(URL.build(scheme="http", host=self._host, port=self._port))

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        server = self._runner.server
        assert server is not None
        server.request_handler = _marking_requests(server.request_handler)
        factory = functools.partial(ClientConnection, server, loop=loop, guard=self._guard, **self._options)
        self._server = await loop.create_server(factory, self._host, self._port, reuse_port=self._reuse_port,
                                                backlog=LISTEN_BACKLOG)


def handler_options(timeouts: ClientTimeouts, base: dict[str, Any]) -> dict[str, Any]:
    """aiohttp's per-connection options (`base`: the header limits and the logger, router.server.auth), plus:
    bodies are not decoded by the server (router/server/request_body.py does it, with clean errors), and aiohttp's
    own keep-alive close is only a backstop behind this module's timers."""
    return {**base, "auto_decompress": False, "keepalive_timeout": max(timeouts.header, timeouts.keep_alive) + 1,
            "access_log": None}
