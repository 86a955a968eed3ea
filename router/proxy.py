"""Forwarding one request to one endpoint and streaming its answer back, chunk by chunk.

- Bodies are never buffered: every chunk read from the engine (`readany`, whatever arrived) is written to
  the client at once, so SSE tokens reach the client when the engine emits them.
- Hop-by-hop headers (RFC 9110 section 7.6.1, plus any named in `Connection`) are not forwarded in either
  direction; `Host` and `Content-Length` are set for the new hop. Compressed bodies pass through as bytes.
- The request counts as in flight at its endpoint until the body ends (`LoadTracker.track`).
- Timeouts: `connect`; `firstByte` until the response headers; `idle` between two body chunks.
- If the client goes away mid-stream (aiohttp cancels the handler, or a write fails), the upstream
  connection is closed, which makes vLLM abort the request and free its batch slot and KV cache.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from router.errors import error_response
from router.loads import LoadTracker
from router.metrics import RouterMetrics
from router.model import EndpointView
from router.settings import Timeouts

log = logging.getLogger("fleetroute.proxy")

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
        "TE", "Trailer", "Transfer-Encoding", "Upgrade",
    )
)
# Set again for the next hop by aiohttp itself.
_NOT_FORWARDED_UP = HOP_BY_HOP | {"host", "content-length"}
_NOT_FORWARDED_DOWN = HOP_BY_HOP | {"content-length"}
ENDPOINT_HEADER = "x-fleetroute-endpoint"


class UpstreamUnreachable(Exception):
    """The connection to the endpoint could not be made: the request never left, so a retry is safe."""


@dataclass
class Outcome:
    response: web.StreamResponse
    status: int
    ttfb: float | None = None  # seconds from request start to the first body byte
    error: str | None = None  # upstream error kind, for metrics and the access log


def _strip(headers: CIMultiDictProxy[str], drop: frozenset[str]) -> CIMultiDict[str]:
    connection_named = {
        token.strip().lower() for value in headers.getall("Connection", ()) for token in value.split(",")
    }
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers.items():
        lower = name.lower()
        if lower not in drop and lower not in connection_named:
            out.add(name, value)
    return out


def upstream_headers(request: web.Request, request_id: str) -> CIMultiDict[str]:
    headers = _strip(request.headers, _NOT_FORWARDED_UP)
    peer = request.remote or ""
    prior = headers.get("X-Forwarded-For")
    headers["X-Forwarded-For"] = f"{prior}, {peer}" if prior else peer
    headers.setdefault("X-Forwarded-Proto", request.scheme)
    headers["X-Request-Id"] = request_id
    return headers


class Proxy:
    def __init__(self, *, session: aiohttp.ClientSession, loads: LoadTracker, metrics: RouterMetrics) -> None:
        self._session = session
        self._loads = loads
        self._metrics = metrics

    async def forward(
        self,
        request: web.Request,
        view: EndpointView,
        body: bytes,
        *,
        request_id: str,
        timeouts: Timeouts,
        started: float,
    ) -> Outcome:
        """Send `body` to `view` and stream the answer to the client.

        Raises UpstreamUnreachable when no connection could be made (the caller may try another
        endpoint); every other failure becomes an `Outcome` with the right status.
        """
        loop = asyncio.get_running_loop()
        endpoint_id = view.id
        url = view.endpoint.url + request.path_qs
        errors = self._metrics.upstream_errors
        with self._loads.track(endpoint_id):
            try:
                async with asyncio.timeout(timeouts.first_byte):
                    upstream = await self._session.request(
                        request.method,
                        url,
                        data=body,
                        headers=upstream_headers(request, request_id),
                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect),
                        allow_redirects=False,
                    )
            except aiohttp.ClientConnectorError as exc:
                errors.labels(endpoint_id, "connect").inc()
                raise UpstreamUnreachable(str(exc)) from exc
            except aiohttp.ConnectionTimeoutError as exc:
                # No connection within `connect` (a blackholed pod IP): the request never left either.
                errors.labels(endpoint_id, "connect_timeout").inc()
                raise UpstreamUnreachable(f"no connection within {timeouts.connect:g}s") from exc
            except (TimeoutError, aiohttp.ServerTimeoutError):
                errors.labels(endpoint_id, "timeout").inc()
                return Outcome(
                    error_response(
                        504,
                        f"endpoint {endpoint_id} did not answer within {timeouts.first_byte:g}s",
                        code="upstream_timeout",
                    ),
                    504,
                    error="timeout",
                )
            except aiohttp.ClientError as exc:
                errors.labels(endpoint_id, "disconnect").inc()
                return Outcome(
                    error_response(
                        502,
                        f"endpoint {endpoint_id} failed: {type(exc).__name__}: {exc}",
                        code="upstream_error",
                    ),
                    502,
                    error="disconnect",
                )
            return await self._stream(request, upstream, endpoint_id, request_id, timeouts, started, loop)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        endpoint_id: str,
        request_id: str,
        timeouts: Timeouts,
        started: float,
        loop: asyncio.AbstractEventLoop,
    ) -> Outcome:
        response = web.StreamResponse(status=upstream.status, reason=upstream.reason)
        response.headers.extend(_strip(upstream.headers, _NOT_FORWARDED_DOWN))
        response.headers[ENDPOINT_HEADER] = endpoint_id
        response.headers["X-Request-Id"] = request_id
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        outcome = Outcome(response, upstream.status)
        errors = self._metrics.upstream_errors
        clean = False
        try:
            await response.prepare(request)
            content = upstream.content
            async with asyncio.timeout(None) as idle:
                while True:
                    idle.reschedule(loop.time() + timeouts.idle)
                    chunk = await content.readany()
                    if not chunk:
                        break
                    idle.reschedule(None)  # a slow client is back-pressure, not an idle engine
                    if outcome.ttfb is None:
                        outcome.ttfb = loop.time() - started
                    await response.write(chunk)
            await response.write_eof()
            clean = True
        except TimeoutError:
            outcome.error = "idle_timeout"
            errors.labels(endpoint_id, "idle_timeout").inc()
            log.warning(
                "upstream stream stalled; closing the client connection",
                extra={"endpoint": endpoint_id, "idle_timeout_s": timeouts.idle},
            )
            _abort(request)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            outcome.error = "disconnect"
            errors.labels(endpoint_id, "disconnect").inc()
            log.warning(
                "upstream closed mid-response; closing the client connection",
                extra={"endpoint": endpoint_id, "error": f"{type(exc).__name__}: {exc}"},
            )
            _abort(request)
        except (ConnectionResetError, asyncio.CancelledError):
            # The client went away. Closing (not releasing) the upstream connection tells the engine to
            # abort the generation instead of computing tokens nobody will read.
            outcome.error = "client_disconnect"
            errors.labels(endpoint_id, "client_disconnect").inc()
            upstream.close()
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise
        finally:
            if clean:
                upstream.release()
            else:
                upstream.close()
        return outcome


def _abort(request: web.Request) -> None:
    """Headers are already sent, so the only honest signal left is to cut the connection: the client sees
    a truncated body instead of a well-formed but incomplete answer."""
    transport = request.transport
    if transport is not None:
        transport.close()
