"""The fidelity benchmark's flood regime: a KV-constrained, preempting engine, the victim
beside a flood, on real vLLM CPU and on the emulator (issue 14, point 4).

Shape (issue 14's): 32 sequences, a 1,024-token budget, 576 KV blocks of 32 tokens (room for
26 of the flood's 704-token sequences, so the engine preempts), fcfs, chunked prefill. The
flood is 500 requests of 512 prompt + 192 output tokens sent at once; the victim sends
Poisson 4 requests/s of 64 + 16 tokens for ``VICTIM_WINDOW_S`` from the same instant. Both go
straight to the engine, streamed, token-id prompts, ``ignore_eos``; the same seeded requests
and arrival times on both backends. The flood's client runs in a process of its own, apart
from the victim's, so consuming 500 streams does not delay the victim's clock.

Figures per run: the victim's TTFT p50 / p90 / p99 (client clock, send to first content
chunk), the engine's output tokens/s over the flood (every output token of the run over the
span from the flood's send to its last token), and ``vllm:num_preemptions_total``'s increase
over the run. The comparison takes the median of each figure over the interleaved repeats.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import random
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection

import aiohttp
import uvloop

from benchmarks import _prom
from benchmarks._flood_shape import (  # noqa: F401 - the regime's shape, re-exported
    ENGINE,
    FLOOD,
    FLOOD_REQUESTS,
    VICTIM,
    VICTIM_RATE,
    VICTIM_WINDOW_S,
)
from benchmarks.calibrate_cpu_tiny import StreamResult, make_prompt, stream_completion
from weighbridge.statistics import percentile

START_DELAY_S = 0.5  # both clients get ready, then start together
METRICS = ("vllm:num_preemptions_total", "vllm:generation_tokens_total",
           "vllm:prompt_tokens_total",
           # Diagnostics of the step time: engine steps (one histogram observation each) and
           # the engine's own clock between a sequence's tokens.
           "vllm:iteration_tokens_total_count", "vllm:inter_token_latency_seconds_sum",
           "vllm:inter_token_latency_seconds_count")


def victim_arrivals(repeat: int, window_s: float = VICTIM_WINDOW_S) -> list[float]:
    """The victim's send times (s after the flood), seeded by repeat."""
    rng = random.Random(f"fidelity-flood/victim/{repeat}")
    out, t = [], 0.0
    while True:
        t += rng.expovariate(VICTIM_RATE)
        if t >= window_s:
            return out
        out.append(t)


