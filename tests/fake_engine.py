"""A fake OpenAI-compatible inference engine for tests, speaking vLLM's wire protocol.

It answers `/v1/chat/completions`, `/v1/completions` and `/v1/embeddings` (streaming as SSE with one
`data:` event per token and a final `data: [DONE]`, like vLLM), `/v1/models`, `/health` and a `/metrics`
page with vLLM's gauge names. Tests steer it through attributes: the load it reports, a status to fail
with, a gate that holds a stream after its first token (to prove the router does not buffer), a hang
before headers (timeouts), how many tokens to answer a request with, bytes that break the chunked encoding
mid-stream, extra response headers, a wedged engine loop (`wedged`: requests get no answer, streams their
head and then nothing, while `/health` still says 200) or a busy one (`busy`: chat completions wait while a
probe completion is answered), and it records every request and whether a stream's client went away.

Streams come in two shapes. By default, OpenAI's: the first event carries the role and the first token,
and an empty `delta: {}` (chat) or `text: ""` (completions) event carries the finish reason. With
`vllm_stream`, vLLM's (vllm/entrypoints/openai/chat_completion/serving.py): a role-only opening event
(`{"role": "assistant", "content": ""}`) and the finish reason on the last token's event, with
`tokens_per_event` tokens in each event (more than one when vLLM merges steps under load). Either way
`stream_options.include_usage` adds a usage-only event (`"choices": []`) before `[DONE]`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web


@dataclass
class EngineLoad:
    waiting: float = 0
    running: float = 0
    kv_usage: float = 0.0
    legacy_names: bool = False  # report vllm:gpu_cache_usage_perc (vLLM v0) instead of kv_cache_usage_perc


@dataclass
class FakeEngine:
    name: str
    models: tuple[str, ...] = ("llama-3-8b",)
    load: EngineLoad = field(default_factory=EngineLoad)
    fail_status: int | None = None  # answer every inference request with this status
    hang: asyncio.Event | None = None  # if set, wait for it before answering (headers included)
    gate: asyncio.Event | None = None  # if set, a stream waits for it after its first token
    # If set, a stream's first token is followed, once this is set, by bytes that are not chunked encoding
    # (`zz` is no chunk size), as a broken engine or a middlebox mangling the body would send; the connection
    # then stays open, silent.
    malformed_chunk: asyncio.Event | None = None
    # While this is an Event not yet set, the engine loop is wedged, as vLLM's can be while its HTTP server
    # still answers /health: a non-streaming request gets no answer (vLLM sends its head with the finished
    # answer), a stream gets its head (vLLM sends it at once) and then nothing, and a started stream stops
    # before its next token. Setting the Event (or None) unwedges it.
    wedged: asyncio.Event | None = None
    # If set, chat completions wait for it before answering while /v1/completions (the router's probe) answers
    # at once: an engine busy with long generations that still schedules new work.
    busy: asyncio.Event | None = None
    response_headers: dict[str, str] = field(default_factory=dict)  # added to every inference response
    requests: list[dict[str, Any]] = field(default_factory=list)
    stream_aborted: asyncio.Event = field(default_factory=asyncio.Event)
    first_token_sent: asyncio.Event = field(default_factory=asyncio.Event)
    request_received: asyncio.Event = field(default_factory=asyncio.Event)  # set by each inference request
    unhealthy: bool = False  # /health answers 503
    # Output tokens for a request body (capped at its max_tokens); None: max_tokens, or 4 without it.
    output_length: Callable[[dict[str, Any]], int] | None = None
    vllm_stream: bool = False  # stream in vLLM's shape (see the module docstring)
    # vLLM shape only: tokens per event, as when vLLM's API server falls behind and merges engine steps.
    tokens_per_event: int = 1
    # Its "tokenizer", for usage.prompt_tokens: this many characters of text per token, plus 4 per message.
    prompt_chars_per_token: float = 4.0
    runner: web.AppRunner | None = None
    url: str = ""
    port: int = 0  # 0: a free port on first start; a restart reuses the same one

    async def start(self) -> FakeEngine:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # vLLM (uvicorn) sets no body limit
        for path in ("/v1/chat/completions", "/v1/completions", "/v1/embeddings"):
            app.router.add_post(path, self._inference)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port, reuse_address=True)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # ---- handlers -----------------------------------------------------------------------------------

    async def _inference(self, request: web.Request) -> web.StreamResponse:
        # As vLLM (Starlette) reads it: JSON from the raw bytes, whatever charset the Content-Type names.
        body = orjson.loads(await request.read())
        self.requests.append({"path": request.path, "headers": dict(request.headers), "body": body})
        self.request_received.set()
        if self.hang is not None:
            await self.hang.wait()
        if not body.get("stream"):
            await self._unwedged()
        if self.busy is not None and request.path == "/v1/chat/completions":
            await self.busy.wait()
        if self.fail_status is not None:
            return web.json_response(
                {"error": {"message": f"{self.name} failing", "type": "server_error", "code": None}},
                status=self.fail_status,
            )
        if body.get("model") not in self.models:
            return web.json_response({"error": {"message": "model not served here"}}, status=404)
        if request.path == "/v1/embeddings":
            return web.json_response(
                {"object": "list", "model": body["model"],
                 "data": [{"object": "embedding", "index": 0, "embedding": [0.1, 0.2, 0.3]}],
                 "usage": {"prompt_tokens": 3, "total_tokens": 3}}
            )
        tokens = [f"tok{i} " for i in range(self._length(body))]
        chat = request.path == "/v1/chat/completions"
        if body.get("stream"):
            return await self._stream(request, body, tokens, chat)
        text = "".join(tokens)
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
            if chat else {"index": 0, "text": text, "finish_reason": "length"}
        )
        return web.json_response(
            {
                "id": f"cmpl-{self.name}-{len(self.requests)}",
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [choice],
                "usage": self._usage(body, tokens),
            },
            headers={"x-served-by": self.name, **self.response_headers},
        )

    def _usage(self, body: dict[str, Any], tokens: list[str]) -> dict[str, int]:
        messages = body.get("messages")
        if isinstance(messages, list):
            chars = sum(len(m["content"]) for m in messages if isinstance(m, dict) and isinstance(m.get("content"), str))
            prompt = math.ceil(chars / self.prompt_chars_per_token) + 4 * len(messages)
        else:
            prompt = math.ceil(len(str(body.get("prompt") or "")) / self.prompt_chars_per_token)
        return {"prompt_tokens": prompt, "completion_tokens": len(tokens), "total_tokens": prompt + len(tokens)}

    def _length(self, body: dict[str, Any]) -> int:
        cap = body.get("max_tokens")
        if self.output_length is None:
            return int(cap or 4)
        wanted = self.output_length(body)
        return min(wanted, int(cap)) if cap else wanted

    async def _stream(
        self, request: web.Request, body: dict[str, Any], tokens: list[str], chat: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "x-served-by": self.name,
                                           **self.response_headers})
        await resp.prepare(request)
        if self.vllm_stream:
            return await self._vllm_stream(request, resp, body, tokens, chat)
        try:
            for i, tok in enumerate(tokens):
                await self._unwedged()
                delta: dict[str, Any] = (
                    {"index": 0, "delta": {"role": "assistant", "content": tok} if i == 0 else {"content": tok},
                     "finish_reason": None}
                    if chat else {"index": 0, "text": tok, "finish_reason": None}
                )
                chunk = {
                    "id": f"cmpl-{self.name}",
                    "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": int(time.time()),
                    "model": body["model"],
                    "choices": [delta],
                }
                await resp.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if i == 0:
                    self.first_token_sent.set()
                    if self.malformed_chunk is not None:
                        await self.malformed_chunk.wait()
                        assert request.transport is not None
                        request.transport.write(b"zz\r\nnot a chunk\r\n")  # past aiohttp's chunked writer
                        await asyncio.Event().wait()  # silent until the router hangs up
                    if self.gate is not None:
                        await self.gate.wait()
            final = {"id": f"cmpl-{self.name}", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": body["model"],
                     "choices": [{"index": 0, "delta": {}, "finish_reason": "length"} if chat
                                 else {"index": 0, "text": "", "finish_reason": "length"}]}
            await resp.write(b"data: " + orjson.dumps(final) + b"\n\n")
            await self._end_stream(resp, body, tokens, chat)
        except (ConnectionResetError, asyncio.CancelledError):
            self.stream_aborted.set()
            raise
        return resp

    async def _vllm_stream(
        self, request: web.Request, resp: web.StreamResponse, body: dict[str, Any], tokens: list[str], chat: bool
    ) -> web.StreamResponse:
        base = {"id": f"cmpl-{self.name}", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": body["model"]}
        try:
            if chat:
                opening = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}
                await resp.write(b"data: " + orjson.dumps({**base, "choices": [opening]}) + b"\n\n")
            step = self.tokens_per_event
            pieces = ["".join(tokens[i:i + step]) for i in range(0, len(tokens), step)]
            for i, tok in enumerate(pieces):
                finish = "length" if i + 1 == len(pieces) else None
                choice = ({"index": 0, "delta": {"content": tok}, "logprobs": None, "finish_reason": finish} if chat
                          else {"index": 0, "text": tok, "logprobs": None, "finish_reason": finish})
                await resp.write(b"data: " + orjson.dumps({**base, "choices": [choice]}) + b"\n\n")
                if i == 0:
                    self.first_token_sent.set()
                    if self.gate is not None:
                        await self.gate.wait()
            await self._end_stream(resp, body, tokens, chat)
        except (ConnectionResetError, asyncio.CancelledError):
            self.stream_aborted.set()
            raise
        return resp

    async def _unwedged(self) -> None:
        if self.wedged is not None:
            await self.wedged.wait()

    async def _end_stream(self, resp: web.StreamResponse, body: dict[str, Any], tokens: list[str], chat: bool) -> None:
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": f"cmpl-{self.name}", "object": "chat.completion.chunk" if chat else "text_completion",
                     "created": int(time.time()), "model": body["model"], "choices": [],
                     "usage": self._usage(body, tokens)}
            await resp.write(b"data: " + orjson.dumps(usage) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.unhealthy else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        kv_name = "vllm:gpu_cache_usage_perc" if self.load.legacy_names else "vllm:kv_cache_usage_perc"
        lines = []
        for name, kind, value in (
            ("vllm:num_requests_running", "gauge", self.load.running),
            ("vllm:num_requests_waiting", "gauge", self.load.waiting),
            (kv_name, "gauge", self.load.kv_usage),
        ):
            lines += [f"# HELP {name} fake", f"# TYPE {name} {kind}",
                      f'{name}{{engine="0",model_name="{self.models[0]}"}} {value}']
        lines += ["# HELP vllm:time_to_first_token_seconds fake", "# TYPE vllm:time_to_first_token_seconds histogram",
                  'vllm:time_to_first_token_seconds_bucket{le="+Inf",model_name="m"} 3',
                  'vllm:time_to_first_token_seconds_count{model_name="m"} 3',
                  'vllm:time_to_first_token_seconds_sum{model_name="m"} 0.3']
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")
