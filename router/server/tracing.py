"""OpenTelemetry tracing: one trace per request, from the client through the router to the engine.

Off by default. Off, the request path holds no span objects: `Tracing.begin` returns `NO_TRACE`, whose methods do
nothing, and nothing of the OpenTelemetry SDK is imported. A client's own `traceparent`/`tracestate` then reach
the engine untouched, as any other header (the router is invisible in the trace).

On (a `tracing:` block with `enabled: true`), each inference request is a trace, continued from the client's W3C
`traceparent`/`tracestate` when it sent one, else started here, sampled parent-based: a sampled or unsampled
parent decides; without one, `sampleRatio` of trace ids are kept. Its spans:

- `POST <path>` (server): the whole request; attributes: model, request id, tenant, final status, endpoint,
  attempts, output and prompt tokens where the answer said;
- `admission` (internal): the wait in the admission queue, for policies that cap concurrency; `outcome` is
  `admitted` or the shed code;
- `pick` (internal), one per attempt: the decision summary (policy, strategy, chosen endpoint, reason in one word
  as the picker gave it, attempt number);
- `attempt` (client), one per endpoint tried: endpoint, outcome (`answered`, `connect`, `timeout`, `http_5xx`...),
  HTTP status; a `first_byte` event when the answer's first body byte arrives. The engine receives a
  `traceparent` naming this span as its parent (any `traceparent` from the client is replaced; its `tracestate`
  is kept, as W3C asks), so the engine's own spans, if it has any, sit under the attempt that reached it.

Spans are exported by the SDK's batch processor (a background thread: the exporter's HTTP calls never block the
event loop) over OTLP/HTTP protobuf to `endpoint`. Export results are counted in
`fleetroute_tracing_spans_exported_total{result}`, and requests by sampling decision in
`fleetroute_tracing_requests_total{sampled}`. A traced request's trace id is in its access log line and on the TTFT
histogram as an exemplar (router/server/handlers.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from router.config.fields import ConfigError, Fields, _secret

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
    from opentelemetry.trace import Span, Tracer

    from router.runtime.metrics import RouterMetrics

log = logging.getLogger("fleetroute.tracing")

DEFAULT_ENDPOINT = "http://127.0.0.1:4318/v1/traces"  # an OpenTelemetry Collector beside the router (OTLP/HTTP)


@dataclass(frozen=True)
class TracingSettings:
    """The top-level `tracing:` block."""

    enabled: bool = False
    endpoint: str = DEFAULT_ENDPOINT  # OTLP/HTTP traces URL (path included: /v1/traces)
    service_name: str = "fleetroute"  # the `service.name` resource attribute
    sample_ratio: float = 1.0  # share of new traces kept (a client's sampled flag decides for the traces it starts)
    headers: tuple[tuple[str, str], ...] = ()  # sent with every export (a collector's API key), from env or file
    timeout: float = 10.0  # per export call
    headers_source: str | None = None  # where the headers came from (for logs; never the values)


def parse_tracing(f: Fields) -> TracingSettings:
    d = TracingSettings()
    enabled = f.boolean("enabled", d.enabled)
    endpoint = f.string("endpoint", d.endpoint)
    if not endpoint.startswith(("http://", "https://")) or "://" not in endpoint or not endpoint.split("://", 1)[1]:
        raise ConfigError(f.at("endpoint"), f"must be an http:// or https:// URL like {DEFAULT_ENDPOINT}, "
                                            f"got {endpoint!r}")
    service_name = f.string("serviceName", d.service_name)
    sample_ratio = f.number("sampleRatio", d.sample_ratio, minimum=0.0, maximum=1.0)
    timeout = f.duration("timeout", d.timeout)
    raw, source = _secret(f, "headers")
    headers = _parse_headers(raw, f.at("headersEnv" if source and source.startswith("$") else "headersFile")) \
        if raw is not None else ()
    f.done()
    if enabled:
        _check_exporter(f.at("enabled"))
    return TracingSettings(enabled=enabled, endpoint=endpoint, service_name=service_name, sample_ratio=sample_ratio,
                           headers=headers, timeout=timeout, headers_source=source)


def _check_exporter(where: str) -> None:
    """Tracing on needs the OTLP exporter importable: say why at start-up (exit 2), not at the first export."""
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: F401
    except ImportError as exc:
        hint = ""
        if "InstrumentationScope" in str(exc):
            # xds-protos (Envoy's API protos) ships an old copy of the same files and may overwrite them
            # (grpc/grpc#42926, open-telemetry/opentelemetry-python#4843).
            hint = ("; opentelemetry-proto's files were overwritten by an older copy (xds-protos ships one): "
                    "pip install --force-reinstall --no-deps opentelemetry-proto")
        raise ConfigError(where, f"tracing needs the OTLP exporter, which cannot be imported: {exc}{hint}") from None


def _parse_headers(raw: str, where: str) -> tuple[tuple[str, str], ...]:
    """`name=value,name=value` (the OTEL_EXPORTER_OTLP_HEADERS form)."""
    out = []
    for item in raw.split(","):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not name or not value or not name.isascii() or any(c in name for c in " :\r\n") \
                or any(c in value for c in "\r\n"):
            raise ConfigError(where, "must hold name=value pairs separated by commas (values not shown)")
        out.append((name, value))
    return tuple(out)


class RequestTrace:
    """One request's spans. `NO_TRACE` (tracing off) is the same interface doing nothing."""

    __slots__ = ()
    trace_id: str | None = None  # 32 hex digits when the request is traced and sampled
    recording = False

    def admission_began(self) -> None: ...
    def admission_ended(self, outcome: str) -> None: ...
    def pick_began(self) -> None: ...
    def picked(self, attempt: int, policy: str, strategy: str, endpoint: str | None, reason: str) -> None: ...
    def attempt_began(self, attempt: int, endpoint: str) -> Mapping[str, str] | None:
        return None
    def first_byte(self) -> None: ...
    def attempt_ended(self, outcome: str, status: int | None) -> None: ...
    def end(self, status: int, attributes: Mapping[str, Any]) -> None: ...


