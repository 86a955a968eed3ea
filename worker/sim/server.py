"""`fleetroute sim`: one simulated vLLM replica behind vLLM's own OpenAI-compatible HTTP surface.

The engine core (`engine.EngineCore`) is pure and runs in virtual time; this module drives it in real time:
one asyncio task steps the engine, sleeps for each step's simulated duration (times `time_scale`, times any
injected slowdown) and then hands the step's tokens to the waiting HTTP handlers, which stream them as SSE
events, one per token, exactly when a real engine would have produced them. Simulated time is real time
divided by `time_scale`, so metrics and GPU telemetry read like a real GPU's even on a slowed-down fleet.

A client that disconnects aborts its request in the engine (its KV blocks are freed at once), as vLLM does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from worker.sim.engine import EngineConfig, EngineCore, SimRequest
from worker.sim.faults import FaultError, Faults
from worker.sim.gpu import SimulatedGpu
from worker.sim.kv_events import KVEventPublisher, KVEventsConfig
from worker.sim.metrics import SimMetrics
from worker.sim.profiles import GpuProfile
from worker.sim.tokenizer import render_chat, token_pieces, tokenize

log = logging.getLogger("fleetroute.sim")

FILLER = ("the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ".")
# Output length when the client gives no max_tokens: lognormal around ShareGPT-like chat answers
# (median ~150 tokens, long tail), seeded so runs repeat.
OUTPUT_MEDIAN, OUTPUT_SIGMA = 150, 0.8


@dataclass(frozen=True)
class SimSettings:
    model: str
    profile: GpuProfile
    engine: EngineConfig
    host: str = "127.0.0.1"
    port: int = 8000
    seed: int = 0
    time_scale: float = 1.0
    max_model_len: int = 8192
    fault_injection: bool = False
    # vLLM's further `--served-model-name` values: accepted in requests and listed in /v1/models; answers
    # name `model`, the first served name, as vLLM's do.
    aliases: tuple[str, ...] = ()
    model_path: str | None = None  # vLLM's `--model` (a Hugging Face id or path): `root` in /v1/models
    kv_events: KVEventsConfig | None = None  # publish KV-cache events (worker/sim/kv_events.py)
    lora_modules: tuple[tuple[str, str], ...] = ()  # vLLM's --lora-modules: (adapter name, path)

    def serves(self, name: object) -> bool:
        return name == self.model or name in self.aliases or self.adapter(name) is not None

    def adapter(self, name: object) -> str | None:
        """The LoRA adapter a request's `model` names, or None (the base model, or nothing served)."""
        return name if isinstance(name, str) and any(name == n for n, _ in self.lora_modules) else None


class _Pending:
    """A request's mailbox: the engine loop posts the number of tokens generated so far, then None."""

    __slots__ = ("request", "updates", "done")

    def __init__(self, request: SimRequest) -> None:
        self.request = request
        self.updates: asyncio.Queue[int | None] = asyncio.Queue()
        self.done = False


def _vllm_error(status: int, message: str, err_type: str) -> web.Response:
    # vLLM's error shape (OpenAI's with vLLM's type names and a numeric code).
    body = {"object": "error", "message": message, "type": err_type, "param": None, "code": status}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


