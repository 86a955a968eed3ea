"""Forwarding one request to one endpoint and streaming its answer back, chunk by chunk.

- Bodies are never buffered: every chunk read from the engine (`readany`, whatever arrived) is written to
  the client at once, so SSE tokens reach the client when the engine emits them.
- Hop-by-hop headers (RFC 9110 section 7.6.1, plus any named in `Connection`) are not forwarded in either
  direction; `Host` and `Content-Length` are set for the new hop; the forwarding headers follow the
  trusted-proxy rule (router/server/forwarding.py). Response bodies pass through as bytes, compressed or not.
- The request counts as in flight at its endpoint until the body ends (`LoadTracker.track`), with its
  predicted cost in tokens when it has one.
- With an `OutputCounter` (requests with a cost estimate), every chunk is also shown to it, unchanged, so
  the answer's output tokens are known at the end (router/routing/output_tokens.py).
- Timeouts: `connect`; `firstByte` until the response headers; `idle` between two body chunks.
- The response head goes to the client with the answer's first body chunk, not before: until then nothing has
  reached the client, so a stream whose engine sent its head and then nothing (vLLM sends a stream's head at
  once) can still be sent elsewhere, and a failure there is answered with a clean error status.
- Every request is a `Waiter` of the stall detector (router/health/stall.py) while it is in flight: each
  response head and chunk is progress, the first chunk a time-to-first-byte sample. When the router takes
  the request off its endpoint (the endpoint stalled, or left the pool while the request waited: router/
  rescue.py), the timer of the current wait expires at once: a request that sent nothing to its client raises
  `UpstreamRescued` (the handler sends it elsewhere), a started stream ends with an error event.
- If the client goes away mid-stream (aiohttp cancels the handler, or a write fails), the upstream
  connection is closed, which makes vLLM abort the request and free its batch slot and KV cache.
- A client that stops reading is back-pressure: `response.write` waits while the client socket's send buffer
  is full (aiohttp drains past 64 KiB; the transport's high-water mark is 64 KiB), and meanwhile nothing more
  is read from the engine, whose own socket fills and pauses it (TCP flow control). So a stalled reader costs
  the router at most a few hundred KiB, never the whole answer. One write may wait `write_timeout` (config
  `limits.writeTimeout`, nginx's send_timeout); past it the client connection is cut and the upstream closed,
  counted in `fleetroute_client_timeouts_total{listener="ingress",phase="write"}`.
- If the engine's connection ends mid-body (it closed, or sent bytes that are not HTTP, such as a malformed
  chunk), the client's stream ends at once with an error event, and the request's slot is freed.
- What reaches the client never names the engine's host or port, nor quotes its bytes (an oversized header
  may hold a session cookie): those go to the log, at most one line per endpoint and kind every 10 s.
"""

from __future__ import annotations

import asyncio
import functools
import io
import logging
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from multidict import CIMultiDict, CIMultiDictProxy

from router.config.settings import ClientTimeouts, Timeouts
from router.health.stall import StallDetector, Waiter
from router.model import EndpointView
from router.routing.loads import LoadTracker
from router.routing.output_tokens import OutputCount, OutputCounter
from router.routing.prefill import Prefill
from router.runtime.errors import clip, error_response
from router.runtime.logs import RateLimitedLog
from router.runtime.metrics import RouterMetrics
from router.server.explain import EXPLAIN_HEADER
from router.server.forwarding import Forwarding

if TYPE_CHECKING:
    from aiohttp.client_proto import ResponseHandler

log = logging.getLogger("fleetroute.proxy")

