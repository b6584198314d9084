"""The relay in process: a backend that writes SSE events in arbitrary pieces (several per
write, one split across writes), the relay in front of it, and a client reading the bytes.
What the client gets is what the backend sent, less the usage chunk unless the client asked
for it; content chunks are counted once each whatever the pieces."""

from __future__ import annotations

import asyncio
import itertools
import socket

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weighbridge.sidecar import proxy
from weighbridge.sidecar.proxy import RelayOutcome, relay
from weighbridge.sidecar.upstream import Upstream, UpstreamResponse


def chunk(text: str) -> bytes:
    return b"data: " + orjson.dumps({"id": "c", "object": "text_completion",
                                     "choices": [{"index": 0, "text": text}]}) + b"\n\n"


ROLE = b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant"}}]}\n\n'
USAGE = (b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":7,"completion_tokens":3,'
         b'"total_tokens":10}}\n\n')
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + chunk("") + chunk("a") + chunk("b") + chunk("c") + USAGE + DONE
# "a", "b", "c": the role chunk and the empty text before the first content carry none (after
# the first, every data chunk but the usage one counts, unparsed: sidecar.proxy).
CONTENT_CHUNKS = 3


def pieces_of(data: bytes, cuts: list[int]) -> list[bytes]:
    edges = [0, *sorted({c % (len(data) + 1) for c in cuts}), len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


async def relayed(pieces: list[bytes], client_wants_usage: bool, *, pause_s: float = 0.0,
                  break_off: bool = False, read_after: asyncio.Event | None = None,
                  ) -> tuple[bytes, RelayOutcome, list[int]]:
    """The client's bytes, the relay's outcome and the counts ``on_content`` was called with,
    for a backend that writes ``pieces`` one write each (``pause_s`` apart: separate reads at
    the relay; ``break_off``: then drops the connection). With ``read_after`` the client
    reads nothing of the body until the event is set."""

    async def backend(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for piece in pieces:
            await response.write(piece)
            if pause_s:
                await asyncio.sleep(pause_s)
        if break_off:
            assert request.transport is not None
            request.transport.abort()
            return response
        await response.write_eof()
        return response

    upstream_app = web.Application()
    upstream_app.router.add_post("/v1/completions", backend)
    outcomes: list[RelayOutcome] = []
    counts: list[int] = []

    async def front(request: web.Request) -> web.StreamResponse:
        if read_after is not None:  # a small kernel buffer toward the client
            sock = request.transport.get_extra_info("socket")  # type: ignore[union-attr]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        pool = Upstream()
        try:
            response, outcome = await relay(
                pool, str(upstream.make_url("/v1/completions")), b"{}", request, {},
                stream=True, strip_usage_chunk=not client_wants_usage,
                on_content=counts.append)
        finally:
            await pool.close()
        outcomes.append(outcome)
        return response

    front_app = web.Application()
    front_app.router.add_post("/v1/completions", front)
    async with TestServer(upstream_app) as upstream, \
            TestClient(TestServer(front_app)) as client:
        answer = await client.post("/v1/completions", data=b"{}")
        if read_after is not None:
            # A deadline, not a pace: reaching it means the relay never paused.
            await asyncio.wait_for(read_after.wait(), timeout=60)
        body = await answer.read()
    return body, outcomes[0], counts


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
       client_wants_usage=st.booleans())
def test_the_client_gets_the_backends_bytes_whatever_the_pieces(
        cuts: list[int], client_wants_usage: bool) -> None:
    body, outcome, counts = asyncio.run(relayed(pieces_of(STREAM, cuts), client_wants_usage))
    expected = STREAM if client_wants_usage else STREAM.replace(USAGE, b"")
    assert body == expected
    assert outcome.content_chunks == CONTENT_CHUNKS == sum(counts)
    assert all(n > 0 for n in counts)
    assert outcome.usage is not None
    assert (outcome.usage.prompt_tokens, outcome.usage.completion_tokens) == (7, 3)
    assert outcome.first_token_s is not None and not outcome.broken


async def test_events_of_one_read_go_out_together() -> None:
    # The whole stream in one backend write: one count for the three content chunks.
    body, _, counts = await relayed([STREAM], client_wants_usage=False)
    assert body == STREAM.replace(USAGE, b"")
    assert counts == [CONTENT_CHUNKS]


async def test_a_last_event_without_its_blank_line_is_relayed() -> None:
    body, outcome, _ = await relayed([ROLE + chunk("a") + DONE.rstrip(b"\n")], False)
    assert body == ROLE + chunk("a") + DONE.rstrip(b"\n")
    assert outcome.content_chunks == 1


async def test_events_apart_are_relayed_as_they_come() -> None:
    # Separate reads: after the first output (written with the head by the handler's task)
    # each goes from the backend's connection straight to the client's.
    events = [ROLE, chunk(""), chunk("a"), chunk("b"), chunk("c"), USAGE, DONE]
    body, outcome, counts = await relayed(events, False, pause_s=0.005)
    assert body == STREAM.replace(USAGE, b"")
    assert counts == [1, 1, 1] and outcome.usage is not None and not outcome.broken


async def test_a_backend_breaking_off_mid_stream_ends_it_with_an_error_event() -> None:
    body, outcome, counts = await relayed([ROLE, chunk("a"), chunk("b")], False, pause_s=0.005,
                                          break_off=True)
    assert body.startswith(ROLE + chunk("a") + chunk("b") + b'data: {"error":')
    assert body.endswith(DONE)
    assert outcome.broken and counts == [1, 1]


async def test_a_slow_client_gets_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    # Far more than the kernel buffers toward a client that reads nothing (an 8 KiB send
    # buffer, the receiver's untuned ~128 KiB): the relay stops reading the backend, whether
    # the bytes queue for the handler's first write or go straight to the client, and once
    # the client reads, resumes and loses nothing. The client waits for the pause itself,
    # so how fast it would have read on this machine does not enter.
    paused = asyncio.Event()
    drained: list[int] = []
    pause, original = UpstreamResponse.pause, proxy._Relay.drained

    def watched(response: UpstreamResponse) -> None:
        pause(response)
        paused.set()

    def counted(relay: proxy._Relay) -> None:
        drained.append(1)
        original(relay)

    monkeypatch.setattr(UpstreamResponse, "pause", watched)
    monkeypatch.setattr(proxy._Relay, "drained", counted)
    many = [chunk("x" * 1000) for _ in range(3000)]
    body, outcome, _ = await relayed([ROLE, *many, USAGE, DONE], False, read_after=paused)
    assert body == ROLE + b"".join(many) + DONE
    assert outcome.content_chunks == 3000
    assert drained  # paused, then resumed once the client's buffer drained
