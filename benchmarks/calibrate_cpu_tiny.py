"""Calibrate the emulator's step-time model against a running vLLM-compatible server.

    python benchmarks/calibrate_cpu_tiny.py --url http://127.0.0.1:8000 [--repeats 3]
    python benchmarks/calibrate_cpu_tiny.py --start          # starts real vLLM itself
    python benchmarks/calibrate_cpu_tiny.py --fit-only saved.json

The emulator charges each engine step

    t_step = t_fixed + t_prefill_token * prefill_tokens + t_decode_seq * decode_seqs
             + t_kv_token * kv_tokens_in_batch

(``kv_tokens_in_batch`` = the context length after the step, summed over the scheduled
sequences). With token-id prompts and ``ignore_eos`` this script measures

* prefill points, concurrency 1, one output token, several prompt lengths P (each within
  ``max_num_batched_tokens``, so one prefill step): TTFT;
* decode points, ``c`` concurrent streams of ``--max-tokens`` tokens with prompt P
  (``c * P`` within one token budget, so the ramp-up is one step): per-stream decode time
  per token ``(last_token - first_token) / (output_tokens - 1)``;
* prefix points (``--prefix-points``, PREFIXxNEW), concurrency 1, one output token: a
  prefix of C token ids sent alone first, then the prefix and N new ids, whose prefill step
  computes N tokens over C cached ones (``t_prefill_context``: N x C pairs);

* contended points (``--contended-repeats``), in chat_sessions' shape: a chat turn after
  its cached history sent alone, and ``--contended-offset`` seconds after another such turn
  started, alternately: how much longer a request takes when the engine is stepping as it
  arrives (``t_api_contended``, below);

each from both clocks: the client's, and vLLM's own histograms (``request_prefill_time`` =
the prefill step, ``inter_token_latency`` = the decode step, from engine-core timestamps).
Two fits follow (non-negative least squares on relative errors):

* ``engine``: the step coefficients from vLLM's clocks: what the engine core does;
* ``client``: the step coefficients plus a per-request ``overhead`` (HTTP, validation, IPC,
  detokenisation; paid once, before the first token) from the client's clock. On a 2-core
  box vLLM's API server, not the engine, limits streaming at high concurrency, and
  this fit folds that into ``t_decode_seq``. The fidelity benchmark compares client-side
  numbers, so this is the one to use for the ``cpu-tiny`` profile.

``t_api_contended`` is the contended points' median client TTFT less the alone ones',
less what the step model itself adds to a request that arrives while another decodes (half
a decode step of waiting for the step in flight, and that decode in its own prefill step):
vLLM CPU's engine core keeps an OpenMP thread on every core while it steps, so on a host
with no spare core the API server's work for the new request waits for one.

Repeats: ``--repeats`` rounds, each measuring every point once (so load from elsewhere hits
all points alike); medians over the rounds are used. The client is aiohttp, not httpx:
with ~32 concurrent streams httpx's AsyncClient added 0.1-6 s of client-side delay to
TTFT on this machine while aiohttp and raw sockets added none. Not a registered
benchmark (no ``BENCHMARK``); run it by hand from the main venv.

The server must allow ``max_num_seqs`` >= the largest concurrency, ``max_num_batched_tokens``
>= the largest prompt, and enough KV blocks that nothing is preempted (``--start`` uses
32 seqs, 2048 batched tokens, 1024 blocks of 32, max_model_len 2048).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

if __package__ in (None, ""):  # run as a script: make the repo importable for --start
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import _prom  # after the path: runnable as a script
from weighbridge.emulator.real_vllm import RealVllmServer
from weighbridge.loadgen.bodies import prompt_text

SERVER_HISTOGRAMS = (
    "time_to_first_token_seconds", "inter_token_latency_seconds",
    "request_prefill_time_seconds", "request_queue_time_seconds",
)


@dataclass
class StreamResult:
    prompt_tokens: int
    output_tokens: int
    ttft_s: float
    decode_span_s: float  # first content chunk -> last content chunk
    chunks: int

    @property
    def tpot_s(self) -> float:
        """Client-side time per output token after the first."""
        n = self.output_tokens - 1
        return self.decode_span_s / n if n > 0 else float("nan")


async def stream_completion(
    session: aiohttp.ClientSession, url: str, model: str, prompt: list[int], max_tokens: int
) -> StreamResult:
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = 0.0
    chunks = 0
    usage: dict[str, Any] | None = None
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.read())[:300]!r}")
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            if b'"choices":[{' in line:  # a content chunk; cheap check, no JSON parse
                last = time.perf_counter()
                if chunks == 0:
                    first = last
                chunks += 1
            elif not line.startswith(b"data: [DONE]"):
                usage = json.loads(line[6:]).get("usage") or usage
    if usage is None or chunks == 0:
        raise RuntimeError("stream ended without content or usage")
    return StreamResult(
        prompt_tokens=int(usage["prompt_tokens"]),
        output_tokens=int(usage["completion_tokens"]),
        ttft_s=first - t0,
        decode_span_s=last - first,
        chunks=chunks,
    )


def make_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    # Ids >= 6 skip the tiny model's special tokens; fresh random ids defeat prefix caching.
    return [rng.randrange(6, vocab) for _ in range(n)]


async def server_sums(session: aiohttp.ClientSession, url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of vLLM's latency histograms; empty when the server has none."""
    async with session.get(f"{url}/metrics") as r:
        samples = _prom.parse(await r.text())
    names = {key.partition("{")[0] for key in samples}
    return {name: (_prom.total(samples, f"vllm:{name}_sum"),
                   _prom.total(samples, f"vllm:{name}_count"))
            for name in SERVER_HISTOGRAMS if f"vllm:{name}_count" in names}


