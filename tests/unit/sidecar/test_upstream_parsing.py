"""The backend client's response parsing (llhttp through httptools, sidecar.upstream) at its
edges: a chunked stream cut at every byte boundary, chunk extensions and trailers,
``Content-Length`` bodies, bodies that end with the connection, connections lost mid-body,
the bounds against a hostile backend (an oversized head, framing with no body), what may be
reused, and errors that quote none of the backend's bytes. Most run against an in-process
asyncio server on loopback that writes exactly the bytes a test gives it; the byte-boundary
cuts feed the connection's protocol directly, so every cut is one read."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest
import trustme
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from tests.support.fed_upstream import fed_response
from weighbridge.sidecar.proxy import BackendFailed, relay
from weighbridge.sidecar.upstream import (
    MAX_FRAMING,
    MAX_HEAD,
    Upstream,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
)

SECRET = b"S3CRET-backend-bytes"
EVENTS = [b'data: {"choices":[{"text":"a"}]}\n\n', b'data: {"choices":[{"text":"b"}]}\n\n',
          b"data: [DONE]\n\n"]
BODY = b"".join(EVENTS)
HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
        b"transfer-encoding: chunked\r\n\r\n")
CHUNKS = b"".join(b"%x\r\n%b\r\n" % (len(e), e) for e in EVENTS) + b"0\r\n\r\n"
CHUNKED = HEAD + CHUNKS


# -- a backend that writes what the test says -----------------------------------------------------


@dataclass
class Answer:
    """What the backend writes for one request: ``pieces`` one write each (a short pause
    between them, so each is likely its own read), then closes the connection if ``close``."""

    pieces: list[bytes]
    close: bool = False


@dataclass
class RawBackend:
    answers: list[Answer]
    url: str = ""
    peers: list[int] = field(default_factory=list)  # the client port of each request


async def _read_request(reader: asyncio.StreamReader) -> bool:
    """One request's head and its Content-Length body; False at the end of the connection."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except (asyncio.IncompleteReadError, ConnectionError):
        return False
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length" and int(value):
            await reader.readexactly(int(value))
    return True


@contextlib.asynccontextmanager
async def raw_backend(*answers: Answer, tls: ssl.SSLContext | None = None,
                      ) -> AsyncIterator[RawBackend]:
    backend = RawBackend(list(answers))

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while backend.answers and await _read_request(reader):
                backend.peers.append(writer.get_extra_info("peername")[1])
                answer = backend.answers.pop(0)
                for piece in answer.pieces:
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.002)
                if answer.close:
                    break
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=tls)
    port = server.sockets[0].getsockname()[1]
    backend.url = f"{'https' if tls else 'http'}://127.0.0.1:{port}/v1/completions"
    try:
        yield backend
    finally:
        server.close()
        await server.wait_closed()


async def exchange(pool: Upstream, backend: RawBackend) -> tuple[UpstreamResponse, bytes]:
    response = await pool.request("POST", backend.url, b"{}")
    body = await response.read()
    response.release()
    return response, body


def _pooled(pool: Upstream) -> int:
    return sum(len(idle) for idle in pool._idle.values())


# -- every byte boundary --------------------------------------------------------------------------




class _Sink:
    def __init__(self) -> None:
        self.pieces: list[tuple[bytes, bool]] = []
        self.ended: list[BaseException | None] = []

    def data(self, data: bytes, last: bool) -> None:
        assert not self.ended
        self.pieces.append((data, last))

    def end(self, error: BaseException | None) -> None:
        self.ended.append(error)


@pytest.mark.parametrize("to_sink", [False, True], ids=["read", "sink"])
def test_a_chunked_stream_cut_at_every_byte_boundary(to_sink: bool) -> None:
    """Every cut of the response into two reads and into three (the second read one byte),
    read whole and streamed to a sink: the same body, a whole response, reusable."""
    cuts = [[i] for i in range(1, len(CHUNKED))]
    cuts += [[i, i + 1] for i in range(1, len(CHUNKED) - 1)]
    for cut in cuts:
        edges = [0, *cut, len(CHUNKED)]
        conn, response = fed_response()
        sink = _Sink()
        body = b""
        for a, b in itertools.pairwise(edges):
            conn.data_received(CHUNKED[a:b])
            if to_sink and response.status and not sink.pieces and not sink.ended:
                response.stream_to(sink)
            elif not to_sink and response._body:
                body += response._drain()
        if to_sink:
            body = b"".join(piece for piece, _ in sink.pieces)
            assert sink.ended == [None], cut
            assert [last for _, last in sink.pieces][:-1] == [False] * (len(sink.pieces) - 1)
        assert body == BODY, cut
        assert response.status == 200 and response.content_type == "text/event-stream", cut
        assert response.complete and response._keep_alive, cut


