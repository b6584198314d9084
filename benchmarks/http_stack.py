"""HTTP stack for the hot path (emulator and sidecar streaming), chosen by numbers.

Servers (benchmarks/_sse_server.py, pinned to one core): aiohttp on uvloop, aiohttp on the
stdlib asyncio loop, starlette + uvicorn (uvloop, httptools); each with orjson or stdlib json
encoding every chunk. Clients (this process, uvloop, pinned to another core): aiohttp and
httpx, each reading SSE the idiomatic way (line by line) and raw (bytes as they arrive, split
on the blank line), because the sidecar relays streams and its client matters as much as its
server. Every (server, encoder, client) cell is measured ``REPEATS`` times, interleaved so a
change in background load hits every cell alike; the median is reported.

Figures: streamed chunks/s, and its ratio to the baseline cell aiohttp-asyncio + json server
with the httpx line client, measured in the same run. With server and client on their own
cores the slower side bounds chunks/s, so CPU time per chunk of each side is reported too:
it separates the server's cost from the client's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from importlib.util import find_spec

import aiohttp
import httpx
import uvloop

from benchmarks import _sse_server, _system
from benchmarks._core import REPO, BenchContext, Benchmark, BenchResult, Table
from weighbridge.launch import ServerProcess, free_port

STREAMS = 32  # concurrent streams
CHUNKS_PER_STREAM = 2000
CLIENTS = ("aiohttp-lines", "aiohttp-raw", "httpx-lines", "httpx-raw")
BASELINE = ("aiohttp-asyncio", "json", "httpx-lines")
TIE = 0.10  # cost differences below this are not told apart on a shared machine
NOISE_WAIT = 0.05  # runnable-but-waiting share of the window above which a sample is suspect


@dataclasses.dataclass(slots=True)
class Window:
    start: float = float("inf")
    end: float = float("inf")
    chunks: int = 0

    def add(self, now: float, n: int) -> None:
        if self.start <= now < self.end:
            self.chunks += n


@dataclasses.dataclass(frozen=True, slots=True)
class Sample:
    client: str
    chunks_per_s: float
    server_us_per_chunk: float
    client_us_per_chunk: float
    server_busy: float  # fraction of the window the server ran on its core
    client_busy: float
    server_wait: float  # fraction of the window it was runnable but another task had the core
    client_wait: float
    stack: str = ""
    encoder: str = ""


# -- clients: each reads one stream to its end, counting data events ---------------------------
# Clients count events only (no JSON decoding), so the comparison is of the libraries.

async def _aiohttp_lines(session: aiohttp.ClientSession, url: str, w: Window) -> None:
    async with session.get(url) as resp:
        resp.raise_for_status()
        async for line in resp.content:
            if line.startswith(b"data: ") and line != b"data: [DONE]\n":
                w.add(time.monotonic(), 1)


async def _aiohttp_raw(session: aiohttp.ClientSession, url: str, w: Window) -> None:
    async with session.get(url) as resp:
        resp.raise_for_status()
        buffer = b""
        async for data in resp.content.iter_any():
            *events, buffer = (buffer + data).split(b"\n\n")
            n = len(events) - (events[-1] == b"data: [DONE]" if events else 0)
            w.add(time.monotonic(), n)


async def _httpx_lines(client: httpx.AsyncClient, url: str, w: Window) -> None:
    async with client.stream("GET", url) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                w.add(time.monotonic(), 1)


async def _httpx_raw(client: httpx.AsyncClient, url: str, w: Window) -> None:
    async with client.stream("GET", url) as resp:
        resp.raise_for_status()
        buffer = b""
        async for data in resp.aiter_raw():
            *events, buffer = (buffer + data).split(b"\n\n")
            n = len(events) - (events[-1] == b"data: [DONE]" if events else 0)
            w.add(time.monotonic(), n)


async def _drive(client_name: str, base: str, server_pid: int, warmup_s: float,
                 window_s: float) -> Sample:
    """Keep ``STREAMS`` streams going and measure them over the window."""
    url = f"{base}/stream?n={CHUNKS_PER_STREAM}"
    w = Window()
    stop_at = time.monotonic() + warmup_s + window_s

    async def loop(read_one: Callable[[], Awaitable[None]]) -> None:
        for _ in range(100_000):  # bounded; the deadline ends it first
            if time.monotonic() >= stop_at:
                return
            await read_one()

    async def measure(reader: Callable[[], Awaitable[None]]) -> Sample:
        tasks = [asyncio.create_task(loop(reader)) for _ in range(STREAMS)]
        try:
            await asyncio.sleep(warmup_s)
            w.start = time.monotonic()
            server0, client0 = _system.process_sched(server_pid), _system.thread_sched()
            await asyncio.sleep(window_s)
            w.end = time.monotonic()
            server = _system.process_sched(server_pid) - server0
            client = _system.thread_sched() - client0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks, timeout=10)
        for task in tasks:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
        if not w.chunks:
            raise RuntimeError(f"{client_name}: no chunk arrived in the window from {base}")
        elapsed = w.end - w.start
        return Sample(client=client_name, chunks_per_s=w.chunks / elapsed,
                      server_us_per_chunk=server.cpu_s / w.chunks * 1e6,
                      client_us_per_chunk=client.cpu_s / w.chunks * 1e6,
                      server_busy=server.cpu_s / elapsed, client_busy=client.cpu_s / elapsed,
                      server_wait=server.wait_s / elapsed, client_wait=client.wait_s / elapsed)

    if client_name.startswith("aiohttp"):
        read = _aiohttp_lines if client_name == "aiohttp-lines" else _aiohttp_raw
        connector = aiohttp.TCPConnector(limit=STREAMS)
        async with aiohttp.ClientSession(connector=connector) as session:
            return await measure(lambda: read(session, url, w))
    read_x = _httpx_lines if client_name == "httpx-lines" else _httpx_raw
    limits = httpx.Limits(max_connections=STREAMS, max_keepalive_connections=STREAMS)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(30.0)) as client:
        return await measure(lambda: read_x(client, url, w))


def _server(stack: str, encoder: str, core: int | None) -> ServerProcess:
    port = free_port()
    argv = [sys.executable, "-m", "benchmarks._sse_server", "--stack", stack, "--encoder",
            encoder, "--port", str(port)]
    return ServerProcess(name=f"sse-{stack}-{encoder}", argv=_system.pinned_argv(argv, core),
                         url=f"http://127.0.0.1:{port}", cwd=REPO)


def _median_by(samples: list[Sample], key: Callable[[Sample], tuple[str, ...]],
               value: Callable[[Sample], float]) -> dict[tuple[str, ...], float]:
    groups: dict[tuple[str, ...], list[float]] = {}
    for s in samples:
        groups.setdefault(key(s), []).append(value(s))
    return {k: statistics.median(v) for k, v in groups.items()}


def run(ctx: BenchContext) -> BenchResult:
    missing = [m for m in ("starlette", "uvicorn", "httptools") if find_spec(m) is None]
    if missing:
        raise RuntimeError(f"http_stack needs {', '.join(missing)}: pip install -e '.[bench]'")
    repeats, warmup_s, window_s = (1, 0.3, 1.0) if ctx.quick else (3, 0.5, 2.5)
    pinning = _system.choose_pinning()
    servers = list(itertools.product(_sse_server.STACKS, _sse_server.ENCODERS))
    task = ctx.progress.add_task("http_stack", total=repeats * len(servers) * len(CLIENTS))
    samples: list[Sample] = []
    for rep in range(repeats):
        for stack, encoder in servers:
            with _server(stack, encoder, pinning.server) as proc, \
                    _system.pin_this_thread(pinning.client), \
                    asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                assert proc.pid is not None
                for client in CLIENTS:
                    ctx.progress.update(task, description=(
                        f"http_stack {rep + 1}/{repeats}: {stack}+{encoder} <- {client}"))
                    sample = runner.run(_drive(client, proc.url, proc.pid, warmup_s,
                                               window_s))
                    samples.append(dataclasses.replace(sample, stack=stack, encoder=encoder))
                    ctx.progress.advance(task)
    return _report(samples, repeats, warmup_s, window_s, pinning)


def _report(samples: list[Sample], repeats: int, warmup_s: float, window_s: float,
            pinning: _system.Pinning) -> BenchResult:
    def cell(s: Sample) -> tuple[str, ...]:
        return (s.stack, s.encoder, s.client)

    rate = _median_by(samples, cell, lambda s: s.chunks_per_s)
    srv = _median_by(samples, cell, lambda s: s.server_us_per_chunk)
    cli = _median_by(samples, cell, lambda s: s.client_us_per_chunk)
    sbusy = _median_by(samples, cell, lambda s: s.server_busy)
    cbusy = _median_by(samples, cell, lambda s: s.client_busy)
    swait = _median_by(samples, cell, lambda s: s.server_wait)
    cwait = _median_by(samples, cell, lambda s: s.client_wait)
    base = rate[BASELINE]
    order = sorted(rate, key=lambda k: -rate[k])
    matrix = Table(
        caption="All cells, fastest first (median of the repeats):",
        columns=("server", "encoder", "client", "chunks/s", "ratio to baseline",
                 "server CPU us/chunk", "client CPU us/chunk", "server busy / waiting",
                 "client busy / waiting"),
        rows=[(k[0], k[1], k[2] + (" (baseline)" if k == BASELINE else ""),
               f"{rate[k]:,.0f}", f"**{rate[k] / base:.2f}**", f"{srv[k]:.1f}",
               f"{cli[k]:.1f}", f"{sbusy[k]:.0%} / {swait[k]:.0%}",
               f"{cbusy[k]:.0%} / {cwait[k]:.0%}") for k in order],
    )

    # Per-factor costs: each side's CPU per chunk, as a median over the other side's
    # variants, so that one noisy cell cannot decide; ratios are against the baseline's side.
    server_cost = _median_by(samples, lambda s: (s.stack, s.encoder),
                             lambda s: s.server_us_per_chunk)
    client_cost = _median_by(samples, lambda s: (s.client,), lambda s: s.client_us_per_chunk)
    base_server = server_cost[BASELINE[:2]]
    base_client = client_cost[BASELINE[2:]]
    # A slower reader lets the kernel buffer fill, so the server's writes coalesce and each
    # chunk gets cheaper: the server's cost is shown per client too, not only as a median.
    by_client = _median_by(samples, lambda s: (s.stack, s.encoder, s.client),
                           lambda s: s.server_us_per_chunk)
    servers = Table(
        caption="Server CPU us/chunk by client (median of repeats); capacity = baseline "
                "server's cost / cost, on the median over clients:",
        columns=("server", "encoder", *CLIENTS, "median", "capacity vs baseline server"),
        rows=[(k[0], k[1], *(f"{by_client[(*k, c)]:.1f}" for c in CLIENTS), f"{v:.1f}",
               f"**{base_server / v:.2f}**")
              for k, v in sorted(server_cost.items(), key=lambda kv: kv[1])],
    )
    clients = Table(
        caption="Client cost per chunk (median over servers and repeats):",
        columns=("client", "client CPU us/chunk", "capacity vs baseline client"),
        rows=[(k[0], f"{v:.1f}", f"**{base_client / v:.2f}**")
              for k, v in sorted(client_cost.items(), key=lambda kv: kv[1])],
    )
    best_server = min(server_cost, key=lambda k: server_cost[k])
    best_client = min(client_cost, key=lambda k: client_cost[k])
    encoder_gain = {stack: server_cost[(stack, "json")] / server_cost[(stack, "orjson")]
                    for stack in _sse_server.STACKS}
    noisy = sum(1 for s in samples if max(s.server_wait, s.client_wait) > NOISE_WAIT)
    summary = [
        f"Fastest cell: {' + '.join(order[0])} at **{rate[order[0]]:,.0f} chunks/s = "
        f"{rate[order[0]] / base:.2f}x** the baseline ({' + '.join(BASELINE)}, "
        f"{base:,.0f} chunks/s).",
        f"Cheapest server: **{best_server[0]} + {best_server[1]}**, "
        f"{server_cost[best_server]:.1f} us/chunk = {base_server / server_cost[best_server]:.2f}x "
        f"the baseline server's capacity{_ties(server_cost, best_server)}. orjson over json "
        "cuts server cost by "
        + ", ".join(f"{v:.2f}x ({k})" for k, v in encoder_gain.items()) + ".",
        f"Cheapest client: **{best_client[0]}**, {client_cost[best_client]:.1f} us/chunk = "
        f"{base_client / client_cost[best_client]:.2f}x the httpx line reader's capacity"
        f"{_ties(client_cost, best_client)}.",
    ]
    if noisy:
        summary.append(f"**Machine noise**: in {noisy} of {len(samples)} samples the server or "
                       f"the client waited for a CPU more than {NOISE_WAIT:.0%} of the window; "
                       "medians over the interleaved repeats damp it.")
    notes = [
        f"{STREAMS} concurrent streams of {CHUNKS_PER_STREAM} chunks (~150-byte vLLM-shaped "
        f"completion chunks), restarted as they end; warm-up {warmup_s} s, window "
        f"{window_s} s, {repeats} repeat(s) per cell, interleaved.",
        "Servers yield to the loop after every chunk (as a relay or the engine loop would), "
        "so each chunk pays a task switch, an encode and a write.",
        "CPU us/chunk: CPU time of the server's threads and of the client's thread over the "
        "window (Linux schedstat), per chunk delivered. The side whose core is ~100% busy "
        "bounds chunks/s. 'waiting': share of the window the side was runnable while another "
        "task (a neighbour on the shared machine) held its core; high values mark noise.",
        "Clients count events only (no JSON decoding): '-lines' iterates lines "
        "(aiohttp StreamReader iteration, httpx aiter_lines), '-raw' splits raw reads on "
        "the blank line (aiohttp iter_any, httpx aiter_raw).",
    ]
    return BenchResult(summary=summary, tables=[matrix, servers, clients], notes=notes,
                       setup=[f"pinning: {pinning.describe()}"])


def _ties(costs: dict[tuple[str, ...], float], best: tuple[str, ...]) -> str:
    """The runners-up within TIE of the best: on a shared machine that is no difference."""
    close = [k for k, v in sorted(costs.items(), key=lambda kv: kv[1])
             if k != best and v <= costs[best] * (1 + TIE)]
    if not close:
        return ""
    return (f"; within {TIE:.0%} of it, so tied with it here: "
            + ", ".join(f"{' + '.join(k)} ({costs[k]:.1f} us)" for k in close))


BENCHMARK = Benchmark(
    name="http_stack",
    title="SSE streaming: server stack, JSON encoder and client library",
    run=run,
)