def server_means(before: dict[str, tuple[float, float]],
                 after: dict[str, tuple[float, float]]) -> dict[str, float]:
    """Mean of each histogram over the observations added between two snapshots."""
    out = {}
    for name, (s1, n1) in after.items():
        s0, n0 = before.get(name, (0.0, 0.0))
        out[name] = (s1 - s0) / (n1 - n0) if n1 > n0 else float("nan")
    return out


def _median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]  # drop NaN
    return statistics.median(xs) if xs else float("nan")


@dataclass
class Point:
    """One load shape, measured ``repeats`` times: per-repeat medians over the streams."""

    concurrency: int
    prompt_len: int  # the tokens computed: the whole prompt, or the part after the prefix
    max_tokens: int
    cached: int = 0  # a prefix of this many tokens is sent alone first, so it is cached
    client_ttft_s: list[float] = field(default_factory=list)
    client_tpot_s: list[float] = field(default_factory=list)
    client_wall_s: list[float] = field(default_factory=list)
    chunks_per_token: list[float] = field(default_factory=list)
    server: list[dict[str, float]] = field(default_factory=list)
    burst_streams: int = 0


def server_median(point: dict[str, Any], name: str) -> float:
    return _median([s[name] for s in point["server"] if name in s])


async def run_point(session: aiohttp.ClientSession, url: str, model: str, rng: random.Random,
                    vocab: int, point: Point, repeats: int) -> Point:
    for _ in range(repeats):
        prefixes = [make_prompt(rng, point.cached, vocab) for _ in range(point.concurrency)]
        if point.cached:
            for prefix in prefixes:
                await stream_completion(session, url, model, prefix, 1)
            await asyncio.sleep(0.1)  # the warm-ups' histograms are in before the scrape
        before = await server_sums(session, url)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            stream_completion(session, url, model,
                              prefix + make_prompt(rng, point.prompt_len, vocab),
                              point.max_tokens)
            for prefix in prefixes
        ))
        point.client_wall_s.append(time.perf_counter() - t0)
        server = server_means(before, await server_sums(session, url))
        point.server.append(server)
        # A "burst" stream reached the client in one piece at the end although vLLM's clock
        # shows it was generated step by step (seen now and then on the 2-core box; its TTFT
        # then reads as the whole e2e). Such streams are counted and left out of the medians.
        itl = server.get("inter_token_latency_seconds", float("nan"))
        burst = [r for r in results if r.output_tokens > 8 and r.tpot_s < 0.2 * itl]
        point.burst_streams += len(burst)
        kept = [r for r in results if r not in burst]  # none left: NaN, dropped by _median
        point.client_ttft_s.append(_median([r.ttft_s for r in kept]))
        if point.max_tokens > 1:
            point.client_tpot_s.append(_median([r.tpot_s for r in kept]))
        point.chunks_per_token.append(
            sum(r.chunks for r in results) / sum(r.output_tokens for r in results))
        await asyncio.sleep(0.2)
    return point


