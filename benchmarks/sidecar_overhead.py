"""Sidecar overhead: TTFT added by the sidecar at 200 streaming requests/s and its CPU time per
request (issue 17's targets: added p50 <= 1 ms, p99 <= 4 ms, <= 400 µs of CPU per request of
16-18 chunks), and the throughput one sidecar process can carry.

Baseline in the same run, at the same time: two independent Poisson streams of 200 requests/s
each, one through the sidecar (default policy ``drr``, one tenant, admission and metrics
polling on) to one emulator, the other direct to an identical emulator. Both see the same
machine at the same moments, so the difference of their TTFT percentiles is what the sidecar
adds: authentication, rate limiting, queueing and the scheduling decision, dispatch, and
relaying the first chunk. (The streams get an engine each because the sidecar's admission gate
reads its engine's waiting queue: a direct stream into the same engine would be load the
sidecar cannot see, and it would rightly hold its own requests back.)
The passes alternate which stream the client opens first, so neither gets a systematic head
start in the client's event loop.

Requests are small (32-token prompts, 16 output tokens, ``ignore_eos``) on an engine with room
for all of them (256 sequences), so engine queueing stays out of the figure. Three sidecar
configurations, each against its own direct baseline (and a fourth, ``COARSE``, that shows
what streaming 4 tokens per chunk buys):

* ``passthrough`` — the proxy alone (no queue, no gate): the cost of the extra hop;
* ``drr``, ``max_backend_waiting: 8`` — the default policy with the waiting gate sized for the
  load (the verdict is on this one);
* ``drr`` with the plain config (tenants and backends only): every admission knob derived
  from the engine's learned shape (docs/sidecar.md#admission-defaults-learned-from-each-engine).
  The engine is never saturated here, so its slots are never learned and the waiting bound
  stays at its unknown-engine default of 8; issue 14 asks that this be no worse than the
  sized config (it was +3 ms p50, +82 ms p99 with the old fixed default of 2).

TTFT is timed from the scheduled send time to the first chunk with generated text. The
client runs on uvloop and reads raw SSE lines (no JSON decoding).

**The peer.** When ``.venv-litellm`` exists (``make litellm``; ``$WEIGHBRIDGE_LITELLM`` names
another ``litellm`` executable), LiteLLM's proxy is measured the same way, in front of the same
engine shape: one worker, no database, no callbacks, the engine as a ``hosted_vllm`` model. One
worker cannot carry 200 requests/s (it spends over 100 ms of CPU on each here), so its row and
a row of our plain config beside it run at ``PEER_RATE``.

**The floor.** When ``haproxy`` is on the PATH (Debian's package), HAProxy relays the same
streams in front of the same engine shape at ``RATE``: a proxy in C doing the least a proxy
does per streamed request (read the request, write it to the backend, read each chunk and
write it to the client). Its CPU per request is what the kernel and one event loop cost on
this machine for that traffic (loopback TCP writes that run the receiver's stack and wake it,
``epoll``), which no relay in user space avoids; the sidecar's figure is read against it.

**Throughput.** One sidecar process should carry 1,000 streaming requests/s of 16-token answers
with its added p99 under 10 ms. On a 2-core machine the client and the engines need most of a
core at that rate, so the benchmark reports the CPU-bound projection (one core's second over
the measured CPU per request at 200 req/s) and measures the proxy alone (``passthrough``: at
this rate the engine's waiting queue, not the sidecar, would close the default config's
admission gate, which is sized for 200 req/s) at ``THROUGHPUT_RATE``, the highest rate run
here.

``python -m benchmarks.sidecar_overhead [--quick] [--rate 200] [--seconds 20]``
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import uvloop
import yaml

from benchmarks import _system
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from weighbridge.launch import (
    ServerProcess,
    emulator_process,
    free_port,
    haproxy_process,
    sidecar_process,
)
from weighbridge.statistics import percentile

MODEL = "m"
# One bearer key for both proxies: the sidecar's tenant key and LiteLLM's master key (which it
# refuses to start without, or with a weak one).
KEY = "sk-bench-6f1d2c9a4e7b8d0c3a5f9e1b7d2c4a6e"
RATE = 200.0
TARGET_P50_S, TARGET_P99_S = 0.001, 0.004
TARGET_CPU_S = 400e-6  # per request of 16-18 chunks, at RATE
TARGET_THROUGHPUT = 1000.0  # streaming req/s with added p99 under THROUGHPUT_P99_S
THROUGHPUT_P99_S = 0.010
# The highest rate measured here: the client and two engines share the 2 cores with the sidecar,
# and at 400 req/s per stream the engines themselves fall behind (direct p50 1.5 s, 12:15 UTC).
THROUGHPUT_RATE = 300.0
THROUGHPUT_CONFIG = "passthrough"
ENGINE = {"profile": "h100-llama3-8b", "max_num_seqs": 256, "max_num_batched_tokens": 8192,
          "num_kv_blocks": 8192, "block_size": 16, "max_model_len": 1024, "model_name": MODEL}
BODY = orjson.dumps({"model": MODEL, "prompt": list(range(10, 42)), "max_tokens": 16,
                     "ignore_eos": True, "stream": True})
# The peer rows' request: LiteLLM refuses token-id prompts for a text completion ("Unmapped
# prompt format"), so those rows (ours beside it too) send 32 words the engine counts as 32
# tokens; the rest is the same.
TEXT_BODY = orjson.dumps({"model": MODEL, "prompt": " ".join(["word"] * 32), "max_tokens": 16,
                          "ignore_eos": True, "stream": True})


CONFIGS: dict[str, dict[str, object]] = {
    "passthrough": {"scheduler": {"policy": "passthrough"}},
    "drr, max_backend_waiting 8": {"admission": {"max_backend_waiting": 8}},
    "drr, plain config (admission derived)": {},
}
PLAIN = "drr, plain config (admission derived)"
VERDICT_ON = "drr, max_backend_waiting 8"
# The lever past the relay (docs/sidecar-performance.md, "What is left"): the same plain
# config with the tenant's tier streaming 4 tokens per chunk (vLLM's request `stream_interval`,
# set by the tier), so a 16-token answer is 5 content chunks instead of 16. Not a row the
# targets judge (they are per request of 16-18 chunks): it shows what fewer wake-ups buy.
COARSE = "drr, plain config, tier stream_interval 4 (5 chunks)"
COARSE_CONFIG: dict[str, object] = {"tiers": {"standard": {"rank": 2, "stream_interval": 4}}}

# The peer (module doc): scripts/install-litellm.sh builds this venv with the version below.
LITELLM = Path(os.environ.get(
    "WEIGHBRIDGE_LITELLM",
    Path(__file__).resolve().parents[1] / ".venv-litellm" / "bin" / "litellm"))
LITELLM_NAME = "LiteLLM proxy (one worker)"
# One LiteLLM worker spends ~150-170 ms of CPU on each streamed request on this machine (a
# first measurement, 2026-12-02): 2 requests/s keep it below saturation, so its row shows its
# cost per request and not a queue.
PEER_RATE = 2.0
# LiteLLM's first requests pay for lazy imports and caches (seconds of CPU): both peer rows
# are warmed for this long before the passes.
PEER_WARMUP_S = 15.0
HAPROXY_NAME = "HAProxy (C), the floor"


def sidecar_config(engine_url: str, overlay: dict[str, object]) -> dict[str, object]:
    return {"tenants": {"bench": {"tier": "standard", "api_keys": [f"plain:{KEY}"]}},
            "backends": [{"url": engine_url}], **overlay}


Proxy = Callable[[str], ServerProcess]  # the engine's URL -> the proxy in front of it


def sidecar(overlay: dict[str, object]) -> Proxy:
    return lambda url: sidecar_process(sidecar_config(url, overlay), name="overhead-sidecar")


def haproxy(url: str) -> ServerProcess:
    """HAProxy in front of ``url`` (the engine answers its health check on /health)."""
    return haproxy_process([url], Path(tempfile.mkdtemp(prefix="weighbridge-haproxy-")),
                           health_path="/health")


def litellm(url: str) -> ServerProcess:
    """LiteLLM's proxy in front of ``url``: the engine as an OpenAI-compatible vLLM model of
    the same name, one worker, nothing else configured."""
    directory = Path(tempfile.mkdtemp(prefix="weighbridge-litellm-"))
    config = directory / "litellm.yaml"
    config.write_text(yaml.safe_dump({
        "model_list": [{"model_name": MODEL,
                        "litellm_params": {"model": f"hosted_vllm/{MODEL}",
                                           "api_base": url + "/v1", "api_key": "none"}}],
        "general_settings": {"master_key": KEY}}))
    port = free_port()
    return ServerProcess(
        name="overhead-litellm", url=f"http://127.0.0.1:{port}", cwd=directory,
        argv=[str(LITELLM), "--config", str(config), "--host", "127.0.0.1", "--port",
              str(port), "--num_workers", "1"],
        health_path="/health/liveliness", startup_timeout_s=180,
        # Offline: the bundled model cost map, not a fetch from GitHub at start-up.
        env={"LITELLM_LOCAL_MODEL_COST_MAP": "True"})


@dataclass(slots=True)
class Stream:
    """One Poisson stream's outcomes."""

    name: str
    ttft_s: list[float] = field(default_factory=list)
    failures: int = 0


