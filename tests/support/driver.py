"""A small asyncio load driver for the integration scenarios: open-loop arrivals, streamed
requests timed from their *scheduled* send time (no coordinated omission), TTFT at the first
content chunk, token counts from the server's usage chunk.

Test-only: the load generator users run is the Locust library in loadgen/.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson


@dataclass(slots=True)
class Outcome:
    tenant: str
    scheduled_s: float
    status: int = 0
    first_token_s: float | None = None
    end_s: float | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    reject_reason: str | None = None
    backend: str | None = None
    queue_ms: float | None = None  # the sidecar's x-weighbridge-queue-ms
    error: str | None = None
    # With record_chunks: (seconds after t0, output tokens) of every content chunk; a chunk
    # counts one token unless the server sends continuous usage (then exact).
    chunks: list[tuple[float, int]] | None = None
    text: str = ""  # the generated text of every content chunk, in order
    done: bool = False  # the stream ended with ``data: [DONE]``

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.scheduled_s

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.end_s is not None

    def tokens_served(self, start_s: float, end_s: float,
                      prompt_tokens: int | None = None) -> float:
        """Tokens this request was served in ``[start_s, end_s)`` (seconds after t0): its
        prompt when the first token came back (prefill done), its output as it streamed.

        The prompt size comes from ``usage`` (a request cut off before any usage passes
        ``prompt_tokens``). Output: the recorded chunks' tokens, scaled to the final
        ``usage`` when it disagrees (merged chunks without continuous usage); without
        recorded chunks, all output counts at ``end_s``.
        """
        if self.first_token_s is None:
            return 0.0
        prompt = self.prompt_tokens or prompt_tokens or 0
        served = float(prompt) if start_s <= self.first_token_s < end_s else 0.0
        if self.chunks is None:
            if self.end_s is not None and start_s <= self.end_s < end_s:
                served += self.output_tokens
            return served
        streamed = sum(n for _, n in self.chunks)
        inside: float = sum(n for t, n in self.chunks if start_s <= t < end_s)
        if self.ok and self.output_tokens and streamed and streamed != self.output_tokens:
            inside *= self.output_tokens / streamed
        return served + inside


def completion_body(prompt_tokens: int, max_tokens: int, model: str,
                    continuous_usage: bool = False, **extra: Any) -> bytes:
    """A streamed /v1/completions body with a token-id prompt and exactly ``max_tokens`` of
    output. ``continuous_usage``: every chunk carries the usage so far (vLLM's
    ``stream_options.continuous_usage_stats``), so a cut-off stream's counts are known."""
    prompt = [(i * 7) % 90 + 5 for i in range(prompt_tokens)]
    options: dict[str, bool] = {"include_usage": True}
    if continuous_usage:
        options["continuous_usage_stats"] = True
    return orjson.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                         "ignore_eos": True, "stream": True, "stream_options": options,
                         **extra})


def _content(choice: dict[str, Any]) -> str:
    """Generated text of a completion or chat chunk's choice."""
    if text := choice.get("text"):
        return str(text)
    delta = choice.get("delta") or {}
    return str(delta.get("content") or "")


async def streamed_request(session: aiohttp.ClientSession, url: str, key: str, tenant: str,
                           body: bytes, scheduled_s: float, t0: float,
                           headers: dict[str, str] | None = None, *,
                           record_chunks: bool = False, out: Outcome | None = None) -> Outcome:
    """Send at ``scheduled_s`` (seconds after ``t0``, monotonic) and time from then.

    ``record_chunks`` keeps the arrival time and tokens of every content chunk (for service
    over a window). ``out`` is filled in place if given, so a caller that cancels the
    request (a deadline) still holds what arrived before it.
    """
    delay = t0 + scheduled_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    if out is None:
        out = Outcome(tenant, scheduled_s)
    if record_chunks:
        out.chunks = []
    request_headers = {"authorization": f"Bearer {key}", "content-type": "application/json",
                       **(headers or {})}
    try:
        async with session.post(url, data=body, headers=request_headers) as response:
            out.status = response.status
            out.backend = response.headers.get("x-weighbridge-backend")
            out.reject_reason = response.headers.get("x-weighbridge-reject-reason")
            if (queue_ms := response.headers.get("x-weighbridge-queue-ms")) is not None:
                out.queue_ms = float(queue_ms)
            if response.status != 200:
                await response.read()
                out.end_s = time.monotonic() - t0
                return out
            buffer = b""
            async for data in response.content.iter_any():
                buffer += data
                while (end := buffer.find(b"\n\n")) >= 0:
                    event, buffer = buffer[:end], buffer[end + 2:]
                    out.done = out.done or event == b"data: [DONE]"
                    if not event.startswith(b"data: {"):
                        continue
                    chunk = orjson.loads(event[6:])
                    if "error" in chunk:
                        out.error = str(chunk["error"])
                    elif chunk.get("choices"):
                        if content := _content(chunk["choices"][0]):
                            out.text += content
                            now = time.monotonic() - t0
                            if out.first_token_s is None:
                                out.first_token_s = now
                            tokens = 1
                            if usage := chunk.get("usage"):  # continuous usage
                                out.prompt_tokens = usage["prompt_tokens"]
                                tokens = usage["completion_tokens"] - out.output_tokens
                                out.output_tokens = usage["completion_tokens"]
                            if out.chunks is not None:
                                out.chunks.append((now, tokens))
                    elif chunk.get("usage"):
                        out.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        out.output_tokens = chunk["usage"]["completion_tokens"]
            out.end_s = time.monotonic() - t0
    except (TimeoutError, aiohttp.ClientError) as e:
        out.error = f"{type(e).__name__}: {e}"
    return out


def poisson_times(rate_per_s: float, duration_s: float, seed: int,
                  start_s: float = 0.0) -> list[float]:
    rng = random.Random(seed)
    times: list[float] = []
    t = start_s
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= start_s + duration_s:
            return times
        times.append(t)


async def closed_loop(clients: int, t0: float, stop_s: float,
                      send: Callable[[int, float, Outcome], Awaitable[object]],
                      tenant: str = "", start_s: float = 0.0,
                      backoff_s: float = 0.05) -> list[Outcome]:
    """``clients`` concurrent users, each sending its next request as soon as the previous one
    ends (``backoff_s`` after one that failed or was turned away), from ``start_s`` until
    ``stop_s`` (seconds after ``t0``), when whatever is still queued or streaming is cut off
    (the connection closes; its Outcome keeps what arrived, with error ``"stopped"``).

    ``send(client, scheduled_s, out)`` issues one request and fills ``out`` (for example
    ``streamed_request(..., scheduled_s, t0, out=out)``). Every Outcome, finished or cut
    off, is returned in the order the requests were sent.
    """
    outcomes: list[Outcome] = []

    async def user(client: int) -> None:
        delay = t0 + start_s - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        out: Outcome | None = None
        try:
            async with asyncio.timeout_at(t0 + stop_s):
                while True:
                    out = Outcome(tenant, time.monotonic() - t0)
                    outcomes.append(out)
                    await send(client, out.scheduled_s, out)
                    if not out.ok:
                        await asyncio.sleep(backoff_s)
        except TimeoutError:
            if out is not None and out.end_s is None:
                out.error = "stopped"

    await asyncio.gather(*(user(c) for c in range(clients)))
    return outcomes


def session(connections: int = 4096) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections),
        timeout=aiohttp.ClientTimeout(total=300))
