"""A small asyncio load driver for the integration scenarios: open-loop arrivals, streamed
requests timed from their *scheduled* send time (no coordinated omission), TTFT at the first
content chunk, token counts from the server's usage chunk.

Test-only: the load generator users run is the Locust library in loadgen/.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Sequence
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

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.scheduled_s

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.end_s is not None


def percentile(values: Sequence[float], q: float) -> float:
    """Exact percentile by linear interpolation between closest ranks."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def completion_body(prompt_tokens: int, max_tokens: int, model: str, **extra: Any) -> bytes:
    prompt = [(i * 7) % 90 + 5 for i in range(prompt_tokens)]
    return orjson.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                         "ignore_eos": True, "stream": True,
                         "stream_options": {"include_usage": True}, **extra})


async def streamed_request(session: aiohttp.ClientSession, url: str, key: str, tenant: str,
                           body: bytes, scheduled_s: float, t0: float,
                           headers: dict[str, str] | None = None) -> Outcome:
    """Send at ``scheduled_s`` (seconds after ``t0``, monotonic) and time from then."""
    delay = t0 + scheduled_s - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    out = Outcome(tenant, scheduled_s)
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
                    if not event.startswith(b"data: {"):
                        continue
                    chunk = orjson.loads(event[6:])
                    if "error" in chunk:
                        out.error = str(chunk["error"])
                    elif chunk.get("choices"):
                        if out.first_token_s is None and chunk["choices"][0].get("text"):
                            out.first_token_s = time.monotonic() - t0
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
    times, t = [], start_s
    while True:
        t += rng.expovariate(rate_per_s)
        if t >= start_s + duration_s:
            return times
        times.append(t)


def session(connections: int = 4096) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections, limit_per_host=connections),
        timeout=aiohttp.ClientTimeout(total=300))