NO_TRACE = RequestTrace()


class Tracing:
    """Tracing off: every request gets `NO_TRACE`."""

    enabled = False

    def begin(self, headers: Mapping[str, str], method: str, path: str, request_id: str) -> RequestTrace:
        return NO_TRACE

    def shutdown(self) -> None: ...


class _SpanTrace(RequestTrace):
    __slots__ = ("_otel", "_tracer", "_server", "_context", "_admission", "_pick_started", "_attempt",
                 "trace_id", "recording")

    def __init__(self, otel: _Otel, tracer: Tracer, server: Span) -> None:
        self._otel = otel
        self._tracer = tracer
        self._server = server
        self._context = otel.trace.set_span_in_context(server)
        self._admission: Span | None = None
        self._pick_started = 0
        self._attempt: Span | None = None
        context = server.get_span_context()
        self.recording = server.is_recording()
        self.trace_id = otel.trace.format_trace_id(context.trace_id) if context.trace_flags.sampled else None

    def admission_began(self) -> None:
        if self.recording:
            self._admission = self._tracer.start_span("admission", context=self._context)

    def admission_ended(self, outcome: str) -> None:
        if self._admission is not None:
            self._admission.set_attribute("fleetroute.admission.outcome", outcome)
            self._admission.end()
            self._admission = None

    def pick_began(self) -> None:
        if self.recording:
            self._pick_started = time.time_ns()

    def picked(self, attempt: int, policy: str, strategy: str, endpoint: str | None, reason: str) -> None:
        if not self.recording:
            return
        span = self._tracer.start_span("pick", context=self._context, start_time=self._pick_started or None,
                                       attributes={"fleetroute.attempt": attempt, "fleetroute.policy": policy,
                                                   "fleetroute.strategy": strategy,
                                                   "fleetroute.endpoint": endpoint or "",
                                                   "fleetroute.pick.reason": reason or "",
                                                   "fleetroute.pick.found": endpoint is not None})
        span.end()

    def attempt_began(self, attempt: int, endpoint: str) -> Mapping[str, str]:
        otel = self._otel
        carrier: dict[str, str] = {}
        if not self.recording:  # unsampled: pass the (unrecorded) context on, flag clear, with no spans of its own
            otel.propagator.inject(carrier, context=self._context)
            return carrier
        span = self._attempt = self._tracer.start_span(
            "attempt", context=self._context, kind=otel.trace.SpanKind.CLIENT,
            attributes={"fleetroute.attempt": attempt, "fleetroute.endpoint": endpoint})
        otel.propagator.inject(carrier, context=otel.trace.set_span_in_context(span))
        return carrier

    def first_byte(self) -> None:
        if self._attempt is not None:
            self._attempt.add_event("first_byte")

    def attempt_ended(self, outcome: str, status: int | None) -> None:
        span = self._attempt
        if span is None:
            return
        span.set_attribute("fleetroute.outcome", outcome)
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        # The client leaving is not the endpoint failing (as for outlier detection: router/server/handlers.py).
        if outcome not in ("answered", "client_disconnect") or (status is not None and status >= 500):
            span.set_status(self._otel.trace.StatusCode.ERROR, outcome)
        span.end()
        self._attempt = None

    def end(self, status: int, attributes: Mapping[str, Any]) -> None:
        if self._admission is not None:  # the handler was interrupted while queued
            self.admission_ended("interrupted")
        if self._attempt is not None:
            self.attempt_ended("interrupted", None)
        server = self._server
        server.set_attribute("http.response.status_code", status)
        for key, value in attributes.items():
            if value is not None:
                server.set_attribute(key, value)
        if status >= 500:
            server.set_status(self._otel.trace.StatusCode.ERROR)
        server.end()