HOP_BY_HOP = frozenset(
    h.lower()
    for h in (
        "Connection", "Keep-Alive", "Proxy-Authenticate", "Proxy-Authorization", "Proxy-Connection",
        "TE", "Trailer", "Transfer-Encoding", "Upgrade",
    )
)
# Set again for the next hop by aiohttp itself. Content-Encoding too: the router has already decoded a
# compressed request body (router/server/request_body.py), and the decoded bytes are what is forwarded. Expect too:
# the router answered `100-continue` itself and sends the engine a complete request (as Envoy does unless
# proxy_100_continue). The explain header is the router's own (and its value may be the admin token): it
# never reaches an engine, whoever sent it.
_NOT_FORWARDED_UP = HOP_BY_HOP | {"host", "content-length", "content-encoding", "expect", EXPLAIN_HEADER}
_NOT_FORWARDED_DOWN = HOP_BY_HOP | {"content-length"}
ENDPOINT_HEADER = "x-fleetroute-endpoint"
LARGE_BODY = 1 << 20  # aiohttp.payload.TOO_LARGE_BYTES_BODY


class UpstreamFailed(Exception):
    """The endpoint failed before any byte reached the client, so another endpoint may be tried.
    `kind` is the failure's kind for metrics and outlier detection: connect, connect_timeout, timeout or
    http_5xx. The message is fit for the client (the endpoint's id, never its address); the log has the rest."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class UpstreamUnreachable(UpstreamFailed):
    """The connection could not be made: the request never left. Always raised (the caller decides)."""


class UpstreamRescued(UpstreamFailed):
    """The router took the request off its endpoint before any byte reached the client; `kind` says why: the
    endpoint stalled, or was ejected, failed its health checks or lost its GPU while the request waited. Always
    raised (the caller sends it elsewhere, or answers)."""


@dataclass
class Outcome:
    response: web.StreamResponse
    status: int
    ttfb: float | None = None  # seconds from request start to the first body byte
    error: str | None = None  # upstream error kind, for metrics and the access log
    output: OutputCount | None = None  # with an OutputCounter: what the complete answer held
    chunks: int = 0  # body chunks forwarded (the status page's inter-token latency: router/server/status/history.py)


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


def upstream_headers(
    request: web.Request, request_id: str, credentials: Callable[[CIMultiDict[str]], None] | None = None,
    forwarding: Forwarding | None = None, trace: Mapping[str, str] | None = None,
) -> CIMultiDict[str]:
    headers = _strip(request.headers, _NOT_FORWARDED_UP)
    if credentials is not None:
        credentials(headers)  # router.server.auth: drop the client's key, or send the engines' instead
    (forwarding or Forwarding()).rewrite(request, headers)
    headers["X-Request-Id"] = request_id
    if trace:  # the attempt's W3C trace context (router/server/tracing.py) replaces the client's, tracestate included
        headers.popall("tracestate", None)  # (kept in `trace` when the client's traceparent was valid)
        for name, value in trace.items():
            headers[name] = value
    return headers


class Proxy:
    def __init__(
        self, *, session: aiohttp.ClientSession, loads: LoadTracker, metrics: RouterMetrics,
        credentials: Callable[[CIMultiDict[str]], None] | None = None, forwarding: Forwarding | None = None,
        stalls: StallDetector | None = None, write_timeout: float = ClientTimeouts.write,
    ) -> None:
        self._session = session
        self._write_timeout = write_timeout
        self._stalls = stalls or StallDetector(time.monotonic)
        self._credentials = credentials
        self._forwarding = forwarding or Forwarding()
        self._loads = loads
        self._metrics = metrics
        self._log = RateLimitedLog(log)  # a dead or misbehaving endpoint must not flood the log
        self._losses = ConnectionLosses()

    async def forward(
        self,
        request: web.Request,
        view: EndpointView,
        body: bytes,
        *,
        request_id: str,
        timeouts: Timeouts,
        started: float,
        retryable: bool = False,
        deadline: float | None = None,
        cost: float = 0.0,
        prefill: float = 0.0,
        streamed: bool = False,
        counter: OutputCounter | None = None,
        extra_headers: Mapping[str, str] | None = None,
        policy: str = "",
        trace_headers: Mapping[str, str] | None = None,
        on_first_byte: Callable[[], None] | None = None,
    ) -> Outcome:
        """Send `body` to `view` and stream the answer to the client.

        Raises UpstreamUnreachable when no connection could be made, and, when `retryable`, UpstreamFailed
        for a first-byte timeout or a 5xx answer (nothing has reached the client yet). Every other failure
        becomes an `Outcome` with the right status. `deadline` (loop time) caps the whole request. `cost` is
        the request's predicted cost in tokens (load while it is in flight); `prefill` the prompt tokens its picker
        expects the endpoint to compute (pending until the first byte, which times the endpoint when `streamed`);
        `counter` sees every chunk.
        `extra_headers` go on the streamed response, before its first byte (a routing explanation).
        Raises UpstreamRescued when the router took the request off the endpoint before any byte reached the
        client (`policy` is the request's, for releases that concern one policy's pool).
        `trace_headers` (a traced request: its attempt's `traceparent`) go upstream; `on_first_byte` is called once,
        at the answer's first body byte.
        """
        loop = asyncio.get_running_loop()
        endpoint_id = view.id
        url = view.endpoint.url + request.path_qs
        errors = self._metrics.upstream_errors
        header_wait = timeouts.first_byte if deadline is None else min(timeouts.first_byte, deadline - loop.time())
        with self._loads.track(endpoint_id, cost, prefill, streamed=streamed) as booked, \
                self._stalls.track(endpoint_id, policy) as waiter:
            try:
                async with asyncio.timeout(max(header_wait, 0.0)) as head_timer:
                    waiter.arm(head_timer)
                    upstream = await self._session.request(
                        request.method,
                        url,
                        # aiohttp warns (ResourceWarning) about bytes bodies over 1 MiB and wants them as a stream,
                        # which it writes in 64 KiB pieces, yielding between them.
                        data=body if len(body) <= LARGE_BODY else io.BytesIO(body),
                        headers=upstream_headers(request, request_id, self._credentials, self._forwarding,
                                                 trace_headers),
                        timeout=aiohttp.ClientTimeout(total=None, sock_connect=timeouts.connect),
                        allow_redirects=False,
                    )
            except aiohttp.ClientConnectorError as exc:
                errors.labels(endpoint_id, "connect").inc()
                self._failed(endpoint_id, "connect", exc)
                raise UpstreamUnreachable("connect", f"endpoint {endpoint_id} refused or dropped the connection") \
                    from exc
            except aiohttp.ConnectionTimeoutError as exc:
                # No connection within `connect` (a blackholed pod IP): the request never left either.
                errors.labels(endpoint_id, "connect_timeout").inc()
                self._failed(endpoint_id, "connect_timeout", exc)
                raise UpstreamUnreachable(
                    "connect_timeout", f"no connection to endpoint {endpoint_id} within {timeouts.connect:g}s") from exc
            except (TimeoutError, aiohttp.ServerTimeoutError):
                if waiter.released is not None:
                    raise self._rescued(endpoint_id, waiter.released) from None
                errors.labels(endpoint_id, "timeout").inc()
                message = f"endpoint {endpoint_id} did not answer within {header_wait:g}s"
                if retryable:
                    raise UpstreamFailed("timeout", message) from None
                return Outcome(error_response(504, message, code="upstream_timeout"), 504, error="timeout")
            except aiohttp.ClientError as exc:
                # Its response head was not HTTP (an oversized header, say), or it closed without answering (an
                # engine killed or restarted with the request in it). Nothing reached the client: retried like a
                # 5xx when a retry is possible (the engine may have seen the request, as with a first-byte timeout).
                kind = "invalid_response" if isinstance(exc, aiohttp.ClientResponseError) else "disconnect"
                errors.labels(endpoint_id, kind).inc()
                self._failed(endpoint_id, kind, exc)
                what = "sent an invalid response" if kind == "invalid_response" else "closed the connection"
                if retryable:
                    raise UpstreamFailed(kind, f"endpoint {endpoint_id} {what}") from None
                return Outcome(error_response(502, f"endpoint {endpoint_id} {what}", code="upstream_error"), 502,
                               error=kind)
            finally:
                waiter.arm(None)
            waiter.progress()
            if upstream.status >= 500:
                errors.labels(endpoint_id, "http_5xx").inc()
                if retryable:
                    upstream.close()
                    raise UpstreamFailed("http_5xx", f"endpoint {endpoint_id} answered {upstream.status}")
            return await self._stream(request, upstream, endpoint_id, request_id, timeouts, started, loop, deadline,
                                      counter, booked, waiter, extra_headers, on_first_byte, retryable)

    async def _stream(
        self,
        request: web.Request,
        upstream: aiohttp.ClientResponse,
        endpoint_id: str,
        request_id: str,
        timeouts: Timeouts,
        started: float,
        loop: asyncio.AbstractEventLoop,
        deadline: float | None,
        counter: OutputCounter | None,
        booked: Prefill | None,
        waiter: Waiter,
        extra_headers: Mapping[str, str] | None = None,
        on_first_byte: Callable[[], None] | None = None,
        retryable: bool = False,
    ) -> Outcome:
        # The engine's reason phrase is not passed on: it means nothing (RFC 9112 section 4) and it is bytes
        # from the engine on the status line (aiohttp < 3.13.4 let a CR/LF in it inject headers).
        response = web.StreamResponse(status=upstream.status)
        response.headers.extend(_strip(upstream.headers, _NOT_FORWARDED_DOWN))
        response.headers[ENDPOINT_HEADER] = endpoint_id
        response.headers["X-Request-Id"] = request_id
        if extra_headers is not None:
            response.headers.update(extra_headers)
        if upstream.content_length is not None:
            response.content_length = upstream.content_length
        outcome = Outcome(response, upstream.status)
        errors = self._metrics.upstream_errors
        clean = False
        writing = False  # the idle timer times the client's write, not the engine's silence
        watch = self._losses.watch(upstream)
        try:
            content = upstream.content
            async with asyncio.timeout(None) as idle:
                waiter.arm(idle)
                while True:
                    wake = loop.time() + timeouts.idle
                    idle.reschedule(wake if deadline is None else min(wake, deadline))
                    writing = False
                    chunk = await content.readany()
                    if waiter.released is not None:  # released as this chunk arrived: its timer was about to fire
                        raise TimeoutError
                    if not chunk:
                        break
                    # From here a wait is the client's (back-pressure), not the engine's: `write_timeout` applies.
                    writing = True
                    wake = loop.time() + self._write_timeout
                    idle.reschedule(wake if deadline is None else min(wake, deadline))
                    if outcome.ttfb is None:
                        outcome.ttfb = time.perf_counter() - started
                        waiter.first_byte()
                        if booked is not None:  # only a stream's first token times prefill; an error is at once
                            self._loads.prefill_done(
                                booked, timed=upstream.status < 400 and upstream.content_type == "text/event-stream")
                        if on_first_byte is not None:
                            on_first_byte()
                        # The head goes with the first chunk: until now the request could still go elsewhere.
                        await response.prepare(request)
                        waiter.streaming = True
                    else:
                        waiter.progress()
                    outcome.chunks += 1
                    if counter is not None:
                        counter.feed(chunk)
                    await response.write(chunk)
                waiter.arm(None)
            if not response.prepared:  # an empty body
                await response.prepare(request)
            await response.write_eof()
            clean = True
            if counter is not None:
                outcome.output = counter.finish(event_stream=upstream.content_type == "text/event-stream")
        except TimeoutError:
            if waiter.released is not None:
                if not response.prepared:
                    raise self._rescued(endpoint_id, waiter.released) from None
                outcome.error = "stalled"  # a started stream is released only when its endpoint stalled
                errors.labels(endpoint_id, "stalled").inc()
                await _end_early(request, response, endpoint_id, "the endpoint stopped making progress")
                return outcome
            total = deadline is not None and loop.time() >= deadline
            if writing and not total:
                self._client_too_slow(request, upstream, outcome, endpoint_id)
                return outcome
            outcome.error = "total_timeout" if total else "idle_timeout"
            errors.labels(endpoint_id, outcome.error).inc()
            log.warning(
                "upstream stream stalled or ran out of time; ending the response",
                extra={"endpoint": endpoint_id, "idle_timeout_s": timeouts.idle, "kind": outcome.error},
            )
            what = "the request's total time ran out" if total else f"no data for {timeouts.idle:g}s"
            if not response.prepared:  # nothing reached the client: a clean error status instead
                _unsent(outcome, 504, f"endpoint {endpoint_id} sent its response head, then {what}",
                        "upstream_timeout")
            else:
                await _end_early(request, response, endpoint_id, what)
        except (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError,
                HttpProcessingError) as exc:
            # HttpProcessingError: the pure-Python parser's own error for a body that is not HTTP.
            cause = exc.cause if isinstance(exc, EndpointConnectionLost) else exc
            outcome.error = "invalid_response" if isinstance(cause, HttpProcessingError) else "disconnect"
            errors.labels(endpoint_id, outcome.error).inc()
            self._failed(endpoint_id, outcome.error, cause or exc, mid_response=True)
            what = ("the endpoint sent an invalid response" if outcome.error == "invalid_response"
                    else "the endpoint closed the connection")
            if not response.prepared and retryable:  # its head only, then it died: nothing reached the client
                raise UpstreamFailed(outcome.error, f"endpoint {endpoint_id}: {what} before the response body") \
                    from None
            if not response.prepared:  # nothing reached the client: a clean error status instead
                _unsent(outcome, 502, f"endpoint {endpoint_id}: {what} before the response body", "upstream_error")
            else:
                await _end_early(request, response, endpoint_id, what)
        except (ConnectionResetError, asyncio.CancelledError):
            # The client went away. Closing (not releasing) the upstream connection tells the engine to
            # abort the generation instead of computing tokens nobody will read.
            outcome.error = "client_disconnect"
            errors.labels(endpoint_id, "client_disconnect").inc()
            upstream.close()
            if asyncio.current_task().cancelling():  # type: ignore[union-attr]
                raise
        finally:
            watch.close()
            if clean:
                upstream.release()
            else:
                upstream.close()
        return outcome

    def _client_too_slow(self, request: web.Request, upstream: aiohttp.ClientResponse, outcome: Outcome,
                         endpoint_id: str) -> None:
        """The client read nothing for `write_timeout` while a chunk waited: cut it, and cancel the engine's work
        (the upstream is closed on the way out). Not the endpoint's failure."""
        outcome.error = "client_disconnect"
        self._metrics.upstream_errors.labels(endpoint_id, "client_disconnect").inc()
        self._metrics.client_timeouts.labels("ingress", "write").inc()
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        self._log.warning(("client", "write"), "client stopped reading the response; closing its connection",
                          endpoint=endpoint_id, timeout_s=self._write_timeout,
                          client=peer[0] if isinstance(peer, tuple) else None)
        upstream.close()
        if request.transport is not None:
            request.transport.abort()  # not close(): that would wait to flush what the client does not read

    def _rescued(self, endpoint_id: str, reason: str) -> UpstreamRescued:
        if reason == "stalled":
            self._metrics.upstream_errors.labels(endpoint_id, "stalled").inc()
            return UpstreamRescued(reason, f"endpoint {endpoint_id} stopped making progress (stalled)")
        return UpstreamRescued(reason, f"endpoint {endpoint_id} was taken out of rotation ({reason}) while the "
                                       "request waited")

    def _failed(self, endpoint_id: str, kind: str, exc: BaseException, *, mid_response: bool = False) -> None:
        """The log line for a failed endpoint, with what the client is not told (addresses, the engine's bytes,
        clipped), at most one per endpoint and kind every 10 s."""
        self._log.warning(
            (endpoint_id, kind),
            "endpoint failed mid-response; ending the response" if mid_response else "endpoint failed",
            endpoint=endpoint_id, kind=kind, error=clip(f"{type(exc).__name__}: {exc}", 300),
        )


class EndpointConnectionLost(aiohttp.ClientPayloadError):
    """The connection to an endpoint ended before the body being streamed over it did; `cause` is why, when
    aiohttp knows (an HttpProcessingError for bytes that were not HTTP)."""

    def __init__(self, cause: BaseException | None) -> None:
        super().__init__("the endpoint's connection ended mid-body")
        self.cause = cause


class _Watch:
    __slots__ = ("_losses", "_protocol")

    def __init__(self, losses: ConnectionLosses, protocol: ResponseHandler | None) -> None:
        self._losses, self._protocol = losses, protocol

    def close(self) -> None:
        if self._protocol is not None:
            self._losses.streaming.pop(self._protocol, None)


class ConnectionLosses:
    """Fails a response body at once when its connection to the endpoint is lost.

    aiohttp's C response parser closes a connection whose body it cannot parse (a malformed chunk) without
    failing the body's reader, which then waits for data that will never come: the client's stream hung
    until the idle timeout (60 s by default), with its slot counted in flight all along. One callback per
    upstream connection, on the connection's `closed` future, fails whatever body is being streamed over it,
    with the parser's error as the cause; aiohttp's pure-Python parser raises by itself, and so does a body
    that has already ended (nothing is being streamed).
    """

    def __init__(self) -> None:
        self.streaming: weakref.WeakKeyDictionary[ResponseHandler, aiohttp.StreamReader] = \
            weakref.WeakKeyDictionary()
        self._hooked: weakref.WeakSet[ResponseHandler] = weakref.WeakSet()

    def watch(self, upstream: aiohttp.ClientResponse) -> _Watch:
        connection = upstream.connection
        protocol = connection.protocol if connection is not None else None
        closed = protocol.closed if protocol is not None else None
        if protocol is None or closed is None:  # body already read, or the connection already gone
            return _Watch(self, None)
        if protocol not in self._hooked:  # once per connection, not per request: keep-alive reuses it
            self._hooked.add(protocol)
            closed.add_done_callback(functools.partial(self._lost, weakref.ref(protocol)))
        self.streaming[protocol] = upstream.content
        return _Watch(self, protocol)

    def _lost(self, protocol_ref: weakref.ref[ResponseHandler], closed: asyncio.Future[None]) -> None:
        if not closed.cancelled():
            closed.exception()  # the future exists because we asked for it: its outcome is ours to collect
        protocol = protocol_ref()
        content = self.streaming.pop(protocol, None) if protocol is not None else None
        if protocol is not None and content is not None and not content.is_eof():
            content.set_exception(EndpointConnectionLost(protocol.exception()))


def _unsent(outcome: Outcome, status: int, message: str, code: str) -> None:
    """The engine failed after its response head but before any byte reached the client: the client gets the
    router's own error answer (the failure is still the attempt's: `outcome.error`)."""
    outcome.response = error_response(status, message, code=code)
    outcome.status = status


async def _end_early(request: web.Request, response: web.StreamResponse, endpoint_id: str, what: str) -> None:
    """A response that cannot be completed after bytes were sent. A stream (SSE) gets a final OpenAI-shaped
    error event and a clean end, which SDKs surface as an error; any other body is cut, so the client sees
    a truncated body rather than a well-formed but incomplete answer. Never retried: the client already
    has part of an answer."""
    if response.prepared and response.content_type == "text/event-stream":
        event = {"error": {"message": f"stream from endpoint {endpoint_id} interrupted: {what}",
                           "type": "server_error", "param": None, "code": "upstream_stream_interrupted"}}
        try:
            await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
            await response.write_eof()
            return
        except ConnectionResetError:
            pass
    _abort(request)


def _abort(request: web.Request) -> None:
    """Headers are already sent, so the only honest signal left is to cut the connection: the client sees
    a truncated body instead of a well-formed but incomplete answer."""
    transport = request.transport
    if transport is not None:
        transport.close()
