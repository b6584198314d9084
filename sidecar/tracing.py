"""OpenTelemetry traces of the sidecar's requests: one span per request with the GenAI
semantic-convention attributes, and child spans for the ingress checks, the wait in the queue
and the backend call, plus an event at the first token.

Tracing is off unless ``telemetry.otlp_endpoint`` is configured. Off means no tracer provider
at all: the application holds ``None`` instead of a :class:`RequestTracing`, and each request
gets ``NO_TRACE``, a :class:`Trace` whose steps do nothing, so no call reaches OpenTelemetry
and the HTTP shell never asks whether tracing is on.

Spans carry counts, names and timings only — never an API key, a prompt or generated text,
nor the credentials a backend URL may hold (``weighbridge.redaction``).
The client's W3C ``traceparent`` (if any) parents the request's span, and the backend call
passes its own context on, so a vLLM started with ``--otlp-traces-endpoint`` joins the trace.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanLimits, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from weighbridge.endpoints import EndpointKind
from weighbridge.redaction import redact_url
from weighbridge.sidecar.config import Telemetry

TRACER_NAME = "weighbridge.sidecar"
# GenAI operation names of the proxied kinds: the semantic conventions' where they name one,
# else the kind's own name.
OPERATIONS = {EndpointKind.CHAT: "chat", EndpointKind.COMPLETIONS: "text_completion",
              EndpointKind.EMBEDDINGS: "embeddings", EndpointKind.POOLING: "pooling",
              EndpointKind.CLASSIFY: "classify", EndpointKind.SCORE: "score",
              EndpointKind.RERANK: "rerank"}
# A client chooses the model string; a long one must not bloat every span.
MAX_MODEL_CHARS = 256

_PROPAGATOR = TraceContextTextMapPropagator()


def tracer_provider(telemetry: Telemetry) -> TracerProvider | None:
    """The provider exporting spans over OTLP/HTTP (protobuf) as configured, or None (off)."""
    url = telemetry.traces_url
    if url is None:
        return None
    # Imported only when tracing is on: the exporter pulls in protobuf and requests.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    provider = TracerProvider(
        sampler=ParentBased(TraceIdRatioBased(telemetry.sample_ratio)),
        resource=Resource.create({"service.name": telemetry.service_name}),
        span_limits=SpanLimits(max_span_attribute_length=MAX_MODEL_CHARS),
        shutdown_on_exit=False,  # the application shuts it down (and flushes) itself
    )
    # The batch processor exports from its own thread: the event loop never waits on it.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
    return provider


class RequestTracing:
    """Starts a :class:`RequestTrace` per request; owns the provider's shutdown."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(TRACER_NAME)

    @classmethod
    def from_config(cls, telemetry: Telemetry) -> RequestTracing | None:
        provider = tracer_provider(telemetry)
        return None if provider is None else cls(provider)

    def start(self, endpoint: str, headers: Mapping[str, str]) -> RequestTrace:
        """The trace of a request that just arrived at ``endpoint`` (a path)."""
        parent = _PROPAGATOR.extract({"traceparent": headers.get("traceparent", ""),
                                      "tracestate": headers.get("tracestate", "")})
        kind = EndpointKind.of_path(endpoint)
        operation = "generate" if kind is None else OPERATIONS[kind]
        root = self.tracer.start_span(
            operation, context=parent, kind=SpanKind.SERVER,
            attributes={"gen_ai.operation.name": operation, "http.request.method": "POST",
                        "http.route": endpoint})
        return RequestTrace(self.tracer, root, operation)

    def shutdown(self) -> None:
        """Flush what is buffered and stop exporting (blocking: run it off the loop)."""
        self.provider.shutdown()


class Trace:
    """The steps of one request's trace, driven by the HTTP shell as the request moves along.
    This base records nothing (``NO_TRACE``, tracing off); :class:`RequestTrace` records
    spans."""

    def identify(self, *, tenant: str, tier: str, model: object,
                 max_tokens: int | None, stream: bool) -> None:
        """What the request is, once it passed authentication and validation."""

    def admission(self, start_ns: int, end_ns: int, result: str,
                  estimated_tokens: int | None) -> None:
        """The ingress checks, from ``start_ns`` to ``end_ns``, and their result."""

    def queued(self, attempt: int) -> None:
        """The request waits for a dispatch (again, after a backend refused it)."""

    def dispatched(self, backend: str, vllm_priority: int | None, over_share: bool) -> None:
        """The wait ended: the request goes to ``backend``."""

    def backend_call(self, backend: str, url: str, headers: dict[str, str]) -> None:
        """The backend call starts; ``headers`` are those sent upstream."""

    def first_token(self) -> None:
        """The first content chunk reached the client."""

    def backend_done(self, status: int | None, error: str | None = None) -> None:
        """The backend call ended."""

    def usage(self, input_tokens: int, output_tokens: int) -> None:
        """The tokens the request consumed."""

    def end(self, outcome: str, status: int | None = None, reason: str | None = None) -> None:
        """The request's single end (later calls are ignored)."""


