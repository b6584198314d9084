"""Load generator capacity: one Locust process, streaming, against a fast emulator.

Target (issue 4, acceptance 5): one Locust process sustains at least 300 streaming
requests/s and 20,000 received tokens/s with p99 schedule lag under 10 ms; report where it
saturates.

Each level runs the real thing, ``locust -f scenarios/ --headless --scenario steady`` with
a generated tenants file (four tenants, Poisson, 16-token-id prompts, exactly 68 output
tokens with ignore_eos, so 300 req/s is ~20,400 tokens/s), pinned to one core, against an
emulator pinned to the other whose step model is only a 10 ms fixed step (no prefill, decode
or API-server cost) with room for 2,048 sequences, so the engine is never what limits.

The same-run baseline is the offered load: the schedule's own rate. Figures per level, over
a window that leaves out the first seconds (start-up) and the last (requests cut off by the
run's end), all from the run's records: completed/offered, received tokens/s, the schedule
lag (actual minus scheduled send, per request) p50/p99/max, TTFT p50, and the generator's
CPU share of its core and run-queue wait (schedstat), which tells "the generator is out of
CPU" from "a neighbour took the CPU". A level *sustains* when >= 99% of its requests end ok
and its lag p99 is under 10 ms; the saturation point is the first level that does not.
"""

from __future__ import annotations

import math
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from benchmarks import _system
from benchmarks._core import REPO, BenchContext, Benchmark, BenchResult, Table
from weighbridge.launch import emulator_process
from weighbridge.loadgen.lag import LAG_WARN_S
from weighbridge.rundir import read_records
from weighbridge.statistics import percentile

LEVELS = (150, 300, 400, 500, 600, 800)  # offered requests/s
QUICK_LEVELS = (150, 300)
TENANTS = 4
PROMPT_TOKENS = 16
OUTPUT_TOKENS = 68
TARGET_RPS = 300.0
TARGET_TOKENS_PER_S = 20_000.0
OK_SHARE = 0.99
T_STEP_S = 0.01
REPEATS = 3  # per level in a full run, interleaved; the quietest is reported
NOISE_WAIT = 0.10  # run-queue wait share above which a row says more about neighbours


@dataclass(frozen=True, slots=True)
class Level:
    offered_rps: float
    window_s: float
    scheduled: int
    ok: int
    ok_rps: float
    tokens_per_s: float
    lag_p50_s: float
    lag_p99_s: float
    lag_max_s: float
    ttft_p50_s: float
    cpu: float  # the Locust process's CPU over the window, share of one core
    wait: float  # its run-queue wait over the window, share of the window
    server_cpu: float  # the emulator's, likewise: near 100% means the engine limited
    server_wait: float

    @property
    def sustained(self) -> bool:
        return self.ok >= OK_SHARE * self.scheduled and self.lag_p99_s < LAG_WARN_S


def _tenants_file(directory: Path, rate: float) -> Path:
    path = directory / f"tenants-{rate:g}.yaml"
    path.write_text(yaml.safe_dump({"tenants": [
        {"name": f"bench-{i}", "endpoint": "completions",
         "lengths": {"prompt": PROMPT_TOKENS, "output": OUTPUT_TOKENS},
         "arrival": {"kind": "poisson", "rate": rate / TENANTS}}
        for i in range(TENANTS)]}))
    return path


def _measure(url: str, server_pid: int, rate: float, run_s: float, warmup_s: float,
             tail_s: float, client_core: int | None, directory: Path) -> Level:
    directory.mkdir(parents=True, exist_ok=True)
    run_dir = directory / f"run-{rate:g}"
    locust = str(Path(sys.executable).with_name("locust"))
    argv = _system.pinned_argv(
        [locust, "-f", "scenarios/", "--headless", "--scenario", "steady",
         "--tenants-file", str(_tenants_file(directory, rate)), "--host", url,
         "-t", f"{run_s:g}s", "--records-dir", str(run_dir), "--exporter-port", "0",
         "--only-summary", "--loglevel", "WARNING"], client_core)
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    # Locust needs about a second to start; the window is measured in run time below, and
    # its CPU is sampled over about the same span.
    time.sleep(warmup_s + 1.0)
    before = _system.process_sched(proc.pid)
    server_before = _system.process_sched(server_pid)
    sampled_at = time.monotonic()
    time.sleep(max(0.5, run_s - warmup_s - tail_s))
    cpu = _system.process_sched(proc.pid) - before
    server = _system.process_sched(server_pid) - server_before
    span = time.monotonic() - sampled_at
    _, stderr = proc.communicate(timeout=run_s + 120)
    if proc.returncode not in (0, 1):  # 1: some requests failed, which the table shows
        raise RuntimeError(f"locust exited {proc.returncode}: {stderr[-3000:]}")
    records = read_records(run_dir)
    end = max(r.scheduled_s for r in records)
    lo, hi = warmup_s, end - tail_s
    window = [r for r in records if lo <= r.scheduled_s < hi]
    ok = [r for r in window if r.status == "ok"]
    lags = sorted(r.sent_s - r.scheduled_s for r in window if r.sent_s is not None)
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    span_s = hi - lo
    return Level(
        offered_rps=rate, window_s=span_s, scheduled=len(window), ok=len(ok),
        ok_rps=len(ok) / span_s, tokens_per_s=sum(r.output_tokens or 0 for r in ok) / span_s,
        lag_p50_s=percentile(lags, 0.5), lag_p99_s=percentile(lags, 0.99),
        lag_max_s=lags[-1] if lags else math.nan, ttft_p50_s=percentile(ttfts, 0.5),
        cpu=cpu.cpu_s / span, wait=cpu.wait_s / span, server_cpu=server.cpu_s / span,
        server_wait=server.wait_s / span,
    )