class SimServer:
    def __init__(self, settings: SimSettings, engine: EngineCore) -> None:
        self.settings = settings
        self.engine = engine
        self.faults = Faults()
        self._rng = random.Random(settings.seed)
        self._pending: dict[str, _Pending] = {}
        self._wake = asyncio.Event()
        self._epoch = time.monotonic()
        self.metrics = SimMetrics(engine, settings.engine, settings.model)
        self.gpu = SimulatedGpu(profile=settings.profile, engine=engine, sim_clock=self.sim_now)
        self.ready = asyncio.Event()
        self.kv_events: KVEventPublisher | None = None

    def sim_now(self) -> float:
        return (time.monotonic() - self._epoch) / self.settings.time_scale

    # ---- app -----------------------------------------------------------------------------------------

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self._completion)
        app.router.add_post("/v1/completions", self._completion)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        for path in ("/v1/completions/render", "/v1/chat/completions/render"):
            app.router.add_post(path, self._scale_out_disabled)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/sim/gpu", self._gpu)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        if self.settings.fault_injection:
            app.router.add_route("*", "/sim/faults", self._faults)
        app.cleanup_ctx.append(self._engine_task)
        return app

    async def _engine_task(self, app: web.Application) -> AsyncIterator[None]:
        if self.settings.kv_events is not None:
            self.kv_events = KVEventPublisher(self.settings.kv_events)
            self.engine.kv_cache.events = []
        task = asyncio.create_task(self._run_engine(), name="sim-engine")
        self.ready.set()
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if self.kv_events is not None:
            await self.kv_events.close()

    def _publish_kv_events(self) -> None:
        kv = self.engine.kv_cache
        if self.kv_events is not None and kv.events:
            self.kv_events.publish(kv.events, kv.block_size)
            kv.events = []

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's POST /reset_prefix_cache: refused (400) while requests hold blocks."""
        if not self.engine.kv_cache.reset():
            return _vllm_error(400, "the prefix cache cannot be reset while requests are running", "BadRequestError")
        self._publish_kv_events()
        return web.Response(status=200)

    # ---- engine loop ---------------------------------------------------------------------------------

    async def _run_engine(self) -> None:
        loop = asyncio.get_running_loop()
        scale = self.settings.time_scale
        while True:
            if not self.engine.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            started = loop.time()
            step_start = self.sim_now()
            try:
                result = self.engine.step(step_start)
                self._publish_kv_events()
            except Exception:  # a simulator bug: fail the waiting requests rather than hang them forever
                log.exception("engine step failed; aborting the requests in flight")
                for pending in list(self._pending.values()):
                    self.engine.abort(pending.request.request_id)
                    pending.updates.put_nowait(None)
                await asyncio.sleep(0.1)
                continue
            if result.idle:
                # Nothing to run yet (a static batch still filling): wait out the window or a new arrival.
                self._wake.clear()
                if result.duration > 0:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(result.duration * scale):
                            await self._wake.wait()
                else:
                    await self._wake.wait()
                continue
            # Sleep until the step would end on the GPU; absolute deadlines keep Python overhead from
            # accumulating into the simulated timeline.
            self.gpu.busy.busy(step_start, result.duration * self.faults.slowdown)
            await asyncio.sleep(max(0.0, started + result.duration * scale * self.faults.slowdown - loop.time()))
            for req in result.emitted:
                pending = self._pending.get(req.request_id)
                if pending is not None:
                    pending.updates.put_nowait(req.num_generated)
            for req in result.finished:
                pending = self._pending.get(req.request_id)
                if pending is not None:
                    pending.done = True
                    pending.updates.put_nowait(None)

    # ---- handlers ------------------------------------------------------------------------------------

    async def _completion(self, request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return _vllm_error(400, f"invalid JSON body: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return _vllm_error(400, "request body must be a JSON object", "BadRequestError")
        faults = self.faults
        if faults.hang:
            while faults.hang:
                await faults.cleared.wait()
        if faults.error_rate and self._rng.random() < faults.error_rate:
            return _vllm_error(faults.error_status, "injected fault", "InternalServerError")
        if not self.settings.serves(body.get("model")):
            return _vllm_error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        chat = request.path == "/v1/chat/completions"
        try:
            prompt = self._prompt_tokens(body, chat)
            max_tokens = self._max_tokens(body, len(prompt))
        except ValueError as exc:
            return _vllm_error(400, str(exc), "BadRequestError")
        req = SimRequest(f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", prompt, max_tokens, self.sim_now(),
                         lora=self.settings.adapter(body.get("model")))
        pending = _Pending(req)
        self._pending[req.request_id] = pending
        self.engine.add_request(req)
        self._wake.set()
        try:
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return await self._stream(request, pending, chat, include_usage)
            return await self._complete(pending, chat)
        finally:
            self._pending.pop(req.request_id, None)
            if not pending.done:
                self.engine.abort(req.request_id)  # the client left: free the batch slot and KV blocks

    def _prompt_tokens(self, body: dict[str, Any], chat: bool) -> list[int]:
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise ValueError("messages must be a non-empty list")
            return tokenize(render_chat(messages))
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return tokenize(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # already token ids
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return tokenize(prompt[0])
        raise ValueError("prompt must be a string, a list with one string, or a list of token ids")

    def _max_tokens(self, body: dict[str, Any], prompt_len: int) -> int:
        # A request must also fit the whole KV pool, or it could never be admitted.
        limit = min(self.settings.max_model_len, self.engine.max_model_len)
        if prompt_len == 0:
            raise ValueError("the prompt is empty")
        if prompt_len >= limit:
            raise ValueError(f"This model's maximum context length is {limit} tokens. However, your prompt has "
                             f"{prompt_len} tokens. Please reduce the length of the messages or prompt.")
        requested = body.get("max_tokens", body.get("max_completion_tokens"))
        if requested is None:
            sampled = int(math.exp(self._rng.gauss(math.log(OUTPUT_MEDIAN), OUTPUT_SIGMA)))
            return max(1, min(sampled, limit - prompt_len))
        if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
            raise ValueError(f"max_tokens must be a positive integer, got {requested!r}")
        if prompt_len + requested > limit:
            raise ValueError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + requested} tokens ({prompt_len} in the messages, {requested} in the completion). "
                "Please reduce the length of the messages or completion."
            )
        return requested

    async def _tokens(self, pending: _Pending) -> AsyncIterator[int]:
        """Yield each new token index as the engine produces it, observing vLLM's latency histograms."""
        req = pending.request
        last = req.arrival
        seen = 0
        while True:
            count = await pending.updates.get()
            if count is None:
                break
            now = self.sim_now()
            (self.metrics.ttft if seen == 0 else self.metrics.itl).observe(now - last)
            last = now
            while seen < count:
                stall = self.faults.stall_after_tokens
                while stall is not None and seen >= stall:
                    await self.faults.cleared.wait()
                    stall = self.faults.stall_after_tokens
                yield seen
                seen += 1
        self.metrics.e2e.observe(self.sim_now() - req.arrival)
        self.metrics.success.inc()

    async def _complete(self, pending: _Pending, chat: bool) -> web.Response:
        text = "".join([FILLER[i % len(FILLER)] async for i in self._tokens(pending)])
        req = pending.request
        choice: dict[str, Any] = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": "length"}
            if chat else {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
        )
        return web.json_response(
            {
                "id": req.request_id,
                "object": "chat.completion" if chat else "text_completion",
                "created": int(time.time()),
                "model": req.lora or self.settings.model,
                "choices": [choice],
                "usage": self._usage(req),
            },
            dumps=lambda o: orjson.dumps(o).decode(),
        )

    def _usage(self, req: SimRequest) -> dict[str, Any]:
        prompt = len(req.prompt_tokens)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": req.num_generated,
            "total_tokens": prompt + req.num_generated,
            "prompt_tokens_details": {"cached_tokens": req.cached_tokens},
        }

    async def _stream(
        self, request: web.Request, pending: _Pending, chat: bool, include_usage: bool
    ) -> web.StreamResponse:
        req = pending.request
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        created = int(time.time())
        base = {"id": req.request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created, "model": req.lora or self.settings.model}

        def event(choice: dict[str, Any] | None, usage: dict[str, Any] | None = None) -> bytes:
            payload = {**base, "choices": [choice] if choice is not None else []}
            if usage is not None:
                payload["usage"] = usage
            return b"data: " + orjson.dumps(payload) + b"\n\n"

        async for i in self._tokens(pending):
            if chat and i == 0:
                # vLLM opens a chat stream with the assistant role and empty content, in the same iteration
                # of its output loop as the first token: after the prefill, not when the request arrives
                # (only the headers go out at once).
                await resp.write(event({"index": 0, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}))
            piece = FILLER[i % len(FILLER)]
            last = i + 1 == req.max_tokens
            finish = "length" if last else None
            choice = ({"index": 0, "delta": {"content": piece}, "logprobs": None, "finish_reason": finish} if chat
                      else {"index": 0, "text": piece, "logprobs": None, "finish_reason": finish})
            await resp.write(event(choice))
        if include_usage:
            await resp.write(event(None, self._usage(req)))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _models(self, request: web.Request) -> web.Response:
        s = self.settings
        return web.json_response({"object": "list", "data": [{
            "id": name, "object": "model", "created": int(self._epoch), "owned_by": "vllm",
            "root": s.model_path or s.model, "parent": None, "max_model_len": s.max_model_len,
        } for name in (s.model, *s.aliases)] + [{  # vLLM lists adapters with their path and base model
            "id": name, "object": "model", "created": int(self._epoch), "owned_by": "vllm", "root": path,
            "parent": s.model, "max_model_len": None,
        } for name, path in s.lora_modules]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `POST /tokenize`: the token ids the engine would see for a `prompt` or a chat's `messages`,
        with the same tokenizer and chat template as the completion endpoints, so the ids match what the
        prefix cache sees (routers that build a prefix tree from them, vllm-router's cache_aware on a vLLM
        without render endpoints, then see what the engine sees)."""
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError as exc:
            return _vllm_error(400, f"invalid JSON body: {exc}", "BadRequestError")
        if not isinstance(body, dict):
            return _vllm_error(400, "request body must be a JSON object", "BadRequestError")
        model = body.get("model")
        if model is not None and not self.settings.serves(model):
            return _vllm_error(404, f"The model `{model}` does not exist.", "NotFoundError")
        try:
            if "messages" in body:
                generation_prompt = body.get("add_generation_prompt", True)
                continue_final = body.get("continue_final_message", False)
                if generation_prompt and continue_final:
                    raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
                text = render_chat(body["messages"], add_generation_prompt=bool(generation_prompt),
                                   continue_final_message=bool(continue_final))
            elif isinstance(body.get("prompt"), str):
                text = body["prompt"]
            else:
                raise ValueError("either `prompt` (a string) or `messages` (a list) is required")
        except ValueError as exc:
            return _vllm_error(400, str(exc), "BadRequestError")
        tokens = tokenize(text)
        return web.json_response({
            "count": len(tokens), "max_model_len": self.settings.max_model_len, "tokens": tokens,
            "token_strs": token_pieces(text) if body.get("return_token_strs") else None,
        })

    async def _scale_out_disabled(self, request: web.Request) -> web.Response:
        # vLLM registers its render endpoints always and, unless started with --enable-scale-out, answers
        # 403 (vllm/entrypoints/scale_out/factories.py). vllm-router's cache_aware asks one before every
        # request and, on this 403, routes on the request text (on a 404 it would ask /tokenize instead).
        return _vllm_error(403, "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to "
                           "enable them.", "PermissionDeniedError")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=503 if self.faults.unhealthy else 200)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(),
                            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _gpu(self, request: web.Request) -> web.Response:
        return web.json_response(self.gpu.sample())

    async def _faults(self, request: web.Request) -> web.Response:
        if request.method == "POST":
            try:
                changes = orjson.loads(await request.read())
                if not isinstance(changes, dict):
                    raise FaultError("body must be a JSON object of faults")
                self.faults.update(changes)
            except (orjson.JSONDecodeError, FaultError) as exc:
                return _vllm_error(400, str(exc), "BadRequestError")
            log.warning("faults injected", extra={"faults": self.faults.as_dict()})
        elif request.method == "DELETE":
            self.faults.reset()
            log.info("faults cleared")
        elif request.method != "GET":
            return _vllm_error(405, f"method {request.method} not allowed", "MethodNotAllowed")
        return web.json_response(self.faults.as_dict())


async def run_sim(settings: SimSettings, engine: EngineCore) -> None:
    """Serve until SIGTERM/SIGINT."""
    import signal

    server = SimServer(settings, engine)
    runner = web.AppRunner(server.build_app(), access_log=None, handler_cancellation=True, shutdown_timeout=2.0)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1] if site._server else settings.port  # type: ignore[union-attr]
    log.info("sim listening", extra={"url": f"http://{settings.host}:{port}", "model": settings.model,
                                      "gpu": settings.profile.name, "time_scale": settings.time_scale,
                                      "batching": settings.engine.batching})
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