def _prompts(kind: str, repeat: int, n: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(f"fidelity-flood/{kind}/{repeat}")
    return [make_prompt(rng, length, vocab) for _ in range(n)]


@dataclass(frozen=True, slots=True)
class Timed:
    """One request's stream, its send time relative to the run's start."""

    sent_s: float
    result: StreamResult

    @property
    def end_s(self) -> float:
        return self.sent_s + self.result.ttft_s + self.result.decode_span_s


@dataclass(slots=True)
class FloodRun:
    backend: str
    repeat: int
    victims: list[Timed]
    flood: list[Timed]
    counters: dict[str, float]  # increase of METRICS over the run
    load: str
    foreign: float = float("nan")  # cores other processes used during the run

    @property
    def victim_ttfts(self) -> list[float]:
        return sorted(t.result.ttft_s for t in self.victims)

    def victim_ttft(self, q: float) -> float:
        return percentile(self.victim_ttfts, q)

    @property
    def makespan_s(self) -> float:
        """From the flood's send to its last token."""
        return max(t.end_s for t in self.flood)

    @property
    def output_tps(self) -> float:
        """The engine's output tokens/s while the flood lasted (victims' tokens in the span
        included)."""
        span = self.makespan_s
        tokens = sum(t.result.output_tokens for t in self.flood) + sum(
            t.result.output_tokens for t in self.victims if t.end_s <= span)
        return tokens / span

    @property
    def preemptions(self) -> float:
        return self.counters.get("vllm:num_preemptions_total", float("nan"))

    @property
    def steps(self) -> float:
        """Engine steps over the run (observations of vllm:iteration_tokens_total)."""
        return self.counters.get("vllm:iteration_tokens_total_count", float("nan"))

    @property
    def engine_itl_s(self) -> float:
        """The mean time between a sequence's tokens on the engine's own clock."""
        count = self.counters.get("vllm:inter_token_latency_seconds_count", 0.0)
        total = self.counters.get("vllm:inter_token_latency_seconds_sum", float("nan"))
        return total / count if count else float("nan")


async def _counters(session: aiohttp.ClientSession, url: str) -> dict[str, float]:
    async with session.get(f"{url}/metrics") as r:
        samples = _prom.parse(await r.text())
    names = {key.partition("{")[0] for key in samples}
    return {name: _prom.total(samples, name) for name in METRICS if name in names}


async def _send_all(url: str, model: str, prompts: list[list[int]], max_tokens: int,
                    offsets: list[float], t0: float) -> list[Timed]:
    """Send ``prompts[i]`` at monotonic time ``t0 + offsets[i]``, each as its own stream."""
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        async def one(prompt: list[int], offset: float) -> Timed:
            await asyncio.sleep(max(t0 + offset - time.monotonic(), 0.0))
            sent = time.monotonic() - t0
            result = await stream_completion(session, url, model, prompt, max_tokens)
            if result.output_tokens != max_tokens:
                raise RuntimeError(f"asked for {max_tokens} tokens with ignore_eos, got "
                                   f"{result.output_tokens}")
            return Timed(sent, result)

        return list(await asyncio.gather(*(one(p, o) for p, o in zip(prompts, offsets,
                                                                      strict=True))))


def _flood_child(conn: Connection, url: str, model: str, repeat: int, vocab: int) -> None:
    """The flood's client, in a process of its own: builds its prompts, reports ready,
    waits for the start time, sends all at once and returns every stream's timings."""
    prompts = _prompts("flood", repeat, FLOOD_REQUESTS, FLOOD[0], vocab)
    conn.send("ready")
    t0 = conn.recv()
    try:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            out = runner.run(_send_all(url, model, prompts, FLOOD[1],
                                       [0.0] * len(prompts), t0))
        conn.send(out)
    except Exception as e:  # reported to the parent, which raises it
        conn.send(RuntimeError(f"flood client: {e!r}"))
    finally:
        conn.close()


async def _victims(url: str, model: str, repeat: int, vocab: int, t0: float,
                   window_s: float) -> list[Timed]:
    arrivals = victim_arrivals(repeat, window_s)
    prompts = _prompts("victim", repeat, len(arrivals), VICTIM[0], vocab)
    return await _send_all(url, model, prompts, VICTIM[1], arrivals, t0)


async def _counters_of(url: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as session:
        return await _counters(session, url)


def _receive(conn: Connection, proc: multiprocessing.process.BaseProcess) -> object:
    """The child's next message; an error if it died without sending one."""
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise RuntimeError(f"flood client exited ({proc.exitcode}) without a result")
    return conn.recv()


def run_flood(url: str, model: str, backend: str, repeat: int, vocab: int, load: str,
              window_s: float = VICTIM_WINDOW_S) -> FloodRun:
    """One run of the regime against ``url``: the flood from a child process, the victim
    from this one, started together."""
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_flood_child, args=(child, url, model, repeat, vocab),
                       name="fidelity-flood-client", daemon=True)
    proc.start()
    try:
        if _receive(parent, proc) != "ready":
            raise RuntimeError("flood client did not start")
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            before = runner.run(_counters_of(url))
            t0 = time.monotonic() + START_DELAY_S
            parent.send(t0)
            victims = runner.run(_victims(url, model, repeat, vocab, t0, window_s))
            flood = _receive(parent, proc)
            if isinstance(flood, Exception):
                raise flood
            after = runner.run(_counters_of(url))
    finally:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()
            proc.join()
    counters = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in METRICS}
    return FloodRun(backend=backend, repeat=repeat, victims=victims, flood=flood,
                    counters=counters, load=load)