class _Otel:
    """The OpenTelemetry API pieces, imported only when tracing is on."""

    def __init__(self) -> None:
        from opentelemetry import trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.trace = trace
        self.propagator = TraceContextTextMapPropagator()


class OtelTracing(Tracing):
    enabled = True

    def __init__(self, provider: TracerProvider, metrics: RouterMetrics | None = None) -> None:
        self._otel = _Otel()
        self._provider = provider
        self._tracer = provider.get_tracer("fleetroute")
        self._sampled = self._unsampled = None
        if metrics is not None:
            self._sampled = metrics.tracing_requests.labels("true")
            self._unsampled = metrics.tracing_requests.labels("false")

    def begin(self, headers: Mapping[str, str], method: str, path: str, request_id: str) -> RequestTrace:
        otel = self._otel
        parent = otel.propagator.extract(headers)  # an invalid traceparent is ignored: a new trace starts
        span = self._tracer.start_span(f"{method} {path}", context=parent, kind=otel.trace.SpanKind.SERVER,
                                       attributes={"http.request.method": method, "url.path": path,
                                                   "fleetroute.request_id": request_id})
        trace = _SpanTrace(otel, self._tracer, span)
        counter = self._sampled if trace.recording else self._unsampled
        if counter is not None:
            counter.inc()
        return trace

    def shutdown(self) -> None:
        self._provider.shutdown()  # flushes what the batch processor holds (bounded by the exporter's timeout)


def build_tracing(settings: TracingSettings, metrics: RouterMetrics,
                  exporter: SpanExporter | None = None) -> Tracing:
    """The process's tracing. `exporter` replaces OTLP (tests pass the SDK's InMemorySpanExporter; spans are then
    handed over synchronously, as each ends)."""
    if not settings.enabled:
        return Tracing()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    # shutdown_on_exit off: the app's cleanup shuts it down (an atexit hook would also keep every test's alive).
    provider = TracerProvider(resource=Resource.create({"service.name": settings.service_name}),
                              sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)), shutdown_on_exit=False)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(_Counted(exporter, metrics)))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        otlp = OTLPSpanExporter(endpoint=settings.endpoint, headers=dict(settings.headers), timeout=settings.timeout)
        provider.add_span_processor(BatchSpanProcessor(_Counted(otlp, metrics)))
    log.info("tracing on", extra={"endpoint": settings.endpoint, "service_name": settings.service_name,
                                  "sample_ratio": settings.sample_ratio, "headers_from": settings.headers_source})
    return OtelTracing(provider, metrics)


class _Counted:
    """An exporter that counts what it exported and what failed (the batch processor only logs failures)."""

    def __init__(self, inner: SpanExporter, metrics: RouterMetrics) -> None:
        self._inner = inner
        self._metrics = metrics

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        from opentelemetry.sdk.trace.export import SpanExportResult

        result = self._inner.export(spans)
        outcome = "success" if result is SpanExportResult.SUCCESS else "failure"
        self._metrics.tracing_spans_exported.labels(outcome).inc(len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)