def test_one_read_per_chunk_goes_straight_to_the_sink() -> None:
    """The relay's common read, one whole chunk: handed on as it is, ``last`` only with the
    read that ends the response."""
    conn, response = fed_response()
    conn.data_received(HEAD)
    sink = _Sink()
    response.stream_to(sink)
    pieces = [b"%x\r\n%b\r\n" % (len(e), e) for e in EVENTS]
    for piece in pieces[:-1]:
        conn.data_received(piece)
    conn.data_received(pieces[-1] + b"0\r\n\r\n")
    assert sink.pieces == [(EVENTS[0], False), (EVENTS[1], False), (EVENTS[2], True)]
    assert sink.ended == [None]


# -- framings -------------------------------------------------------------------------------------


async def test_chunk_extensions_and_trailers_and_the_connection_reused() -> None:
    answer = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-Id: 1\r\n"
              b"Trailer: X-Checksum\r\n\r\n"
              b"3;name=value;quoted=\"a b\"\r\nabc\r\n"
              b"4;ext\r\ndefg\r\n0;last=1\r\nX-Checksum: 99\r\n\r\n")
    async with raw_backend(Answer([answer]), Answer([answer])) as backend:
        pool = Upstream()
        try:
            response, body = await exchange(pool, backend)
            assert body == b"abcdefg" and response.complete
            assert ("X-Id", "1") in response.headers
            assert all(name != "X-Checksum" for name, _ in response.headers)  # a trailer
            assert _pooled(pool) == 1
            _, body = await exchange(pool, backend)
            assert body == b"abcdefg"
            assert len(set(backend.peers)) == 1  # one connection for both
        finally:
            await pool.close()


async def test_a_content_length_body_across_reads() -> None:
    head = b"HTTP/1.1 404 Not Found\r\nContent-Type: application/json\r\nContent-Length: 11\r\n"
    async with raw_backend(Answer([head, b"\r\n{\"err", b"or\":1", b"}"]),
                           Answer([head + b"\r\n{\"error\":2}"])) as backend:
        pool = Upstream()
        try:
            response, body = await exchange(pool, backend)
            assert (response.status, body) == (404, b'{"error":1}')
            assert response.content_type == "application/json"
            _, body = await exchange(pool, backend)
            assert body == b'{"error":2}' and len(set(backend.peers)) == 1
        finally:
            await pool.close()


async def test_a_body_without_length_ends_with_the_connection() -> None:
    async with raw_backend(Answer([b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n",
                                   b"some ", b"body"], close=True)) as backend:
        pool = Upstream()
        try:
            response, body = await exchange(pool, backend)
            assert body == b"some body" and response.complete and _pooled(pool) == 0
        finally:
            await pool.close()