async def one_request(session: aiohttp.ClientSession, url: str, headers: dict[str, str],
                      due: float, out: Stream, body: bytes = BODY) -> None:
    await asyncio.sleep(max(0.0, due - time.monotonic()))
    try:
        async with session.post(url, data=body, headers=headers) as response:
            if response.status != 200:
                out.failures += 1
                await response.read()
                return
            first: float | None = None
            async for line in response.content:
                if first is None and line.startswith(b"data: {") and b'"text":""' not in line:
                    first = time.monotonic()
            if first is None:
                out.failures += 1
            else:
                out.ttft_s.append(first - due)
    except aiohttp.ClientError:
        out.failures += 1


def poisson(rate: float, seconds: float, rng: random.Random) -> list[float]:
    times, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= seconds:
            return times
        times.append(t)


async def drive(direct_url: str, sidecar_url: str, rate: float, seconds: float, seed: int,
                sidecar_first: bool, body: bytes = BODY) -> tuple[Stream, Stream]:
    rng = random.Random(seed)
    direct, side = Stream("direct"), Stream("sidecar")
    plans = [(direct_url, {"content-type": "application/json"}, direct,
              poisson(rate, seconds, rng)),
             (sidecar_url, {"content-type": "application/json",
                            "authorization": f"Bearer {KEY}"}, side,
              poisson(rate, seconds, rng))]
    if sidecar_first:
        plans.reverse()
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=60)) as session:
        t0 = time.monotonic() + 0.2
        await asyncio.gather(*(one_request(session, url + "/v1/completions", headers, t0 + at,
                                           out, body)
                               for url, headers, out, times in plans for at in times))
    return direct, side


