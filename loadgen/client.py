"""The HTTP shell: sends one request with geventhttpclient and feeds a StreamMeter.

geventhttpclient is Locust's fast client (``FastHttpUser``); it is used directly rather than
through ``FastHttpSession`` because the session fires Locust's request event itself, and
weighbridge fires its own per-tenant TTFT and E2E rows from the finished record. Streamed
bodies are read one SSE event at a time (``readline`` on the blank line) and each event is
stamped with the monotonic clock as it comes off the socket.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import orjson
from geventhttpclient import HTTPClient
from geventhttpclient.response import HTTPConnectionClosed, HTTPSocketPoolResponse
from geventhttpclient.url import URL

from weighbridge.loadgen.measure import StreamMeter

__all__ = ["HttpTarget"]


class _Headers:
    """Response headers as the meter reads them (case-insensitive ``get``)."""

    __slots__ = ("_response",)

    def __init__(self, response: HTTPSocketPoolResponse) -> None:
        self._response = response

    def get(self, key: str, default: str | None = None) -> str | None:
        value = self._response.get(key)
        if isinstance(value, list):  # a repeated header: the last one wins
            value = value[-1]
        return value if value is not None else default


def _discard(response: HTTPSocketPoolResponse) -> None:
    """Close the connection of a response that was not read to its end: returning it to
    the pool would hand the rest of this body to the next request."""
    sock, pool = getattr(response, "_sock", None), getattr(response, "_pool", None)
    if sock is not None and pool is not None:
        pool.release_socket(sock)  # closes it and frees its slot in the pool
        response._sock = None
        response._pool = None


class HttpTarget:
    """One server (base URL) with a connection pool shared by all of a process's requests."""

    def __init__(self, base_url: str, *, max_connections: int = 10_000,
                 connect_timeout_s: float = 10.0, read_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        # No read timeout by default: a timeout per recv costs a timer per chunk; the driver
        # bounds each whole request instead (the tenant's timeout_s).
        url = URL(base_url)
        self.prefix = url.path.rstrip("/")
        self.clock = clock
        self.client = HTTPClient.from_url(
            url, concurrency=max_connections, connection_timeout=connect_timeout_s,
            network_timeout=read_timeout_s, block_size=64 * 1024,
            headers={"content-type": "application/json"},
        )

    def close(self) -> None:
        self.client.close()

    def get_json(self, path: str, headers: Mapping[str, str] | None = None) -> object:
        response = self.client.get(self.prefix + path, headers=dict(headers or {}))
        body = response.read()
        if response.status_code != 200:
            raise RuntimeError(f"GET {path}: HTTP {response.status_code}: {body[:200]!r}")
        return orjson.loads(body)

    def exchange(self, path: str, body: bytes, headers: Mapping[str, str],
                 meter: StreamMeter, t0: float = 0.0) -> None:
        """Send ``body`` and measure the answer into ``meter`` (times relative to ``t0``).

        Raises whatever the transport raises (the caller records it as a failure, timeout
        or cancellation); the meter keeps what arrived before.
        """
        clock = self.clock
        uri = self.prefix + path
        meter.sent(clock() - t0)
        try:
            response = self.client.post(uri, body=body, headers=dict(headers))
        except HTTPConnectionClosed:
            # The server closed an idle keep-alive connection as we reused it; nothing was
            # processed, so one retry on a fresh connection is safe.
            response = self.client.post(uri, body=body, headers=dict(headers))
        complete = False
        try:
            meter.response(clock() - t0, response.status_code, _Headers(response))
            if meter.plan.stream and response.status_code == 200:
                readline = response.readline
                feed = meter.feed
                while event := readline(b"\n\n"):
                    feed(event, clock() - t0)
            else:
                meter.body(response.read(), clock() - t0)
            complete = True
            meter.finish(clock() - t0)
        finally:
            if complete:
                response.release()
            else:
                _discard(response)