async def run_contended(session: aiohttp.ClientSession, url: str, model: str, offset_s: float,
                        repeats: int, seed: int) -> dict[str, Any]:
    """``repeats`` pairs in chat_sessions' shape: a chat turn after its cached history
    (``_fidelity_turns``: a 256-word system prompt, four earlier exchanges, a new message),
    alone, then another such turn started ``offset_s`` before it (30 output tokens, its own
    history cached too): the client's TTFT of each."""
    from benchmarks import _fidelity_turns as turns  # it imports this module

    async def turn(history: list[dict[str, str]], last: str, tokens: int,
                   delay: float) -> float:
        await asyncio.sleep(delay)
        ttft, _ = await turns._stream(
            session, url, "/v1/chat/completions",
            {"model": model, "max_tokens": tokens,
             "messages": [*history, {"role": "user", "content": last}]})
        return ttft

    out: dict[str, Any] = {"offset_s": offset_s, "alone_ttft_s": [], "busy_ttft_s": []}
    for k in range(repeats):
        for j, key in enumerate(("alone_ttft_s", "busy_ttft_s")):
            base = seed * 1000 + 10 * k + 2 * j
            ours, other = turns._history(base), turns._history(base + 1)
            for history in (ours, other):  # cached, as a session's earlier turns left it
                await turns._stream(session, url, "/v1/chat/completions",
                                    {"model": model, "max_tokens": 1, "messages": history})
            await asyncio.sleep(0.15)
            ask = prompt_text(48, base * 100 + 99)
            if key == "alone_ttft_s":
                ttft = await turn(ours, ask, 16, 0.0)
            else:
                ttft, _ = await asyncio.gather(
                    turn(ours, ask, 16, offset_s),
                    turn(other, prompt_text(48, base * 100 + 98), 30, 0.0))
            out[key].append(ttft)
            await asyncio.sleep(0.2)
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:7.2f}"


async def measure(args: argparse.Namespace, url: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=timeout) as session:
        async with session.get(f"{url}/v1/models") as resp:
            models = (await resp.json())["data"]
        model = args.model or models[0]["id"]
        # Warm-up: the first requests pay lazy initialisation.
        for n in (16, max(args.prompt_lens)):
            await stream_completion(session, url, model, make_prompt(rng, n, args.vocab), 8)

        # Rounds: every point once per round, so a burst of load from elsewhere on a shared
        # machine hits all points alike instead of ruining one of them.
        prefill_pts = [Point(1, p, 1) for p in args.prompt_lens]
        decode_pts = [Point(c, p, args.max_tokens) for c, p in args.decode_shapes]
        prefix_pts = [Point(1, n, 1, cached=c)
                      for c, n in getattr(args, "prefix_points", None) or ()]
        for rnd in range(args.repeats):
            for pt in prefill_pts:
                await run_point(session, url, model, rng, args.vocab, pt, args.ttft_samples)
            for pt in decode_pts:
                await run_point(session, url, model, rng, args.vocab, pt, 1)
            for pt in prefix_pts:
                await run_point(session, url, model, rng, args.vocab, pt, args.ttft_samples)
            print(f"round {rnd + 1}/{args.repeats} done", file=sys.stderr)
        contended = None
        repeats = getattr(args, "contended_repeats", 0)
        if repeats:
            contended = await run_contended(session, url, model, args.contended_offset,
                                            repeats, args.seed)
            print(f"contended chat turns: client TTFT "
                  f"{_ms(_median(contended['alone_ttft_s']))} ms alone, "
                  f"{_ms(_median(contended['busy_ttft_s']))} ms beside another",
                  file=sys.stderr)
        prefill = [asdict(pt) for pt in prefill_pts]
        decode = [asdict(pt) for pt in decode_pts]
        prefix = [asdict(pt) for pt in prefix_pts]
        for d in prefill:
            print(f"prefill P={d['prompt_len']:5d}: client TTFT "
                  f"{_ms(_median(d['client_ttft_s']))} ms, server TTFT "
                  f"{_ms(server_median(d, 'time_to_first_token_seconds'))} ms, prefill step "
                  f"{_ms(server_median(d, 'request_prefill_time_seconds'))} ms", file=sys.stderr)
        for d in decode:
            tpot = _median(d["client_tpot_s"])
            print(f"decode c={d['concurrency']:3d} P={d['prompt_len']:5d}: client TTFT "
                  f"{_ms(_median(d['client_ttft_s']))} ms, client TPOT {_ms(tpot)} ms "
                  f"({1 / tpot:6.1f} tok/s/stream), server ITL "
                  f"{_ms(server_median(d, 'inter_token_latency_seconds'))} ms", file=sys.stderr)
    return {"model": model, "prefill": prefill, "decode": decode, "prefix": prefix,
            "contended": contended}


