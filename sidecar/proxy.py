"""Relaying one request to a backend and its answer to the client, byte-faithfully.

The only bytes the sidecar changes on the way back are the usage chunk it asked the backend
for on the client's behalf (``stream_options.include_usage`` is forced on so the sidecar
learns the real token counts; the chunk is dropped again if the client did not ask for it).
Everything else — event boundaries, field order, unknown fields — passes through as sent. The
events of one read from the backend go to the client in one write (the HTTP chunk framing
may differ; SSE's framing is the blank line, which stays).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import orjson
from aiohttp import web

from sidecar.upstream import Upstream, UpstreamConnectError, UpstreamError, UpstreamResponse

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


@dataclass(slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int


@dataclass(slots=True)
class RelayOutcome:
    status: int  # the backend's HTTP status
    usage: Usage | None
    first_token_s: float | None  # monotonic time the first content chunk reached the client
    content_chunks: int
    broken: bool = False  # the backend failed after the response started
    error: str | None = None
    client_gone: bool = False  # the client went away mid-stream (the upstream was closed)


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
        return Usage(p, c)
    return None


def _carries_content(event: bytes) -> bool:
    """Whether an SSE chunk carries generated content (text, reasoning or tool-call delta),
    as opposed to a role-only chunk, an empty delta or the usage chunk."""
    if b'"choices":[]' in event:
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


BACKEND_FAILED = "backend_failed"


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
                        clock: Callable[[], float]) -> tuple[web.StreamResponse, RelayOutcome]:
    """An SSE stream, relayed as its events arrive. A backend that breaks off ends the
    client's stream with an error event (``broken``); a client that goes away makes a write
    fail (``client_gone``)."""
    response = web.StreamResponse(status=200, headers=headers)
    outcome = RelayOutcome(200, None, None, 0)
    complete = False
    try:
        await response.prepare(request)
        buffer = b""
        try:
            async for data in upstream.pieces():
                buffer += data
                end = buffer.rfind(b"\n\n")
                if end < 0:
                    continue
                # Every complete event of this read goes out in one write: one system call
                # instead of one per event when the backend got ahead of us (the relay's
                # dominant cost is the socket write, benchmarks/RESULTS.md).
                events, buffer = buffer[: end + 2], buffer[end + 2:]
                await _forward(events, response, outcome, strip_usage_chunk, on_content, clock)
            if buffer.strip():
                await _forward(buffer, response, outcome, strip_usage_chunk, on_content, clock)
        except ConnectionResetError:
            raise  # writing to the client failed: the client is gone, not the backend
        except (UpstreamError, OSError) as e:
            outcome.broken = True
            outcome.error = f"{type(e).__name__}: {e}"
        if outcome.broken or (outcome.usage is None and not outcome.content_chunks):
            outcome.broken = True
            outcome.error = outcome.error or "backend ended the stream early"
            await response.write(error_event(f"backend failed mid-stream: {outcome.error}"))
            await response.write(_DONE + b"\n\n")
        complete = not outcome.broken
        await response.write_eof()
    except ConnectionResetError:
        # A write to the client failed: it went away. Unless the backend had finished,
        # the caller closes the upstream, which aborts the request there. Returning (not
        # raising) lets aiohttp end the exchange quietly.
        outcome.client_gone = not complete and not outcome.broken
    return response, outcome


async def _forward(events: bytes, response: web.StreamResponse, outcome: RelayOutcome,
                   strip_usage_chunk: bool, on_content: Callable[[int], None] | None,
                   clock: Callable[[], float]) -> None:
    """Relay one read's complete SSE events (each ending in a blank line, but the last of a
    stream may not) in one write, counting the content chunks among them."""
    content = 0
    kept: list[bytes] | None = None  # the events written, once one is dropped
    start = 0
    while start < len(events):
        end = events.find(b"\n\n", start)
        end = len(events) if end < 0 else end + 2
        event = events[start:end]
        drop = False
        if event.startswith(b"data: {") and b'"usage":{' in event \
                and b'"choices":[]' in event:
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
    out = events if kept is None else b"".join(kept)
    if out:
        await response.write(out)