@dataclass(frozen=True, slots=True)
class Overhead:
    requests: int
    failures: int
    direct_p50_s: float
    direct_p99_s: float
    sidecar_p50_s: float
    sidecar_p99_s: float
    cpu_per_request_s: float  # sidecar process CPU over requests it served
    client_wait_share: float  # the client's run-queue wait / wall: the machine's noise

    @property
    def added_p50_s(self) -> float:
        return self.sidecar_p50_s - self.direct_p50_s

    @property
    def added_p99_s(self) -> float:
        return self.sidecar_p99_s - self.direct_p99_s


def measure(rate: float, seconds: float, passes: int, proxy: Proxy,
            log: Callable[[str], None] = print, body: bytes = BODY,
            warmup_s: float = 1.0) -> Overhead:
    direct: list[float] = []
    side: list[float] = []
    failures = 0
    cpu = 0.0
    wait = wall = 0.0
    with emulator_process(name="overhead-direct", **ENGINE) as engine, \
            emulator_process(name="overhead-behind", **ENGINE) as behind, \
            proxy(behind.url) as sidecar:
        # Warm both paths (connection pools, first dispatch, the metrics poller's first scrape).
        uvloop.run(drive(engine.url, sidecar.url, min(rate, 50), warmup_s, seed=0,
                         sidecar_first=False, body=body))
        for k in range(passes):
            assert sidecar.pid is not None
            # The proxy's whole process group: it runs in its own session (workers included).
            before, client_before = _system.group_sched(sidecar.pid), _system.thread_sched()
            start = time.monotonic()
            d, s = uvloop.run(drive(engine.url, sidecar.url, rate, seconds, seed=k + 1,
                                     sidecar_first=k % 2 == 1, body=body))
            wall += time.monotonic() - start
            cpu += (_system.group_sched(sidecar.pid) - before).cpu_s
            wait += (_system.thread_sched() - client_before).wait_s
            direct += d.ttft_s
            side += s.ttft_s
            failures += d.failures + s.failures
            d_ttft, s_ttft = sorted(d.ttft_s), sorted(s.ttft_s)
            log(f"pass {k + 1}/{passes}: direct p50 {percentile(d_ttft, 0.5) * 1e3:.2f} ms "
                f"p99 {percentile(d_ttft, 0.99) * 1e3:.2f} ms; sidecar p50 "
                f"{percentile(s_ttft, 0.5) * 1e3:.2f} ms p99 "
                f"{percentile(s_ttft, 0.99) * 1e3:.2f} ms")
    direct.sort()
    side.sort()
    return Overhead(
        requests=len(side), failures=failures,
        direct_p50_s=percentile(direct, 0.5), direct_p99_s=percentile(direct, 0.99),
        sidecar_p50_s=percentile(side, 0.5), sidecar_p99_s=percentile(side, 0.99),
        cpu_per_request_s=cpu / max(1, len(side)),
        client_wait_share=wait / wall if wall else math.nan,
    )


