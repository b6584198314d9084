"""The sidecar's one HTTP/1.1 client to its backends: a pool of keep-alive connections, each
an ``asyncio.Protocol`` that parses the response itself.

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
scrape. Here a request is one ``write`` of preformatted bytes, the response's status line
and headers are split once, and the body's chunked framing is undone in ``data_received``;
the relay's task wakes once per read from the backend.

Only what the relay needs: ``http://`` and ``https://`` backends (TLS verified against the
system's CAs, as aiohttp's default), ``POST``/``GET`` with a body of known length,
responses framed by ``Content-Length``, chunked transfer coding or the end of the connection, no
``Expect: 100-continue``, no content coding asked for (no ``Accept-Encoding``: the backend
answers in identity, which is what the relay passes on). A connection goes back to the pool
only after a complete response the server did not mark ``Connection: close``; idle ones are
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

# (scheme, host, port): the connections of one backend.
_Key = tuple[str, str, int]
_DEFAULT_PORTS = {"http": 80, "https": 443}
# Buffered body bytes above which the backend's socket is not read until the relay caught
# up (the client reads slower than the backend writes).
HIGH_WATER = 1 << 16
MAX_HEAD = 1 << 16  # status line and headers: more is not a backend we talk to


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


# Parser states of the body.
_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILER, _UNTIL_CLOSE, _DONE = range(8)


def _whole_chunk(data: bytes) -> bytes | None:
    """The data of ``data`` if it is exactly one whole non-empty chunk (size line, data,
    CRLF), else None. The common read of a stream, as an engine writes one event per step:
    taken without the state machine's round, which judges everything else (and names the
    error of a malformed size)."""
    eol = data.find(b"\r\n", 0, 10)
    if eol <= 0:
        return None
    line = data[:eol]
    if not line.isalnum():  # hex digits only (no sign, space, "_", ";")
        return None
    try:
        size = int(line, 16)
    except ValueError:
        return None
    end = eol + 2 + size
    if size and len(data) == end + 2 and data.endswith(b"\r\n"):
        return data[eol + 2:end]
    return None


class UpstreamResponse:
    """A backend's response: its head once :meth:`head` returned, then its body, whole
    (:meth:`read`) or as it arrives (:meth:`pieces`). End it with :meth:`release` (the body
    was read to its end) or :meth:`close` (drops the connection, which tells the backend
    the client is gone)."""

    __slots__ = ("_body", "_buffer", "_conn", "_error", "_head", "_keep_alive", "_left",
                 "_paused", "_sink", "_size", "_state", "_waiter", "content_type", "headers",
                 "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._state = _HEAD
        self._head = b""  # head bytes until the blank line
        self._buffer = b""  # framing bytes not yet parsed (chunk sizes split across reads)
        self._body: list[bytes] = []  # decoded body bytes not yet taken
        self._size = 0
        self._left = 0  # bytes left of the body (Content-Length) or of the chunk
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = True
        self._paused = False
        self._sink: BodySink | None = None
        self.status = 0
        self.headers: list[tuple[str, str]] = []
        self.content_type = ""

    # -- fed by the connection -------------------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    def _feed(self, data: bytes) -> None:
        sink = self._sink
        if sink is not None and self._state == _CHUNK_SIZE and not self._buffer \
                and not self._body:
            # The relay's common read: one whole chunk, straight to the sink (no body list,
            # no drain: with nothing buffered, only the relay itself can have paused reading,
            # and it resumes it).
            piece = _whole_chunk(data)
            if piece is not None:
                sink.data(piece, False)
                return
        try:
            if self._state == _HEAD:
                data = self._parse_head(data)
                if self._state == _HEAD:
                    return
                self._wake()  # the head is there
            if data:
                self._parse_body(data)
        except UpstreamError as e:
            self._error = e
            self._conn.abort()
        if self._sink is not None:
            self._to_sink(self._sink)
            return
        if self._body or self._state == _DONE:
            self._wake()
        if self._size > HIGH_WATER and not self._paused and self._conn.transport is not None:
            self._paused = True
            self._conn.transport.pause_reading()

    def _lost(self, exc: Exception | None) -> None:
        if self._state == _UNTIL_CLOSE:
            self._state = _DONE
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

    def _parse_head(self, data: bytes) -> bytes:
        head = self._head + data
        end = head.find(b"\r\n\r\n")
        if end < 0:
            if len(head) > MAX_HEAD:
                raise UpstreamError("response head too large")
            self._head = head
            return b""
        self._head = b""
        lines = head[:end].decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not code.isdigit():
            raise UpstreamError(f"not an HTTP/1.1 response: {lines[0][:80]!r}")
        self.status = int(code)
        length: int | None = None
        chunked = False
        keep_alive = version == "HTTP/1.1"
        headers = self.headers
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep:
                raise UpstreamError(f"malformed header line {line[:80]!r}")
            value = value.strip()
            headers.append((name, value))
            lower = name.lower()
            if lower == "content-length":
                if not value.isdigit():
                    raise UpstreamError(f"bad Content-Length {value[:40]!r}")
                length = int(value)
            elif lower == "transfer-encoding":
                chunked = value.lower().endswith("chunked")
            elif lower == "content-type":
                self.content_type = value.partition(";")[0].strip().lower()
            elif lower == "connection":
                tokens = {t.strip().lower() for t in value.split(",")}
                if "close" in tokens:
                    keep_alive = False
                elif "keep-alive" in tokens:
                    keep_alive = True
        self._keep_alive = keep_alive
        if self.status in (204, 304) or 100 <= self.status < 200:
            self._state = _DONE
        elif chunked:
            self._state = _CHUNK_SIZE
        elif length is not None:
            self._left = length
            self._state = _LENGTH if length else _DONE
        else:
            self._keep_alive = False
            self._state = _UNTIL_CLOSE
        return head[end + 4:]

    def _take(self, piece: bytes) -> None:
        self._body.append(piece)
        self._size += len(piece)

    def _parse_body(self, data: bytes) -> None:
        state = self._state
        if state == _LENGTH:
            if len(data) >= self._left:
                self._take(data[: self._left])
                self._left = 0
                self._state = _DONE
            else:
                self._take(data)
                self._left -= len(data)
            return
        if state == _UNTIL_CLOSE:
            self._take(data)
            return
        if state == _DONE:
            self._keep_alive = False  # bytes after the response: do not reuse
            return
        if state == _CHUNK_SIZE and not self._buffer:
            piece = _whole_chunk(data)
            if piece is not None:
                self._take(piece)
                return
        buffer = self._buffer + data if self._buffer else data
        self._buffer = b""
        pos, n = 0, len(buffer)
        while pos < n:
            if state == _CHUNK_SIZE:
                eol = buffer.find(b"\r\n", pos)
                if eol < 0:
                    if n - pos > 1024:
                        raise UpstreamError("chunk size line too long")
                    self._buffer = buffer[pos:]
                    break
                line = buffer[pos:eol].partition(b";")[0].strip()
                try:
                    size = int(line, 16)
                except ValueError:
                    raise UpstreamError(f"bad chunk size {line[:20]!r}") from None
                pos = eol + 2
                if size == 0:
                    state = _TRAILER
                else:
                    self._left = size
                    state = _CHUNK_DATA
            elif state == _CHUNK_DATA:
                take = min(self._left, n - pos)
                self._take(buffer[pos:pos + take] if take < n or pos else buffer)
                pos += take
                self._left -= take
                if not self._left:
                    state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if n - pos < 2:
                    self._buffer = buffer[pos:]
                    break
                if buffer[pos:pos + 2] != b"\r\n":
                    raise UpstreamError("chunk not followed by CRLF")
                pos += 2
                state = _CHUNK_SIZE
            elif state == _TRAILER:
                eol = buffer.find(b"\r\n", pos)
                if eol < 0:
                    self._buffer = buffer[pos:]
                    break
                if eol == pos:  # the blank line ending the trailer: the response is whole
                    state = _DONE
                    if eol + 2 < n:
                        self._keep_alive = False
                    break
                pos = eol + 2
            else:  # pragma: no cover
                break
        self._state = state

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

    async def read(self) -> bytes:
        parts = [piece async for piece in self.pieces()]
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
        its status and body. Raises :class:`TimeoutError`, :class:`UpstreamConnectError` or
        :class:`UpstreamError`; the connection goes back to the pool only after a whole
        answer, so a late one never leaves a half-read connection behind."""
        response: UpstreamResponse | None = None
        try:
            async with asyncio.timeout(timeout_s):
                response = await self.request("GET", url, headers=headers)
                body = await response.read()
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
