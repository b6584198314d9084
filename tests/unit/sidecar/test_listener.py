"""sidecar.listener in process: the real ``Sidecar`` app behind its own listening site on
loopback. Connections beyond ``max_client_connections`` are answered 503, and a head that
aiohttp's parser refuses is answered and logged without quoting a byte of it (the key it may
carry). The backend is an address nothing listens on: nothing here needs one."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import orjson
import pytest
from aiohttp import web

from weighbridge.launch import free_port
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.listener import ClientSite

KEY = "sk-listener-secret-9f3c"
MAX_CONNECTIONS = 2


@dataclass
class Served:
    port: int
    site: ClientSite


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    config = parse_config({
        "tenants": {"t": {"tier": "standard", "api_keys": [f"plain:{KEY}"]}},
        "backends": [{"url": f"http://127.0.0.1:{free_port()}"}],
        "max_client_connections": MAX_CONNECTIONS,
    })
    runner = web.AppRunner(Sidecar(config).app, access_log=None, handler_cancellation=True)
    await runner.setup()
    port = free_port()
    site = ClientSite(runner, "127.0.0.1", port, max_connections=MAX_CONNECTIONS,
                      keepalive_timeout=30)
    await site.start()
    try:
        yield Served(port, site)
    finally:
        await runner.cleanup()


async def exchange(port: int, raw: bytes) -> bytes:
    """Send ``raw`` on a new connection and read until the server closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        await writer.drain()
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def head_and_body(answer: bytes) -> tuple[bytes, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


HEALTHZ = b"GET /healthz HTTP/1.1\r\nHost: sidecar\r\nConnection: close\r\n\r\n"


async def test_a_connection_beyond_the_cap_is_answered_503(served: Served) -> None:
    held = [await asyncio.open_connection("127.0.0.1", served.port)
            for _ in range(MAX_CONNECTIONS)]
    try:
        connections = served.site.connections
        assert connections is not None
        while connections.open < MAX_CONNECTIONS:  # accepted in this same loop
            await asyncio.sleep(0)
        head, body = head_and_body(await exchange(served.port, HEALTHZ))
        assert head.startswith(b"HTTP/1.1 503 "), head
        assert b"x-weighbridge-reject-reason: too_many_connections" in head.lower()
        assert b"retry-after: 1" in head.lower()
        assert orjson.loads(body)["error"]["code"] == "too_many_connections"
        # One held connection closes: its place is free for the next client.
        _, writer = held.pop()
        writer.close()
        await writer.wait_closed()
        while connections.open >= MAX_CONNECTIONS:
            await asyncio.sleep(0)
        head, _ = head_and_body(await exchange(served.port, HEALTHZ))
        assert head.startswith(b"HTTP/1.1 200 "), head
    finally:
        for _, writer in held:
            writer.close()


# Heads aiohttp's parser refuses, each carrying the key: a key file with CRLF line ends, a
# NUL after the key, a space before the colon, bare LF line ends, a control character.
MALFORMED_HEADS = {
    "cr-after-key": f"Authorization: Bearer {KEY}\r\r\n",
    "nul-after-key": f"Authorization: Bearer {KEY}\x00\r\n",
    "space-before-colon": f"Authorization : Bearer {KEY}\r\n",
    "control-in-value": f"Authorization: Bearer {KEY}\x01\r\n",
}


@pytest.mark.parametrize("line", MALFORMED_HEADS.values(), ids=MALFORMED_HEADS.keys())
async def test_a_refused_head_quotes_nothing(served: Served, line: str,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: sidecar\r\n" + line.encode("latin-1")
           + b"Content-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
    head, body = head_and_body(await exchange(served.port, raw))
    assert head.split(b" ")[1] == b"400", head  # aiohttp answers a refused head in HTTP/1.0
    error = orjson.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "bad_request"
    assert KEY.encode() not in head + body
    logged = "\n".join(record.getMessage() + (caplog.text if record.exc_info else "")
                       for record in caplog.records) + caplog.text
    assert "malformed request" in logged  # the refusal is logged ...
    assert KEY not in logged  # ... without the key


async def test_a_bare_lf_head_quotes_nothing(served: Served,
                                             caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    raw = (f"POST /v1/completions HTTP/1.1\nHost: sidecar\nAuthorization: Bearer {KEY}\n"
           "Content-Length: 2\n\n{}").encode()
    answer = await exchange(served.port, raw)
    assert KEY.encode() not in answer
    assert KEY not in caplog.text


def request(*header_lines: str) -> bytes:
    return ("GET /healthz HTTP/1.1\r\n" + "".join(f"{h}\r\n" for h in header_lines)
            + "\r\n").encode()


# What the review found a hand-written front serving, each refused by aiohttp's own rules.
REFUSED_HEADS = {
    "no-host": request("Connection: close"),
    "two-hosts": request("Host: a", "Host: b", "Connection: close"),
    "8000-headers": request("Host: a", *(f"X-{i}: v" for i in range(8000))),
    "60kb-line": request("Host: a", "X-Long: " + "v" * 60_000),
}


@pytest.mark.parametrize("raw", REFUSED_HEADS.values(), ids=REFUSED_HEADS.keys())
async def test_heads_http_s_rules_refuse_are_400(served: Served, raw: bytes) -> None:
    head, body = head_and_body(await exchange(served.port, raw))
    assert head.split(b" ")[1] == b"400", head
    assert orjson.loads(body)["error"]["code"] == "bad_request"



async def test_a_later_keep_alive_does_not_undo_connection_close(served: Served) -> None:
    """Connection: close, then keep-alive: answered, and the connection ends after the
    answer (exchange reads until the server closes; a kept connection would time out)."""
    answer = await exchange(served.port, request("Host: a", "Connection: close",
                                                 "Connection: keep-alive"))
    assert answer.startswith(b"HTTP/1.1 200 "), answer


async def test_a_401_from_the_head_alone_keeps_the_connection_for_the_body(
        served: Served) -> None:
    """The key is refused before the body is read; the body that follows is read and
    discarded (aiohttp's lingering read), not met with a reset, and the connection answers
    the next request."""
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: s\r\nAuthorization: Bearer nope"
                     b"\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n")
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 401 "), head
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        await asyncio.wait_for(reader.readexactly(length), 10)
        writer.write(b'{"prompt": [1]}' + HEALTHZ)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
    finally:
        writer.close()
