"""The sidecar's listening socket: aiohttp's own HTTP/1.1 server, with what a server that
faces hostile clients adds to it.

- **A cap on open client connections** (``max_client_connections``). A connection accepted
  beyond it is still read by aiohttp's parser, and its request answered ``503
  too_many_connections`` with ``Connection: close``, so the client learns why instead of
  seeing a reset.
- **Parse errors that quote nothing.** aiohttp answers a head its parser refuses with a 400
  whose text, and an ERROR log line whose traceback, quote the offending bytes; a header
  line can hold an API key (a key file with CRLF endings, a NUL after the key). Here the
  answer is an OpenAI-style error body naming only the kind of fault, and the log line names
  the exception's class.

Everything else (the parser's limits on lines, fields and header counts, ``Host`` rules,
keep-alive, lingering reads of a body left unread, disconnects cancelling handlers) is
aiohttp's, unchanged: the project parses HTTP with a maintained library, never by hand.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from typing import Any

import orjson
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from weighbridge import headers as headers_

log = logging.getLogger("weighbridge.sidecar")

TOO_MANY_CONNECTIONS = "too_many_connections"
# Descriptors a process needs beyond one per client connection: an upstream connection per
# request in flight (at most one per client connection), scrapes, Redis, logs.
_SPARE_DESCRIPTORS = 64


def error_body(message: str, type_: str, code: str) -> bytes:
    """The OpenAI-style error body every refusal of the sidecar's carries."""
    return orjson.dumps({"error": {"message": message, "type": type_, "code": code}})


class ClientConnection(web.RequestHandler):
    """aiohttp's handler of one client connection; refusals of its parser are answered
    and logged without the bytes they quote."""

    __slots__ = ("_counted", "_counts", "over_capacity")

    def __init__(self, manager: web.Server, *, counts: ClientConnections,
                 **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._counts = counts
        self._counted = False
        # Accepted beyond max_client_connections: every request on it is answered 503.
        self.over_capacity = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.over_capacity = not self._counts.admit()
        self._counted = not self.over_capacity
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        super().connection_lost(exc)
        if self._counted:
            self._counted = False
            self._counts.open -= 1

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if not isinstance(exc, HttpProcessingError):
            return super().handle_error(request, status, exc, message)
        # The parser's message quotes the line it refused, which may carry a key.
        log.info("refused a malformed request from %s: %s", request.remote,
                 type(exc).__name__)
        response = web.Response(
            body=error_body(f"malformed HTTP request ({type(exc).__name__})",
                            "invalid_request_error", "bad_request"),
            status=status, content_type="application/json",
            headers={headers_.REJECT_REASON: "bad_request"})
        response.force_close()
        return response


class ClientConnections:
    """The protocol factory of the sidecar's listening socket: aiohttp's handler per
    connection, counting the connections it admits."""

    def __init__(self, server: web.Server, max_connections: int, **handler_args: Any) -> None:
        self._server = server
        self._max = max_connections
        self._args = handler_args
        self.open = 0  # connections admitted and not yet closed

    def __call__(self) -> ClientConnection:
        return ClientConnection(self._server, counts=self, loop=asyncio.get_running_loop(),
                                **self._args)

    def admit(self) -> bool:
        """Count a new connection in, unless the cap is reached."""
        if self.open >= self._max:
            return False
        self.open += 1
        return True


def refuse_over_capacity(request: web.Request) -> web.Response | None:
    """The answer to a request on a connection accepted beyond the cap, or None."""
    if not getattr(request.protocol, "over_capacity", False):
        return None
    response = web.Response(
        body=error_body("too many client connections; retry shortly", "server_error",
                        TOO_MANY_CONNECTIONS),
        status=503, content_type="application/json",
        headers={headers_.REJECT_REASON: TOO_MANY_CONNECTIONS, "Retry-After": "1"})
    response.force_close()
    return response


def ensure_descriptors(max_connections: int) -> None:
    """Raise the soft limit on open files towards what ``max_connections`` needs, warning
    when the hard limit leaves less: running out of descriptors fails every tenant."""
    needed = 2 * max_connections + _SPARE_DESCRIPTORS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
    if soft != resource.RLIM_INFINITY and soft < needed:
        log.warning("max_client_connections %d needs %d open files; the limit is %d",
                    max_connections, needed, soft)


class ClientSite(web.TCPSite):
    """aiohttp's TCP site, listening through :class:`ClientConnections`."""

    def __init__(self, runner: web.AppRunner, host: str, port: int, *,
                 max_connections: int, keepalive_timeout: float) -> None:
        super().__init__(runner, host, port)
        self._max_connections = max_connections
        self._keepalive_timeout = keepalive_timeout
        self.connections: ClientConnections | None = None

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self.connections = ClientConnections(
            server, self._max_connections, keepalive_timeout=self._keepalive_timeout,
            # As vLLM's server, no request body is decompressed: a Content-Encoding'd body is
            # not JSON (400), and no small body inflates to gigabytes.
            auto_decompress=False, access_log=None)
        self._server = await asyncio.get_running_loop().create_server(
            self.connections, self._host, self._port, backlog=self._backlog,
            reuse_address=self._reuse_address, reuse_port=self._reuse_port)
