"""fidelity_sessions' single-turn probe: one request at a time, each case the least of a few
repeats, so that a shared machine's neighbours (which only ever add time) drop out.

It separates the terms that could make a chat turn slower on real vLLM than on the emulator:

- the API server's chat path (chat template and tokenizer over the whole history) against
  the same prompt sent as token ids: client TTFT minus the server's own TTFT
  (``vllm:time_to_first_token_seconds`` starts once the prompt is tokenized);
- the engine with a cached prefix against the same prompt computed whole: the server's
  ``vllm:request_prefill_time_seconds`` (scheduled to first token) and
  ``vllm:request_queue_time_seconds``.

Each repeat uses fresh content (its own seeds), so nothing is cached but what the case caches
on purpose: a *cached* case first sends its history alone (one output token), then the history
and a new message, as a chat session's next turn does.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from benchmarks import _prom
from benchmarks.calibrate_cpu_tiny import make_prompt
from weighbridge.loadgen.bodies import prompt_text

OUTPUT_TOKENS = 16
HISTORY_TURNS = 4  # earlier (user, assistant) pairs behind a 256-word system prompt
IDS_PREFIX, IDS_NEW = 896, 64  # the token-id cases: 28 blocks of 32 cached, then a new part
CASES = ("chat, history cached", "chat, nothing cached", "token ids, prefix cached",
         "token ids, nothing cached")
_HISTOGRAMS = ("time_to_first_token_seconds", "request_prefill_time_seconds",
               "request_queue_time_seconds")


@dataclass(frozen=True, slots=True)
class Turn:
    """One measured request: seconds on the client's clock and the server's own."""

    client_ttft_s: float
    server_ttft_s: float
    prefill_s: float
    queue_s: float
    prompt_tokens: int
    cached_tokens: int | None

    @property
    def api_s(self) -> float:
        """What the client saw beyond the server's TTFT: HTTP, chat template, tokenizer."""
        return self.client_ttft_s - self.server_ttft_s


def _history(seed: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": prompt_text(256, seed)}]
    for i in range(HISTORY_TURNS):
        messages += [{"role": "user", "content": prompt_text(48, seed * 100 + 2 * i)},
                     {"role": "assistant", "content": prompt_text(32, seed * 100 + 2 * i + 1)}]
    return messages


async def _stream(session: aiohttp.ClientSession, url: str, path: str,
                  body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """(client TTFT to the first chunk with content, usage)."""
    t0 = time.perf_counter()
    first = math.nan
    usage: dict[str, Any] = {}
    async with session.post(url + path, json={**body, "stream": True, "ignore_eos": True,
                                              "stream_options": {"include_usage": True}}) as r:
        if r.status != 200:
            raise RuntimeError(f"{path}: HTTP {r.status}: {(await r.read())[:300]!r}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or ():
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text and math.isnan(first):
                    first = time.perf_counter() - t0
    return first, usage


async def _sums(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(url + "/metrics") as r:
        samples = _prom.parse(await r.text())
    return {h: _prom.total(samples, f"vllm:{h}_sum") for h in _HISTOGRAMS}


async def _turn(session: aiohttp.ClientSession, url: str, model: str, case: str,
                seed: int) -> Turn:
    rng = random.Random(f"fidelity_sessions/turns/{seed}")
    base = {"model": model, "max_tokens": OUTPUT_TOKENS}
    warm: tuple[str, dict[str, Any]] | None = None
    if case.startswith("chat"):
        history = _history(seed)
        last = {"role": "user", "content": prompt_text(48, seed * 100 + 99)}
        request = ("/v1/chat/completions", {**base, "messages": [*history, last]})
        if case == "chat, history cached":
            warm = ("/v1/chat/completions", {**base, "messages": history, "max_tokens": 1})
    else:
        prefix = make_prompt(rng, IDS_PREFIX, 2048)
        request = ("/v1/completions", {**base, "prompt": prefix + make_prompt(rng, IDS_NEW, 2048)})
        if case == "token ids, prefix cached":
            warm = ("/v1/completions", {**base, "prompt": prefix, "max_tokens": 1})
    if warm is not None:
        await _stream(session, url, *warm)
    await asyncio.sleep(0.1)  # the warm-up's metrics are in before the first scrape
    before = await _sums(session, url)
    client_ttft, usage = await _stream(session, url, *request)
    await asyncio.sleep(0.15)  # the server records a request's histograms after its end
    after = await _sums(session, url)
    d = {h: after[h] - before[h] for h in _HISTOGRAMS}
    return Turn(client_ttft_s=client_ttft, server_ttft_s=d["time_to_first_token_seconds"],
                prefill_s=d["request_prefill_time_seconds"],
                queue_s=d["request_queue_time_seconds"],
                prompt_tokens=int(usage.get("prompt_tokens", 0)),
                cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"))


async def measure(url: str, model: str, repeats: int) -> dict[str, list[Turn]]:
    """Every case ``repeats`` times, the cases interleaved within each repeat."""
    out: dict[str, list[Turn]] = {case: [] for case in CASES}
    async with aiohttp.ClientSession() as session:
        for k in range(repeats):
            for i, case in enumerate(CASES):
                out[case].append(await _turn(session, url, model, case, 1000 * k + i))
    return out


def least(turns: list[Turn], attr: str) -> float:
    values = [getattr(t, attr) for t in turns]
    return min((v for v in values if v == v), default=math.nan)