NO_TRACE = Trace()


class RequestTrace(Trace):
    """The spans of one request."""

    def __init__(self, tracer: trace.Tracer, root: Span, operation: str) -> None:
        self.tracer = tracer
        self.root = root
        self.operation = operation
        self._context = trace.set_span_in_context(root)
        self._queue: Span | None = None
        self._backend: Span | None = None
        self._first_token = False
        self._ended = False

    def identify(self, *, tenant: str, tier: str, model: object,
                 max_tokens: int | None, stream: bool) -> None:
        attributes: dict[str, Any] = {"weighbridge.tenant": tenant, "weighbridge.tier": tier,
                                      "weighbridge.stream": stream}
        if isinstance(model, str):
            model = model[:MAX_MODEL_CHARS]
            attributes["gen_ai.request.model"] = model
            self.root.update_name(f"{self.operation} {model}")
        if max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = max_tokens
        self.root.set_attributes(attributes)

    def admission(self, start_ns: int, end_ns: int, result: str,
                  estimated_tokens: int | None) -> None:
        """The ingress checks (rate limit, early rejection, bounded queue), which run
        synchronously: recorded once they are done, with their real start and end."""
        span = self.tracer.start_span("weighbridge.admission", context=self._context,
                                      start_time=start_ns)
        span.set_attribute("weighbridge.admission.result", result)
        if estimated_tokens is not None:
            span.set_attribute("weighbridge.estimated_tokens", estimated_tokens)
        span.end(end_time=end_ns)

    def queued(self, attempt: int) -> None:
        self._queue = self.tracer.start_span("weighbridge.queue_wait", context=self._context,
                                             attributes={"weighbridge.attempt": attempt})

    def dispatched(self, backend: str, vllm_priority: int | None, over_share: bool) -> None:
        span = self._queue
        if span is None:
            return
        span.set_attributes({"weighbridge.backend": backend,
                             "weighbridge.over_share": over_share})
        if vllm_priority is not None:
            span.set_attribute("weighbridge.vllm_priority", vllm_priority)
        span.end()
        self._queue = None

    def backend_call(self, backend: str, url: str, headers: dict[str, str]) -> None:
        """The backend call starts; ``headers`` (those sent upstream) get its trace context.
        ``url.full`` is the URL without its credentials, as the HTTP conventions want."""
        self._backend = self.tracer.start_span(
            "weighbridge.backend_call", context=self._context, kind=SpanKind.CLIENT,
            attributes={"weighbridge.backend": backend, "url.full": redact_url(url)})
        _PROPAGATOR.inject(headers, context=trace.set_span_in_context(self._backend))

    def first_token(self) -> None:
        if not self._first_token:
            self._first_token = True
            self.root.add_event("first_token")

    def backend_done(self, status: int | None, error: str | None = None) -> None:
        span = self._backend
        if span is None:
            return
        if status is not None:
            span.set_attribute("http.response.status_code", status)
        if error is not None or (status is not None and status >= 500):
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()
        self._backend = None

    def usage(self, input_tokens: int, output_tokens: int) -> None:
        self.root.set_attributes({"gen_ai.usage.input_tokens": input_tokens,
                                  "gen_ai.usage.output_tokens": output_tokens})

    def end(self, outcome: str, status: int | None = None, reason: str | None = None) -> None:
        """The request's single end: ``completed``, ``rejected``, ``cancelled`` or
        ``failed``; ``reason`` is the reject reason or error code. Later calls are
        ignored (the shell ends the trace where it knows most, then again on its way out)."""
        if self._ended:
            return
        self._ended = True
        if self._queue is not None:  # left while queued
            self._queue.end()
            self._queue = None
        self.backend_done(None, None if outcome != "failed" else reason)
        root = self.root
        root.set_attribute("weighbridge.outcome", outcome)
        if status is not None:
            root.set_attribute("http.response.status_code", status)
        if reason is not None:
            root.set_attribute("weighbridge.reason", reason)
        if outcome == "failed" or (status is not None and status >= 500):
            root.set_status(Status(StatusCode.ERROR, reason))
            root.set_attribute("error.type", reason or str(status))
        root.end()
