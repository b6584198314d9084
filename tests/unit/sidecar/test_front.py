"""sidecar.http1's front, in process: the generation endpoints it serves itself answer as
aiohttp's path does (status, headers, body), and every other request is handed with its
connection to aiohttp (405, 413, /healthz, a chunked body) — on the same keep-alive
connection too. The backend is an emulator on aiohttp's test server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.support.stack import auth, completion
from weighbridge.config import parse_config
from weighbridge.emulator.profiles import get_profile
from weighbridge.emulator.server import Emulator, EmulatorSettings
from weighbridge.launch import free_port
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.http1 import FrontSite

KEY = "sk-front"
MAX_BODY_BYTES = 4096
CLIENT_TIMEOUT_MS = 400


class Stack:
    def __init__(self, port: int, sidecar: Sidecar, aiohttp_client: TestClient[Any, Any]) -> None:
        self.port = port
        self.sidecar = sidecar  # served through the front
        self.aiohttp = aiohttp_client  # the same app, served by aiohttp alone

    async def exchange(self, raw: bytes, *, read_until_close: bool = False) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(raw)
            await writer.drain()
            if read_until_close:
                return await asyncio.wait_for(reader.read(), 10)
            return await read_response(reader)
        finally:
            writer.close()


async def read_response(reader: asyncio.StreamReader) -> bytes:
    """One whole HTTP/1.1 response (Content-Length or chunked)."""
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    headers = parse_head(head)[1]
    if headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readuntil(b"\r\n")).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if not size:
                break
            body += chunk[:-2]
        return head + body
    return head + await reader.readexactly(int(headers.get("content-length", "0")))


def parse_head(response: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(lines[0].split()[1]), headers, body


def post(path: str, body: bytes, *extra: str, key: str = KEY) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: sidecar", f"Authorization: Bearer {key}",
             "Content-Type: application/json", f"Content-Length: {len(body)}", *extra]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    engine = Emulator(EmulatorSettings(), get_profile("cpu-tiny"))
    async with TestServer(engine.app) as backend:
        config = parse_config({
            "tenants": {"t": {"tier": "standard", "api_keys": [f"plain:{KEY}"]}},
            "backends": [{"url": str(backend.make_url("")).rstrip("/")}],
            "max_body_bytes": MAX_BODY_BYTES,
            "client_timeout_ms": CLIENT_TIMEOUT_MS,
        })
        sidecar = Sidecar(config)
        runner = web.AppRunner(sidecar.app, access_log=None, handler_cancellation=True,
                               keepalive_timeout=CLIENT_TIMEOUT_MS / 1000)
        await runner.setup()
        port = free_port()
        await FrontSite(runner, "127.0.0.1", port, sidecar.front).start()
        try:
            async with TestClient(TestServer(Sidecar(config).app)) as other:
                yield Stack(port, sidecar, other)
        finally:
            await runner.cleanup()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_completion_answers_as_through_aiohttp(stack: Stack, stream: bool) -> None:
    body = orjson.dumps(completion(4, stream=stream))
    status, headers, payload = parse_head(await stack.exchange(post("/v1/completions", body)))
    theirs = await stack.aiohttp.post("/v1/completions", data=body,
                                      headers={**auth(KEY), "Content-Type": "application/json"})
    assert status == theirs.status == 200
    assert set(headers) == {name.lower() for name in theirs.headers}
    assert headers["server"] == theirs.headers["Server"]
    assert headers["content-type"] == theirs.headers["Content-Type"]
    their_payload = await theirs.read()
    if stream:
        assert headers["transfer-encoding"] == "chunked"
        events = [e for e in payload.split(b"\n\n") if e]
        assert len(events) == len([e for e in their_payload.split(b"\n\n") if e])
        assert events[-1] == b"data: [DONE]"
        assert all(b'"usage"' not in e for e in events)  # asked for by the sidecar, dropped
    else:
        assert int(headers["content-length"]) == len(payload)
        assert orjson.loads(payload)["usage"]["completion_tokens"] == 4


async def test_an_error_has_the_api_shape_and_the_connection_stays(stack: Stack) -> None:
    body = orjson.dumps(completion(4))
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
    try:
        writer.write(post("/v1/completions", body, key="sk-wrong"))
        status, headers, payload = parse_head(await read_response(reader))
        assert status == 401 and headers["x-weighbridge-reject-reason"] == "unauthorized"
        assert orjson.loads(payload)["error"]["code"] == "unauthorized"
        assert "connection" not in headers
        # The same connection: a completion, then requests aiohttp answers.
        writer.write(post("/v1/completions", body))
        assert parse_head(await read_response(reader))[0] == 200
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n\r\n")
        status, _, payload = parse_head(await read_response(reader))
        assert status == 200 and orjson.loads(payload) == {"status": "ok"}
        writer.write(post("/v1/completions", body))
        assert parse_head(await read_response(reader))[0] == 200
    finally:
        writer.close()


async def test_other_requests_are_aiohttp_s(stack: Stack) -> None:
    get = b"GET /v1/completions HTTP/1.1\r\nHost: sidecar\r\n\r\n"
    status, headers, _ = parse_head(await stack.exchange(get))
    assert status == 405 and headers["allow"] == "POST"
    big = b"{" + b" " * MAX_BODY_BYTES + b"}"
    status, headers, _ = parse_head(await stack.exchange(post("/v1/completions", big)))
    assert status == 413 and headers["x-weighbridge-reject-reason"] == "body_too_large"
    body = orjson.dumps(completion(4))
    chunked = (f"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\n"
               f"Authorization: Bearer {KEY}\r\nTransfer-Encoding: chunked\r\n\r\n"
               f"{len(body):x}\r\n").encode() + body + b"\r\n0\r\n\r\n"
    status, _, payload = parse_head(await stack.exchange(chunked))
    assert status == 200 and orjson.loads(payload)["usage"]["completion_tokens"] == 4
    # HTTP/1.0: aiohttp's, whose answer ends with the connection.
    old = post("/v1/completions", body).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    status, _, payload = parse_head(await stack.exchange(old, read_until_close=True))
    assert status == 200 and orjson.loads(payload)["usage"]["completion_tokens"] == 4


async def test_a_body_that_does_not_come_is_a_408_and_the_end(stack: Stack) -> None:
    head = post("/v1/completions", b"")[:-len(b"\r\n\r\n")].replace(
        b"Content-Length: 0", b"Content-Length: 100") + b"\r\n\r\n{"
    response = await stack.exchange(head, read_until_close=True)
    status, headers, payload = parse_head(response)
    assert status == 408 and headers["connection"] == "close"
    assert orjson.loads(payload)["error"]["code"] == "request_timeout"


async def test_a_client_that_leaves_mid_stream_cancels_its_request(stack: Stack) -> None:
    body = orjson.dumps(completion(900, stream=True))
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
    writer.write(post("/v1/completions", body))
    await reader.readuntil(b"data: ")  # the stream runs
    writer.close()
    ledger = stack.sidecar.core.ledger
    for _ in range(200):
        if ledger.total().cancelled:
            break
        await asyncio.sleep(0.02)
    total = ledger.total()
    assert total.cancelled == 1 and total.completed == 0
    # The backend's connection was dropped, which aborts the sequence there: the stream of
    # 900 tokens did not run to its end.
    assert stack.sidecar.core.stats(stack.sidecar.clock()).backends[0].inflight == 0


async def test_pipelined_requests_are_answered_in_order(stack: Stack) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", stack.port)
    try:
        writer.write(post("/v1/completions", orjson.dumps(completion(2, stream=True)))
                     + post("/v1/completions", orjson.dumps(completion(3)))
                     + b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\n\r\n")
        status, _, payload = parse_head(await read_response(reader))
        assert status == 200 and payload.endswith(b"data: [DONE]\n\n")
        status, _, payload = parse_head(await read_response(reader))
        assert status == 200 and orjson.loads(payload)["usage"]["completion_tokens"] == 3
        status, _, payload = parse_head(await read_response(reader))
        assert status == 200 and orjson.loads(payload) == {"status": "ok"}
    finally:
        writer.close()
