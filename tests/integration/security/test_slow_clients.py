"""Slow clients cannot hold the sidecar: headers dribbled byte by byte are cut off after
``client_timeout_ms`` (by closing the connection), a body after ``client_body_timeout_ms``
(a 408 ``request_timeout``, counted as a rejection), a crowd of dribblers costs bounded
memory, and the sidecar serves everyone else meanwhile.

Oversized bodies (413, also while reading a chunked body), deep JSON and invalid UTF-8 are
in tests/integration/sidecar/test_bad_input.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from tests.support import loopback
from tests.support.answers import assert_rejected, assert_served
from tests.support.chaos import rss_bytes
from tests.support.ledger import ledger, settled
from tests.support.stack import (
    Stack,
    auth,
    completion,
    start_stack,
    tenant,
)

pytestmark = pytest.mark.timeout(90)

KEY = "sk-slow-client"
TIMEOUT_MS = 1500
DRIP_S = 0.1  # one byte every 100 ms


@pytest.fixture(scope="module")
def stack(processes: contextlib.ExitStack) -> Stack:
    return start_stack(processes, {
        "tenants": {"t": tenant("standard", KEY)},
        "client_timeout_ms": TIMEOUT_MS,
        "client_body_timeout_ms": TIMEOUT_MS,  # the same bound for the head and the body
    })


async def dribble(url: str, head: bytes, drip: bytes, limit_s: float) -> tuple[bytes, float]:
    """Send ``head`` at once, then ``drip`` a byte at a time until the server answers or
    closes; returns what it answered (b"" for a close) and after how long."""
    target = httpx.URL(url)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    started = time.monotonic()
    try:
        writer.write(head)
        await writer.drain()
        for i in range(len(drip)):
            if time.monotonic() - started > limit_s:
                raise AssertionError(f"still connected after {limit_s} s")
            try:
                writer.write(drip[i:i + 1])
                await writer.drain()
            except ConnectionError:
                return b"", time.monotonic() - started
            try:
                answer = await asyncio.wait_for(reader.read(4096), DRIP_S)
                return answer, time.monotonic() - started
            except TimeoutError:
                continue
        raise AssertionError("ran out of bytes to dribble")
    finally:
        writer.transport.abort()


def head_of(url: str, length: int) -> bytes:
    host = httpx.URL(url).host
    return (f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n").encode()


async def test_dribbled_body_gets_408(stack: Stack) -> None:
    before = await asyncio.to_thread(ledger, stack.sidecar)
    body = b'{"prompt": "' + b"x" * 1000 + b'", "max_tokens": 4}'
    answer, took = await dribble(stack.sidecar, head_of(stack.sidecar, len(body)), body,
                                 limit_s=10 * TIMEOUT_MS / 1000)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert b"x-weighbridge-reject-reason: request_timeout" in answer.lower()
    assert b'"code":"request_timeout"' in answer
    assert TIMEOUT_MS / 1000 <= took < TIMEOUT_MS / 1000 + 3
    delta = await asyncio.to_thread(settled, stack.sidecar) - before
    assert delta.arrived == 1 and delta.rejected == {"request_timeout": 1}


@pytest.mark.parametrize("where", ["request-line", "headers"])
async def test_dribbled_headers_are_cut_off(stack: Stack, where: str) -> None:
    host = httpx.URL(stack.sidecar).host
    if where == "request-line":
        head, drip = b"", b"POST /v1/completions" + b"/x" * 2000
    else:
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\n".encode()
        drip = b"X-Padding: " + b"y" * 4000
    answer, took = await dribble(stack.sidecar, head, drip, limit_s=10 * TIMEOUT_MS / 1000)
    assert answer == b"", answer[:200]  # closed, no request to answer
    assert took < TIMEOUT_MS / 1000 + 3


async def test_idle_connection_is_closed(stack: Stack) -> None:
    target = httpx.URL(stack.sidecar)
    reader, writer = await asyncio.open_connection(target.host, target.port)
    try:
        started = time.monotonic()
        assert await asyncio.wait_for(reader.read(1), 10 * TIMEOUT_MS / 1000) == b""
        assert time.monotonic() - started < TIMEOUT_MS / 1000 + 3
    finally:
        writer.transport.abort()


async def test_a_crowd_of_dribblers_costs_bounded_memory(stack: Stack) -> None:
    """200 connections dribbling bodies at once: all cut off, memory back within bounds, and
    an honest client served while they hang on."""
    crowd = 200
    rss_before = rss_bytes(stack.pid)
    body = b'{"prompt": "' + b"z" * 2000 + b'"}'
    tasks = [asyncio.create_task(dribble(stack.sidecar, head_of(stack.sidecar, len(body)),
                                         body, limit_s=30)) for _ in range(crowd)]
    await asyncio.sleep(TIMEOUT_MS / 2000)
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(stack.sidecar + "/v1/completions", json=completion(),
                                     headers=auth(KEY))
    assert_served(response, "t")
    answers = await asyncio.gather(*tasks)
    assert all(a.startswith(b"HTTP/1.1 408 ") for a, _ in answers)
    assert rss_bytes(stack.pid) - rss_before < 32 << 20
    health = await asyncio.to_thread(httpx.get, stack.sidecar + "/healthz", timeout=10)
    assert health.status_code == 200
    await asyncio.to_thread(settled, stack.sidecar)


def test_a_slow_but_steady_body_within_the_timeout_is_served(stack: Stack) -> None:
    """The timeout is for the whole body, not per byte: a body sent in a few pieces with
    pauses, all within the timeout, is fine."""
    def pieces():
        yield b'{"prompt": [1, 2, 3],'
        time.sleep(TIMEOUT_MS / 4000)
        yield b' "max_tokens": 4}'

    response = loopback.post(stack.sidecar + "/v1/completions", content=pieces(),
                          headers={**auth(KEY), "content-type": "application/json"},
                          timeout=10)
    assert_served(response, "t")
    bad = loopback.post(stack.sidecar + "/v1/completions", content=b"{", headers=auth(KEY),
                     timeout=10)
    assert_rejected(bad, 400, "invalid_json")
    settled(stack.sidecar)