# --- fitting ----------------------------------------------------------------------------

STEP = ("t_fixed", "t_prefill_token", "t_decode_seq", "t_kv_token", "t_prefill_context")
WITH_OVERHEAD = (*STEP, "overhead")
Row = tuple[list[float], float, str]


def _prefill_x(t: dict[str, Any]) -> list[float]:
    """A prefill point's step terms: N computed tokens over C cached (C = 0: the whole
    prompt), KV N + C after the step, N x C pairs of attention to the cached prefix."""
    n, c = t["prompt_len"], t.get("cached", 0)
    return [1.0, n, 0.0, n + c, n * c]


def _label(t: dict[str, Any]) -> str:
    c = t.get("cached", 0)
    return f"P={c}+{t['prompt_len']}" if c else f"P={t['prompt_len']}"


def engine_rows(data: dict[str, Any]) -> list[Row]:
    """Step times from vLLM's clocks. Prefill: ``request_prefill_time`` (scheduled -> first
    token) is one step of P prefill tokens whose KV after the step is P (after a cached
    prefix of C: N tokens, KV N + C, N x C context pairs). Decode: the mean inter-token
    latency is a step of c decoding sequences with contexts of P + max_tokens/2 on average."""
    rows: list[Row] = []
    for t in [*data["prefill"], *data.get("prefix", ())]:
        rows.append((_prefill_x(t), server_median(t, "request_prefill_time_seconds"),
                     f"prefill {_label(t)}"))
    for d in data["decode"]:
        c, p, m = d["concurrency"], d["prompt_len"], d["max_tokens"]
        rows.append(([1.0, 0.0, c, c * (p + m / 2), 0.0],
                     server_median(d, "inter_token_latency_seconds"), f"decode c={c} P={p}"))
    return [r for r in rows if r[1] == r[1]]  # drop NaN (a server without vLLM histograms)


