"""Isolation where the engine caches prefixes (issue 30): ``noisy_neighbour_sessions``'s chat
sessions flooded by long prefix-free prompts on real vLLM CPU with its prefix cache on,
through the sidecar with a plain config, against the best the engine allows, in one run.

The arms, the victims' own process, the window and the ratios are benchmarks/isolation.py's
(``quiet``, ``ideal``, ``sidecar``, interleaved repeats, ``--cpus shared|split``); only the
traffic and the engine differ. Sized to the tiny CPU model (``max_model_len`` 1,024, the
real-vLLM harness's):

engine    32 sequences, a 1,024-token step budget, blocks of 32 tokens, ``KV_BLOCKS`` blocks
          (20,480 tokens), ``fcfs``, the prefix cache on, ``--enable-prompt-tokens-details``;
victims   the scenario's three session tenants (``VICTIM_TENANTS``), sent by the load
          generator (weighbridge.app.loadrun, its own process) through the scenario's
          phases (quiet 15 s, flood 20 s, recovery 25 s): ``victim`` and ``steady-a`` chat
          behind one shared 256-token system prompt, ``steady-b`` completions behind its own;
          0.3 sessions/s each of 2-6 turns, each turn a 16-64-token message and a 16-48-token
          answer after 0.2-3 s of thought, so every history stays under 1,024 tokens and a
          turn's prompt is mostly its history, which the cache holds;
flood     prefix-free token-id prompts of ``FLOOD_PROMPT`` + ``FLOOD_OUTPUT`` tokens (the
          scenario's flooder, long prompts and short answers, at a third of its length),
          starting with the flood phase: ``FLOOD_COUNT`` at once through the sidecar; in the
          ideal arm, straight to the engine, as many at a time as fit in KV once the victims'
          working set (``VICTIM_ROOM_SEQS`` histories of ``VICTIM_HISTORY`` tokens) is left
          free (benchmarks.isolation.flood_streams_in_kv).

The window is the flood phase from ``warmup_s`` after its start. Per arm: the victims' TTFT
p50, p90, p99 over their turns sent in it (from the scheduled send, all three tenants), the
engine's prefix-cache hit rate over it (``vllm:prefix_cache_hits_total`` over
``queries_total``; the flood's queries are in it) and the victims' own (their answers'
``cached_tokens``), and the engine's output tokens/s. All tenants are in one tier with the
same weight; the sidecar runs its defaults (prefix_aware routing, computed-token charging).

``python -m benchmarks.isolation_sessions [--engine real|emulator] [--repeats 3]
[--cpus shared|split]``
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import json
import statistics
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks.agreement import hit_rate
from benchmarks.isolation import (
    FLOOD_KEY,
    ArmResult,
    Cpus,
    EngineKind,
    FloodShape,
    Setup,
    VictimOutcome,
    Window,
    flood_streams_in_kv,
    run_all,
    verdict,
)
from weighbridge.app.loadrun import LoadRun
from weighbridge.rundir import RUN_JSON, read_records, read_run_info

SCENARIO = "noisy_neighbour_sessions"
QUIET_PHASE_S, FLOOD_PHASE_S = 15.0, 20.0  # the scenario's quiet and flood phases
WARMUP_S = 4.0
WINDOW_S = FLOOD_PHASE_S - WARMUP_S  # the rest of the flood phase
ENGINE: dict[str, Any] = {"max_num_seqs": 32, "max_num_batched_tokens": 1024,
                          "block_size": 32, "max_model_len": 1024}
KV_BLOCKS = 640
FLOOD_PROMPT, FLOOD_OUTPUT, FLOOD_COUNT = 768, 32, 900
SYSTEM_PROMPT, TURNS, MESSAGE, ANSWER = 256, (2, 6), (16, 64), (16, 48)
VICTIM_HISTORY = SYSTEM_PROMPT + TURNS[1] * (MESSAGE[1] + ANSWER[1])  # 928: the longest
VICTIM_ROOM_SEQS = 8  # the victims' sessions live at once, at most, in the quiet phase
IDEAL_STREAMS = flood_streams_in_kv(
    KV_BLOCKS, ENGINE["block_size"], FLOOD_PROMPT + FLOOD_OUTPUT,
    VICTIM_ROOM_SEQS * VICTIM_HISTORY, ENGINE["max_num_seqs"], VICTIM_ROOM_SEQS)
SESSION_RATE = 0.3  # sessions per second, each tenant

_SESSIONS = {"turns": {"kind": "uniform", "low": TURNS[0], "high": TURNS[1]},
             "think_ms": {"kind": "uniform", "low": 200, "high": 3000}}
_LENGTHS = {"prompt": {"kind": "uniform", "low": MESSAGE[0], "high": MESSAGE[1]},
            "output": {"kind": "uniform", "low": ANSWER[0], "high": ANSWER[1]}}
VICTIM_TENANTS: list[dict[str, Any]] = [
    {"name": "victim", "api_key": "sk-victim-demo", "endpoint": "chat", "users": 50,
     "system_prompt": {"length": SYSTEM_PROMPT, "shared": "assistant"}},
    {"name": "steady-a", "api_key": "sk-steady-a-demo", "endpoint": "chat",
     "system_prompt": {"length": SYSTEM_PROMPT, "shared": "assistant"}},
    {"name": "steady-b", "api_key": "sk-steady-b-demo", "endpoint": "completions",
     "system_prompt": {"length": SYSTEM_PROMPT}},
]


def tenants_yaml() -> str:
    """The victims' tenants file: the scenario's session tenants at the sizes above, one tier
    (the flood is this benchmark's, not the load generator's)."""
    tenants = [{**t, "tier": "standard", "sessions": copy.deepcopy(_SESSIONS),
                "lengths": copy.deepcopy(_LENGTHS),
                "arrival": {"kind": "poisson", "rate": SESSION_RATE}}
               for t in VICTIM_TENANTS]
    return yaml.safe_dump({"tenants": tenants}, sort_keys=False)


class SessionVictims:
    """The session tenants, sent by the load generator through the whole scenario; the flood
    starts with its flood phase and runs until the load generator ends."""

    quiet_warmup_s: float | None = None  # the quiet arm measures the same phase

    def __init__(self) -> None:
        self._task: asyncio.Future[Path] | None = None
        self._run_dir: Path | None = None
        self._t0 = 0.0

    async def start(self, url: str, seed: int, out: Path, warmup_s: float,
                    window_s: float) -> float:
        out.mkdir(parents=True, exist_ok=True)
        tenants = out / "tenants.yaml"
        tenants.write_text(tenants_yaml())
        self._run_dir = out / "run"
        run = LoadRun(scenario=SCENARIO, host=url, run_dir=self._run_dir,
                      log_path=out / "locust.log", run_id=out.name, tenants_file=tenants,
                      seed=seed)
        self._task = asyncio.ensure_future(asyncio.to_thread(run.run))
        # The load generator writes its run's t = 0 (a moment ahead) when it begins.
        while not (self._run_dir / RUN_JSON).is_file():
            if self._task.done():
                self._task.result()
                raise RuntimeError(f"the load generator ended before it began: {out}")
            await asyncio.sleep(0.1)
        self._t0 = read_run_info(self._run_dir).started_at.timestamp()
        return self._t0 + QUIET_PHASE_S

    async def settle(self) -> None:
        assert self._task is not None
        await self._task

    async def outcome(self, window: Window) -> VictimOutcome:
        assert self._run_dir is not None
        lo = window.start - self._t0
        mine = [r for r in read_records(self._run_dir)
                if lo <= r.scheduled_s < lo + window.seconds]
        return VictimOutcome([r.ttft_s if r.status == "ok" else None for r in mine],
                             hit_rate(mine))


SETUP = Setup(engine={**ENGINE, "num_kv_blocks": KV_BLOCKS,
                      "enable_prompt_tokens_details": True},
              flood=FloodShape(FLOOD_PROMPT, FLOOD_OUTPUT, FLOOD_COUNT, IDEAL_STREAMS),
              victims=SessionVictims,
              keys={**{t["name"]: t["api_key"] for t in VICTIM_TENANTS}, "flood": FLOOD_KEY})


def hit_medians(results: list[ArmResult]) -> dict[str, tuple[float | None, float | None]]:
    """Per arm, the medians over repeats of (the engine's hit rate, the victims')."""
    def median(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    arms = dict.fromkeys(r.arm for r in results)
    return {arm: (median([r.engine_hit_rate for r in results if r.arm == arm]),
                  median([r.victim_hit_rate for r in results if r.arm == arm]))
            for arm in arms}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def table(results: list[ArmResult], caption: str) -> Table:
    rows: list[tuple[str, ...]] = [
            (r.arm, str(r.repeat), str(len(r.ttft_s) + r.failed), f"{r.p(50) * 1e3:.0f}",
             f"{r.p(90) * 1e3:.0f}", f"{r.p(99) * 1e3:.0f}", _pct(r.engine_hit_rate),
             _pct(r.victim_hit_rate), f"{r.output_tokens_per_s:.0f}", f"{r.preemptions:.0f}",
             str(r.flood_left), f"{r.engine_running:.1f} / {r.engine_waiting:.1f}",
             f"{r.engine_cores:.2f}", f"{r.sidecar_cores:.2f}",
             f"{r.victim_queue_wait_s * 1e3:.0f}") for r in results]
    return Table(("arm", "repeat", "victim turns", "p50 ms", "p90 ms", "p99 ms",
                  "engine hit rate", "victims' hit rate", "engine tok/s", "preemptions",
                  "flood left", "running / waiting", "engine cores", "sidecar cores",
                  "victims' sidecar wait ms"), rows, caption=caption)


def summary_line(kind: EngineKind, cpus: Cpus, results: list[ArmResult], repeats: int) -> str:
    v = verdict(results)
    hits = hit_medians(results)

    def arm(name: str) -> str:
        f, (engine_hits, victim_hits) = getattr(v, name), hits.get(name, (None, None))
        return (f"{name} p50/p90/p99 {f['p50'] * 1e3:.0f}/{f['p90'] * 1e3:.0f}/"
                f"{f['p99'] * 1e3:.0f} ms, hit rate {_pct(engine_hits)} (victims "
                f"{_pct(victim_hits)}), {f['tok_s']:.0f} tok/s")
    return (f"{kind}, cpus {cpus}: victims' TTFT through the sidecar against the ideal "
            f"(medians of {repeats}): **p50 {v.p50_ratio:.2f}x, p90 {v.p90_ratio:.2f}x** "
            f"(target <= 1.3), output {v.output_ratio:.2f} of the ideal's; "
            f"{arm('ideal')}; {arm('sidecar')}; {arm('quiet')}")


def run(ctx: BenchContext) -> BenchResult:
    """Real vLLM CPU with the CPUs shared (the acceptance) and split (the diagnosis: the
    engine's compute then does not depend on the sidecar's CPU)."""
    repeats = 1 if ctx.quick else 3
    summary: list[str] = []
    tables: list[Table] = []
    passed = True
    for cpus in ("shared", "split"):
        results = run_all("real", repeats, WARMUP_S, WINDOW_S, log=ctx.log, cpus=cpus,
                          setup=SETUP)
        v = verdict(results)
        summary.append(summary_line("real", cpus, results, repeats))
        tables.append(table(results, f"**real, cpus {cpus}**"))
        if cpus == "shared":
            passed = v.p50_ratio <= 1.3 and v.p90_ratio <= 1.3
    return BenchResult(
        summary=summary, tables=tables,
        notes=[" ".join(p.replace("\n", " ").split())
               for p in __doc__.split("\n\n")[1:4]],
        passed=passed)


BENCHMARK = Benchmark("isolation_sessions",
                      "isolation with the prefix cache on: chat sessions under a flood, "
                      "real vLLM CPU, plain config", run, needs_vllm=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.isolation_sessions",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=["emulator", "real"], default="real")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=WARMUP_S)
    parser.add_argument("--window", type=float, default=WINDOW_S)
    parser.add_argument("--cpus", choices=["shared", "split"], default="shared",
                        help="split: the engine on one core, everything else on another")
    parser.add_argument("--kv-reserve-blocks", type=int, default=None,
                        help="diagnosis: the sidecar's admission.kv_reserve_blocks (default: "
                             "the plain config, which derives it)")
    parser.add_argument("--json", type=Path, default=None)
    a = parser.parse_args(argv)
    setup = SETUP if a.kv_reserve_blocks is None else dataclasses.replace(
        SETUP, overlay={"admission": {"kv_reserve_blocks": a.kv_reserve_blocks}})
    results = run_all(a.engine, a.repeats, a.warmup, a.window, cpus=a.cpus, setup=setup)
    print(summary_line(a.engine, a.cpus, results, a.repeats))
    print(table(results, "").markdown())
    if a.json is not None:
        a.json.write_text(json.dumps([asdict(r) for r in results]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