def _ms(x: float) -> str:
    return f"{x * 1e3:.2f}"


def verdict(o: Overhead) -> bool:
    return (o.failures == 0 and o.added_p50_s <= TARGET_P50_S
            and o.added_p99_s <= TARGET_P99_S and o.cpu_per_request_s <= TARGET_CPU_S)


def run(ctx: BenchContext) -> BenchResult:
    seconds, passes = (5.0, 2) if ctx.quick else (15.0, 4)
    runs: list[tuple[str, float, Overhead]] = []
    for name, overlay in CONFIGS.items():
        ctx.log(f"{name}: {passes} passes of {seconds:.0f} s at {RATE:.0f} req/s through the "
                f"sidecar and {RATE:.0f} req/s direct")
        runs.append((name, RATE, measure(RATE, seconds, passes, sidecar(overlay), log=ctx.log)))
    ctx.log(f"{COARSE}: {passes} passes of {seconds:.0f} s at {RATE:.0f} req/s")
    runs.append((COARSE, RATE, measure(RATE, seconds, passes, sidecar(COARSE_CONFIG),
                                       log=ctx.log)))
    ctx.log(f"{THROUGHPUT_CONFIG}: {passes} passes of {seconds:.0f} s at {THROUGHPUT_RATE:.0f} "
            "req/s")
    runs.append((THROUGHPUT_CONFIG, THROUGHPUT_RATE,
                 measure(THROUGHPUT_RATE, seconds, passes, sidecar(CONFIGS[THROUGHPUT_CONFIG]),
                         log=ctx.log)))
    notes = []
    if shutil.which("haproxy"):
        ctx.log(f"{HAPROXY_NAME}: {passes} passes of {seconds:.0f} s at {RATE:.0f} req/s")
        runs.append((HAPROXY_NAME, RATE, measure(RATE, seconds, passes, haproxy, log=ctx.log)))
        notes.append(f"{HAPROXY_NAME}: `{_haproxy_version()}` with launch.haproxy_config "
                     "(HTTP mode, default threads, keep-alive to the engine), the least a "
                     "proxy does per streamed request; measured like the sidecar rows.")
    else:
        notes.append(f"No {HAPROXY_NAME} row: `haproxy` is not on the PATH "
                     "(Debian: apt-get install haproxy).")
    if LITELLM.exists():
        for name, proxy in ((LITELLM_NAME, litellm), (PLAIN, sidecar(CONFIGS[PLAIN]))):
            ctx.log(f"{name}: {passes} passes of {seconds:.0f} s at {PEER_RATE:.0f} req/s")
            runs.append((name, PEER_RATE, measure(PEER_RATE, seconds, passes, proxy,
                                                  log=ctx.log, body=TEXT_BODY,
                                                  warmup_s=PEER_WARMUP_S)))
        notes.append(f"{LITELLM_NAME}: `{LITELLM}` ({_litellm_version()}), started as "
                     "`litellm --config F --num_workers 1` with the engine as a "
                     "`hosted_vllm` model and nothing else (no database, no callbacks); "
                     f"measured at {PEER_RATE:.0f} req/s, with our plain config at the "
                     "same rate beside it, because one worker cannot carry "
                     f"{RATE:.0f} req/s.")
    else:
        notes.append(f"No LiteLLM row: `{LITELLM}` does not exist (`make litellm` builds it).")
    rows = [(name, f"{rate:.0f}", _ms(o.direct_p50_s), _ms(o.sidecar_p50_s),
             f"**{_ms(o.added_p50_s)}**", _ms(o.direct_p99_s), _ms(o.sidecar_p99_s),
             f"**{_ms(o.added_p99_s)}**", f"{o.cpu_per_request_s * 1e6:.0f}", str(o.failures))
            for name, rate, o in runs]
    results = {name: o for name, rate, o in runs if rate == RATE}
    o = results[VERDICT_ON]
    plain = results.get(PLAIN)
    floor = results.get(HAPROXY_NAME)
    summary = [f"TTFT added by the sidecar (`{VERDICT_ON}`) at {RATE:.0f} streaming req/s: "
               f"p50 **{_ms(o.added_p50_s)} ms**, p99 **{_ms(o.added_p99_s)} ms** (targets "
               f"{TARGET_P50_S * 1e3:.0f} / {TARGET_P99_S * 1e3:.0f} ms); sidecar CPU "
               f"**{o.cpu_per_request_s * 1e6:.0f} µs per request** (target "
               f"{TARGET_CPU_S * 1e6:.0f} µs)."]
    if floor is not None:
        base = floor.cpu_per_request_s
        ratios = ", ".join(f"{name} {results[name].cpu_per_request_s / base:.2f}x"
                           for name in CONFIGS)
        summary.append(f"The floor: HAProxy relays the same streams at "
                       f"**{floor.cpu_per_request_s * 1e6:.0f} µs** of CPU per request on this "
                       f"machine; the sidecar's CPU per request against it: {ratios}.")
    if plain is not None:
        coarse = results[COARSE]
        summary.append(
            f"Fewer chunks: with its tier streaming 4 tokens per chunk (vLLM's "
            f"`stream_interval`, 5 content chunks instead of 16) the plain config spends "
            f"**{coarse.cpu_per_request_s * 1e6:.0f} µs** per request, "
            f"{coarse.cpu_per_request_s / plain.cpu_per_request_s:.2f}x the 16-chunk row's "
            f"(added TTFT p50 {_ms(coarse.added_p50_s)} ms, p99 {_ms(coarse.added_p99_s)} ms).")
    high = next(o for name, rate, o in runs if rate == THROUGHPUT_RATE)
    projection = 1 / o.cpu_per_request_s if o.cpu_per_request_s else math.inf
    summary.append(
        f"Throughput: CPU-bound projection **{projection:,.0f} streaming req/s** on one core "
        f"(1 s over {o.cpu_per_request_s * 1e6:.0f} µs; target {TARGET_THROUGHPUT:,.0f}); "
        f"measured ({THROUGHPUT_CONFIG}) at {THROUGHPUT_RATE:.0f} req/s, the highest rate run "
        f"on this 2-core machine: added p50 {_ms(high.added_p50_s)} ms, p99 "
        f"{_ms(high.added_p99_s)} ms (target under "
        f"{THROUGHPUT_P99_S * 1e3:.0f} ms), {high.cpu_per_request_s * 1e6:.0f} µs of CPU per "
        f"request, {high.failures} failures.")
    if plain is not None:
        summary.append(f"The plain config (every admission knob derived) adds p50 "
                       f"**{_ms(plain.added_p50_s)} ms**, p99 **{_ms(plain.added_p99_s)} ms** "
                       f"(the sized config's: {_ms(o.added_p50_s)} / {_ms(o.added_p99_s)} ms).")
    peer = {name: o for name, rate, o in runs if rate == PEER_RATE}
    if LITELLM_NAME in peer and PLAIN in peer:
        ours, theirs = peer[PLAIN], peer[LITELLM_NAME]
        summary.append(
            f"At {PEER_RATE:.0f} req/s: LiteLLM's proxy adds p50 "
            f"**{_ms(theirs.added_p50_s)} ms**, p99 **{_ms(theirs.added_p99_s)} ms** at "
            f"**{theirs.cpu_per_request_s * 1e6:,.0f} µs** of CPU per request; the sidecar "
            f"(plain config) {_ms(ours.added_p50_s)} / {_ms(ours.added_p99_s)} ms at "
            f"{ours.cpu_per_request_s * 1e6:,.0f} µs.")
    return BenchResult(
        summary=summary,
        tables=[Table(("proxy", "req/s", "direct p50 ms", "proxied p50 ms", "added p50 ms",
                       "direct p99 ms", "proxied p99 ms", "added p99 ms",
                       "proxy CPU µs/req", "failures"), rows)],
        notes=["Identical engines, same time: a Poisson stream through the proxy and one "
               "direct, each at the full rate; the added TTFT is the difference of their "
               "percentiles. On the 2-core machine four busy processes (client, two engines, "
               "proxy) share the CPU, so the extra hop also waits for a core: part of the "
               "added figure is the machine's. The client waited for a CPU "
               f"{o.client_wait_share:.0%} of the time in the verdict's run. CPU per request "
               "is the proxy's whole process group's.", *notes],
        passed=(verdict(o) and (plain is None or verdict(plain))
                and projection >= TARGET_THROUGHPUT),
    )


