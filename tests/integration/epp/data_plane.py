"""The data plane's side of the ext_proc protocol, for tests that talk to a picker directly:
the messages Envoy sends (request headers with their metadata, bodies, response headers) and
one stream's sends and reads."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import grpc
import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from google.protobuf import struct_pb2

from tests.support.stack import completion

DESTINATION = "x-gateway-destination-endpoint"
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
USAGE = orjson.dumps({"choices": [{"text": "hi"}],
                      "usage": {"prompt_tokens": 4, "completion_tokens": 2}})


def request_headers(key: str | None, path: str = "/v1/completions",
                    subset: Sequence[str] | None = None, subset_as_text: bool = False,
                    headers: Mapping[str, str] | None = None,
                    metadata: Mapping[str, Mapping[str, Any]] | None = None
                    ) -> ext_proc.ProcessingRequest:
    """A POST's request headers as Envoy sends them: ``key`` as a bearer (None: no
    authorization), more ``headers``, the subset hint and other filters' ``metadata``."""
    pairs = [(":method", "POST"), (":path", path), ("content-type", "application/json")]
    if key is not None:
        pairs.append(("authorization", f"Bearer {key}"))
    pairs += list((headers or {}).items())
    message = ext_proc.ProcessingRequest(
        request_headers=ext_proc.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs])),
        protocol_config=ext_proc.ProtocolConfiguration(request_body_mode=FULL_DUPLEX,
                                                       response_body_mode=FULL_DUPLEX))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset":
                     ",".join(subset) if subset_as_text else list(subset)})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    for namespace, values in (metadata or {}).items():
        struct = struct_pb2.Struct()
        struct.update(dict(values))
        message.metadata_context.filter_metadata[namespace].CopyFrom(struct)
    return message


def request_body(data: bytes, end: bool = True) -> ext_proc.ProcessingRequest:
    return ext_proc.ProcessingRequest(request_body=ext_proc.HttpBody(body=data,
                                                                     end_of_stream=end))


def response_headers(status: int = 200, served: str | None = None
                     ) -> ext_proc.ProcessingRequest:
    message = ext_proc.ProcessingRequest(response_headers=ext_proc.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=":status", raw_value=str(status).encode()),
            base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")])))
    if served is not None:
        lb = struct_pb2.Struct()
        lb.update({"x-gateway-destination-endpoint-served": served})
        message.metadata_context.filter_metadata["envoy.lb"].CopyFrom(lb)
    return message


class Stream:
    """One ext_proc stream: the messages sent, the answers read."""

    def __init__(self, stub: ext_proc_grpc.ExternalProcessorStub) -> None:
        self._outbox: asyncio.Queue[ext_proc.ProcessingRequest | None] = asyncio.Queue()
        self.call = stub.Process(self._messages())

    async def _messages(self) -> AsyncIterator[ext_proc.ProcessingRequest]:
        while (message := await self._outbox.get()) is not None:
            yield message

    def send(self, *messages: ext_proc.ProcessingRequest) -> None:
        for message in messages:
            self._outbox.put_nowait(message)

    async def read(self) -> ext_proc.ProcessingResponse:
        answer = await self.call.read()
        assert answer is not grpc.aio.EOF
        return answer

    async def finish(self) -> dict[str, str]:
        """The response's end, as Envoy ends a completed request: usage, then half-close;
        the headers the picker set on the response."""
        self.send(response_headers(), ext_proc.ProcessingRequest(
            response_body=ext_proc.HttpBody(body=USAGE, end_of_stream=True)))
        headers = await self.read()
        await self.read()
        self._outbox.put_nowait(None)
        return {h.header.key: h.header.raw_value.decode()
                for h in headers.response_headers.response.header_mutation.set_headers}


@contextlib.asynccontextmanager
async def channel(target: str) -> AsyncIterator[ext_proc_grpc.ExternalProcessorStub]:
    async with grpc.aio.insecure_channel(target) as ch:
        yield ext_proc_grpc.ExternalProcessorStub(ch)


async def bind(stub: ext_proc_grpc.ExternalProcessorStub, key: str | None = "sk-a",
               **headers: Any) -> tuple[Stream, ext_proc.ProcessingResponse]:
    """A 2-token completion's request sent whole; the stream and the picker's first answer
    (its binding, or its refusal). ``headers``: ``request_headers``' other arguments."""
    stream = Stream(stub)
    stream.send(request_headers(key, **headers), request_body(orjson.dumps(completion(2))))
    return stream, await stream.read()


def destination(answer: ext_proc.ProcessingResponse) -> tuple[str, str]:
    """The endpoint in the header mutation and in ``envoy.lb``."""
    header = {h.header.key: h.header.raw_value.decode()
              for h in answer.request_headers.response.header_mutation.set_headers}
    metadata = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return header[DESTINATION], metadata[DESTINATION].string_value
