"""Streams of several tokens per chunk (vLLM's ``stream_interval``, per request or the engine's
``--stream-interval``): live charging counts what the chunks surely carried, never more, and
the usage settles the rest; a tier's ``stream_interval`` is sent to the engine.

In process: the real ``Sidecar`` app in front of an aiohttp backend that streams as vLLM does
with an interval (the first token at once, then every N, the rest at the end) and holds the
last chunk until the test has read the sidecar's counts."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from tests.support.stack import auth, completion
from tests.support.wait import await_for
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.session import tokens_in_chunks

KEY = "sk-stream-interval"


def vllm_chunks(tokens: int, interval: int) -> list[int]:
    """The tokens of each content chunk vLLM sends for ``tokens`` output tokens
    (vllm.v1.engine.output_processor: first at once, then when ``interval`` are unsent, and
    what is left at the end; measured on vLLM 0.32: 16 tokens at 4 are 1, 4, 4, 4, 3)."""
    chunks, sent = [1], 1
    while sent < tokens:
        n = min(interval, tokens - sent)
        chunks.append(n)
        sent += n
    return chunks


@given(tokens=st.integers(1, 300), interval=st.integers(1, 40),
       reads=st.lists(st.integers(1, 5), max_size=300))
def test_counted_tokens_lag_the_stream_by_less_than_one_chunk(
        tokens: int, interval: int, reads: list[int]) -> None:
    """Whatever reads the chunks arrive in, the count fed chunk by chunk is what the chunks
    before the latest carried plus one: never more than passed, never behind by
    ``interval`` or more; the chunks' count alone gives it (one token each at interval 1)."""
    chunks = vllm_chunks(tokens, interval)
    seen = counted = 0
    for n in itertools.chain(reads, itertools.repeat(1)):
        if seen == len(chunks):
            break
        n = min(n, len(chunks) - seen)
        counted += tokens_in_chunks(seen + n, interval) - tokens_in_chunks(seen, interval)
        seen += n
        passed = sum(chunks[:seen])
        assert counted == sum(chunks[:seen - 1]) + 1
        assert passed - interval < counted <= passed
    if interval == 1:
        assert counted == tokens


