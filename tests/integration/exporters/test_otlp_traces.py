"""A real sidecar process with ``telemetry.otlp_endpoint`` set exports its spans over
OTLP/HTTP (protobuf) to a small receiver run by the test: the configuration path, the
exporter and the flush at shutdown, end to end."""

from __future__ import annotations

import gzip
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.support import loopback
from weighbridge.launch import emulator_process, free_port, sidecar_process

KEY = "sk-otlp-tenant"
PROMPT = "a prompt the trace must not contain"


class Receiver:
    """An OTLP/HTTP trace receiver on loopback: keeps every exported span."""

    def __init__(self) -> None:
        self.spans: list[dict[str, object]] = []
        self.raw: list[bytes] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces" and \
                    self.headers.get("content-type") == "application/x-protobuf"
                if ok:
                    receiver.take(ExportTraceServiceRequest.FromString(body), body)
                answer = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *_args: object) -> None:
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def take(self, request: ExportTraceServiceRequest, raw: bytes) -> None:
        with self.lock:
            self.raw.append(raw)
            for resource_spans in request.resource_spans:
                service = {a.key: a.value.string_value
                           for a in resource_spans.resource.attributes}.get("service.name")
                for scope in resource_spans.scope_spans:
                    for span in scope.spans:
                        attributes = {}
                        for a in span.attributes:
                            value = a.value
                            attributes[a.key] = (value.string_value or value.int_value
                                                 or value.bool_value)
                        self.spans.append({"service": service, "name": span.name,
                                           "trace_id": span.trace_id.hex(),
                                           "attributes": attributes,
                                           "events": [e.name for e in span.events]})

    def roots(self) -> list[dict[str, object]]:
        with self.lock:
            return [s for s in self.spans if "weighbridge.outcome" in s["attributes"]]

    def __enter__(self) -> Receiver:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with Receiver() as r:
        yield r


def _complete(url: str, stream: bool) -> None:
    response = loopback.post(url + "/v1/completions", timeout=30,
                          headers={"authorization": f"Bearer {KEY}"},
                          json={"model": "weighbridge-emulator", "prompt": PROMPT,
                                "max_tokens": 4, "ignore_eos": True, "stream": stream})
    assert response.status_code == 200, response.text


def test_a_configured_sidecar_exports_its_spans_over_otlp_http(receiver: Receiver) -> None:
    with emulator_process(max_num_seqs=4, max_num_batched_tokens=512, num_kv_blocks=256,
                          max_model_len=2048) as emulator:
        config = {
            "backends": [{"url": emulator.url, "name": "emu"}],
            "tenants": {"acme": {"tier": "standard", "api_keys": [f"plain:{KEY}"]}},
            "telemetry": {"otlp_endpoint": f"http://127.0.0.1:{receiver.port}",
                          "service_name": "sidecar-under-test"},
        }
        sidecar = sidecar_process(config).start()
        try:
            _complete(sidecar.url, stream=True)
            _complete(sidecar.url, stream=False)
            # The batch processor exports on its own schedule (5 s by default).
            deadline = time.monotonic() + 20
            while len(receiver.roots()) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert len(receiver.roots()) == 2, receiver.spans
            # A span still buffered when the sidecar stops is flushed on the way out.
            _complete(sidecar.url, stream=True)
        finally:
            sidecar.stop()
    roots = receiver.roots()
    assert len(roots) == 3, receiver.spans
    for root in roots:
        assert root["service"] == "sidecar-under-test"
        assert root["name"] == "text_completion weighbridge-emulator"
        attributes = root["attributes"]
        assert attributes["weighbridge.tenant"] == "acme"
        assert attributes["weighbridge.tier"] == "standard"
        assert attributes["gen_ai.request.model"] == "weighbridge-emulator"
        assert attributes["gen_ai.usage.output_tokens"] == 4
        assert attributes["gen_ai.usage.input_tokens"] > 0
        assert attributes["weighbridge.outcome"] == "completed"
    assert [r["events"] for r in roots] == [["first_token"], [], ["first_token"]]
    names = sorted(s["name"] for s in receiver.spans if s["trace_id"] == roots[0]["trace_id"])
    assert names == ["text_completion weighbridge-emulator", "weighbridge.admission",
                     "weighbridge.backend_call", "weighbridge.queue_wait"]
    for raw in receiver.raw:
        assert KEY.encode() not in raw and PROMPT.encode() not in raw