def client_rows(data: dict[str, Any]) -> list[Row]:
    """The same shapes from the client's clock; TTFT also pays the per-request overhead."""
    rows: list[Row] = []
    for t in [*data["prefill"], *data.get("prefix", ())]:
        rows.append(([*_prefill_x(t), 1.0], _median(t["client_ttft_s"]), f"TTFT {_label(t)}"))
    for d in data["decode"]:
        c, p, m = d["concurrency"], d["prompt_len"], d["max_tokens"]
        rows.append(([1.0, 0.0, c, c * (p + m / 2), 0.0, 0.0], _median(d["client_tpot_s"]),
                     f"TPOT c={c} P={p}"))
    return rows


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (small dense systems)."""
    n = len(b)
    m = [[*row, b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            raise ValueError("singular system")
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                for k in range(col, n + 1):
                    m[r][k] -= f * m[col][k]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls_relative(rows: list[Row], names: tuple[str, ...]) -> dict[str, float]:
    """Least squares on relative residuals (each row weighted by 1/y), coefficients >= 0.

    Active set: solve, pin any negative coefficient to 0, re-solve, until all are >= 0."""
    # A term no row exercises (no prefix points: no context pairs) is not fitted: 0.
    free = {n for i, n in enumerate(names) if any(x[i] for x, _, _ in rows)}
    while True:
        idx = [i for i, n in enumerate(names) if n in free]
        ata = [[0.0] * len(idx) for _ in idx]
        atb = [0.0] * len(idx)
        for x, y, _ in rows:
            xs = [x[i] / y for i in idx]
            for r in range(len(idx)):
                atb[r] += xs[r]
                for c in range(len(idx)):
                    ata[r][c] += xs[r] * xs[c]
        sol = _solve(ata, atb)
        neg = [names[idx[k]] for k, v in enumerate(sol) if v < 0]
        if not neg:
            out = dict.fromkeys(names, 0.0)
            out.update({names[i]: v for i, v in zip(idx, sol, strict=True)})
            return out
        free -= set(neg)


def predict(coef: dict[str, float], names: tuple[str, ...], x: list[float]) -> float:
    return sum(coef[n] * v for n, v in zip(names, x, strict=True))


def _fit_table(rows: list[Row], coef: dict[str, float], names: tuple[str, ...]) -> list[str]:
    lines = ["| point | measured ms | model ms | error |", "|---|---|---|---|"]
    for x, y, label in rows:
        f = predict(coef, names, x)
        lines.append(f"| {label} | {y * 1e3:.2f} | {f * 1e3:.2f} | {(f - y) / y:+.0%} |")
    return lines


def contended_fit(contended: dict[str, Any], step: dict[str, float]) -> float:
    """``t_api_contended`` from the contended points and the fitted step terms: the measured
    TTFT difference less the step model's own (the turn waits on average half of the
    other's decode step and then carries that decode in its prefill step; the other's
    context is about a thousand tokens)."""
    context = 1000.0
    decode = step["t_fixed"] + step["t_decode_seq"] + step["t_kv_token"] * context
    own = decode / 2 + step["t_decode_seq"] + step["t_kv_token"] * context
    measured = _median(contended["busy_ttft_s"]) - _median(contended["alone_ttft_s"])
    return max(measured - own, 0.0)


def report(data: dict[str, Any]) -> dict[str, Any]:
    erows, crows = engine_rows(data), client_rows(data)
    engine: dict[str, float] = {}
    client: dict[str, float] = {}
    with contextlib.suppress(ValueError):  # too few distinct points for a fit
        engine = nnls_relative(erows, STEP)
    with contextlib.suppress(ValueError):
        client = nnls_relative([r for r in crows if r[1] == r[1]], WITH_OVERHEAD)
    raw_pre = ["| P | client TTFT ms | server TTFT ms | prefill step ms (server) |",
               "|---|---|---|---|"]
    for t in [*data["prefill"], *data.get("prefix", ())]:
        raw_pre.append(
            f"| {_label(t)[2:]} | {_median(t['client_ttft_s']) * 1e3:.2f} | "
            f"{server_median(t, 'time_to_first_token_seconds') * 1e3:.2f} | "
            f"{server_median(t, 'request_prefill_time_seconds') * 1e3:.2f} |")
    raw_dec = ["| c | P | out | client TTFT ms | client TPOT ms | client tok/s/stream | "
               "server ITL ms | chunks/token | burst streams |",
               "|---|---|---|---|---|---|---|---|---|"]
    for d in data["decode"]:
        tpot = _median(d["client_tpot_s"])
        raw_dec.append(
            f"| {d['concurrency']} | {d['prompt_len']} | {d['max_tokens']} | "
            f"{_median(d['client_ttft_s']) * 1e3:.2f} | {tpot * 1e3:.2f} | {1 / tpot:.1f} | "
            f"{server_median(d, 'inter_token_latency_seconds') * 1e3:.2f} | "
            f"{_median(d['chunks_per_token']):.3f} | {d['burst_streams']} |")
    contended = data.get("contended")
    t_contended = contended_fit(contended, engine) if contended and engine else None
    out: list[str] = []
    if client:
        out += ["Client fit (step coefficients + per-request overhead; use for cpu-tiny):",
                "  " + ", ".join(f"{k}={v:.4g}" for k, v in client.items()),
                *_fit_table(crows, client, WITH_OVERHEAD), ""]
    if engine:
        out += ["Engine fit (vLLM's own clocks: what the engine core does):",
                "  " + ", ".join(f"{k}={v:.4g}" for k, v in engine.items()),
                *_fit_table(erows, engine, STEP), ""]
    out += ["Raw prefill points (concurrency 1, max_tokens 1):", *raw_pre, "",
            "Raw decode points:", *raw_dec]
    if contended:
        out += ["", f"Contended chat turns ({len(contended['alone_ttft_s'])} pairs; the other "
                f"turn started {contended['offset_s'] * 1e3:.0f} ms before): client TTFT "
                f"median {_median(contended['alone_ttft_s']) * 1e3:.2f} ms alone, "
                f"{_median(contended['busy_ttft_s']) * 1e3:.2f} ms beside another"
                + (f"; t_api_contended {t_contended * 1e3:.2f} ms"
                   if t_contended is not None else "")]
    return {"client_fit": client, "engine_fit": engine, "t_api_contended": t_contended,
            "table": "\n".join(out)}


def _parse_ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def _parse_shapes(s: str) -> list[tuple[int, int]]:
    shapes = []
    for x in (x for x in s.split(",") if x):
        c, _, p = x.partition("x")
        if not (c.isdigit() and p.isdigit()):
            raise argparse.ArgumentTypeError(f"shape {x!r} is not AxB (two integers)")
        shapes.append((int(c), int(p)))
    return shapes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="base URL of a running server (vLLM or the emulator)")
    src.add_argument("--start", action="store_true",
                     help="start real vLLM with the calibration settings "
                          "(weighbridge.emulator.real_vllm)")
    src.add_argument("--fit-only", type=Path, help="refit the raw data of a saved --out JSON")
    ap.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    ap.add_argument("--vocab", type=int, default=2048, help="token ids are drawn below this")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ttft-samples", type=int, default=5, help="TTFT samples per repeat")
    ap.add_argument("--prompt-lens", type=_parse_ints, default=[16, 128, 512, 1024, 2000],
                    help="prefill points (concurrency 1); each must fit the token budget")
    ap.add_argument("--decode-shapes", type=_parse_shapes,
                    default=_parse_shapes("1x16,1x1536,8x16,8x256,32x16,32x64"),
                    help="CONCURRENCYxPROMPT decode points; c*P within one token budget "
                         "keeps the ramp-up to one step")
    ap.add_argument("--prefix-points", type=_parse_shapes, default=_parse_shapes("896x64,896x256"),
                    help="PREFIXxNEW prefill points after a cached prefix (t_prefill_context)")
    ap.add_argument("--contended-repeats", type=int, default=20,
                    help="pairs of a chat turn alone and beside another (t_api_contended); "
                         "0: none")
    ap.add_argument("--contended-offset", type=float, default=0.06,
                    help="seconds the other turn starts before the contended one")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write raw data + fits as JSON")
    args = ap.parse_args(argv)

    if args.fit_only:
        print(report(json.loads(args.fit_only.read_text())["data"])["table"])
        return 0

    meta: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                            "host": platform.node(), "argv": sys.argv[1:],
                            "loadavg_before": os.getloadavg()}
    if args.start:
        server = RealVllmServer(max_num_seqs=32, max_num_batched_tokens=2048,
                                max_model_len=2048, block_size=32, num_kv_blocks=1024)
        with server:
            meta["server"] = {"command": server.command(), "startup_s": server.startup_s}
            print(f"started vLLM at {server.url} in {server.startup_s:.1f} s", file=sys.stderr)
            data = asyncio.run(measure(args, server.url))
    else:
        meta["server"] = {"url": args.url}
        data = asyncio.run(measure(args, args.url.rstrip("/")))
    meta["loadavg_after"] = os.getloadavg()
    fit = report(data)
    print(fit["table"])
    print(f"\nload average before/after: {meta['loadavg_before']} / {meta['loadavg_after']} "
          "(the server and this client account for ~2 while running)")
    if args.out:
        args.out.write_text(json.dumps({"meta": meta, "data": data,
                                        "client_fit": fit["client_fit"],
                                        "engine_fit": fit["engine_fit"],
                                        "t_api_contended": fit["t_api_contended"]},
                                       indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
