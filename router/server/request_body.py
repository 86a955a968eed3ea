"""Reading an inference request's body: `Expect: 100-continue`, the size limit, the body-read timeout and
`Content-Encoding`, each refusal a clean OpenAI-shaped 4xx.

- **100-continue.** aiohttp's default answers `100 Continue` as soon as the route matches, before the API
  key or the size is checked, so a client is invited to upload 16 MiB that will be refused. The inference
  routes' expect handler (`expect_handler`) sends nothing; `read_body` sends `100 Continue` once the request
  has passed the key check (a middleware, already run) and the size check (a final status instead, as RFC
  9110 section 10.1.1 allows). An expectation other than `100-continue` gets 417. `Expect` is not forwarded:
  the engine receives a complete request (router/server/proxy.py).
- **Timeout.** Each read of the body must bring data within `limits.bodyTimeout` (nginx's
  client_body_timeout: between two reads, not for the whole body); a stalled upload gets 408 and the
  connection is closed. Counted in `fleetroute_client_timeouts_total{phase="body"}`.
- **Size.** `limits.maxBodyBytes` bounds the bytes received and, separately, the decoded body: a 10 kB gzip
  bomb that inflates to 1 GB stops at the limit (413).
- **Content-Encoding.** The server does not decode bodies itself (aiohttp's own decoding answered a corrupt
  gzip body with a 500 and two tracebacks, and `br` with a plain-text 400). `gzip` and `deflate` (zlib or
  raw, as clients send it), in any stack, are decoded here; a body that does not decode is a 400
  (`invalid_body_encoding`, one info line, no traceback); any other coding is a 415 naming the ones accepted
  (`Accept-Encoding`, RFC 9110 section 15.5.16).
"""

from __future__ import annotations

import asyncio
import zlib
from collections.abc import Callable

from aiohttp import web
from aiohttp.http import HttpVersion11

from router.runtime.errors import clip, error_response

ACCEPTED_ENCODINGS = ("gzip", "deflate")
_IDENTITY = frozenset({"", "identity"})
_GZIP = frozenset({"gzip", "x-gzip"})
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"


class BodyRejected(Exception):
    """The body cannot be accepted; `response` says why (a 4xx in the OpenAI shape, closing the connection)."""

    def __init__(self, status: int, message: str, *, code: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.response = error_response(status, message, code=code, headers=headers)
        self.response.force_close()  # whatever the client still sends of the body is not read


async def expect_handler(request: web.Request) -> web.StreamResponse | None:
    """The inference routes' `Expect` handler: no `100 Continue` yet (`read_body` sends it after the checks);
    417 for an expectation the router does not know."""
    expect = request.headers.get("Expect", "")
    if request.version >= HttpVersion11 and expect.strip().lower() != "100-continue":
        response = error_response(417, f"unsupported expectation: Expect: {clip(expect, 64)}",
                                  code="expectation_failed", param="Expect")
        response.force_close()
        return response
    return None  # HTTP/1.0 ignores Expect (RFC 9110 section 10.1.1)


def content_codings(request: web.Request) -> list[str]:
    """The request's content codings in the order they were applied; BodyRejected (415) for one the router
    cannot decode."""
    codings = [c.strip().lower() for v in request.headers.getall("Content-Encoding", ()) for c in v.split(",")]
    codings = [c for c in codings if c not in _IDENTITY]
    for coding in codings:
        if coding not in _GZIP and coding != "deflate":
            raise BodyRejected(415, f"Content-Encoding {clip(coding, 32)!r} is not supported; send the body "
                                    f"uncompressed or as {' or '.join(ACCEPTED_ENCODINGS)}",
                               code="unsupported_content_encoding",
                               headers={"Accept-Encoding": ", ".join(ACCEPTED_ENCODINGS)})
    return codings


async def read_body(request: web.Request, *, limit: int, timeout: float,
                    on_timeout: Callable[[], None] | None = None) -> bytes:
    """The request's body, decoded. Raises BodyRejected (413, 415, 400, 408)."""
    codings = content_codings(request)
    if request.content_length is not None and request.content_length > limit:
        raise _too_large(limit)
    if request.version >= HttpVersion11 and request.headers.get("Expect", "").strip().lower() == "100-continue":
        await _send_continue(request)
    raw = await _read_raw(request, limit, timeout, on_timeout)
    for coding in reversed(codings):  # the last coding applied is undone first (RFC 9110 section 8.4)
        raw = _decode(raw, coding, limit)
    return raw


async def _send_continue(request: web.Request) -> None:
    # As aiohttp's own default expect handler does, once the request has passed its checks.
    await request.writer.write(_CONTINUE)
    request.writer.output_size = 0  # the interim response is not the response's start


async def _read_raw(request: web.Request, limit: int, timeout: float, on_timeout: Callable[[], None] | None) -> bytes:
    chunks: list[bytes] = []
    size = 0
    content = request.content
    while True:
        try:
            async with asyncio.timeout(timeout):
                chunk = await content.readany()
        except TimeoutError:
            if on_timeout is not None:
                on_timeout()
            raise BodyRejected(408, f"the request body stalled: no data for {timeout:g}s",
                               code="request_timeout") from None
        except web.RequestPayloadError as exc:  # a malformed chunked upload
            raise BodyRejected(400, "the request body is malformed: it is not valid HTTP chunked encoding",
                               code="invalid_body") from exc
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)


def _decode(data: bytes, coding: str, limit: int) -> bytes:
    """One coding undone, the output bounded by `limit`; gzip may hold several members (RFC 1952)."""
    out: list[bytes] = []
    size = 0
    while data:
        if coding == "deflate":
            # RFC 9110's deflate is zlib-wrapped, but many clients send raw deflate: the header tells which.
            wbits = zlib.MAX_WBITS if _zlib_header(data) else -zlib.MAX_WBITS
        else:
            wbits = 16 + zlib.MAX_WBITS  # gzip
        decoder = zlib.decompressobj(wbits)
        try:
            piece = decoder.decompress(data, limit + 1 - size)
        except zlib.error as exc:
            raise _undecodable(coding, str(exc)) from None
        size += len(piece)
        if size > limit or decoder.unconsumed_tail:
            raise _too_large(limit, decoded=True)
        if not decoder.eof:
            raise _undecodable(coding, "the compressed data ends early")
        out.append(piece)
        data = decoder.unused_data
        if data and coding == "deflate":
            raise _undecodable(coding, "data follows the end of the compressed stream")
    return b"".join(out)


def _zlib_header(data: bytes) -> bool:
    """RFC 1950's two-byte header: compression method 8, and the pair a multiple of 31."""
    return len(data) >= 2 and data[0] & 0x0F == 8 and (data[0] << 8 | data[1]) % 31 == 0


def _too_large(limit: int, *, decoded: bool = False) -> BodyRejected:
    what = "decoded request body" if decoded else "request body"
    return BodyRejected(413, f"{what} exceeds the limit of {limit} bytes", code="body_too_large")


def _undecodable(coding: str, why: str) -> BodyRejected:
    return BodyRejected(400, f"the request body is not valid {coding} ({why})", code="invalid_body_encoding")
