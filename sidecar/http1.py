"""The sidecar's HTTP/1.1 front for its hot path: the generation endpoints served from an
``asyncio.Protocol`` of its own instead of aiohttp's request machinery.

aiohttp's server costs ~30 µs of CPU per request on this machine beyond a bare protocol
(its parser, ``web.Request``, the handler task's layers, ``StreamResponse``); at 200 streamed
requests/s that was most of what stood between the sidecar and its 400 µs target
(docs/sidecar-performance.md). This front takes the plainest, commonest request only:
``POST`` to one of the generation endpoints, HTTP/1.1, an ASCII head of well-formed header
lines, a ``Content-Length`` body no larger than the configured limit, no
``Transfer-Encoding``, ``Expect`` or ``Upgrade``. Any
other request — every other path, a malformed or unusual head, a body too large — is handed
with its connection to aiohttp's own protocol, bytes unread and all, so it is answered
exactly as before (404, 405, 413, 400, ``/metrics``, ``/admin``...), and the connection
stays with aiohttp from then on.

The handlers are the application's own (``Sidecar.completions`` and the rest, through its
error middleware): the request they get is a :class:`FrontRequest`, which offers what they
read of aiohttp's, and their answer is written here the way aiohttp writes it (the same
status line and headers: ``Date``, ``Server``, ``Content-Length`` or chunked,
``Connection: close`` when the exchange ends the connection). As with aiohttp's
``handler_cancellation``, a client that disconnects cancels its handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from http import HTTPStatus
from typing import Any, cast

from aiohttp import web
from aiohttp.helpers import rfc822_formatted_time
from aiohttp.http import SERVER_SOFTWARE
from multidict import CIMultiDict, CIMultiDictProxy

log = logging.getLogger("weighbridge.sidecar")

Handler = Callable[[Any], Awaitable[Any]]
Middleware = Callable[[Any, Handler], Awaitable[Any]]

# A head this front takes: header lines of a token, a colon and visible ASCII (or tabs and
# spaces), nothing else. Anything else goes to aiohttp, whose parser judges it as before.
_HEADER_LINE = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+:[\t\x20-\x7e]*")
_MAX_HEAD = 8190  # aiohttp's default line limit: a longer head is aiohttp's to refuse
_PASSED_ON = frozenset({b"transfer-encoding", b"expect", b"upgrade"})
_CRLF = b"\r\n"


class _Writer:
    """What the relay and the error middleware read of aiohttp's ``StreamWriter``."""

    __slots__ = ("_conn", "chunked", "output_size")

    def __init__(self, conn: FrontProtocol) -> None:
        self._conn = conn
        self.chunked = True  # HTTP/1.1 only
        self.output_size = 0

    async def drain(self) -> None:
        await self._conn.drain()


class _Content:
    __slots__ = ("_request",)

    def __init__(self, request: FrontRequest) -> None:
        self._request = request

    def is_eof(self) -> bool:
        return self._request._body is not None