def _haproxy_version() -> str:
    try:
        out = subprocess.run(["haproxy", "-v"], capture_output=True, text=True, timeout=30,
                             check=True)
        return out.stdout.splitlines()[0].split(" - ")[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return "haproxy, version unknown"


def _litellm_version() -> str:
    python = LITELLM.parent / "python"
    try:
        out = subprocess.run([str(python), "-c", "import importlib.metadata as m; "
                              "print(m.version('litellm'))"], capture_output=True, text=True,
                             timeout=60, check=True)
        return "litellm " + out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "version unknown"


BENCHMARK = Benchmark("sidecar_overhead", "sidecar: added TTFT at 200 streaming req/s", run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sidecar_overhead",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rate", type=float, default=RATE)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--passes", type=int, default=4)
    parser.add_argument("--config", choices=[*sorted(CONFIGS), COARSE, "litellm", "haproxy"],
                        default=VERDICT_ON,
                        help="a sidecar config, LiteLLM's proxy (needs make litellm) or "
                             "HAProxy (the floor; needs haproxy on the PATH)")
    args = parser.parse_args(argv)
    seconds, passes = (5.0, 2) if args.quick else (args.seconds, args.passes)
    peer = args.config == "litellm"
    proxy = (litellm if peer else haproxy if args.config == "haproxy"
             else sidecar(COARSE_CONFIG) if args.config == COARSE
             else sidecar(CONFIGS[args.config]))
    o = measure(args.rate, seconds, passes, proxy, body=TEXT_BODY if peer else BODY,
                warmup_s=PEER_WARMUP_S if peer else 1.0)
    print(f"added TTFT p50 {_ms(o.added_p50_s)} ms, p99 {_ms(o.added_p99_s)} ms; sidecar CPU "
          f"{o.cpu_per_request_s * 1e6:.0f} µs/request; {o.failures} failures; client CPU "
          f"wait {o.client_wait_share:.0%}")
    ok = verdict(o)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
