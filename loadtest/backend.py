"""A zero-latency fake OpenAI backend for benchmarks: a raw asyncio HTTP/1.1 server, as cheap as possible.

It answers every POST to /v1/* at once: a fixed chat completion (JSON, Content-Length), or, when the body
says `"stream": true`, an SSE stream of `--chunks` `data:` events (chunked transfer encoding) followed by
`data: [DONE]`, the first event written at once and the next ones `--token-interval-ms` apart (with
`--tokens-from-request`, a request's own `max_tokens`, at most 4,096, sets its number of events). GET /metrics
returns a small vLLM-style page (so the router's telemetry scrape works as in production), GET /health 200,
GET /v1/models the one model (peer routers' readiness checks ask for it).
Keep-alive and pipelined requests are supported; there is no JSON validation beyond what the router needs.

    python -m loadtest.backend --ports 2      # prints "READY port1,port2" on stdout, runs until SIGTERM
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import sys

import orjson

COMPLETION = orjson.dumps(
    {
        "id": "cmpl-bench",
        "object": "chat.completion",
        "created": 1700000000,
        "model": "llama-3-8b",
        "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "tok " * 16}, "finish_reason": "length"}
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 16, "total_tokens": 21},
    }
)
METRICS = (
    b"# HELP vllm:num_requests_waiting Waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
    b'vllm:num_requests_waiting{model_name="llama-3-8b"} 0.0\n'
    b"# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
    b'vllm:num_requests_running{model_name="llama-3-8b"} 0.0\n'
    b"# HELP vllm:kv_cache_usage_perc KV.\n# TYPE vllm:kv_cache_usage_perc gauge\n"
    b'vllm:kv_cache_usage_perc{model_name="llama-3-8b"} 0.1\n'
)


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type
        + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


OK_COMPLETION = _response(b"200 OK", b"application/json", COMPLETION)
OK_METRICS = _response(b"200 OK", b"text/plain; version=0.0.4", METRICS)
OK_HEALTH = _response(b"200 OK", b"text/plain", b"ok")
OK_MODELS = _response(b"200 OK", b"application/json", orjson.dumps(
    {"object": "list", "data": [{"id": "llama-3-8b", "object": "model", "created": 1700000000, "owned_by": "vllm"}]}
))
NOT_FOUND = _response(b"404 Not Found", b"text/plain", b"not found")
BAD_REQUEST = _response(b"400 Bad Request", b"text/plain", b"not an HTTP/1.1 request")
STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse(i: int) -> bytes:
    event = {
        "id": "cmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "llama-3-8b",
        "choices": [{"index": 0, "delta": {"content": f"tok{i} "}, "finish_reason": None}],
    }
    return _chunk(b"data: " + orjson.dumps(event) + b"\n\n")


class BackendProtocol(asyncio.Protocol):
    def __init__(self, chunks: int, interval: float, tokens_from_request: bool = False) -> None:
        self.chunks = chunks
        self.tokens_from_request = tokens_from_request
        self.interval = interval
        self.buf = b""
        self.transport: asyncio.Transport | None = None
        self.streaming: asyncio.Task[None] | None = None
        self.pending: list[tuple[bytes, bytes, bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.streaming is not None:
            self.streaming.cancel()
        self.transport = None

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end]
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = self.buf[end + 4 : end + 4 + length]
            self.buf = self.buf[end + 4 + length :]
            request_line = head.split(b"\r\n", 1)[0].split(b" ", 2)
            if len(request_line) != 3:  # not HTTP/1.x: sglang-router probes with an HTTP/2 preface first
                if self.transport is not None:
                    self.transport.write(BAD_REQUEST)
                    self.transport.close()
                return
            method, path, _ = request_line
            self.pending.append((method, path, body))
            if self.streaming is None:
                self._drain()

    def _drain(self) -> None:
        while self.pending and self.transport is not None and self.streaming is None:
            method, path, body = self.pending.pop(0)
            if method == b"POST" and path.startswith(b"/v1/"):
                request = orjson.loads(body) if b'"stream"' in body else {}
                if request.get("stream"):
                    chunks = self.chunks
                    if self.tokens_from_request and isinstance(request.get("max_tokens"), int):
                        chunks = max(1, min(request["max_tokens"], 4096))
                    self.streaming = asyncio.get_running_loop().create_task(self._stream(chunks))
                    return
                self.transport.write(OK_COMPLETION)
            elif path == b"/metrics":
                self.transport.write(OK_METRICS)
            elif path == b"/health":
                self.transport.write(OK_HEALTH)
            elif path == b"/v1/models":
                self.transport.write(OK_MODELS)
            else:
                self.transport.write(NOT_FOUND)

    async def _stream(self, chunks: int) -> None:
        try:
            assert self.transport is not None
            self.transport.write(STREAM_HEAD + _sse(0))
            for i in range(1, chunks):
                await asyncio.sleep(self.interval)
                if self.transport is None:
                    return
                self.transport.write(_sse(i))
            await asyncio.sleep(self.interval)
            if self.transport is not None:
                self.transport.write(_chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        finally:
            self.streaming = None
        self._drain()


async def serve(ports: int, chunks: int, interval: float, tokens_from_request: bool = False) -> None:
    loop = asyncio.get_running_loop()
    servers = []
    for _ in range(ports):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        servers.append(
            await loop.create_server(lambda: BackendProtocol(chunks, interval, tokens_from_request), sock=sock,
                                     backlog=1024)
        )
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bound = ",".join(str(s.sockets[0].getsockname()[1]) for s in servers)
    print(f"READY {bound}", flush=True)
    await stop.wait()
    for s in servers:
        s.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ports", type=int, default=1, help="listening ports (one per fake endpoint)")
    parser.add_argument("--chunks", type=int, default=16, help="SSE data events per streamed completion")
    parser.add_argument("--token-interval-ms", type=float, default=1.0, help="delay between two SSE events")
    parser.add_argument("--tokens-from-request", action="store_true",
                        help="a streamed answer has the request's max_tokens events (at most 4096), else --chunks")
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = parser.parse_args(argv)
    coro = serve(args.ports, args.chunks, args.token_interval_ms / 1000, args.tokens_from_request)
    if args.loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            asyncio.run(coro)
        else:
            uvloop.run(coro)
    else:
        asyncio.run(coro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