class FrontStream:
    """A streamed answer written by the relay: its head goes with the first output."""

    __slots__ = ("_head", "_request", "status")

    def __init__(self, request: FrontRequest, status: int,
                 headers: Mapping[str, str]) -> None:
        self._request = request
        self.status = status
        self._head: bytes | None = _head(status, _reason(status), headers, request.keep_alive,
                                         b"Transfer-Encoding: chunked\r\n")

    def _send(self, data: bytes) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("Cannot write to closing transport")
        if self._head is not None:
            data = self._head + data
            self._head = None
        self._request.writer.output_size += len(data)
        transport.write(data)

    async def write(self, data: bytes) -> None:
        if data:
            self._send(b"%x\r\n%b\r\n" % (len(data), data))
        elif self._head is not None:
            self._send(b"")
        await self._request.writer.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        self._send(b"%x\r\n%b\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        self._request._streamed = True
        await self._request.writer.drain()


class FrontRequest:
    """What the sidecar's handlers read of an aiohttp ``web.Request``."""

    __slots__ = ("_body", "_body_waiter", "_streamed", "content", "handler", "headers",
                 "keep_alive", "method", "path", "transport", "writer")

    def __init__(self, conn: FrontProtocol, path: str, handler: Handler,
                 headers: CIMultiDictProxy[str], keep_alive: bool) -> None:
        self.handler = handler
        self.method = "POST"
        self.path = path
        self.headers = headers
        self.keep_alive = keep_alive
        self.transport = conn.transport
        self.writer = _Writer(conn)
        self.content = _Content(self)
        self._body: bytes | None = None
        self._body_waiter: asyncio.Future[None] | None = None
        self._streamed = False

    async def read(self) -> bytes:
        while self._body is None:
            self._body_waiter = asyncio.get_running_loop().create_future()
            try:
                await self._body_waiter
            finally:
                self._body_waiter = None
        return self._body

    def _set_body(self, body: bytes) -> None:
        self._body = body
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def stream(self, status: int, headers: Mapping[str, str]) -> FrontStream:
        return FrontStream(self, status, headers)


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def _head(status: int, reason: str, headers: Mapping[str, str], keep_alive: bool,
          framing: bytes) -> bytes:
    """The status line and headers as aiohttp writes them for an HTTP/1.1 client."""
    lines = [f"HTTP/1.1 {status} {reason}\r\n"]
    has = set()
    for name, value in headers.items():
        lower = name.lower()
        if lower in ("content-length", "transfer-encoding"):
            continue  # the framing is this front's
        has.add(lower)
        lines.append(f"{name}: {value}\r\n")
    if "content-type" not in has:
        lines.append("Content-Type: application/octet-stream\r\n")
    if "date" not in has:
        lines.append(f"Date: {rfc822_formatted_time()}\r\n")
    if "server" not in has:
        lines.append(f"Server: {SERVER_SOFTWARE}\r\n")
    if "connection" not in has and not keep_alive:
        lines.append("Connection: close\r\n")
    return "".join(lines).encode("utf-8") + framing + _CRLF


class FrontProtocol(asyncio.Protocol):
    """One client connection: the fast requests served here, one at a time; the first
    other request hands the connection to aiohttp."""

    def __init__(self, front: Front) -> None:
        self._front = front
        self.transport: asyncio.Transport | None = None
        self._buffer = b""
        self._request: FrontRequest | None = None  # the request being read or answered
        self._body_left = 0
        self._task: asyncio.Task[None] | None = None
        self._idle: asyncio.TimerHandle | None = None
        self._paused = False
        self._reading_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._closed = False

    # -- the transport's callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._front.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._front.connections.discard(self)
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        if self._task is not None and not self._task.done():
            self._task.cancel()  # as aiohttp's handler_cancellation
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_exception(ConnectionResetError("the client went away"))
        self.transport = None

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)

    async def drain(self) -> None:
        if self._closed:
            raise ConnectionResetError("the client went away")
        if not self._paused:
            return
        self._drain = asyncio.get_running_loop().create_future()
        try:
            await self._drain
        finally:
            self._drain = None

    def data_received(self, data: bytes) -> None:
        request = self._request
        if request is not None and request._body is None:
            # The body of the request being read.
            take = min(self._body_left, len(data))
            self._buffer += data[:take]
            self._body_left -= take
            rest = data[take:]
            if not self._body_left:
                body, self._buffer = self._buffer, rest
                request._set_body(body)
            elif rest:  # pragma: no cover (take < len(data) only when the body is whole)
                self._buffer += rest
            return
        self._buffer += data
        if self._task is None:
            self._next()
        elif len(self._buffer) > _MAX_HEAD and self.transport is not None \
                and not self._reading_paused:
            # A client sending ahead of its answer: wait for the answer to end.
            self._reading_paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # close the transport (a half-closed client is done)

    # -- requests ---------------------------------------------------------------------------------

    def _arm_idle(self) -> None:
        loop = asyncio.get_running_loop()
        self._idle = loop.call_later(self._front.keepalive_s, self._expire)

    def _expire(self) -> None:
        self._idle = None
        if self._task is None and self.transport is not None:
            self.transport.close()

    def _next(self) -> None:
        """Start the next request in the buffer, once its head is whole."""
        buffer = self._buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(buffer) > _MAX_HEAD:
                self._hand_over()
            return
        parsed = self._front.parse(buffer[:end])
        if parsed is None:
            self._hand_over()
            return
        path, handler, headers, length, keep_alive = parsed
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        request = FrontRequest(self, path, handler, headers, keep_alive)
        body = buffer[end + 4:end + 4 + length]
        self._buffer = buffer[end + 4 + length:]
        self._request = request
        if len(body) == length:
            request._body = body
        else:
            self._body_left = length - len(body)
            self._buffer, body = body, b""
        self._task = asyncio.get_running_loop().create_task(self._answer(request))

    def _hand_over(self) -> None:
        """aiohttp's protocol takes the connection and everything unread."""
        transport = self.transport
        if transport is None:
            return
        if self._idle is not None:
            self._idle.cancel()
            self._idle = None
        self._front.connections.discard(self)
        protocol = self._front.aiohttp_protocol()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        buffer, self._buffer = self._buffer, b""
        self.transport = None
        if buffer:
            protocol.data_received(buffer)

    async def _answer(self, request: FrontRequest) -> None:
        keep_alive = request.keep_alive
        try:
            response = await self._front.handle(request)
            if isinstance(response, FrontStream):
                keep_alive = keep_alive and request._streamed  # else the stream broke off
            elif self.transport is not None:
                keep_alive = self._write_whole(request, response)
            if request._body is None:
                keep_alive = False  # answered before its body came: the rest is unread
        except asyncio.CancelledError:
            keep_alive = False
        except Exception:  # the middleware answered all it could: drop the connection
            keep_alive = False
        finally:
            self._task = None
            self._request = None
        transport = self.transport
        if transport is None or self._closed:
            return
        if not keep_alive or transport.is_closing():
            transport.close()
            return
        self._arm_idle()
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        if self._buffer:
            self._next()

    def _write_whole(self, request: FrontRequest, response: Any) -> bool:
        """A whole answer (``web.Response``), written as aiohttp would; whether the
        connection stays open."""
        assert isinstance(response, web.Response) and self.transport is not None
        body = response.body
        assert isinstance(body, bytes | bytearray)
        keep_alive = request.keep_alive and response.keep_alive is not False
        head = _head(response.status, response.reason, response.headers, keep_alive,
                     b"Content-Length: %d\r\n" % len(body))
        self.transport.write(head + body)
        return keep_alive


