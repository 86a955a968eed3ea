"""The endpoint picker: Envoy's ext_proc `ExternalProcessor.Process`, one gRPC stream per HTTP request.

Envoy forwards the bytes; this only decides. A stream goes:
1. request headers: kept (model-independent checks need the body); the gateway's subset hint is read;
2. request body (BUFFERED: whole, `end_of_stream`): parsed exactly as the aiohttp router parses it, then the
   shared routing core (router/server/route.py) resolves a model alias, describes the request, estimates its cost,
   finds its session's pin, admission admits or sheds it, and the balancer picks (within the subset, if any).
   The answer sets the destination header and `envoy.lb` metadata (router/gateway/protocol.py), with the body
   rewritten for an alias's target (a body mutation and its content-length), or is an ImmediateResponse in
   the OpenAI error shape (400/404 refused, 429 shed, 503 no endpoint);
3. response headers: the gateway's served endpoint (a fallback may have answered) and the status: the outcome
   goes to health (>= 500 is a failure: outlier detection and breakers see it as they do behind the proxy);
4. the end: the request counts as in flight at its endpoint from the pick until the response body ends
   (`end_of_stream` with response body STREAMED), its trailers, or the stream's end (Envoy closes it when the
   HTTP stream ends; a cancelled stream too), whichever comes first.

Nothing here is a routing policy: the same pick, admission and health serve both data paths. What the proxy
does that the picker does not (yet): retries on other endpoints (the gateway's job, with a fallback list),
tenancy and budgets, routing explanations, stall detection, output-token learning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import orjson

from router.config.settings import PolicySpec
from router.gateway import protocol
from router.gateway.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from router.gateway.envoy_api.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from router.routing.aliases import Choice
from router.routing.prefill import Prefill
from router.runtime.errors import error_response
from router.server.context import RouterContext
from router.server.handlers import REQUEST_ID
from router.server.proxy import ENDPOINT_HEADER
from router.server.route import (
    Described,
    choose,
    describe,
    failed,
    no_endpoint,
    reject,
    requested_model,
    resolve_alias,
    session_pin,
    unknown_model,
)

log = logging.getLogger("fleetroute.epp")

CONTINUE_HEADERS = ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
CONTINUE_RESPONSE_BODY = ext_proc.ProcessingResponse(response_body=ext_proc.BodyResponse())


class EndpointPicker(ext_proc_grpc.ExternalProcessorServicer):
    """`fallbacks`: further endpoints after the pick in the destination list (0: the pick alone, which an
    ORIGINAL_DST cluster needs; a gateway with Envoy's override_host policy and retries can walk a list)."""

    def __init__(self, ctx: RouterContext, *, fallbacks: int = 0, test_hooks: bool = False) -> None:
        self._ctx = ctx
        self._fallbacks = fallbacks
        self._addresses = AddressBook(ctx)
        self._test_hooks = test_hooks  # the GIE conformance suite's hooks (router/gateway/protocol.py)

    async def Process(self, request_iterator: AsyncIterator[ext_proc.ProcessingRequest],  # noqa: N802 (gRPC's name)
                      context: grpc.aio.ServicerContext) -> None:
        # The context's read() and write() rather than iterating the requests and yielding the answers: grpc.aio
        # wraps each of those in an async generator of its own, two more generator steps per message.
        stream = _Stream(self._ctx, self._fallbacks, self._addresses, self._test_hooks)
        self._ctx.metrics.epp_streams.inc()
        try:
            while (message := await context.read()) is not grpc.aio.EOF:
                answer = await stream.handle(message)
                if answer is not None:
                    await context.write(answer)
        except asyncio.CancelledError:
            stream.cancelled = True
            raise
        finally:
            self._ctx.metrics.epp_streams.dec()
            stream.finish()


class AddressBook:
    """Which endpoint a gateway's "ip:port" names (the served endpoint): one lookup per response, the map rebuilt
    only when an address is not (or no longer) where it was."""

    def __init__(self, ctx: RouterContext) -> None:
        self._ctx = ctx
        self._by_address: dict[str, str] = {}

    def endpoint_at(self, address: str) -> str | None:
        found = self._by_address.get(address)
        if found is not None:
            endpoint = self._ctx.balancer.endpoint(found)
            if endpoint is not None and protocol.address(endpoint.url) == address:
                return found
        self._by_address = {protocol.address(e.url): e.id for e in self._ctx.balancer.endpoints()}
        return self._by_address.get(address)


class _Stream:
    """One HTTP request's ext_proc exchange and, once routed, its place in flight."""

    def __init__(self, ctx: RouterContext, fallbacks: int, addresses: AddressBook, test_hooks: bool = False) -> None:
        self.ctx = ctx
        self.fallbacks = fallbacks
        self.addresses = addresses
        self.test_hooks = test_hooks
        self.selection: tuple[str, ...] | None = None  # the conformance suite's candidates (test hooks only)
        self.started = time.perf_counter()
        self.headers: dict[str, str] = {}
        self.subset: tuple[str, ...] | None = None
        self.body: bytes = b""
        self.request_id = ""
        self.model = ""  # a served model (metric label)
        self.spec: PolicySpec | None = None
        self.endpoint = ""  # the endpoint counted in flight (the pick, or the one that served)
        self.picked = ""
        self.probe = False
        self.reported = False
        self.status: int | None = None  # the response's, once seen; or the picker's own refusal
        self.ttfb: float | None = None
        self.in_flight = contextlib.ExitStack()
        self.booked: Prefill | None = None  # prompt tokens pending at the endpoint until its answer begins
        self._cost = 0.0
        self.cancelled = False
        self.done = False

    async def handle(self, message: ext_proc.ProcessingRequest) -> ext_proc.ProcessingResponse | None:
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            self._start(protocol.headers_of(message.request_headers), message)
            if message.request_headers.end_of_stream:  # no body: nothing names a model
                return self._refuse(reject(self.ctx, 400, "request body must be a JSON object", code="invalid_json"),
                                    "invalid")
            return CONTINUE_HEADERS
        if kind == "request_body":
            part = message.request_body
            if part.end_of_stream and not self.body:  # BUFFERED: the whole body in one message, used as it is
                self.body = part.body
            else:
                self.body += part.body  # STREAMED chunks (bounded by max_body_bytes)
            if len(self.body) > self.ctx.settings.max_body_bytes:
                self.body = b""
                return self._refuse(reject(self.ctx, 413, f"request body is larger than "
                                                          f"{self.ctx.settings.max_body_bytes} bytes",
                                           code="body_too_large"), "invalid")
            if not part.end_of_stream:
                # Only in STREAMED mode, which this picker does not support for routing: Envoy has chosen the host
                # with the headers before the body's end can name the model (docs/gateway.md: use BUFFERED).
                return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse())
            return await self._decide()
        if kind == "request_trailers":
            return ext_proc.ProcessingResponse(request_trailers=ext_proc.TrailersResponse())
        if kind == "response_headers":
            return self._answered(message)
        if kind == "response_body":
            if message.response_body.end_of_stream:
                self.finish()
            return CONTINUE_RESPONSE_BODY
        if kind == "response_trailers":
            self.finish()
            return ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())
        return None

    def _start(self, headers: dict[str, str], message: ext_proc.ProcessingRequest) -> None:
        self.headers = headers
        given = headers.get("x-request-id")
        self.request_id = given if given and REQUEST_ID.match(given) else uuid.uuid4().hex
        self.subset = protocol.subset_hint(message)
        if self.test_hooks and headers.get(protocol.TEST_SELECTION):
            self.selection = tuple(v.strip() for v in headers[protocol.TEST_SELECTION].split(",") if v.strip())

    # ---- the decision ------------------------------------------------------------------------------------

    async def _decide(self) -> ext_proc.ProcessingResponse:
        ctx = self.ctx
        began = time.perf_counter()
        try:
            answer = await self._route()
        except Exception:
            log.exception("endpoint picker failed", extra={"request_id": self.request_id})
            answer = self._refuse(error_response(500, "internal router error; see the router log",
                                                 code="internal_error"), "error")
        ctx.metrics.epp_decision_seconds.observe(time.perf_counter() - began)
        return answer

    async def _route(self) -> ext_proc.ProcessingResponse:
        ctx = self.ctx
        body, self.body = self.body, b""
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            return self._refuse(reject(ctx, 400, f"request body is not valid JSON: {exc}", code="invalid_json"),
                                "invalid")
        model = requested_model(ctx, payload)
        if not isinstance(model, str):
            return self._refuse(model, "invalid")
        aliased = resolve_alias(ctx, model, self.request_id, self.headers, payload)
        rewritten: bytes | None = None  # a model alias's request: the body Envoy forwards names the target
        if aliased is not None and not isinstance(aliased, Choice):
            return self._refuse(aliased, "no_endpoint")
        if aliased is not None:
            assert aliased.target is not None
            model = aliased.target
            payload = {**payload, "model": model}
            rewritten = orjson.dumps(payload)
        unknown = unknown_model(ctx, model)
        if unknown is not None:
            return self._refuse(unknown, "invalid")
        self.model = model
        path = self.headers.get(":path", "").split("?", 1)[0]
        described = describe(ctx, model, self.request_id, self.headers, payload, path)
        spec = self.spec = described.spec
        pin = await session_pin(ctx, spec.name, described.info)
        admission = ctx.admission.pool(spec, model)
        if admission is not None:  # no await between admission and the in-flight count below
            shed = await admission.admit(self.request_id, self.headers, described.cost)
            if shed is not None:
                return self._refuse(shed, "shed")
        outside = self._outside_subset(model)
        denied: frozenset[str] = frozenset()
        view = None
        for _ in range(max(spec.retries.attempts, 1) + len(ctx.balancer.candidates(model))):
            excluded = outside | denied
            if admission is not None:
                excluded = admission.exclude(excluded)
            view = choose(ctx, described.info, excluded, pin)
            if view is None:
                break
            allowed, self.probe = ctx.balancer.acquire(spec, view.id)
            if allowed:
                break
            denied |= {view.id}  # its breaker is half-open and every probe slot is taken
            view = None
        if view is None:
            return self._refuse(no_endpoint(ctx, model), "no_endpoint")
        self._count(view.id, described)
        self.picked = view.id
        addresses = [protocol.address(view.endpoint.url), *self._fallback_addresses(model, excluded | {view.id})]
        ctx.metrics.child(ctx.metrics.epp_decisions, model, "routed").inc()
        if log.isEnabledFor(logging.DEBUG):  # not even the extra dict per request otherwise
            log.debug("routed", extra={"request_id": self.request_id, "model": model, "endpoint": view.id,
                                       "destination": addresses})
        # The engine logs the same request id as the picker (a generated one when the client sent none, or a bad one).
        common = protocol.destination(addresses, {"x-request-id": self.request_id}, body=rewritten)
        return ext_proc.ProcessingResponse(request_body=ext_proc.BodyResponse(response=common),
                                           dynamic_metadata=protocol.destination_metadata(addresses))

    def _outside_subset(self, model: str) -> frozenset[str]:
        """The pool's endpoints the gateway's subset hint (and, with the test hooks, the conformance suite's
        selection header) leaves out: none without either."""
        if self.subset is None and self.selection is None:
            return frozenset()
        allowed = set(self.subset) if self.subset is not None else None
        out = set()
        for view in self.ctx.balancer.candidates(model):
            url = view.endpoint.url
            if (allowed is not None and protocol.address(url) not in allowed) or (
                    self.selection is not None and not any(protocol.selected(v, url) for v in self.selection)):
                out.add(view.id)
        return frozenset(out)

    def _fallback_addresses(self, model: str, excluded: frozenset[str]) -> list[str]:
        """Up to `fallbacks` more routable endpoints, the least loaded first (a gateway retry walks them). Not
        the policy's picks: a pick teaches stateful policies (a prefix index) where the request went."""
        if self.fallbacks <= 0:
            return []
        loads = self.ctx.loads
        rest = sorted((v for v in self.ctx.balancer.candidates(model) if v.id not in excluded),
                      key=lambda v: (loads.cluster_in_flight(v.id), v.id))
        return [protocol.address(v.endpoint.url) for v in rest[:self.fallbacks]]

    def _count(self, endpoint_id: str, described: Described | None = None) -> None:
        """In flight at `endpoint_id` until the stream ends (moved when another endpoint served)."""
        cost = described.cost if described is not None else 0.0
        prefill = described.info.note.prefill_tokens if described is not None else 0.0
        self.booked = self.in_flight.enter_context(self.ctx.loads.track(endpoint_id, cost, prefill))
        self.endpoint = endpoint_id
        self._cost = cost

    def _refuse(self, response: Any, outcome: str) -> ext_proc.ProcessingResponse:
        self.status = response.status
        self.ctx.metrics.child(self.ctx.metrics.epp_decisions, self.model, outcome).inc()
        return protocol.immediate(response)

    # ---- the answer --------------------------------------------------------------------------------------

    def _answered(self, message: ext_proc.ProcessingRequest) -> ext_proc.ProcessingResponse:
        self.status = protocol.status_of(message.response_headers)
        self.ttfb = time.perf_counter() - self.started
        extra = {"x-request-id": self.request_id} if self.request_id else {}
        if self.booked is not None:  # the head says nothing of the engine's prefill speed (vLLM sends it at once)
            self.ctx.loads.prefill_done(self.booked, timed=False)
        if self.endpoint:
            served = protocol.served_address(message)
            served_id = self._endpoint_at(served) if served is not None else None
            if served_id is not None and served_id != self.endpoint:
                # A fallback of the list answered: the gateway moves on only when an attempt failed, so the pick
                # failed (its verdict goes to health), and the request is in flight at the fallback now.
                self.ctx.metrics.epp_served_elsewhere.inc()
                self._report(502, "connect")
                self.reported = False
                self.in_flight.close()
                self.in_flight = contextlib.ExitStack()
                self.in_flight.enter_context(self.ctx.loads.track(served_id, self._cost))
                self.endpoint, self.probe = served_id, False
            self._report(self.status)
            extra[ENDPOINT_HEADER] = self.endpoint
        if self.test_hooks:  # only the gateway's report, never the pick: a gateway that does not report fails
            extra[protocol.TEST_SERVED] = protocol.reported_served(message) or "fail: no served-endpoint metadata"
        if message.response_headers.end_of_stream:
            self.finish()
        return protocol.response_headers(extra)

    def _endpoint_at(self, address: str) -> str | None:
        return self.addresses.endpoint_at(address)

    def _report(self, status: int, kind: str = "http_5xx") -> None:
        """The answer's verdict on its endpoint (>= 500 is a failure), once per endpoint."""
        if self.reported or self.spec is None:
            return
        self.reported = True
        ok = not failed(status, None)
        self.ctx.balancer.report_outcome(self.spec, self.model, self.endpoint, ok, kind, probe=self.probe)

    def finish(self) -> None:
        """The request is over: its in-flight count ends, an unused probe slot is given back, it is counted
        and logged. Idempotent (the body's end, trailers and the stream's end may all come)."""
        if self.done:
            return
        self.done = True
        ctx = self.ctx
        self.in_flight.close()
        if self.endpoint and self.probe and not self.reported and self.spec is not None:
            ctx.balancer.release_probe(self.spec, self.endpoint)
        status = self.status if self.status is not None else 499  # the stream ended before any answer
        duration = time.perf_counter() - self.started
        if self.status is not None or self.endpoint:
            metrics = ctx.metrics
            metrics.child(metrics.requests, self.model, self.endpoint, str(status)).inc()
            if self.endpoint:
                metrics.child(metrics.request_duration, self.model, self.endpoint).observe(duration)
                if self.ttfb is not None:
                    metrics.child(metrics.time_to_first_byte, self.model, self.endpoint).observe(self.ttfb)
        if ctx.settings.access_log and (self.status is not None or self.endpoint):
            ctx.access_log.write({
                "request_id": self.request_id,
                "data_path": "ext_proc",
                "method": self.headers.get(":method"),
                "path": self.headers.get(":path"),
                "model": self.model,
                "picked": self.picked,
                "endpoint": self.endpoint,
                "status": status,
                "ttfb_ms": round(self.ttfb * 1000, 3) if self.ttfb is not None else None,
                "duration_ms": round(duration * 1000, 3),
                "cancelled": self.cancelled,
            })
