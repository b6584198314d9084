"""The sidecar's HTTP/1.1 client to its backends (sidecar.upstream): responses parsed from any
split of their bytes across reads, the framings a backend may use, and connections reused
only when whole."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.fed_upstream import FakeTransport, fed_response
from weighbridge.sidecar.upstream import (
    Upstream,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
)

EVENTS = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
          b"data: [DONE]\n\n"]
HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
        b"Transfer-Encoding: chunked\r\nX-Request-Id: 7\r\n\r\n")
CHUNKED = HEAD + b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"




def pieces_of(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


def _body(response: UpstreamResponse) -> bytes:
    return response._drain() if response._body else b""


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=12))
def test_a_chunked_response_split_anywhere_reads_the_same(cuts: list[int]) -> None:
    conn, response = fed_response()
    body = b""
    for piece in pieces_of(CHUNKED, cuts):
        conn.data_received(piece)
        body += _body(response)
    assert response.status == 200
    assert response.content_type == "text/event-stream"
    assert ("X-Request-Id", "7") in response.headers
    assert body == b"".join(EVENTS)
    assert response.complete and response._keep_alive


def test_every_single_byte_split_of_a_chunked_response() -> None:
    conn, response = fed_response()
    body = b""
    for i in range(len(CHUNKED)):
        conn.data_received(CHUNKED[i:i + 1])
        body += _body(response)
    assert body == b"".join(EVENTS) and response.complete


def test_content_length_and_chunk_extensions_and_trailers() -> None:
    conn, response = fed_response()
    conn.data_received(b"HTTP/1.1 404 Not Found\r\ncontent-length: 5\r\n\r\nhel")
    conn.data_received(b"lo")
    assert response.status == 404 and _body(response) == b"hello" and response.complete
    conn, response = fed_response()
    conn.data_received(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                       b"3;ext=1\r\nabc\r\n0\r\nX-Trailer: 1\r\n\r\n")
    assert _body(response) == b"abc" and response.complete


def test_a_response_without_length_ends_with_the_connection() -> None:
    conn, response = fed_response()
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nsome")
    assert not response.complete
    conn.connection_lost(None)
    assert _body(response) == b"some" and response.complete and not response._keep_alive


@pytest.mark.parametrize("data", [
    HEAD + b"5\r\nab",  # the backend died mid-chunk
    b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc",
    b"HTTP/1.1 200 OK\r\nContent-Le",  # before the head was whole
])
def test_a_connection_lost_early_is_an_error(data: bytes) -> None:
    conn, response = fed_response()
    conn.data_received(data)
    conn.connection_lost(ConnectionResetError("reset"))
    assert not response.complete and isinstance(response._error, UpstreamError)


@pytest.mark.parametrize("data", [
    b"SSH-2.0-OpenSSH\r\n\r\n",
    HEAD + b"zz\r\n",
    HEAD + b"3\r\nabcXY",
    b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n",
])
def test_what_is_not_http_is_an_error_and_drops_the_connection(data: bytes) -> None:
    conn, response = fed_response()
    conn.data_received(data)
    assert isinstance(response._error, UpstreamError)
    assert conn.transport is not None and conn.transport.is_closing()


def test_a_slow_reader_pauses_the_backend() -> None:
    conn, response = fed_response()
    conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 200000\r\n\r\n" + b"x" * 100_000)
    transport = conn.transport
    assert isinstance(transport, FakeTransport) and transport.paused
    assert len(response._drain()) == 100_000 and not transport.paused


async def test_connections_are_reused_only_after_a_whole_response() -> None:
    peers: list[object] = []

    async def answer(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in EVENTS:
            await response.write(event)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", answer)
    async with TestServer(app) as server:
        pool = Upstream()
        url = str(server.make_url("/v1/completions"))
        try:
            for _ in range(3):
                response = await pool.request("POST", url, b"{}", {"X-A": "1"})
                assert b"".join([p async for p in response.pieces()]) == b"".join(EVENTS)
                response.release()
            assert len(set(peers)) == 1  # one connection for all three
            response = await pool.request("POST", url, b"{}")
            response.close()  # unfinished: dropped, not pooled
            await asyncio.sleep(0.01)
            response = await pool.request("POST", url, b"{}")
            assert await response.read() == b"".join(EVENTS)
            response.release()
            assert len(set(peers)) == 2
        finally:
            await pool.close()


async def test_get_reads_whole_answers_and_drops_a_late_one() -> None:
    """Scrapes, probes and model lists (``Upstream.get``): a whole answer within the deadline
    leaves its connection pooled; a late one raises TimeoutError and its connection is
    dropped, so the next exchange never reads the late answer's bytes."""
    peers: list[object] = []
    held = asyncio.Event()  # /slow answers only once the test lets it

    async def health(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        return web.Response(status=503, body=b"down")

    async def slow(request: web.Request) -> web.Response:
        peers.append(request.transport.get_extra_info("peername"))  # type: ignore[union-attr]
        await held.wait()
        return web.Response(body=b"late")

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/slow", slow)
    async with TestServer(app) as server:
        pool = Upstream()
        try:
            assert await pool.get(str(server.make_url("/health")), 5.0) == (503, b"down")
            assert await pool.get(str(server.make_url("/health")), 5.0) == (503, b"down")
            assert len(set(peers)) == 1  # a whole answer, even a failing one: pooled
            with pytest.raises(TimeoutError):
                # Never answered before the test sets ``held``: the deadline always passes.
                await pool.get(str(server.make_url("/slow")), 0.05)
            assert not any(pool._idle.values())  # the late exchange's connection is not reused
            held.set()
            assert await pool.get(str(server.make_url("/health")), 5.0) == (503, b"down")
            assert len(set(peers)) == 2
        finally:
            held.set()
            await pool.close()


async def test_a_refused_connection_is_a_connect_error() -> None:
    pool = Upstream(connect_timeout_s=1)
    with pytest.raises(UpstreamConnectError):
        await pool.request("POST", "http://127.0.0.1:9/v1/completions", b"{}")
    await pool.close()


async def test_idle_connections_are_closed_after_the_keepalive() -> None:
    async def answer(request: web.Request) -> web.Response:
        return web.Response(body=b"ok")

    app = web.Application()
    app.router.add_post("/", answer)
    async with TestServer(app) as server:
        pool = Upstream(keepalive_s=0.05)
        try:
            responses = await asyncio.gather(*(pool.request("POST", str(server.make_url("/")))
                                               for _ in range(3)))
            for response in responses:
                assert await response.read() == b"ok"
                response.release()
            assert sum(len(idle) for idle in pool._idle.values()) == 3
            await asyncio.sleep(0.2)
            assert not pool._idle and pool._sweep is None
        finally:
            await pool.close()


def test_backend_urls_name_their_connections_and_host() -> None:
    pool = Upstream()
    assert pool._target("http://127.0.0.1:8001/v1/completions") == (
        ("http", "127.0.0.1", 8001), "/v1/completions", b"Host: 127.0.0.1:8001\r\n")
    assert pool._target("https://vllm.example/v1/chat/completions?x=1") == (
        ("https", "vllm.example", 443), "/v1/chat/completions?x=1", b"Host: vllm.example\r\n")
    assert pool._target("http://[::1]:9000/metrics") == (
        ("http", "::1", 9000), "/metrics", b"Host: [::1]:9000\r\n")
    with pytest.raises(UpstreamConnectError):
        pool._target("ftp://h/x")
