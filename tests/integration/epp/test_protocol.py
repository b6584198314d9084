"""The endpoint-picker protocol's MUSTs (GIE docs/proposals/004-endpoint-picker-protocol),
one test each, against a ``weighbridge epp`` process: this module is the data plane, sending
the ext_proc messages Envoy sends and reading the picker's answers, so the cases Envoy never
produces on its own (a subset hint as a list, the served endpoint read back) are covered too.
The same picker behind a real Envoy is test_envoy.py."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import orjson
import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.integration.epp.data_plane import (
    USAGE,
    Stream,
    bind,
    channel,
    destination,
    request_body,
    request_headers,
    response_headers,
)
from tests.support.ledger import ledger, settled
from tests.support.stack import completion, start_emulator, tenant
from tests.support.wait import await_for
from weighbridge.launch import epp_process, free_port

pytestmark = pytest.mark.timeout(90)

@dataclass(frozen=True)
class Picker:
    url: str  # its HTTP port: /metrics
    target: str  # its gRPC address
    engines: tuple[str, ...]  # the engines' ip:port
    log: Path  # the process's log


@pytest.fixture(scope="module")
def picker(processes: contextlib.ExitStack) -> Picker:
    engines = [start_emulator(processes) for _ in range(2)]
    process, port = epp_process({
        "tenants": {"a": tenant("interactive", "sk-a"),
                    # One request a minute: the second is shed.
                    "limited": tenant("batch", "sk-limited",
                                      limits={"requests_per_minute": 1})},
        "backends": [{"url": e.url} for e in engines],
        "admission": {"max_inflight_per_backend": 1},
    })
    processes.enter_context(process)
    assert process.log_path is not None
    return Picker(process.url, f"127.0.0.1:{port}",
                  tuple(e.url.removeprefix("http://") for e in engines), process.log_path)


@pytest.fixture
def drained(picker: Picker) -> Iterator[None]:
    """Every test leaves the picker with nothing queued or in flight, its ledger balanced."""
    yield
    settled(picker.url)


# -- the MUSTs ----------------------------------------------------------------------------


async def test_implements_ext_proc_in_full_duplex_streaming_mode(picker: Picker,
                                                                 drained: None) -> None:
    """MUST implement the ext_proc service and support its streaming mode: the held
    request-headers answer, then the body as a streamed body answer that ends the stream."""
    async with channel(picker.target) as stub:
        stream, headers = await bind(stub)
        assert headers.HasField("request_headers")
        body = await stream.read()
        streamed = body.request_body.response.body_mutation.streamed_response
        assert streamed.end_of_stream
        forwarded = orjson.loads(streamed.body)
        assert forwarded["prompt"] == [7] * 4 and forwarded["max_tokens"] == 2
        await stream.finish()


async def test_a_body_ended_by_trailers_is_answered_to_its_trailers(picker: Picker,
                                                                   drained: None) -> None:
    """A client's request with trailers: Envoy sends them after a body that has not ended,
    and waits for their answer."""
    async with channel(picker.target) as stub:
        stream = Stream(stub)
        stream.send(request_headers("sk-a"), request_body(orjson.dumps(completion(2)), end=False),
                    ext_proc.ProcessingRequest(request_trailers=ext_proc.HttpTrailers()))
        answers = [await stream.read() for _ in range(3)]
        assert [a.WhichOneof("response") for a in answers] == [
            "request_headers", "request_body", "request_trailers"]
        await stream.finish()


async def test_destination_in_header_and_metadata_alike(picker: Picker, drained: None) -> None:
    """MUST set x-gateway-destination-endpoint as a header and in dynamic_metadata
    envoy.lb, MUST not set two different values, and the value MUST be ip:port."""
    async with channel(picker.target) as stub:
        stream, answer = await bind(stub)
        header, metadata = destination(answer)
        assert header == metadata
        assert header in picker.engines
        host, _, port = header.rpartition(":")
        assert host.count(".") == 3 and port.isdigit()
        await stream.read()
        await stream.finish()


async def test_picks_only_from_the_subset_hint(picker: Picker, drained: None) -> None:
    """MUST pick only from x-gateway-destination-endpoint-subset when set: each engine named
    alone gets every request, as a list and as the comma-separated text Envoy's
    header-to-metadata filter writes."""
    async with channel(picker.target) as stub:
        for engine in picker.engines:
            for as_text in (False, True):
                for _ in range(3):
                    stream, answer = await bind(stub, subset=[engine, "10.255.0.1:8000"],
                                                subset_as_text=as_text)
                    assert destination(answer) == (engine, engine)
                    await stream.read()
                    await stream.finish()


async def test_503_when_no_subset_endpoint_is_eligible(picker: Picker, drained: None) -> None:
    """MUST answer ImmediateResponse 503 when none of the subset's endpoints is eligible or
    the list is empty."""
    before = ledger(picker.url)
    async with channel(picker.target) as stub:
        for subset in (["10.255.0.1:8000"], []):
            _stream, answer = await bind(stub, subset=subset)
            assert answer.immediate_response.status.code == 503
            error = orjson.loads(answer.immediate_response.body)["error"]
            assert error["code"] == "no_eligible_endpoint"
    delta = ledger(picker.url) - before
    assert delta.rejected == {"no_eligible_endpoint": 2} and delta.dispatched == 0


async def test_503_when_no_endpoint_is_ready(processes: contextlib.ExitStack) -> None:
    """MUST answer ImmediateResponse 503 when there are no ready endpoints: a picker whose
    only backend refuses every connection."""
    process, port = epp_process({"tenants": {"a": tenant("interactive", "sk-a")},
                                 "backends": [{"url": f"http://127.0.0.1:{free_port()}"}]})
    process.health_path = "/healthz"  # alive, never ready
    processes.enter_context(process)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        _stream, answer = await bind(ext_proc_grpc.ExternalProcessorStub(ch))
    assert answer.immediate_response.status.code == 503
    assert orjson.loads(answer.immediate_response.body)["error"]["code"] == \
        "no_eligible_endpoint"
    assert ledger(process.url).rejected == {"no_eligible_endpoint": 1}


async def test_picks_from_the_pool_without_a_hint(picker: Picker, drained: None) -> None:
    """MUST pick from the pool when no subset is set: two requests held at once (one slot an
    engine) go to both engines."""
    async with channel(picker.target) as stub:
        first, a = await bind(stub)
        second, b = await bind(stub)
        assert {destination(a)[0], destination(b)[0]} == set(picker.engines)
        for stream in (first, second):
            await stream.read()
            await stream.finish()


async def test_holds_the_request_until_its_dispatch(picker: Picker, drained: None) -> None:
    """Late binding: with every engine's one slot taken, a third request is queued in the
    core and its stream gets no answer; the first slot freed binds it."""
    async with channel(picker.target) as stub:
        first, _ = await bind(stub)
        second, _ = await bind(stub)
        for stream in (first, second):
            await stream.read()
        third = Stream(stub)
        third.send(request_headers("sk-a"), request_body(orjson.dumps(completion(2))))
        answer = asyncio.ensure_future(third.read())
        await await_for(lambda: ledger(picker.url).queued == 1, what="the third queued")
        # Queued in the core with both slots held by streams this test has not ended: no
        # dispatch can happen, so no answer can have been sent.
        assert not answer.done()
        await first.finish()
        bound = await answer
        assert bound.HasField("request_headers")
        await third.read()
        await third.finish()
        await second.finish()


async def test_429_to_shed(picker: Picker, drained: None) -> None:
    """MUST answer ImmediateResponse 429 for a request it drops: the tenant's second request
    in a minute of a one-request limit."""
    async with channel(picker.target) as stub:
        stream, answer = await bind(stub, key="sk-limited")
        assert answer.HasField("request_headers")
        await stream.read()
        await stream.finish()
        _stream, shed = await bind(stub, key="sk-limited")
    assert shed.immediate_response.status.code == 429
    assert orjson.loads(shed.immediate_response.body)["error"]["type"] == "rate_limit_error"
    retry = {h.header.key: h.header.raw_value.decode()
             for h in shed.immediate_response.headers.set_headers}
    assert int(retry["retry-after"]) >= 1


async def test_reads_the_served_endpoint(picker: Picker, drained: None) -> None:
    """The data plane MUST report the endpoint that served the request
    (envoy.lb x-gateway-destination-endpoint-served): the picker reads it, and counts a
    response served elsewhere than it bound (its log says so)."""
    async with channel(picker.target) as stub:
        stream, answer = await bind(stub)
        picked = destination(answer)[0]
        other = next(e for e in picker.engines if e != picked)
        await stream.read()
        stream.send(response_headers(served=other), ext_proc.ProcessingRequest(
            response_body=ext_proc.HttpBody(body=USAGE, end_of_stream=True)))
        await stream.read()
        await stream.read()
    await await_for(lambda: f"served {other} a request bound to {picked}"
                    in picker.log.read_text(), what="the picker's log")


@pytest.mark.parametrize("service", ["", "liveness", "readiness",
                                     "envoy.service.ext_proc.v3.ExternalProcessor"])
async def test_health_services(picker: Picker, service: str) -> None:
    """MUST serve the gRPC health checking protocol: liveness, readiness and the ext_proc
    service, SERVING while a backend is healthy."""
    async with grpc.aio.insecure_channel(picker.target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)

        status = None
        for _ in range(200):  # the health watch runs every second: at most 10 s here
            answer = await stub.Check(health_pb2.HealthCheckRequest(service=service))
            status = answer.status
            if status == health_pb2.HealthCheckResponse.SERVING:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"{service!r}: {status}")