@dataclass
class Backend:
    """Streams vLLM's chunks for the body's ``max_tokens`` at the larger of the body's
    ``stream_interval`` and ``engine_interval``, holding the last until ``release``."""

    engine_interval: int = 1
    bodies: list[dict[str, Any]] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)
    holding: asyncio.Event = field(default_factory=asyncio.Event)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.bodies.append(body)
        if not body.get("stream"):
            return web.json_response({"id": "c", "object": "text_completion", "choices": [
                {"index": 0, "text": "x", "finish_reason": "length"}], "usage": {
                "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
        interval = max(body.get("stream_interval") or 1, self.engine_interval)
        chunks = vllm_chunks(body["max_tokens"], interval)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for i, n in enumerate(chunks):
            last = i == len(chunks) - 1
            if last:
                self.holding.set()
                await self.release.wait()
            await response.write(b"data: " + orjson.dumps({
                "id": "c", "object": "text_completion",
                "choices": [{"index": 0, "text": "x" * n,
                             "finish_reason": "length" if last else None}]}) + b"\n\n")
            await asyncio.sleep(0)
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"],
                 "total_tokens": len(body["prompt"]) + body["max_tokens"]}
        await response.write(b"data: " + orjson.dumps({"id": "c", "choices": [],
                                                        "usage": usage}) + b"\n\ndata: [DONE]\n\n")
        await response.write_eof()
        return response


@dataclass
class Rig:
    client: TestClient[Any, Any]
    sidecar: Sidecar
    backend: Backend

    def streamed_output(self) -> float:
        value = self.sidecar.metrics.registry.get_sample_value(
            "weighbridge_tokens_streamed_total",
            {"tenant": "t", "tier": "batch", "kind": "output"})
        return value or 0.0


async def ok(_: web.Request) -> web.Response:
    return web.Response()


async def no_metrics(_: web.Request) -> web.Response:
    """No engine metrics: admission falls back to its in-flight cap."""
    return web.Response(status=500)


@contextlib.asynccontextmanager
async def rig_of(engine_interval: int = 1, tier_interval: int | None = None
                 ) -> AsyncIterator[Rig]:
    backend = Backend(engine_interval)
    app = web.Application()
    app.router.add_post("/v1/completions", backend.completions)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", no_metrics)
    async with TestServer(app) as server:
        batch: dict[str, Any] = {"rank": 3}
        if tier_interval is not None:
            batch["stream_interval"] = tier_interval
        config = parse_config({
            "tiers": {"interactive": {"rank": 1}, "batch": batch},
            "tenants": {"t": {"tier": "batch", "api_keys": [f"plain:{KEY}"]}},
            "backends": [{"url": str(server.make_url("")).rstrip("/"),
                          "stream_interval": engine_interval}],
        })
        sidecar = Sidecar(config)
        async with TestClient(TestServer(sidecar.app)) as client:
            yield Rig(client, sidecar, backend)


async def stream_and_watch(rig: Rig, body: dict[str, Any]) -> tuple[float, float, str]:
    """Send a streamed request; return the output tokens the sidecar counted while the
    backend holds the last chunk, after the stream ended, and the text the client got."""
    response = await rig.client.post("/v1/completions", json=body, headers=auth(KEY))
    assert response.status == 200, await response.text()
    await await_for(rig.backend.holding.is_set, timeout_s=30, what="the last chunk held")
    # Every chunk before the last has passed the sidecar once the client has read it.
    text = ""
    sent = len(vllm_chunks(body["max_tokens"], max(
        rig.backend.bodies[-1].get("stream_interval") or 1, rig.backend.engine_interval))) - 1
    while text.count("data: {") < sent:
        text += (await response.content.readany()).decode()
    mid = rig.streamed_output()
    rig.backend.release.set()
    text += (await response.read()).decode()
    return mid, rig.streamed_output(), text


async def test_the_engines_interval_counts_every_chunk_before_the_latest_in_full() -> None:
    async with rig_of(engine_interval=4) as rig:
        mid, end, text = await stream_and_watch(rig, completion(16, stream=True))
    # Chunks of 1, 4, 4, 4 passed (the last, 3, held): 1 + 4 + 4 + 1 surely; usage settles 16.
    assert (mid, end) == (10, 16)
    assert "stream_interval" not in rig.backend.bodies[0]  # the engine's own: nothing to send
    assert text.count("data: {") == 5  # the usage chunk, asked for by the sidecar, dropped


async def test_without_an_interval_each_chunk_is_one_token() -> None:
    async with rig_of() as rig:
        mid, end, _ = await stream_and_watch(rig, completion(16, stream=True))
    assert (mid, end) == (15, 16)


async def test_a_clients_interval_is_counted_and_forwarded_as_sent() -> None:
    async with rig_of(engine_interval=2) as rig:
        mid, end, _ = await stream_and_watch(rig, completion(20, stream=True,
                                                             stream_interval=6))
    # Chunks of 1, 6, 6, 6 passed (the last, 1, held): 1 + 6 + 6 + 1.
    assert (mid, end) == (14, 20)
    assert rig.backend.bodies[0]["stream_interval"] == 6


@pytest.mark.parametrize(("asked", "sent"), [(None, 8), (2, 8), (8, 8), (12, 12)])
async def test_a_tiers_interval_raises_the_clients(asked: int | None,
                                                   sent: int) -> None:
    extra = {} if asked is None else {"stream_interval": asked}
    async with rig_of(tier_interval=8) as rig:
        mid, end, _ = await stream_and_watch(rig, completion(30, stream=True, **extra))
    assert rig.backend.bodies[0]["stream_interval"] == sent
    chunks = vllm_chunks(30, sent)
    assert (mid, end) == (sum(chunks[:-2]) + 1, 30)


async def test_a_tiers_interval_is_not_sent_with_an_answer_that_does_not_stream() -> None:
    async with rig_of(tier_interval=8) as rig:
        rig.backend.release.set()
        response = await rig.client.post("/v1/completions", json=completion(4, stream=False),
                                         headers=auth(KEY))
        await response.read()
    assert "stream_interval" not in rig.backend.bodies[0]
