"""The sidecar's one HTTP/1.1 client to its backends: a pool of keep-alive connections, each
an ``asyncio.Protocol`` whose responses llhttp parses (``httptools``; decision 0002).

Every request the sidecar sends to a backend goes through one :class:`Upstream`: the relayed
requests (:meth:`Upstream.request`, read as they stream) and the small exchanges read whole
within a deadline (:meth:`Upstream.get`: metrics scrapes, health probes, model lists). So
there is one connection-pool policy, one timeout vocabulary (``connect_timeout_s`` for every
connect, a caller's ``timeout_s`` for a whole exchange, none on a relayed stream) and one
place that writes a request's head, which is where a header every backend request carries
would go; header values are never logged or put in an error's message.

Why not aiohttp's client: per proxied request it builds a URL object, a request object,
header multidicts, timers and a response object, and per body piece it wakes a stream reader
through a future. That was about a fifth of the sidecar's CPU per streamed request (the
profile in docs/sidecar-performance.md), and about three times this client's cost per
scrape. Here a request is one ``write`` of preformatted bytes, and each read from the backend
goes to llhttp (Node's HTTP parser, through ``httptools.HttpResponseParser``) in
``data_received``: the status line, the headers and the chunked or ``Content-Length`` framing
are its work, never this module's (the project's rule: protocols are parsed by maintained
libraries). What llhttp leaves to its caller is here: a bound on the head
(:data:`MAX_HEAD`) and on framing that carries no body (:data:`MAX_FRAMING`), a body that
ends with the connection, and whether the connection may be reused. Errors quote none of the
backend's bytes (llhttp's reasons are fixed phrases). The relay's task wakes once per read
from the backend, or not at all once the body goes to a :class:`BodySink`.

Only what the relay needs: ``http://`` and ``https://`` backends (TLS verified against the
system's CAs, as aiohttp's default), ``POST``/``GET`` with a body of known length, responses
framed by ``Content-Length``, chunked transfer coding or (with neither header) the end of the
connection, interim 1xx responses skipped, no ``Expect: 100-continue``, no content coding
asked for (no ``Accept-Encoding``: the backend answers in identity, which is what the relay
passes on). A connection goes back to the pool
only after a complete response that llhttp judges keep-alive (HTTP/1.1 without ``Connection:
close``, or HTTP/1.0 with ``keep-alive``) and that no further bytes followed; idle ones are
dropped after ``keepalive_s`` (before the backend drops them: vLLM's uvicorn closes idle
keep-alive connections after 5 s, and a request written on a connection the server is
closing fails as if the backend had died).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import AsyncIterator, Mapping
from typing import Protocol, cast
from urllib.parse import urlsplit

import httptools

# (scheme, host, port): the connections of one backend.
_Key = tuple[str, str, int]
_DEFAULT_PORTS = {"http": 80, "https": 443}
# Buffered body bytes above which the backend's socket is not read until the relay caught
# up (the client reads slower than the backend writes).
HIGH_WATER = 1 << 16
MAX_HEAD = 1 << 16  # status line and headers: more is not a backend we talk to
# Bytes in a row with no body byte once the body began: a chunk's size line and its
# extensions, the CRLFs, the trailer. vLLM sends a few bytes of framing per chunk; a backend
# that sends more (endless chunk extensions or trailer fields) is broken off.
MAX_FRAMING = 1 << 12
# A scrape, probe or model list read whole (vLLM's /metrics is ~50 KB): a backend that
# answers more is broken off rather than buffered, whatever its speed.
MAX_GET_BODY = 1 << 23


class BodySink(Protocol):
    """Where :meth:`UpstreamResponse.stream_to` delivers the body."""

    def data(self, data: bytes, last: bool) -> None:
        """Body bytes as they arrive; ``last``: the response is whole with these."""

    def end(self, error: BaseException | None) -> None:
        """The body ended (``error`` None) or broke off; nothing follows."""


class UpstreamConnectError(Exception):
    """The connection could not be made (refused, unreachable, connect timeout): the request
    never left the sidecar."""


class UpstreamError(Exception):
    """The backend broke the exchange after the connection was made (it closed the
    connection early, or sent what is not HTTP/1.1)."""


class _Connection(asyncio.Protocol):
    """One connection to a backend and the response being read on it."""

    def __init__(self, pool: Upstream, key: _Key) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.closed = False
        self._response: UpstreamResponse | None = None

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport instances, but have its methods.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None:  # bytes nobody asked for: not a connection to reuse
            self.closed = True
            if self.transport is not None:
                self.transport.close()
            return
        response._feed(data)

    def eof_received(self) -> bool:
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._response is not None:
            self._response._lost(exc)

    # -- use -----------------------------------------------------------------------------------

    def start(self, request: bytes) -> UpstreamResponse:
        assert self.transport is not None
        response = UpstreamResponse(self)
        self._response = response
        self.transport.write(request)
        return response

    def finished(self, reusable: bool) -> None:
        self._response = None
        if reusable and not self.closed and self.transport is not None \
                and not self.transport.is_closing():
            self.pool._put(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        self._response = None
        if self.transport is not None:
            self.transport.abort()


# Where a response is: waiting for its head (status line and headers), reading its body,
# whole.
_HEAD, _BODY, _DONE = range(3)
_VERSIONS = ("1.1", "1.0")


class _AfterResponse(Exception):
    """Raised in the parser's callback when bytes after the response begin another one: stops
    the parser there (the response is whole; the connection is not reused)."""


class UpstreamResponse:
    """A backend's response: its head once :meth:`head` returned, then its body, whole
    (:meth:`read`) or as it arrives (:meth:`pieces`). End it with :meth:`release` (the body
    was read to its end) or :meth:`close` (drops the connection, which tells the backend
    the client is gone).

    The bytes are parsed by llhttp (``httptools.HttpResponseParser``, one per response), which
    calls the ``on_*`` methods below; what is kept here is what llhttp leaves to its caller:
    the bounds (:data:`MAX_HEAD`, :data:`MAX_FRAMING`), a body that ends with the connection,
    and whether the connection may be reused."""

    __slots__ = ("_body", "_conn", "_error", "_framed", "_framing", "_keep_alive", "_parser",
                 "_paused", "_seen", "_sink", "_size", "_state", "_waiter", "content_type",
                 "headers", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._parser = httptools.HttpResponseParser(self)
        self._state = _HEAD
        self._seen = 0  # bytes fed before the head was whole
        self._framing = 0  # bytes fed in a row since the last body byte
        self._framed = False  # Content-Length or Transfer-Encoding: the body does not end
        # with the connection
        self._body: list[bytes] = []  # decoded body bytes not yet taken
        self._size = 0
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = False
        self._paused = False
        self._sink: BodySink | None = None
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.content_type = ""

    # -- llhttp's callbacks (httptools' protocol) ------------------------------------------------

    def on_message_begin(self) -> None:
        if self._state == _DONE:  # bytes after the response: stop there
            raise _AfterResponse

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._state != _HEAD:
            return  # a trailer's field: not the response's headers
        lower = name.lower()
        if lower == b"content-type":
            self.content_type = value.partition(b";")[0].strip().lower().decode("latin-1")
        elif lower in (b"content-length", b"transfer-encoding"):
            self._framed = True
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        parser = self._parser
        if parser.get_http_version() not in _VERSIONS:
            raise UpstreamError("the backend's response is not HTTP/1.1")
        status = parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            # An interim response (102, 103): its fields are not the response's, which
            # follows on the same connection.
            self.headers = []
            self.content_type = ""
            self._framed = False
            return
        self.status = status
        self._keep_alive = parser.should_keep_alive()
        self._state = _BODY

    def on_body(self, body: bytes) -> None:
        self._body.append(body)
        self._size += len(body)

    def on_message_complete(self) -> None:
        if self._state == _BODY:  # not an interim response's end
            self._state = _DONE

    # -- fed by the connection -------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        head = self._state == _HEAD
        try:
            if head:
                self._feed_head(data)
            else:
                self._feed_body(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade, UpstreamError) as e:
            self._broke(e)
        sink = self._sink
        if sink is not None:
            body = self._body
            done = self._state == _DONE
            if body:
                # Straight to the sink (no drain: with nothing buffered, only the relay
                # itself can have paused reading, and it resumes it).
                out = body[0] if len(body) == 1 else b"".join(body)
                body.clear()
                self._size = 0
                sink.data(out, done and self._error is None)
            if done or self._error is not None:
                self._sink = None
                sink.end(self._error)
            return
        if self._body or self._state == _DONE or self._error is not None \
                or (head and self._state != _HEAD):
            self._wake()
        if self._size > HIGH_WATER and not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()

    def _feed_body(self, data: bytes) -> None:
        """Feed bytes after the head: chunked framing that carries no body is bounded."""
        size = self._size
        self._parser.feed_data(data)
        if self._size != size:
            self._framing = 0
        elif self._state == _BODY:
            self._framing += len(data)
            if self._framing > MAX_FRAMING:
                raise UpstreamError("the backend's chunked framing carries no body "
                                    f"for over {MAX_FRAMING} bytes")

    def _feed_head(self, data: bytes) -> None:
        """Feed bytes of the head: at most :data:`MAX_HEAD` of them before the head is whole
        (llhttp bounds no field's length; httptools joins a field's pieces)."""
        room = MAX_HEAD - self._seen
        if len(data) <= room:
            self._seen += len(data)
            self._parser.feed_data(data)
            return
        view = memoryview(data)
        self._parser.feed_data(view[:room])
        if self._state == _HEAD:
            raise UpstreamError(f"the backend's response head is over {MAX_HEAD} bytes")
        self._parser.feed_data(view[room:])

    def _broke(self, error: Exception) -> None:
        """The parser stopped on ``error``. After a whole response that is the bytes after
        it (another response, or anything else): the response stands, the connection is not
        reused. Before, the exchange failed; the message quotes none of the backend's bytes
        (llhttp's reasons are its own fixed phrases)."""
        if self._state == _DONE:
            self._keep_alive = False
            return
        if isinstance(error, UpstreamError):
            self._error = error
        elif isinstance(error, httptools.HttpParserCallbackError) \
                and isinstance(error.__context__, UpstreamError):
            self._error = error.__context__
        else:
            reason = error.args[0] if error.args and isinstance(error.args[0], str) else ""
            self._error = UpstreamError(
                "the backend's response is not valid HTTP/1.1"
                + (f" ({reason})" if reason and isinstance(error, httptools.HttpParserError)
                   else ""))
        self._conn.abort()

    def _lost(self, exc: Exception | None) -> None:
        if self._state == _BODY and not self._framed and self._error is None:
            self._state = _DONE  # a body without length ends with the connection
            self._keep_alive = False
        elif self._state != _DONE and self._error is None:
            what = f": {exc}" if exc else ""
            self._error = UpstreamError(
                "the backend closed the connection before the response ended" + what
                if self._state != _HEAD else
                "the backend closed the connection before answering" + what)
        if self._sink is not None:
            self._to_sink(self._sink)
        self._wake()

    def _to_sink(self, sink: BodySink) -> None:
        """Hand the sink what arrived, and the end once it is known."""
        done = self._state == _DONE
        if self._body:
            sink.data(self._drain(), done and self._error is None)
        if done or self._error is not None:
            self._sink = None
            sink.end(self._error)

    # -- read by the relay -----------------------------------------------------------------------

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiter = waiter
        try:
            await waiter
        finally:
            self._waiter = None

    async def head(self) -> None:
        """Wait for the status line and headers."""
        while self._state == _HEAD and self._error is None:
            await self._wait()
        if self._state == _HEAD and self._error is not None:
            raise self._error

    def _drain(self) -> bytes:
        body = self._body
        out = body[0] if len(body) == 1 else b"".join(body)
        body.clear()
        self._size = 0
        if self._paused and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()
        return out

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives: what each wake-up found, joined. Raises
        :class:`UpstreamError` if the backend broke off."""
        while True:
            if self._body:
                yield self._drain()
            elif self._state == _DONE:
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait()

    def stream_to(self, sink: BodySink) -> None:
        """From now on the body goes to ``sink`` from the connection's callbacks, as it
        arrives: no task wakes per read (the relay's per-chunk path)."""
        self._sink = sink
        self._to_sink(sink)

    def pause(self) -> None:
        """Stop reading the backend's socket (the client is slower)."""
        if not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self._conn.transport is not None:
            self._paused = False
            self._conn.transport.resume_reading()

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body; over ``limit`` bytes raises :class:`UpstreamError`."""
        parts: list[bytes] = []
        size = 0
        async for piece in self.pieces():
            size += len(piece)
            if limit is not None and size > limit:
                raise UpstreamError(f"the backend's answer is over {limit} bytes")
            parts.append(piece)
        return b"".join(parts)

    @property
    def complete(self) -> bool:
        return self._state == _DONE and self._error is None

    def release(self) -> None:
        """The exchange is over: the connection goes back to the pool if it may."""
        self._conn.finished(self.complete and self._keep_alive)

    def close(self) -> None:
        """Drop the connection (the backend sees the client go)."""
        self._conn.abort()


class Upstream:
    """Keep-alive connections to backends, by host and port."""

    def __init__(self, keepalive_s: float = 4.0, connect_timeout_s: float = 5.0) -> None:
        self.keepalive_s = keepalive_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: dict[_Key, list[_Connection]] = {}
        self._targets: dict[str, tuple[_Key, str, bytes]] = {}
        self._tls: ssl.SSLContext | None = None
        self._closed = False
        self._sweep: asyncio.TimerHandle | None = None

    def _target(self, url: str) -> tuple[_Key, str, bytes]:
        """((scheme, host, port), path, Host header line) of ``url``, parsed once per URL."""
        target = self._targets.get(url)
        if target is None:
            parts = urlsplit(url)
            if parts.scheme not in _DEFAULT_PORTS or parts.hostname is None:
                # Not the URL itself: it may carry user:password.
                raise UpstreamConnectError("a backend URL must be http(s)://host[:port]/...")
            default = _DEFAULT_PORTS[parts.scheme]
            port = parts.port or default
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
            if port != default:
                host = f"{host}:{port}"
            target = ((parts.scheme, parts.hostname, port), path,
                      f"Host: {host}\r\n".encode("idna"))
            if len(self._targets) < 1024:
                self._targets[url] = target
        return target

    def _put(self, conn: _Connection) -> None:
        if self._closed:
            conn.abort()
            return
        conn.idle_since = time.monotonic()
        self._idle.setdefault(conn.key, []).append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(self.keepalive_s, self._expire)

    def _expire(self) -> None:
        """Close the connections idle for ``keepalive_s``: after a burst, the pool shrinks
        back instead of holding its peak's connections open (one timer for the pool, not
        one per connection)."""
        self._sweep = None
        now = time.monotonic()
        for key, idle in list(self._idle.items()):
            keep = [c for c in idle if not c.closed and now - c.idle_since < self.keepalive_s]
            for conn in idle:
                if conn not in keep:
                    conn.abort()
            if keep:
                self._idle[key] = keep
            else:
                del self._idle[key]
        if self._idle and not self._closed:
            oldest = min(c.idle_since for idle in self._idle.values() for c in idle)
            self._sweep = asyncio.get_running_loop().call_later(
                max(0.01, oldest + self.keepalive_s - now), self._expire)

    def _get(self, key: _Key) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to be closing
            if conn.closed or conn.transport is None or conn.transport.is_closing() \
                    or now - conn.idle_since > self.keepalive_s:
                conn.abort()
                continue
            return conn
        return None

    async def _connect(self, key: _Key) -> _Connection:
        loop = asyncio.get_running_loop()
        scheme, host, port = key
        tls = None
        if scheme == "https":
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, key), host, port, ssl=tls,
                    server_hostname=host if tls is not None else None)
        except TimeoutError as e:
            raise UpstreamConnectError(f"connect to {host}:{port} timed out") from e
        except OSError as e:
            raise UpstreamConnectError(f"{type(e).__name__}: {e}") from e
        return conn

    async def request(self, method: str, url: str, body: bytes = b"",
                      headers: Mapping[str, str] | None = None) -> UpstreamResponse:
        """Send the request; returns once the response's head is read. Raises
        :class:`UpstreamConnectError` before anything was sent, :class:`UpstreamError`
        after."""
        key, path, host_line = self._target(url)
        conn = self._get(key) or await self._connect(key)
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        head = (f"{method} {path} HTTP/1.1\r\n".encode() + host_line
                + f"{extra}Content-Length: {len(body)}\r\n\r\n".encode("latin-1"))
        response = conn.start(head + body)
        try:
            await response.head()
        except BaseException:
            response.close()
            raise
        return response

    async def get(self, url: str, timeout_s: float,
                  headers: Mapping[str, str] | None = None) -> tuple[int, bytes]:
        """GET ``url`` and read the whole answer within ``timeout_s`` (connect included):
        its status and body, at most :data:`MAX_GET_BODY` bytes. Raises
        :class:`TimeoutError`, :class:`UpstreamConnectError` or :class:`UpstreamError`; the
        connection goes back to the pool only after a whole
        answer, so a late one never leaves a half-read connection behind."""
        response: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.request("GET", url, headers=headers)
                body = await response.read(MAX_GET_BODY)
        except BaseException:
            if response is not None:
                response.close()
            raise
        response.release()
        return response.status, body

    async def close(self) -> None:
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for conns in self._idle.values():
            for conn in conns:
                conn.abort()
        self._idle.clear()
        await asyncio.sleep(0)  # let the transports' connection_lost run
