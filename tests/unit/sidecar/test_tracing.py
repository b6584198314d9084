"""The sidecar's OpenTelemetry spans, checked with the SDK's in-memory exporter through the
real aiohttp application, in front of a small in-process vLLM stand-in that streams."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Iterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from weighbridge.sidecar import tracing as tracing_module
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import ConfigError, Telemetry, parse_config
from weighbridge.sidecar.tracing import (
    NO_TRACE,
    RequestTrace,
    RequestTracing,
    Trace,
    tracer_provider,
)

KEY = "sk-trace-secret-key"
LIMITED_KEY = "sk-limited-secret"
PROMPT = "the secret prompt text nobody may see"
MODEL = "tiny-model"
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN = "b7ad6b7169203331"


class FakeVllm:
    """/health, /metrics (the series admission needs) and /v1/completions, streamed or not,
    answering ``output`` tokens with usage; records the headers of every completion."""

    def __init__(self, output: int = 5) -> None:
        self.output = output
        self.headers: list[dict[str, str]] = []
        self.app = web.Application()
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_post("/v1/completions", self.completions)

    async def health(self, _r: web.Request) -> web.Response:
        return web.Response(text="")

    async def metrics(self, _r: web.Request) -> web.Response:
        return web.Response(text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
                                 "vllm:generation_tokens_total 0\nvllm:prompt_tokens_total 0\n")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(dict(request.headers))
        body = await request.json()
        usage = {"prompt_tokens": 9, "completion_tokens": self.output,
                 "total_tokens": 9 + self.output}
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "text_completion", "model": MODEL,
                                      "choices": [{"index": 0, "text": "x" * self.output,
                                                   "finish_reason": "length"}],
                                      "usage": usage})
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i in range(self.output):
            chunk = {"id": "c", "object": "text_completion", "model": MODEL,
                     "choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: " + orjson.dumps({"id": "c", "choices": [],
                                                       "usage": usage}) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@pytest.fixture
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    provider = TracerProvider(shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider
    provider.shutdown()


def _config(backend_url: str, **extra: Any) -> Any:
    return parse_config({
        "backends": [{"url": backend_url, "name": "fake"}],
        "tenants": {
            "acme": {"tier": "standard", "api_keys": [f"plain:{KEY}"]},
            "limited": {"tier": "batch", "api_keys": [f"plain:{LIMITED_KEY}"],
                        "limits": {"requests_per_minute": 1}},
        },
        "admission": {"metrics_poll_ms": 50, "metrics_stale_ms": 1000},
        **extra,
    })


@pytest.fixture
async def backend() -> AsyncIterator[tuple[FakeVllm, str]]:
    fake = FakeVllm()
    server = TestServer(fake.app, host="127.0.0.1")
    await server.start_server()
    try:
        yield fake, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def _serve(sidecar: Sidecar) -> TestServer:
    server = TestServer(sidecar.app, host="127.0.0.1")
    await server.start_server()
    return server


async def _post(server: TestServer, key: str, body: dict[str, Any],
                headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
        server.make_url("/v1/completions"), json=body,
        headers={"authorization": f"Bearer {key}", **(headers or {})},
    ) as response:
        return response.status, await response.read()


def _by_name(spans: tuple[ReadableSpan, ...]) -> dict[str, ReadableSpan]:
    return {span.name: span for span in spans}


async def test_a_streamed_request_is_one_span_tree(backend: tuple[FakeVllm, str],
                                                  provider: TracerProvider,
                                                  exporter: InMemorySpanExporter) -> None:
    fake, url = backend
    sidecar = Sidecar(_config(url), tracing=RequestTracing(provider))
    server = await _serve(sidecar)
    try:
        status, body = await _post(
            server, KEY, {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True},
            {"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN}-01"})
    finally:
        await server.close()
    assert status == 200 and b"[DONE]" in body
    spans = _by_name(exporter.get_finished_spans())
    assert set(spans) == {f"text_completion {MODEL}", "weighbridge.admission",
                          "weighbridge.queue_wait", "weighbridge.backend_call"}
    root = spans[f"text_completion {MODEL}"]
    assert root.kind is SpanKind.SERVER
    # The client's trace continues through the sidecar.
    assert f"{root.context.trace_id:032x}" == TRACE_ID
    assert root.parent is not None and f"{root.parent.span_id:016x}" == PARENT_SPAN
    attributes = dict(root.attributes or {})
    assert attributes["gen_ai.operation.name"] == "text_completion"
    assert attributes["gen_ai.request.model"] == MODEL
    assert attributes["gen_ai.request.max_tokens"] == 5
    assert attributes["gen_ai.usage.input_tokens"] == 9  # the backend's usage, not the estimate
    assert attributes["gen_ai.usage.output_tokens"] == 5
    assert attributes["weighbridge.tenant"] == "acme"
    assert attributes["weighbridge.tier"] == "standard"
    assert attributes["weighbridge.outcome"] == "completed"
    assert attributes["http.response.status_code"] == 200
    assert root.status.status_code is StatusCode.UNSET
    assert [e.name for e in root.events] == ["first_token"]

    for name in ("weighbridge.admission", "weighbridge.queue_wait", "weighbridge.backend_call"):
        child = spans[name]
        assert child.parent is not None and child.parent.span_id == root.context.span_id, name
        assert child.context.trace_id == root.context.trace_id
        assert root.start_time <= child.start_time <= child.end_time <= root.end_time, name
    assert spans["weighbridge.admission"].attributes["weighbridge.admission.result"] == "queued"
    assert spans["weighbridge.queue_wait"].attributes["weighbridge.backend"] == "fake"
    call = spans["weighbridge.backend_call"]
    assert call.kind is SpanKind.CLIENT
    assert call.attributes["http.response.status_code"] == 200
    # Order: checks, then the queue, then the call; the first token comes during the call.
    assert spans["weighbridge.admission"].end_time <= spans["weighbridge.queue_wait"].start_time
    assert spans["weighbridge.queue_wait"].end_time <= call.start_time
    assert call.start_time <= root.events[0].timestamp <= call.end_time
    # The backend got the call's context (so vLLM's own spans join the trace).
    sent = fake.headers[-1]["traceparent"]
    assert sent == f"00-{TRACE_ID}-{call.context.span_id:016x}-01"


async def test_spans_never_carry_keys_or_prompts(backend: tuple[FakeVllm, str],
                                                 provider: TracerProvider,
                                                 exporter: InMemorySpanExporter) -> None:
    _, url = backend
    sidecar = Sidecar(_config(url), tracing=RequestTracing(provider))
    server = await _serve(sidecar)
    try:
        for stream in (True, False):
            status, _ = await _post(server, KEY, {"model": MODEL, "prompt": PROMPT,
                                                  "max_tokens": 5, "stream": stream})
            assert status == 200
        status, _ = await _post(server, "sk-wrong-key", {"prompt": PROMPT})
        assert status == 401
    finally:
        await server.close()
    spans = exporter.get_finished_spans()
    assert len(spans) == 4 + 4 + 1
    text = "\n".join(span.to_json() for span in spans)
    for secret in (KEY, "sk-wrong-key", PROMPT, "secret", "t0t1"):
        assert secret not in text


async def test_a_credentialed_backend_url_is_redacted_in_url_full(
        backend: tuple[FakeVllm, str], provider: TracerProvider,
        exporter: InMemorySpanExporter) -> None:
    # The operator's backend URL carries user:password: the call still goes out (the
    # upstream client reads only host and port), and url.full shows the URL as the HTTP
    # semantic conventions want it, with REDACTED:REDACTED for the userinfo.
    _, url = backend
    credentialed = url.replace("http://", "http://backend-user:backend-pass-123@", 1)
    sidecar = Sidecar(_config(credentialed), tracing=RequestTracing(provider))
    server = await _serve(sidecar)
    try:
        for stream in (True, False):
            status, _ = await _post(server, KEY, {"model": MODEL, "prompt": [1, 2],
                                                  "max_tokens": 2, "stream": stream})
            assert status == 200
    finally:
        await server.close()
    calls = [s for s in exporter.get_finished_spans() if s.name == "weighbridge.backend_call"]
    assert len(calls) == 2
    host = url.removeprefix("http://")
    for call in calls:
        assert call.attributes["url.full"] == f"http://REDACTED:REDACTED@{host}/v1/completions"
    text = "\n".join(span.to_json() for span in exporter.get_finished_spans())
    for secret in ("backend-user", "backend-pass-123"):
        assert secret not in text


def test_url_full_redacts_sensitive_query_values(
        provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    tracing = RequestTracing(provider)
    trace = tracing.start("/v1/completions", {})
    trace.backend_call("b", "https://u:p@edge.example:8443/v1/completions"
                            "?model=m&sig=abc123&X-Goog-Signature=def456", {})
    trace.end("completed", 200)
    (call,) = [s for s in exporter.get_finished_spans() if s.name == "weighbridge.backend_call"]
    assert call.attributes["url.full"] == (
        "https://REDACTED:REDACTED@edge.example:8443/v1/completions"
        "?model=m&sig=REDACTED&X-Goog-Signature=REDACTED")


async def test_rejections_and_non_streams_end_the_span_with_their_reason(
        backend: tuple[FakeVllm, str], provider: TracerProvider,
        exporter: InMemorySpanExporter) -> None:
    _, url = backend
    sidecar = Sidecar(_config(url), tracing=RequestTracing(provider))
    server = await _serve(sidecar)
    try:
        assert (await _post(server, LIMITED_KEY, {"model": MODEL, "prompt": [1, 2],
                                                  "max_tokens": 2}))[0] == 200
        assert (await _post(server, LIMITED_KEY, {"model": MODEL, "prompt": [1, 2],
                                                  "max_tokens": 2}))[0] == 429
        assert (await _post(server, "sk-nobody", {"prompt": [1]}))[0] == 401
        assert (await _post(server, KEY, {"prompt": [1], "max_tokens": 0}))[0] == 400
    finally:
        await server.close()
    roots = [s for s in exporter.get_finished_spans() if s.kind is SpanKind.SERVER]
    outcomes = [(r.attributes.get("weighbridge.outcome"), r.attributes.get("weighbridge.reason"),
                 r.attributes.get("http.response.status_code")) for r in roots]
    assert outcomes == [("completed", None, 200), ("rejected", "rate_limited", 429),
                        ("rejected", "unauthorized", 401),
                        ("rejected", "invalid_max_tokens", 400)]
    served, limited, unknown, _ = roots
    # A non-streaming answer: usage recorded, no first-token event (the sidecar cannot see it).
    assert served.attributes["gen_ai.usage.output_tokens"] == 5
    assert not served.events
    assert limited.attributes["weighbridge.tenant"] == "limited"
    assert limited.attributes["weighbridge.tier"] == "batch"
    assert "weighbridge.tenant" not in unknown.attributes
    admissions = [s for s in exporter.get_finished_spans() if s.name == "weighbridge.admission"]
    assert [a.attributes["weighbridge.admission.result"] for a in admissions] == [
        "queued", "rate_limited"]
    assert admissions[1].parent.span_id == limited.context.span_id


async def test_a_failing_backend_marks_the_span_as_an_error(
        provider: TracerProvider, exporter: InMemorySpanExporter) -> None:
    async def broken(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "boom"}}, status=500)

    fake = FakeVllm()
    app = web.Application()
    app.router.add_get("/health", fake.health)
    app.router.add_get("/metrics", fake.metrics)
    app.router.add_post("/v1/completions", broken)
    backend = TestServer(app, host="127.0.0.1")
    await backend.start_server()
    sidecar = Sidecar(_config(str(backend.make_url("")).rstrip("/")),
                      tracing=RequestTracing(provider))
    server = await _serve(sidecar)
    try:
        status, _ = await _post(server, KEY, {"model": MODEL, "prompt": [1], "max_tokens": 2})
    finally:
        await server.close()
        await backend.close()
    assert status == 500  # the backend's own answer passes through
    spans = _by_name(exporter.get_finished_spans())
    root = spans[f"text_completion {MODEL}"]
    assert root.attributes["weighbridge.outcome"] == "failed"
    assert root.status.status_code is StatusCode.ERROR
    assert spans["weighbridge.backend_call"].status.status_code is StatusCode.ERROR


async def test_tracing_off_builds_nothing_and_calls_nothing(
        backend: tuple[FakeVllm, str], monkeypatch: pytest.MonkeyPatch) -> None:
    _, url = backend
    config = _config(url)
    assert config.telemetry.otlp_endpoint is None
    assert tracer_provider(config.telemetry) is None

    def forbidden(*_args: object, **_kwargs: object) -> None:
        raise AssertionError("tracing code ran while tracing is off")

    # Every entry point of a trace: with tracing off none of them may run.
    monkeypatch.setattr(tracing_module.RequestTracing, "start", forbidden)
    for method in ("identify", "admission", "queued", "dispatched", "backend_call",
                   "first_token", "backend_done", "usage", "end"):
        monkeypatch.setattr(tracing_module.RequestTrace, method, forbidden)
    sidecar = Sidecar(config)
    assert sidecar.tracing is None
    server = await _serve(sidecar)
    try:
        for stream in (True, False):
            status, _ = await _post(server, KEY, {"model": MODEL, "prompt": [1, 2],
                                                  "max_tokens": 3, "stream": stream})
            assert status == 200
        assert (await _post(server, LIMITED_KEY, {"prompt": [1], "max_tokens": 1}))[0] == 200
        assert (await _post(server, LIMITED_KEY, {"prompt": [1], "max_tokens": 1}))[0] == 429
    finally:
        await server.close()


def test_telemetry_configuration() -> None:
    telemetry = Telemetry(otlp_endpoint="http://collector:4318/", sample_ratio=0.5)
    assert telemetry.traces_url == "http://collector:4318/v1/traces"
    assert Telemetry().traces_url is None
    provider = tracer_provider(Telemetry(otlp_endpoint="http://127.0.0.1:9",
                                         service_name="edge-1"))
    assert provider is not None
    try:
        assert provider.resource.attributes["service.name"] == "edge-1"
    finally:
        provider.shutdown()
    for bad, field in (({"sample_ratio": 0}, "telemetry.sample_ratio"),
                       ({"otlp_endpoint": "collector:4318"}, "telemetry.otlp_endpoint"),
                       ({"exporter": "grpc"}, "telemetry.exporter")):
        with pytest.raises(ConfigError) as error:
            parse_config({"backends": [{"url": "http://127.0.0.1:1"}], "telemetry": bad})
        assert field in str(error.value)


async def test_sampled_out_requests_record_nothing(backend: tuple[FakeVllm, str],
                                                  exporter: InMemorySpanExporter) -> None:
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    _, url = backend
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(0.0)),
                              shutdown_on_exit=False)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sidecar = Sidecar(_config(url), tracing=RequestTracing(provider))
    server = await _serve(sidecar)
    try:
        status, _ = await asyncio.wait_for(
            _post(server, KEY, {"prompt": [1], "max_tokens": 2, "stream": True}), 10)
    finally:
        await server.close()
        provider.shutdown()
    assert status == 200
    assert exporter.get_finished_spans() == ()


def test_the_no_op_trace_has_every_step_of_the_recording_one() -> None:
    # The HTTP shell calls a trace's steps unconditionally: the no-op one (tracing off) must
    # take every call the recording one takes, with the same parameters.
    steps = {name for name, value in vars(RequestTrace).items()
             if callable(value) and not name.startswith("_")}
    assert steps == {name for name, value in vars(Trace).items()
                     if callable(value) and not name.startswith("_")}
    for name in steps:
        assert (inspect.signature(getattr(Trace, name))
                == inspect.signature(getattr(RequestTrace, name))), name
    assert type(NO_TRACE) is Trace
