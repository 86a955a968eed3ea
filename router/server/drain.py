"""Shutdown without losing a request, for clients that keep connections alive.

A router replica that stops (SIGTERM: a rollout, a scale-down, a node drain) holds client connections that
kube-proxy (or a load balancer) pinned to it before its endpoint left the Service. Closing those that sit
idle at once, as nginx's and Go's graceful shutdowns do, races the client: a keep-alive client may be writing
its next request on one as the close arrives ("server disconnected" or "can not write request body"), and
only a client that resends on a connection failure recovers (HTTP/1.1 lets a client resend an idempotent
request, RFC 9112 section 9.3.1; a POST is not one, though the OpenAI SDKs resend anyway). So, as Envoy
drains (its drain sequence answers with `Connection: close`), the router tells each client instead:

    SIGTERM -> readiness fails (/readyz 503) -> the ingress listener stops accepting
      -> drain, for at most `drainConnections`: connections already open are still served, and every
         response says `Connection: close`; the connection closes after it. A client learns from the answer
         to its next request that this connection is done, and opens its next one elsewhere. A request in
         flight finishes; if its response began before the drain (it promised keep-alive) the connection
         stays open for one more request. The drain ends early once every connection has closed.
      -> close the connections still idle (clients that sent nothing for the whole drain), and from then on
         each one as soon as it goes idle
      -> wait for the requests still in flight, until `shutdownGrace` after SIGTERM; cut what remains.

The trade-off is `drainConnections`: a connection idle for the whole period is closed unannounced, and a
client that writes on it at that instant sees the failure the drain exists to avoid. A period longer than the
clients' own idle timeouts (httpx and the OpenAI SDK 5 s, aiohttp 15 s) lets them close idle connections
first; a longer one holds a stopping replica (and its pod) longer while a client keeps an idle connection
open. Busy clients end the drain within one request each. The admin listener is not drained: probes and
scrapes keep working until the process exits.

Counted per listener and how each connection closed (`fleetroute_client_connections_drained_total`), and
logged once at the end ("client connections drained", with the counts and the time taken).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web

from router.server.connections import CUT, ConnectionGuard

log = logging.getLogger("fleetroute.drain")


@dataclass(frozen=True)
class DrainReport:
    seconds: float
    closed: dict[str, int]  # how -> connections (router.server.connections' ANSWERED, BY_CLIENT, CLOSED_IDLE, CUT...)


async def drain_listener(runner: web.AppRunner, guard: ConnectionGuard, *, period: float, grace: float) -> DrainReport:
    """Stop `runner`'s listeners and drain `guard`'s connections: serve for `period` seconds (or until none is
    open) with `Connection: close` on every response, close the idle ones, and give the requests still in
    flight until `grace` seconds after the start; then cut the rest. The runner is left to `cleanup()`."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    guard.start_draining()
    for site in list(runner.sites):
        await site.stop()  # no new connection: the listening socket closes
    log.info("draining client connections", extra={"listener": guard.listener, "open": guard.open,
                                                   "drain_s": period, "grace_s": grace})
    idle = 0
    if not await guard.wait_none_open(period):
        idle = guard.close_idle()
        if not await guard.wait_none_open(started + grace - loop.time()):
            guard.cut()
            await guard.wait_none_open(1.0)  # connection_lost follows the transport's close within a tick
    report = DrainReport(seconds=round(loop.time() - started, 3), closed=dict(guard.drained))
    (log.warning if report.closed.get(CUT) else log.info)(
        "client connections drained", extra={"listener": guard.listener, "seconds": report.seconds,
                                             "closed": report.closed, "idle_at_drain_end": idle})
    return report
