"""Fidelity on sessions: chat_sessions straight to real vLLM CPU and to the emulator, and
real vLLM with its prefix cache on and off (issue 29's acceptance).

Target: with the same traffic (``scenarios/chat_sessions.py``, seed 0: multi-turn chat
sessions behind a shared system prompt and a completions tenant with a fixed one, sent open
loop by the Locust load generator), the emulator's prefix-cache hit rate within ±5 points of
real vLLM's, and its TTFT p50 and p90 and output tokens/s within ±25%.

Both servers get fidelity's engine shape (``benchmarks.fidelity.ENGINE``: 32 sequences,
a 2,048-token budget, 1,024 KV blocks of 32 tokens) with the prefix cache on and
``--enable-prompt-tokens-details``; the emulator runs cpu-tiny calibrated on this host's real
vLLM first, as ``python -m benchmarks fidelity`` does ($WEIGHBRIDGE_FIDELITY_CALIBRATE=0:
cpu-tiny as shipped). A third run sends the same traffic to real vLLM with
``--no-enable-prefix-caching``: what the cache buys, per tenant, as the report reads it.

Figures per run: the hit rate (cached over prompt tokens of the requests that reported them,
``usage.prompt_tokens_details``); over the requests that ended ok, TTFT p50 and p90 (from
the scheduled send), output tokens/s (their output tokens over the scenario's 60 s) and the
per-stream decode speed p50; per tenant, the report's ``prefix_cache_hit_rate``
(weighbridge.analysis).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks import fidelity
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.summary import analyse, summary
from weighbridge.emulator.profiles import get_profile
from weighbridge.emulator.real_vllm import RealVllmServer
from weighbridge.launch import emulator_process
from weighbridge.loadrun import LoadRun
from weighbridge.records import RequestRecord
from weighbridge.rundir import read_records
from weighbridge.simulation.agreement import hit_rate
from weighbridge.statistics import percentile

SCENARIO = "chat_sessions"
SEED = 0
HIT_RATE_POINTS = 0.05
TOLERANCE = 0.25


@dataclass(frozen=True)
class Figures:
    name: str
    requests: int
    ok: int
    hit_rate: float | None
    ttft_p50_s: float
    ttft_p90_s: float
    output_tps: float
    decode_tps_p50: float
    tenants: dict[str, float | None]  # the report's per-tenant hit rate
    neighbours: str = ""  # what else ran: load average, other vLLM servers


def figures(name: str, loaded: tuple[Path, str], duration_s: float) -> Figures:
    run_dir, neighbours = loaded
    records: list[RequestRecord] = read_records(run_dir)
    ok = [r for r in records if r.status == "ok"]
    ttfts = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    decode = sorted(r.decode_tps for r in ok if r.decode_tps is not None)
    s = summary(analyse(load_run(run_dir), window_s=2.0))
    return Figures(
        name=name, requests=len(records), ok=len(ok), hit_rate=hit_rate(records),
        ttft_p50_s=percentile(ttfts, 0.5), ttft_p90_s=percentile(ttfts, 0.9),
        output_tps=sum(r.output_tokens or 0 for r in ok) / duration_s,
        decode_tps_p50=percentile(decode, 0.5),
        tenants={n: t["prefix_cache_hit_rate"] for n, t in s["tenants"].items()},
        neighbours=neighbours)


def _load(ctx: BenchContext, name: str, url: str, out: Path, pgid: int) -> tuple[Path, str]:
    """The run's directory, and what else the machine ran meanwhile: another vLLM server
    halves real vLLM's speed (both spin on the same two cores)."""
    ctx.log(f"  {name}: chat_sessions for 60 s ...")
    run = LoadRun(scenario=SCENARIO, host=url, run_dir=out / name,
                  log_path=out / f"{name}.log", run_id=name, seed=SEED)
    others = set(fidelity._foreign_vllm((pgid,)))
    run_dir = run.run()
    others |= set(fidelity._foreign_vllm((pgid,)))
    return run_dir, (f"load {os.getloadavg()[0]:.1f}, {len(others)} other vLLM process(es)")


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def run(ctx: BenchContext) -> BenchResult:
    profile, calibration = fidelity._host_profile(ctx) if fidelity.CALIBRATE else (
        get_profile(fidelity.PROFILE), [])
    engine = fidelity.ENGINE
    out = Path(tempfile.mkdtemp(prefix="bench-fidelity-sessions-"))
    duration = 60.0
    runs: dict[str, Figures] = {}
    for name, caching in (("vllm", True), ("vllm-no-cache", False)):
        ctx.log(f"  starting real vLLM ({'cache on' if caching else 'cache off'}) ...")
        with RealVllmServer(model_name=fidelity.MODEL, enable_prefix_caching=caching,
                            enable_prompt_tokens_details=True, **engine) as vllm:
            assert vllm.pid is not None
            runs[name] = figures(name, _load(ctx, name, vllm.url, out, vllm.pid), duration)
    with emulator_process(name="bench-fidelity-sessions-emulator", model_name=fidelity.MODEL,
                          profile=fidelity.PROFILE, vocab_size=fidelity.VOCAB,
                          enable_prompt_tokens_details=True,
                          **fidelity._overrides(profile), **engine) as emulator:
        assert emulator.pid is not None
        runs["emulator"] = figures(
            "emulator", _load(ctx, "emulator", emulator.url, out, emulator.pid), duration)
    vllm, emu, off = runs["vllm"], runs["emulator"], runs["vllm-no-cache"]

    def ratio(e: float, v: float) -> float:
        return e / v if v else float("nan")

    checks = {
        "hit rate": (vllm.hit_rate is not None and emu.hit_rate is not None
                     and abs(emu.hit_rate - vllm.hit_rate) <= HIT_RATE_POINTS),
        "TTFT p50": abs(ratio(emu.ttft_p50_s, vllm.ttft_p50_s) - 1) <= TOLERANCE,
        "TTFT p90": abs(ratio(emu.ttft_p90_s, vllm.ttft_p90_s) - 1) <= TOLERANCE,
        "output tok/s": abs(ratio(emu.output_tps, vllm.output_tps) - 1) <= TOLERANCE,
    }
    passed = all(checks.values())
    rows = [(f.name, f"{f.requests:,}", f"{f.ok:,}", _pct(f.hit_rate),
             f"{f.ttft_p50_s * 1000:,.1f}", f"{f.ttft_p90_s * 1000:,.1f}",
             f"{f.output_tps:,.0f}", f"{f.decode_tps_p50:,.0f}", f.neighbours)
            for f in (vllm, emu, off)]
    main = Table(("run", "requests", "ok", "hit rate", "TTFT p50 ms", "TTFT p90 ms",
                  "output tok/s", "decode tok/s p50", "meanwhile"), rows)
    tenants = sorted(vllm.tenants)
    per_tenant = Table(("tenant", "vLLM, cache on", "emulator", "vLLM, cache off"),
                       [(t, _pct(vllm.tenants.get(t)), _pct(emu.tenants.get(t)),
                         _pct(off.tenants.get(t))) for t in tenants],
                       "Per-tenant hit rate, as `weighbridge report` reads each run "
                       "(`tenants.<name>.prefix_cache_hit_rate`).")
    summary_lines = [
        f"Emulator against real vLLM on chat_sessions: hit rate {_pct(emu.hit_rate)} vs "
        f"{_pct(vllm.hit_rate)} (±5 points: {'yes' if checks['hit rate'] else 'no'}), "
        f"TTFT p50 **{ratio(emu.ttft_p50_s, vllm.ttft_p50_s):.2f}x**, p90 "
        f"**{ratio(emu.ttft_p90_s, vllm.ttft_p90_s):.2f}x**, output tok/s "
        f"**{ratio(emu.output_tps, vllm.output_tps):.2f}x** (target ±25%).",
        f"Real vLLM, cache on against off: hit rate {_pct(vllm.hit_rate)} vs "
        f"{_pct(off.hit_rate)}, TTFT p50 {vllm.ttft_p50_s * 1000:,.1f} vs "
        f"{off.ttft_p50_s * 1000:,.1f} ms, p90 {vllm.ttft_p90_s * 1000:,.1f} vs "
        f"{off.ttft_p90_s * 1000:,.1f} ms, output {vllm.output_tps:,.0f} vs "
        f"{off.output_tps:,.0f} tok/s.",
    ]
    return BenchResult(
        summary=summary_lines, tables=[main, per_tenant],
        notes=[*calibration,
               "Load: `locust -f scenarios/ --headless --scenario chat_sessions --seed 0` "
               "(weighbridge.loadrun), 60 s, straight to each server (no sidecar); the run "
               f"directories are kept in {out}.",
               "Hit rate: cached over prompt tokens of the requests that reported them "
               "(usage.prompt_tokens_details.cached_tokens). Chat prompts are the tenants' "
               "words under each server's own tokenizer and chat template, so prompt sizes "
               "differ a little between the two; the hit rate is a ratio of each side's own.",
               f"Engine shape of both: {engine}; prefix cache on, "
               "--enable-prompt-tokens-details."],
        passed=passed)


BENCHMARK = Benchmark(
    name="fidelity_sessions",
    title="emulator vs real vLLM CPU on chat_sessions, and vLLM's prefix cache on and off",
    run=run,
    needs_vllm=True,
)