class Front:
    """The protocol factory: which paths are served here, the handlers, and aiohttp's own
    protocol factory for everything else."""

    def __init__(self, routes: Mapping[str, Handler], middleware: Middleware,
                 aiohttp_server: Callable[[], asyncio.Protocol], *, max_body: int,
                 keepalive_s: float) -> None:
        self._routes = {path.encode("ascii"): (path, handler) for path, handler in routes.items()}
        self._middleware = middleware
        self.aiohttp_protocol = aiohttp_server
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.connections: set[FrontProtocol] = set()

    def __call__(self) -> FrontProtocol:
        return FrontProtocol(self)

    def parse(self, head: bytes) -> tuple[str, Handler, CIMultiDictProxy[str], int,
                                          bool] | None:
        """(path, handler, headers, body length, keep-alive) of a head this front takes,
        else None."""
        if not head.isascii():
            return None
        lines = head.split(_CRLF)
        method, _, rest = lines[0].partition(b" ")
        target, _, version = rest.partition(b" ")
        if method != b"POST" or version != b"HTTP/1.1":
            return None
        route = self._routes.get(target)
        if route is None:
            return None
        pairs: list[tuple[str, str]] = []
        length: int | None = None
        keep_alive = True
        match = _HEADER_LINE.fullmatch
        for line in lines[1:]:
            if match(line) is None:
                return None
            name, _, value = line.partition(b":")
            lower = name.lower()
            value = value.strip(b" \t")
            if lower == b"content-length":
                if length is not None or not value.isdigit():
                    return None
                length = int(value)
            elif lower in _PASSED_ON:
                return None
            elif lower == b"connection":
                tokens = {t.strip().lower() for t in value.split(b",")}
                if not tokens <= {b"close", b"keep-alive"}:
                    return None
                keep_alive = b"close" not in tokens
            pairs.append((name.decode("ascii"), value.decode("ascii")))
        if length is None or length > self.max_body:
            return None
        return route[0], route[1], CIMultiDictProxy(CIMultiDict(pairs)), length, keep_alive

    async def handle(self, request: FrontRequest) -> Any:
        return await self._middleware(request, request.handler)

    async def shutdown(self, timeout: float) -> None:
        """Idle connections close; those answering get up to ``timeout`` seconds, then
        their handlers are cancelled."""
        tasks = []
        for conn in list(self.connections):
            if conn._task is None:
                if conn.transport is not None:
                    conn.transport.close()
            else:
                tasks.append(conn._task)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            for task in pending:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pending, return_exceptions=True)
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()


class FrontSite(web.TCPSite):
    """aiohttp's TCP site, listening through :class:`Front` (which passes aiohttp's share of
    the traffic on to the runner's own protocol)."""

    def __init__(self, runner: web.AppRunner, host: str, port: int,
                 make_front: Callable[[Callable[[], asyncio.Protocol]], Front],
                 shutdown_timeout: float = 60.0) -> None:
        super().__init__(runner, host, port)
        self._make_front = make_front
        self._front: Front | None = None
        self._shutdown_timeout = shutdown_timeout

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._front = self._make_front(server)
        self._server = await asyncio.get_running_loop().create_server(
            self._front, self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)

    async def stop(self) -> None:
        await super().stop()
        if self._front is not None:
            await self._front.shutdown(self._shutdown_timeout)