async def test_an_interim_response_is_skipped() -> None:
    async with raw_backend(Answer([b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n",
                                   b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"])) as backend:
        pool = Upstream()
        try:
            response, body = await exchange(pool, backend)
            assert (response.status, body) == (200, b"ok")
            assert all(name != "Link" for name, _ in response.headers)
        finally:
            await pool.close()


@pytest.mark.parametrize("answer", [
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
    b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nokHTTP/1.1 200 OK\r\n",  # bytes after it
    b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok" + SECRET,
], ids=["connection-close", "http-1.0", "a-second-response", "garbage-after"])
async def test_what_may_not_be_reused_is_not(answer: bytes) -> None:
    async with raw_backend(Answer([answer])) as backend:
        pool = Upstream()
        try:
            response, body = await exchange(pool, backend)
            assert body == b"ok" and response.complete and _pooled(pool) == 0
        finally:
            await pool.close()


# -- broken and hostile backends ------------------------------------------------------------------


async def _failure(*pieces: bytes, close: bool = False) -> tuple[UpstreamError, Upstream]:
    """The UpstreamError of one exchange (raised by the head or by the body's read)."""
    async with raw_backend(Answer(list(pieces), close=close)) as backend:
        pool = Upstream()
        try:
            with pytest.raises(UpstreamError) as caught:
                await exchange(pool, backend)
            return caught.value, pool
        finally:
            await pool.close()


@pytest.mark.parametrize("pieces", [
    [HEAD + b"5\r\nab"],  # mid-chunk
    [HEAD + b"5\r\nabcde\r\n"],  # between chunks
    [HEAD + CHUNKS[:-2]],  # before the blank line ending the trailer
    [b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"],
    [b"HTTP/1.1 200 OK\r\nContent-Le"],  # before the head was whole
    [b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nabc"],  # framed, not by the close
], ids=["mid-chunk", "between-chunks", "in-trailer", "content-length", "head", "te-gzip"])
async def test_a_connection_closed_mid_response_is_an_error(pieces: list[bytes]) -> None:
    error, pool = await _failure(*pieces, close=True)
    assert "closed the connection" in str(error)
    assert _pooled(pool) == 0


@pytest.mark.parametrize("answer", [
    HEAD + SECRET + b"\r\n",  # not a chunk size
    HEAD + b"1" * 17 + b"\r\n",  # a chunk size past 64 bits
    HEAD + b"-3\r\nabc\r\n",
    HEAD + b"3\r\nabc" + SECRET,  # a chunk not followed by CRLF
    HEAD + b"3;" + SECRET + b"=\x01\r\nabc\r\n",  # a chunk extension with a control byte
    b"HTTP/1.1 200 OK\r\n" + SECRET + b"\r\n\r\n",  # a header line without a colon
    b"HTTP/1.1 200 OK\r\nContent-Length: 1" + SECRET + b"\r\n\r\n",
    b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nx",
    b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n",
    SECRET + b" 200 OK\r\n\r\n",
    b"HTTP/2.0 200 OK\r\nX: " + SECRET + b"\r\nContent-Length: 0\r\n\r\n",
    b"HTTP/1.1 2000 " + SECRET + b"\r\n\r\n",
], ids=["bad-size", "size-overflow", "negative-size", "no-crlf", "bad-extension",
        "no-colon", "bad-content-length", "two-content-lengths", "length-and-chunked",
        "not-http", "http-2.0", "bad-status"])
async def test_what_is_not_http_is_an_error_that_quotes_none_of_it(answer: bytes) -> None:
    error, pool = await _failure(answer)
    assert "not valid HTTP/1.1" in str(error) or "not HTTP/1.1" in str(error)
    assert SECRET.decode() not in str(error) and "S3CRET" not in repr(error)
    assert _pooled(pool) == 0


@pytest.mark.parametrize("reads", [1, 64], ids=["one-read", "many-reads"])
async def test_an_oversized_head_is_refused(reads: int) -> None:
    head = b"HTTP/1.1 200 OK\r\nX-Pad: " + SECRET * (MAX_HEAD // len(SECRET)) + b"\r\n\r\n"
    step = -(-len(head) // reads)
    error, _ = await _failure(*(head[i:i + step] for i in range(0, len(head), step)))
    assert "head is over" in str(error) and SECRET.decode() not in str(error)


def test_the_head_bound_is_exact() -> None:
    """A head of exactly MAX_HEAD bytes (its blank line included) is read, in one read with
    its body or byte by byte; one byte more is refused, however it is cut."""
    start, end = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX-Pad: ", b"\r\n\r\n"
    head = start + b"a" * (MAX_HEAD - len(start) - len(end)) + end
    assert len(head) == MAX_HEAD
    conn, response = fed_response()
    conn.data_received(head + b"ok")
    assert response.complete and response._drain() == b"ok"
    conn, response = fed_response()
    for i in range(0, len(head), 997):
        conn.data_received(head[i:i + 997])
    conn.data_received(b"ok")
    assert response.complete and response._drain() == b"ok"
    longer = head[:-4] + b"a" + end
    for step in (len(longer) + 2, 1000, 65535):
        conn, response = fed_response()
        for i in range(0, len(longer), step):
            conn.data_received(longer[i:i + step])
        assert isinstance(response._error, UpstreamError), step
        assert conn.transport is not None and conn.transport.is_closing()


def test_framing_without_body_is_bounded() -> None:
    """Endless chunk extensions (or trailer fields) carry no body: llhttp keeps none of them,
    and past MAX_FRAMING bytes in a row the exchange is broken off."""
    conn, response = fed_response()
    conn.data_received(HEAD + b"3\r\nabc\r\n")
    assert response._drain() == b"abc"
    conn.data_received(b"5;x=")
    for _ in range(MAX_FRAMING // 512 - 1):
        conn.data_received(b"y" * 512)
    assert response._error is None  # 4 + 7 * 512 bytes: within the bound
    conn.data_received(b"y" * 512)
    assert isinstance(response._error, UpstreamError)
    assert "framing" in str(response._error)
    assert conn.transport is not None and conn.transport.is_closing()


def test_the_bound_counts_only_reads_without_body() -> None:
    """A long stream of small chunks, each read carrying body bytes, is never cut off."""
    conn, response = fed_response()
    conn.data_received(HEAD)
    for _ in range(2 * MAX_FRAMING):
        conn.data_received(b"1;e=1\r\nx\r\n")
    conn.data_received(b"0\r\n\r\n")
    assert response.complete and response._drain() == b"x" * 2 * MAX_FRAMING


async def test_the_502_quotes_none_of_the_backends_bytes() -> None:
    """The relay's BackendFailed (the client's 502 says its message) names the failure
    without the backend's bytes."""
    failures: list[str] = []

    async def front(request: web.Request) -> web.StreamResponse:
        pool = Upstream()
        try:
            response, _ = await relay(pool, backend.url, b"{}", request, {}, stream=True,
                                      strip_usage_chunk=True)
            return response
        except BackendFailed as e:
            failures.append(str(e))
            return web.Response(status=502, text=str(e))
        finally:
            await pool.close()

    app = web.Application()
    app.router.add_post("/v1/completions", front)
    bad = [b"HTTP/1.1 200 " + SECRET + b"\r\nX: " + SECRET + b"\r\n" + SECRET + b"\r\n\r\n",
           b"HTTP/1.1 200 OK\r\nContent-Length: " + SECRET + b"\r\n\r\n"]
    async with raw_backend(*(Answer([b]) for b in bad)) as backend, \
            TestClient(TestServer(app)) as client:
        for _ in bad:
            answer = await client.post("/v1/completions", data=b"{}")
            text = await answer.text()
            assert answer.status == 502 and "S3CRET" not in text
    assert len(failures) == 2 and all("UpstreamError" in f for f in failures)


# -- TLS ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_side() -> tuple[trustme.CA, ssl.SSLContext]:
    """A test certificate authority (trustme), and a server's TLS context with a certificate
    it issued for 127.0.0.1."""
    authority = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(context)
    return authority, context


async def test_an_https_backend_is_parsed_and_reused(
        server_side: tuple[trustme.CA, ssl.SSLContext]) -> None:
    authority, context = server_side
    pieces = [CHUNKED[i:i + 7] for i in range(0, len(CHUNKED), 7)]
    async with raw_backend(Answer(pieces), Answer([CHUNKED]), tls=context) as backend:
        pool = Upstream()
        pool._tls = ssl.create_default_context()  # as the pool makes it: the system's CAs
        authority.configure_trust(pool._tls)  # and the test's
        try:
            response, body = await exchange(pool, backend)
            assert body == BODY and response.complete
            _, body = await exchange(pool, backend)
            assert body == BODY and len(set(backend.peers)) == 1
        finally:
            await pool.close()


async def test_an_https_backend_with_an_untrusted_certificate_is_refused(
        server_side: tuple[trustme.CA, ssl.SSLContext]) -> None:
    _, context = server_side
    async with raw_backend(Answer([CHUNKED]), tls=context) as backend:
        pool = Upstream()
        try:
            with pytest.raises(UpstreamConnectError) as caught:
                await exchange(pool, backend)
            assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value)
            assert backend.peers == []
        finally:
            await pool.close()


async def test_a_get_answer_over_its_bound_is_broken_off_not_buffered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape, probe or model list is read whole: a backend answering more than
    MAX_GET_BODY (here made small) is an error, and its connection is not reused."""
    monkeypatch.setattr("weighbridge.sidecar.upstream.MAX_GET_BODY", 1024)
    big = b"x" * 600
    head = b"HTTP/1.1 200 OK\r\ncontent-length: 1800\r\n\r\n"
    async with raw_backend(Answer([head, big, big, big])) as backend:
        pool = Upstream()
        try:
            with pytest.raises(UpstreamError, match="over 1024 bytes") as raised:
                await pool.get(backend.url, timeout_s=10)
            assert "x" not in str(raised.value)
            assert _pooled(pool) == 0
        finally:
            await pool.close()
