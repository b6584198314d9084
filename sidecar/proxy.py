"""Relaying one request to a backend and its answer to the client, byte-faithfully.

The only bytes the sidecar changes on the way back are the usage chunk it asked the backend
for on the client's behalf (``stream_options.include_usage`` is forced on so the sidecar
learns the real token counts; the chunk is dropped again if the client did not ask for it).
Everything else — event boundaries, field order, unknown fields — passes through as sent. The
events of one read from the backend go to the client in one write (the HTTP chunk framing
may differ; SSE's framing is the blank line, which stays).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Mapping

import orjson
from aiohttp import web

from weighbridge.sidecar.session import BACKEND_FAILED, RelayOutcome, Usage
from weighbridge.sidecar.upstream import (
    HIGH_WATER,
    Upstream,
    UpstreamConnectError,
    UpstreamError,
    UpstreamResponse,
)

# Response headers that describe the backend's connection, not the content.
_HOP_BY_HOP = frozenset({
    "connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding",
    "date", "server", "proxy-authenticate", "proxy-authorization", "te", "trailer", "upgrade",
})

_DONE = b"data: [DONE]"


class BackendUnavailable(Exception):
    """The backend could not be reached: the request never left the sidecar (connection
    refused, connect timeout), so it may be retried on another backend."""


class BackendFailed(Exception):
    """The backend took the request and failed before anything reached the client (it
    dropped the connection, or the answer's body broke off). Not retried: the backend may
    have been working on it, and a request that crashes backends must not visit them all."""


def _usage_of(obj: object) -> Usage | None:
    if not isinstance(obj, dict):
        return None
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if c is None and isinstance(p, int) and usage.get("total_tokens") == p:
        c = 0  # an embeddings answer: OpenAI's usage there has no completion_tokens
    if isinstance(p, int) and isinstance(c, int):
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if not isinstance(cached, int) or isinstance(cached, bool) or not 0 <= cached <= p:
            cached = None  # absent, or not a count of this prompt's tokens
        return Usage(p, c, cached)
    return None


def _carries_content(event: bytes) -> bool:
    """Whether an SSE chunk carries generated content (text, reasoning or tool-call delta),
    as opposed to a role-only chunk, an empty delta or the usage chunk."""
    # bytes.find, not `in`: CPython 3.11's bytes `in` first tries the operand as an integer,
    # raising and clearing a TypeError every time (callgrind: ~1,800 instructions a test).
    if event.find(b'"choices":[]') >= 0:
        return False
    try:
        obj = orjson.loads(event[len(b"data: "):])
    except orjson.JSONDecodeError:
        return False
    for choice in obj.get("choices") or ():
        if choice.get("text"):
            return True
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") \
                or delta.get("tool_calls"):
            return True
    return False


def error_event(message: str, code: str = BACKEND_FAILED) -> bytes:
    """The SSE event that ends a stream the backend broke off (then ``data: [DONE]``)."""
    body = {"error": {"message": message, "type": "server_error", "code": code}}
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def relay(
    upstream: Upstream,
    url: str,
    body: bytes,
    request: web.Request,
    extra_headers: Mapping[str, str],
    *,
    stream: bool,
    strip_usage_chunk: bool,
    on_content: Callable[[int], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    upstream_headers: Mapping[str, str] | None = None,
) -> tuple[web.StreamResponse, RelayOutcome]:
    """POST ``body`` to ``url`` and relay the answer to ``request``'s client.

    Raises :class:`BackendUnavailable` if the backend could not be reached (the caller may
    retry elsewhere) and :class:`BackendFailed` if it failed before anything was sent to the
    client (the caller answers 502). Once the client has the response headers, a backend
    failure ends the stream with an error event instead. A client that goes away either
    cancels the handler (``CancelledError`` is raised here) or makes a write fail (the
    outcome says ``client_gone``); either way the upstream connection is closed, which
    aborts the backend's request. ``upstream_headers`` go to the backend besides the
    content type (the trace context); the client's own headers never do.
    """
    answer = await _post(upstream, url, body, upstream_headers)
    complete = False
    try:
        headers = {k: v for k, v in answer.headers if k.lower() not in _HOP_BY_HOP}
        headers.update(extra_headers)
        if stream and answer.status == 200 and answer.content_type == "text/event-stream":
            response, outcome = await _relay_stream(answer, request, headers,
                                                    strip_usage_chunk, on_content, clock)
            complete = not (outcome.broken or outcome.client_gone)
        else:
            response, outcome = await _relay_whole(answer, headers, clock)
            complete = True
        return response, outcome
    finally:
        # Closing (not releasing) an unfinished upstream drops its connection, which is how
        # the backend learns the client went away and aborts the sequence.
        if complete:
            answer.release()
        else:
            answer.close()


async def _post(upstream: Upstream, url: str, body: bytes,
                upstream_headers: Mapping[str, str] | None) -> UpstreamResponse:
    """The backend's response, its head read; the two exceptions say whether the request
    may be retried elsewhere."""
    try:
        return await upstream.request("POST", url, body, {**(upstream_headers or {}),
                                                          "Content-Type": "application/json"})
    except UpstreamConnectError as e:
        raise BackendUnavailable(str(e)) from e
    except (UpstreamError, OSError) as e:
        raise BackendFailed(f"{type(e).__name__}: {e}") from e


async def _relay_whole(upstream: UpstreamResponse, headers: dict[str, str],
                       clock: Callable[[], float]) -> tuple[web.Response, RelayOutcome]:
    """A whole answer (not streamed, or the backend's error answer to a streamed request),
    passed on as one response; usage read from a successful one."""
    try:
        payload = await upstream.read()
    except (UpstreamError, OSError) as e:
        raise BackendFailed(f"{type(e).__name__}: {e}") from e
    usage = None
    if upstream.status == 200:
        try:
            usage = _usage_of(orjson.loads(payload))
        except orjson.JSONDecodeError:
            usage = None
    response = web.Response(body=payload, status=upstream.status, headers=headers)
    return response, RelayOutcome(upstream.status, usage, clock() if usage else None, 0)


async def _relay_stream(upstream: UpstreamResponse, request: web.Request,
                        headers: dict[str, str], strip_usage_chunk: bool,
                        on_content: Callable[[int], None] | None,
                        clock: Callable[[], float]
                        ) -> tuple[web.StreamResponse, RelayOutcome]:
    """An SSE stream, relayed as its events arrive. A backend that breaks off ends the
    client's stream with an error event (``broken``); a client that goes away makes a write
    fail (``client_gone``).

    The handler's task writes the first output (with the response head, in one write) and the
    last (with the end of the chunked body); everything between goes from the backend's
    socket to the client's in the connection's callback (:class:`_Relay`), without waking
    the task per chunk."""
    outcome = RelayOutcome(200, None, None, 0)
    complete = False
    relay = _Relay(upstream, request, outcome, strip_usage_chunk, on_content, clock)
    try:
        response = web.StreamResponse(status=200, headers=headers)
        await response.prepare(request)
        # Chunked for HTTP/1.1 clients; an HTTP/1.0 client's body ends with the connection.
        relay.chunked = bool(getattr(request.writer, "chunked", True))
        upstream.stream_to(relay)
        while not relay.ended:
            await relay.wait()
            relay.check()
            if not relay.direct and not relay.ended:
                # The head goes with the first output; until it is out, outputs queue here.
                while out := relay.take():
                    await response.write(out)
                    relay.check()
                    if relay.drain:
                        relay.drained()
                relay.direct = True  # no await since the queue was found empty
            if relay.drain:
                await request.writer.drain()
                relay.drained()
        relay.check()
        tail = relay.take()
        if outcome.broken or (outcome.usage is None and not outcome.content_chunks):
            outcome.broken = True
            outcome.error = outcome.error or "backend ended the stream early"
            tail += error_event(f"backend failed mid-stream: {outcome.error}") + _DONE + b"\n\n"
        complete = not outcome.broken
        await response.write_eof(tail)  # the last output and the body's end in one write
    except ConnectionResetError:
        # A write to the client failed: it went away. Unless the backend had finished,
        # the caller closes the upstream, which aborts the request there. Returning (not
        # raising) lets aiohttp end the exchange quietly.
        outcome.client_gone = not complete and not outcome.broken
    return response, outcome


class _Relay:
    """The body's path from the backend's connection to the client's: SSE events cut at
    their blank lines, counted, the usage chunk read (and dropped unless the client asked
    for it), and written straight to the client's transport once the response head is out
    (``direct``); before that, and for the last output, queued for the handler's task."""

    __slots__ = ("_buffer", "_failure", "_pending", "_pending_bytes", "_strip", "_transport",
                 "_upstream", "_waiter", "chunked", "clock", "direct", "drain", "ended", "gone",
                 "on_content", "outcome")

    def __init__(self, upstream: UpstreamResponse, request: web.Request,
                 outcome: RelayOutcome,
                 strip_usage_chunk: bool, on_content: Callable[[int], None] | None,
                 clock: Callable[[], float]) -> None:
        self._upstream = upstream
        self._transport = request.transport
        self.chunked = True
        self._strip = strip_usage_chunk
        self.on_content = on_content
        self.clock = clock
        self.outcome = outcome
        self._buffer = b""
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._waiter: asyncio.Future[None] | None = None
        self._failure: BaseException | None = None
        self.direct = False
        self.drain = False
        self.ended = False
        self.gone = False

    # -- the handler's task ------------------------------------------------------------------

    async def wait(self) -> None:
        if self._pending or self.ended or self.drain or self.gone or self._failure:
            return
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def check(self) -> None:
        """Raise what the callbacks found: the client gone, or an error of the shell's."""
        if self._failure is not None:
            raise self._failure
        if self.gone:
            raise ConnectionResetError("the client went away")

    def take(self) -> bytes:
        pending = self._pending
        if not pending:
            return b""
        out = pending[0] if len(pending) == 1 else b"".join(pending)
        pending.clear()
        self._pending_bytes = 0
        return out

    def drained(self) -> None:
        self.drain = False
        self._upstream.resume()

    # -- the backend connection's callbacks (sidecar.upstream.BodySink) ------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def data(self, data: bytes, last: bool) -> None:
        try:
            buffer = self._buffer + data if self._buffer else data
            end = buffer.rfind(b"\n\n")
            if end < 0:
                self._buffer = buffer
                return
            # Every complete event of this read goes out in one write: one system call
            # instead of one per event when the backend got ahead of us.
            events, self._buffer = buffer[: end + 2], buffer[end + 2:]
            out = _select(events, self.outcome, self._strip, self.on_content, self.clock)
            if not out:
                return
            if self.direct and not last:
                self._write(out)
            else:
                self._pending.append(out)
                self._pending_bytes += len(out)
                if self._pending_bytes > HIGH_WATER:
                    # The handler's task is still writing an earlier output to a slow
                    # client: what waits for it is bounded as the direct path's buffer is.
                    self._upstream.pause()
                    self.drain = True
                self._wake()
        except BaseException as e:  # a bug of the shell's: the handler raises it
            self._fail(e)

    def end(self, error: BaseException | None) -> None:
        try:
            if error is not None:
                self.outcome.broken = True
                self.outcome.error = f"{type(error).__name__}: {error}"
            elif self._buffer.strip():  # a last event without its blank line
                out = _select(self._buffer, self.outcome, self._strip, self.on_content,
                              self.clock)
                if out:
                    self._pending.append(out)
            self._buffer = b""
        except BaseException as e:
            self._fail(e)
        self.ended = True
        self._wake()

    def _fail(self, error: BaseException) -> None:
        self._failure = error
        self.ended = True
        self._upstream.close()
        self._wake()

    def _write(self, out: bytes) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            self.gone = True
            self.ended = True
            self._upstream.close()
            self._wake()
            return
        transport.write(b"%x\r\n%b\r\n" % (len(out), out) if self.chunked else out)
        if transport.get_write_buffer_size() > HIGH_WATER:
            # The client reads slower than the backend writes: stop reading the backend
            # until the handler's task has drained the client's buffer.
            self._upstream.pause()
            self.drain = True
            self._wake()


def _select(events: bytes, outcome: RelayOutcome, strip_usage_chunk: bool,
            on_content: Callable[[int], None] | None, clock: Callable[[], float]) -> bytes:
    """One read's complete SSE events (each ending in a blank line, but the last of a
    stream may not), less a usage chunk to strip; the content chunks among them counted.
    Only the framing is read: a content chunk is a ``data: {`` event once the first one
    showed content (parsed until then), the usage chunk the one with ``"usage":{`` and no
    choices (the only one parsed in full)."""
    content = 0
    kept: list[bytes] | None = None  # the events written, once one is dropped
    start = 0
    while start < len(events):
        end = events.find(b"\n\n", start)
        end = len(events) if end < 0 else end + 2
        event = events[start:end]
        drop = False
        if event.startswith(b"data: {") and event.find(b'"usage":{') >= 0 \
                and event.find(b'"choices":[]') >= 0:  # find: see _carries_content
            with contextlib.suppress(orjson.JSONDecodeError):
                outcome.usage = _usage_of(orjson.loads(event[len(b"data: "):]))
            drop = strip_usage_chunk
        elif event.startswith(b"data: {") and (
            # Parse only until the first content chunk; after it every data chunk is content.
            outcome.first_token_s is not None or _carries_content(event)
        ):
            content += 1
            if outcome.first_token_s is None:
                outcome.first_token_s = clock()
        if drop and kept is None:
            kept = [events[:start]]
        elif not drop and kept is not None:
            kept.append(event)
        start = end
    if content:
        outcome.content_chunks += content
        if on_content is not None:
            on_content(content)
    return events if kept is None else b"".join(kept)