def _ms(x: float) -> str:
    return f"{x * 1000:.2f}" if math.isfinite(x) else "n/a"


def run(ctx: BenchContext) -> BenchResult:
    levels = QUICK_LEVELS if ctx.quick else LEVELS
    run_s, warmup_s, tail_s = (10.0, 3.0, 2.0) if ctx.quick else (25.0, 5.0, 3.0)
    pinning = _system.choose_pinning()
    proc = emulator_process(
        max_num_seqs=2048, max_num_batched_tokens=65536, num_kv_blocks=65536, block_size=16,
        # Zeros as strings: emulator_process drops flags whose value == False.
        t_fixed=T_STEP_S, t_prefill_token="0", t_decode_seq="0", t_kv_token="0",
        t_api_serial="0", t_api_latency="0", t_api_token="0",
    )
    proc.argv = _system.pinned_argv(proc.argv, pinning.server)
    repeats = 1 if ctx.quick else REPEATS
    task = ctx.progress.add_task("loadgen_capacity", total=len(levels) * repeats)
    runs: dict[float, list[Level]] = {rate: [] for rate in levels}
    directory = Path(tempfile.mkdtemp(prefix="weighbridge-loadgen-bench-"))
    try:
        with proc:
            for rep in range(repeats):  # interleaved: a burst of neighbours' load hits one
                for rate in levels:
                    ctx.progress.update(task, description=(
                        f"loadgen_capacity {rep + 1}/{repeats}: {rate:g} req/s"))
                    assert proc.pid is not None
                    level = _measure(proc.url, proc.pid, rate, run_s, warmup_s, tail_s,
                                     pinning.client, directory / f"rep{rep}")
                    ctx.log(f"  {rate:g} req/s: ok {level.ok_rps:.0f}/s, "
                            f"{level.tokens_per_s:,.0f} tok/s, lag p99 "
                            f"{_ms(level.lag_p99_s)} ms, generator CPU {level.cpu:.0%} "
                            f"(waiting {level.wait:.0%}), emulator CPU "
                            f"{level.server_cpu:.0%}")
                    runs[rate].append(level)
                    ctx.progress.advance(task)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    # Neighbours only ever slow the generator down: each level reports the repeat that
    # waited least for a CPU, as timeit reports its fastest.
    results = [min(runs[rate], key=lambda lv: lv.wait + lv.server_wait) for rate in levels]

    sustained = [lv for lv in results if lv.sustained]
    best = max(sustained, key=lambda lv: lv.offered_rps, default=None)
    # The saturation point is the first level above the best sustained one that is not
    # sustained; a lower level that missed did so in noise (its wait column shows it).
    floor = best.offered_rps if best is not None else 0.0
    saturated = next((lv for lv in results if lv.offered_rps > floor and not lv.sustained),
                     None)
    noisy = [lv for lv in results if lv.wait > NOISE_WAIT or lv.server_wait > NOISE_WAIT]
    passed = best is not None and best.ok_rps >= TARGET_RPS * 0.97 and \
        best.tokens_per_s >= TARGET_TOKENS_PER_S * 0.97 and best.offered_rps >= TARGET_RPS
    summary = []
    if best is not None:
        summary.append(
            f"Highest sustained level: **{best.offered_rps:g} req/s offered, {best.ok_rps:.0f} "
            f"completed/s = {best.ok_rps / best.offered_rps:.3f}x offered, "
            f"{best.tokens_per_s:,.0f} received tok/s**, schedule lag p99 "
            f"{_ms(best.lag_p99_s)} ms (target >= {TARGET_RPS:g} req/s, >= "
            f"{TARGET_TOKENS_PER_S:,.0f} tok/s, p99 lag < {LAG_WARN_S * 1000:g} ms); "
            f"generator at {best.cpu:.0%} of its core.")
    if saturated is not None:
        reason = ("lag p99 " + _ms(saturated.lag_p99_s) + " ms"
                  if saturated.lag_p99_s >= LAG_WARN_S else
                  f"only {saturated.ok / max(saturated.scheduled, 1):.1%} ended ok")
        limit = ("the emulator (its core busy)" if saturated.server_cpu > 0.9 else
                 "the generator" if saturated.cpu + saturated.wait > 0.9 else
                 "neither process's CPU alone: the generator's event loop latency")
        summary.append(f"Saturates at **{saturated.offered_rps:g} req/s** ({reason}; "
                       f"generator CPU {saturated.cpu:.0%}, waiting {saturated.wait:.0%}; "
                       f"emulator CPU {saturated.server_cpu:.0%}, waiting "
                       f"{saturated.server_wait:.0%}); limited by {limit}.")
    else:
        summary.append(f"No saturation up to {levels[-1]:g} req/s.")
    if noisy:
        summary.append(
            "**Machine noise**: at " + ", ".join(f"{lv.offered_rps:g}" for lv in noisy) +
            f" req/s even the quietest repeat waited more than {NOISE_WAIT:.0%} of the window "
            "for a CPU (neighbours on the shared machine); those rows understate the "
            "generator.")
    table = Table(
        columns=("offered req/s (baseline)", "completed req/s", "ratio to offered",
                 "received tok/s", "lag p50 / p99 / max (ms)", "TTFT p50 (ms)",
                 "generator CPU", "generator waiting for CPU", "emulator CPU",
                 "emulator waiting for CPU", "sustained"),
        rows=[(f"{lv.offered_rps:g}", f"{lv.ok_rps:.0f}", f"**{lv.ok_rps / lv.offered_rps:.3f}**",
               f"{lv.tokens_per_s:,.0f}",
               f"{_ms(lv.lag_p50_s)} / {_ms(lv.lag_p99_s)} / {_ms(lv.lag_max_s)}",
               _ms(lv.ttft_p50_s), f"{lv.cpu:.0%}", f"{lv.wait:.0%}",
               f"{lv.server_cpu:.0%}", f"{lv.server_wait:.0%}",
               "yes" if lv.sustained else "no") for lv in results],
    )
    notes = [
        f"Load: `locust -f scenarios/ --headless --scenario steady --tenants-file <generated> "
        f"-t {run_s:g}s` (one process, no --processes), {TENANTS} tenants with Poisson "
        f"arrivals, {PROMPT_TOKENS}-token-id prompts, {OUTPUT_TOKENS} output tokens "
        "(ignore_eos), streamed with include_usage; every request is a greenlet sent at "
        "its scheduled time.",
        "Emulator: `weighbridge emulator --max-num-seqs 2048 --num-kv-blocks 65536 "
        f"--t-fixed {T_STEP_S} --t-prefill-token 0 --t-decode-seq 0 --t-kv-token 0 "
        "--t-api-serial 0 --t-api-latency 0`: a 10 ms step whatever the batch, so each "
        f"request lives ~{OUTPUT_TOKENS * T_STEP_S:.2f} s and the engine has room for all.",
        f"Window: requests scheduled from {warmup_s:g} s after the start to {tail_s:g} s "
        "before the last one; tokens are the usage counts of the requests that ended ok.",
        "Schedule lag: sent_s - scheduled_s of every request in the window (the records' "
        "own fields); TTFT from the scheduled time.",
        "Generator CPU: schedstat of the Locust process over the window; 'waiting' is time "
        "it was runnable while another process had its core (a shared machine). "
        f"{repeats} interleaved repeat(s) per level; the one that waited least is shown.",
        "Client choice: geventhttpclient (Locust's FastHttpUser client) used directly, one "
        "SSE event per readline; see docs/loadgen.md.",
    ]
    return BenchResult(summary=summary, tables=[table], notes=notes, passed=passed,
                       setup=[f"pinning: {pinning.describe()}"])


BENCHMARK = Benchmark(
    name="loadgen_capacity",
    title="one Locust process: streaming requests/s and tokens/s at < 10 ms schedule lag",
    run=run,
)
