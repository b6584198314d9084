"""Emulator speed: one emulator process on one core keeps up with its own step model.

Target (issue 2, section 5): at least 64 concurrent streams and 5,000 streamed tokens/s on one
core, with the step clock within 10% of the model's step time.

The step model is configured so that its ideal rate is known exactly and is above the target:
only the fixed term is non-zero (``t_fixed`` = 10 ms), so every step takes 10 ms whatever its
batch, and with N sequences decoding the model emits N / 0.01 tokens/s (6,400 at N = 64). KV
is large enough that nothing is ever preempted, prompts are 8 token ids, and ``ignore_eos``
streams of 800-1,200 tokens keep N streams in flight (each client restarts its stream as soon
as it ends; staggered lengths keep restarts from lining up). That ideal rate is the same-run
baseline: the emulator's achieved rate over it is the figure.

Lag is measured two ways, both from /metrics scraped at the start and the end of the window:
- directly: wall-clock time of the window over the model time of the steps that ran in it
  (``vllm:iteration_tokens_total`` counts steps; each is 10 ms of model time) minus 1. This
  is start-to-start, so it includes the loop's own bookkeeping between steps;
- from ``weighbridge_emulator_step_lag_seconds`` (a step's end minus its due time), mean and
  p99 relative to the 10 ms step: the tail of how late single steps end. Early wake-ups are
  recorded as 0, so its mean is biased up; the direct figure is the one to judge by.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field

import aiohttp
import orjson
import uvloop

from benchmarks import _prom, _system
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from weighbridge.launch import emulator_process

T_STEP_S = 0.01  # the model's step time: t_fixed, every other term zero
ZERO_FLAGS = ("--t-prefill-token", "--t-decode-seq", "--t-kv-token", "--t-api-serial",
              "--t-api-latency", "--t-api-token")
PROMPT = list(range(1, 9))  # 8 token ids
MIN_TOKENS, MAX_TOKENS = 800, 1200
BLOCK_SIZE = 16
MODEL = "weighbridge-emulator"
TARGET_STREAMS = 64
TARGET_TOKENS_PER_S = 5000.0
TARGET_LAG = 0.10
REPEATS = 3  # per level in a full run; the quietest is reported
NOISE_WAIT = 0.05  # runnable-but-waiting share of the window above which a row is suspect


@dataclass(slots=True)
class WindowStats:
    """What the load generator saw inside the measurement window."""

    start: float = math.inf
    end: float = math.inf
    tokens: int = 0
    gaps: list[float] = field(default_factory=list)  # per-token gap between token arrivals
    streams_done: int = 0
    usage_mismatches: int = 0  # usage.completion_tokens != tokens counted in the chunks
    errors: int = 0

    def inside(self, t: float) -> bool:
        return self.start <= t < self.end


def _max_tokens(worker: int, k: int) -> int:
    return MIN_TOKENS + (worker * 131 + k * 71) % (MAX_TOKENS - MIN_TOKENS + 1)


async def _one_stream(session: aiohttp.ClientSession, url: str, max_tokens: int,
                      stats: WindowStats) -> None:
    payload = orjson.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens,
                            "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True}})
    async with session.post(url, data=payload,
                            headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            stats.errors += 1
            await resp.read()
            return
        buffer = b""
        counted = 0
        usage: int | None = None
        last: float | None = None
        async for data in resp.content.iter_any():
            now = time.monotonic()
            *events, buffer = (buffer + data).split(b"\n\n")
            tokens = 0
            for event in events:
                body = event[6:]  # after "data: "
                if body == b"[DONE]":
                    continue
                chunk = orjson.loads(body)
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                for choice in chunk["choices"]:
                    # Every generated token is one word with a leading space (emulator/text.py).
                    tokens += choice["text"].count(" ")
            if not tokens:
                continue
            counted += tokens
            if stats.inside(now):
                stats.tokens += tokens
                if last is not None:
                    stats.gaps.append((now - last) / tokens)
            last = now
    stats.streams_done += 1
    if usage != counted:
        stats.usage_mismatches += 1


async def _worker(index: int, session: aiohttp.ClientSession, url: str, stop_at: float,
                  stats: WindowStats) -> None:
    # Bounded: at most enough streams to fill the time even if each ended at once.
    for k in range(10_000):
        if time.monotonic() >= stop_at:
            return
        try:
            await _one_stream(session, url, _max_tokens(index, k), stats)
        except (aiohttp.ClientError, ValueError):
            stats.errors += 1
            await asyncio.sleep(0.05)


@dataclass(frozen=True, slots=True)
class Measurement:
    concurrency: int
    window_s: float
    client_tokens_per_s: float
    server_tokens_per_s: float  # vllm:generation_tokens_total delta over the window
    steps: float
    tokens_per_step: float  # = sequences decoding in an average step
    direct_lag: float  # wall time / model time of the steps - 1
    hist_lag_mean: float  # relative to T_STEP_S
    hist_lag_p99: float
    hist_lag_p99_bound: float
    gap_p50_s: float
    gap_p99_s: float
    server_cpu: float  # fraction of one core
    server_wait: float  # fraction of the window the emulator was runnable but not running
    client_cpu: float
    client_wait: float
    usage_mismatches: int
    errors: int

    @property
    def ideal_tokens_per_s(self) -> float:
        return self.concurrency / T_STEP_S


async def _scrape(session: aiohttp.ClientSession, base: str) -> tuple[float, _prom.Samples]:
    sent = time.monotonic()
    async with session.get(base + "/metrics") as resp:
        text = await resp.text()
    # The server rendered the page somewhere in between: take the midpoint as its time.
    return (sent + time.monotonic()) / 2, _prom.parse(text)


async def _drive(base: str, server_pid: int, concurrency: int, warmup_s: float,
                 window_s: float) -> Measurement:
    stats = WindowStats()
    connector = aiohttp.TCPConnector(limit=concurrency + 4)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=30)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        stop_at = time.monotonic() + warmup_s + window_s + 60  # a backstop; we cancel first
        workers = [asyncio.create_task(_worker(i, session, base + "/v1/completions", stop_at,
                                               stats)) for i in range(concurrency)]
        try:
            await asyncio.sleep(warmup_s)
            t0, m0 = await _scrape(session, base)
            server0, client0 = _system.process_sched(server_pid), _system.thread_sched()
            stats.start = t0
            await asyncio.sleep(window_s)
            t1, m1 = await _scrape(session, base)
            stats.end = t1
            server = _system.process_sched(server_pid) - server0
            client = _system.thread_sched() - client0
        finally:
            for task in workers:
                task.cancel()
            await asyncio.wait(workers, timeout=10)
    elapsed = t1 - t0
    steps = _prom.total(m1, "vllm:iteration_tokens_total_count") - _prom.total(
        m0, "vllm:iteration_tokens_total_count")
    generated = _prom.total(m1, "vllm:generation_tokens_total") - _prom.total(
        m0, "vllm:generation_tokens_total")
    lag = _prom.histogram_delta(m0, m1, "weighbridge_emulator_step_lag_seconds")
    gaps = sorted(stats.gaps)
    return Measurement(
        concurrency=concurrency,
        window_s=elapsed,
        client_tokens_per_s=stats.tokens / elapsed,
        server_tokens_per_s=generated / elapsed,
        steps=steps,
        tokens_per_step=generated / steps if steps else 0.0,
        direct_lag=elapsed / (steps * T_STEP_S) - 1 if steps else math.inf,
        hist_lag_mean=lag.mean / T_STEP_S,
        hist_lag_p99=lag.quantile(0.99) / T_STEP_S,
        hist_lag_p99_bound=lag.upper_bound(0.99) / T_STEP_S,
        gap_p50_s=gaps[len(gaps) // 2] if gaps else math.nan,
        gap_p99_s=gaps[min(len(gaps) - 1, int(len(gaps) * 0.99))] if gaps else math.nan,
        server_cpu=server.cpu_s / elapsed,
        server_wait=server.wait_s / elapsed,
        client_cpu=client.cpu_s / elapsed,
        client_wait=client.wait_s / elapsed,
        usage_mismatches=stats.usage_mismatches,
        errors=stats.errors,
    )


def measure(concurrency: int, warmup_s: float, window_s: float,
            pinning: _system.Pinning) -> Measurement:
    """Start a pinned emulator sized for ``concurrency`` streams and drive it."""
    blocks_per_seq = math.ceil((len(PROMPT) + MAX_TOKENS) / BLOCK_SIZE) + 1
    proc = emulator_process(
        name=f"bench-emulator-{concurrency}",
        model_name=MODEL, max_num_seqs=concurrency, max_num_batched_tokens=2048,
        num_kv_blocks=max(concurrency * blocks_per_seq, 512), block_size=BLOCK_SIZE,
        # Zeros as strings: emulator_process drops flags whose value == False, and 0 == False.
        t_fixed=T_STEP_S, t_prefill_token="0", t_decode_seq="0", t_kv_token="0",
        # No API-server overhead either: the model under test is the step clock alone.
        t_api_serial="0", t_api_latency="0", t_api_token="0",
    )
    missing = [f for f in ZERO_FLAGS if f not in proc.argv]
    if missing:  # the ideal rate below would be wrong
        raise RuntimeError(f"emulator command line lacks {missing}: {proc.argv}")
    proc.argv = _system.pinned_argv(proc.argv, pinning.server)
    with proc, _system.pin_this_thread(pinning.client):
        assert proc.pid is not None
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(_drive(proc.url, proc.pid, concurrency, warmup_s, window_s))


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%" if math.isfinite(x) else "n/a"


def run(ctx: BenchContext) -> BenchResult:
    levels = [TARGET_STREAMS] if ctx.quick else [16, TARGET_STREAMS, 128]
    repeats = 1 if ctx.quick else REPEATS
    warmup_s, window_s = (1.0, 6.0) if ctx.quick else (2.0, 20.0)
    pinning = _system.choose_pinning()
    task = ctx.progress.add_task("emulator_speed", total=len(levels) * repeats)
    runs: dict[int, list[Measurement]] = {c: [] for c in levels}
    for rep in range(repeats):  # interleaved, so a burst of background load hits one repeat
        for c in levels:
            ctx.progress.update(task, description=(
                f"emulator_speed {rep + 1}/{repeats}: {c} streams, {window_s:.0f} s"))
            m = measure(c, warmup_s, window_s, pinning)
            ctx.log(f"  {c} streams: {m.client_tokens_per_s:,.0f} tok/s "
                    f"({m.client_tokens_per_s / m.ideal_tokens_per_s:.3f} of ideal), "
                    f"lag {_pct(m.direct_lag)}, emulator CPU {m.server_cpu:.0%}, waiting "
                    f"for a CPU: emulator {m.server_wait:.0%}, client {m.client_wait:.0%}")
            runs[c].append(m)
            ctx.progress.advance(task)
    # Neighbours' load only ever slows the emulator down, so each level reports its quietest
    # repeat (least time spent waiting for a CPU), as timeit reports its fastest.
    results = [min(runs[c], key=lambda m: m.server_wait + m.client_wait) for c in levels]

    rows = [(
        str(m.concurrency),
        f"{m.ideal_tokens_per_s:,.0f}",
        f"{m.client_tokens_per_s:,.0f}",
        f"**{m.client_tokens_per_s / m.ideal_tokens_per_s:.3f}**",
        f"{m.server_tokens_per_s / m.ideal_tokens_per_s:.3f}",
        _pct(m.direct_lag),
        _pct(m.hist_lag_mean),
        f"{_pct(m.hist_lag_p99)} (<= {_pct(m.hist_lag_p99_bound)})",
        f"{m.gap_p50_s * 1e3:.2f} / {m.gap_p99_s * 1e3:.2f}",
        f"{m.tokens_per_step:.1f}",
        f"{m.server_cpu:.0%}",
        f"{m.server_wait:.1%}",
        f"{m.client_cpu:.0%}",
        f"{m.client_wait:.1%}",
        f"{m.usage_mismatches} / {m.errors}",
    ) for m in results]
    table = Table(
        columns=("streams", "ideal tok/s (baseline)", "streamed tok/s", "ratio to ideal",
                 "engine tok/s ratio", "step lag, direct (mean)", "step lag, histogram mean",
                 "step lag, histogram p99", "client ITL p50 / p99 (ms)", "seqs per step",
                 "emulator CPU", "emulator waiting for CPU", "client CPU",
                 "client waiting for CPU",
                 "usage mismatches / errors"),
        rows=rows,
    )
    target = next(m for m in results if m.concurrency == TARGET_STREAMS)
    # A stream restarting leaves its slot empty for a step or two, hence the 2% allowance.
    passed = (target.tokens_per_step >= 0.98 * TARGET_STREAMS
              and target.client_tokens_per_s >= TARGET_TOKENS_PER_S
              and target.direct_lag < TARGET_LAG
              and target.usage_mismatches == 0 and target.errors == 0)
    summary = [
        f"At {TARGET_STREAMS} streams the emulator streamed "
        f"**{target.client_tokens_per_s:,.0f} tok/s** = "
        f"**{target.client_tokens_per_s / target.ideal_tokens_per_s:.3f}x** the model's ideal "
        f"{target.ideal_tokens_per_s:,.0f} tok/s (target >= {TARGET_TOKENS_PER_S:,.0f}), "
        f"step clock **{_pct(target.direct_lag)}** behind the model (target < "
        f"{TARGET_LAG:.0%}); histogram p99 lag {_pct(target.hist_lag_p99)}; emulator at "
        f"{target.server_cpu:.0%} of its core.",
    ]
    noisy = [m for m in results if max(m.server_wait, m.client_wait) > NOISE_WAIT]
    if noisy:
        summary.append(
            "**Machine noise**: at " + ", ".join(f"{m.concurrency}" for m in noisy)
            + f" streams the emulator or the client waited for a CPU more than "
            f"{NOISE_WAIT:.0%} of the window (neighbours on the shared machine); those rows "
            "understate the emulator.")
    notes = [
        f"Emulator: `weighbridge emulator --max-num-seqs N --max-num-batched-tokens 2048 "
        f"--block-size {BLOCK_SIZE} --t-fixed {T_STEP_S} --t-prefill-token 0 "
        f"--t-decode-seq 0 --t-kv-token 0 --t-api-serial 0 --t-api-latency 0` with KV for N "
        "maximal sequences (no preemption).",
        f"Load: N aiohttp streams (uvloop) of {len(PROMPT)}-token-id prompts, ignore_eos, "
        f"max_tokens {MIN_TOKENS}-{MAX_TOKENS}, include_usage; each restarts when it ends. "
        f"Warm-up {warmup_s:.0f} s, window {window_s:.0f} s; {repeats} interleaved repeat(s) "
        "per level, the one with the least CPU wait (emulator + client) reported.",
        "seqs per step: generated tokens / steps in the window, i.e. sequences decoding in "
        "an average step (a restarting stream leaves its slot empty for a step or two).",
        "streamed tok/s: tokens the client received inside the window, counted from the chunk "
        "text (one leading-space word per token) and checked against each stream's usage chunk.",
        "engine tok/s ratio: vllm:generation_tokens_total over the window / ideal.",
        "step lag, direct: window wall time / (steps in window x 10 ms) - 1; start-to-start, "
        "so it includes the engine loop's bookkeeping and the handlers' writes.",
        "step lag, histogram: weighbridge_emulator_step_lag_seconds (how late a step ended "
        "past its due time) / 10 ms. The emulator records early wake-ups as 0, so its mean "
        "overstates the lag: the direct figure is the mean; the histogram gives the tail. "
        "p99 interpolated within its bucket as histogram_quantile does, with the bucket's "
        "upper bound in brackets.",
        "client ITL: gap between token arrivals at the client, per token; includes the "
        "client's own scheduling jitter.",
        "Reading the table: lag with the emulator's CPU far below 100% means the engine "
        "loop's timekeeping, not its CPU, limits it; lag with CPU near 100% means CPU.",
    ]
    return BenchResult(summary=summary, tables=[table], notes=notes, passed=passed,
                       setup=[f"pinning: {pinning.describe()}"])


BENCHMARK = Benchmark(
    name="emulator_speed",
    title="one emulator process on one core vs its own step model",
    run=run,
)
