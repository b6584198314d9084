"""Agent programs, live, against vllm-router's program scheduling (issue 40's peer point).

vllm-router 0.1.17 (``make vllm-router``) with ``--enable-program-scheduling`` (binding
programs to engines, pausing and queueing them by KV-token capacity) and its default policy
(``cache_aware``), against ``weighbridge sidecar`` with the plain config (tiers, tenants,
backends) and with ``scheduler.ordering: program_las`` added; each arm on 4 new emulated
engines of ``deploy/stacks/agent-programs.yaml`` (h100-llama3-8b, 64 sequences, 4,096 KV
blocks of 16 tokens, the prefix cache on), the load generator's ``agent_programs`` scenario
(its 45 s programs phase and 30 s drain, stretched) with benchmarks/program_ordering.py's
tenant shape:

``alone``   ``alpha`` alone at ``ALONE_RATE`` programs/s (near the fleet's saturation in
            virtual time: its p90 is still the unloaded one at 8/s, two such tenants at
            5/s each fill the sidecar's queue);
``flood``   ``alpha`` at ``SMALL_RATE`` beside ``beta``, a second tenant's flood of programs
            at ``FLOOD_RATE`` (program_ordering's arm (b)).

Both tenants name their programs in vllm-router's ``vllm_xargs.agentic_context`` (the body
field it reads by default; a JSON string, the form vLLM takes), ``alpha`` also as Claude Code
does, ``beta`` as OpenCode does. vllm-router is tenant-blind: it forwards each tenant's key
to the engines, which ignore it; the sidecar reads it.

The peer is told each engine's KV capacity in tokens (``token_capacity_per_dp_rank``); arm
``vllm_router_ledger`` runs it without (its router-ledger accounting), a diagnosis.

Per arm: program completion p50/p90 per tenant (start: the root's first call's scheduled
send; end: its last call's end; a program unfinished when the run ends counts its wait so
far, a lower bound, and is counted in the "open" column), the engines' output tokens
(``vllm:generation_tokens_total``'s delta over the run), their prefix-cache hit rate and
preemptions, and the emulated engines' mean step lag (how far a CPU-starved engine fell
behind its model). ``--starts-seconds S`` has programs start for the first S seconds only,
so the rest of the run lets them end. ``--ordering`` runs program_ordering's comparison
(sidecar orderings, virtual time there) live instead.

``python -m benchmarks.peer_programs [--scenarios alone,flood] [--arms ...] [--stretch X]
[--starts-seconds S] [--alone-rate R] [--small-rate R] [--flood-rate R] [--seed N]
[--record] [--ordering]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from benchmarks import _results, program_ordering
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks._peer_figures import FleetCounters
from benchmarks.peer_router import VLLM_ROUTER, code_version, fleet, scrape_fleet, vllm_router
from benchmarks.peer_router import weighbridge as weighbridge_process
from benchmarks.program_ordering import ALPHA, BETA, Arm, measure, program_shape
from weighbridge.app.loadrun import LoadRun
from weighbridge.app.stack import load_stack, sidecar_config
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.launch import ServerProcess, sidecar_process
from weighbridge.resources import DEPLOY_DIR
from weighbridge.rundir import read_records

ENGINE_STACK = DEPLOY_DIR / "stacks" / "agent-programs.yaml"
ENGINES = 4
SCENARIO = "agent_programs"  # the load generator's: a programs phase, then a drain
STRETCH = 2.0  # its 45 s + 30 s: programs start for 90 s, 60 s more let them end
ALONE_RATE, SMALL_RATE, FLOOD_RATE = 8.0, 1.0, 10.0  # programs/s
SEED = 0
PEER = "vllm_router"  # --enable-program-scheduling, --policy cache_aware (its default)
# The peer not told the engines' KV capacity: its router-ledger accounting (a diagnosis).
LEDGER = "vllm_router_ledger"
OURS = ("weighbridge", "weighbridge_las")
ARMS = (PEER, *OURS, LEDGER)
SCENARIOS = ("alone", "flood")
TARGET_ALONE, TARGET_FLOOD = 1.0, 0.5  # weighbridge's p90 over the peer's, at most
ALPHA_IDENTITY = ["claude_code", "agentic_context"]
BETA_IDENTITY = ["opencode", "agentic_context"]


@dataclass(frozen=True, slots=True)
class Rates:
    alone: float = ALONE_RATE
    small: float = SMALL_RATE
    flood: float = FLOOD_RATE


def tenants(scenario: str, rates: Rates, starts_s: float | None = None
            ) -> list[dict[str, Any]]:
    """The tenants file's tenants of ``scenario``, starting programs for ``starts_s``
    (None: the whole programs phase)."""
    if scenario == "alone":
        shapes = [program_shape("alpha", ALPHA[0], ALPHA_IDENTITY, rates.alone)]
    else:
        shapes = [program_shape("alpha", ALPHA[0], ALPHA_IDENTITY, rates.small),
                  program_shape("beta", BETA[0], BETA_IDENTITY, rates.flood)]
    return shapes if starts_s is None else starting_for(shapes, starts_s)


def starting_for(shapes: list[dict[str, Any]], seconds: float) -> list[dict[str, Any]]:
    """``shapes`` starting programs for the first ``seconds`` of the phase only (an on-off
    arrival whose off period outlasts any run), so the rest of a live run lets them end."""
    return [{**t, "arrival": {"kind": "on_off", "rate": t["arrival"]["rate"],
                              "on_s": seconds, "off_s": 1e9}} for t in shapes]


def peer_flags(options: EmulatorOptions) -> list[str]:
    """vllm-router's program scheduling, told each engine's KV capacity in tokens: without
    it the router falls back to its own ledger (``capacity_tokens=None`` in its log) and
    never pauses a program for capacity, only when its TTL expires."""
    capacity = options.kv_blocks() * options.block_size
    return ["--enable-program-scheduling", "--program-scheduling-config-json",
            json.dumps({"token_capacity_per_dp_rank": capacity})]


def front(arm: str, urls: Sequence[str], options: EmulatorOptions,
          log_dir: Path) -> ServerProcess:
    """The arm's router in front of the engines ``urls``."""
    if arm == PEER:
        return vllm_router("cache_aware", urls, log_dir, extra=peer_flags(options))
    if arm == LEDGER:
        return vllm_router("cache_aware", urls, log_dir, extra=peer_flags(options)[:1])
    keys = {"alpha": ALPHA[0], "beta": BETA[0]}
    settings = {"scheduler": {"ordering": "program_las"}} if arm == "weighbridge_las" else {}
    return weighbridge_process(urls, keys, log_dir, settings)


@dataclass(frozen=True)
class Run:
    scenario: str
    arm: str
    programs: Arm
    fleet: FleetCounters  # the engines' counters over the run
    failed: int  # calls not answered in full
    took_s: float


def run_arm(scenario: str, arm: str, rates: Rates, stretch: float, seed: int,
            workdir: Path, starts_s: float | None = None) -> Run:
    """``arm`` on ``scenario``, on new engines."""
    workdir.mkdir(parents=True, exist_ok=True)
    options = EmulatorOptions.model_validate(load_stack(ENGINE_STACK).engines.emulator
                                             .model_dump())
    tenants_file = workdir / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump({"tenants": tenants(scenario, rates, starts_s)},
                                           sort_keys=False))
    started = time.monotonic()
    with fleet(ENGINES, options, workdir) as engines:
        urls = [e.url for e in engines]
        with front(arm, urls, options, workdir) as router:
            run = LoadRun(scenario=SCENARIO, host=router.url, run_dir=workdir / "run",
                          log_path=workdir / "locust.log", run_id=workdir.name,
                          tenants_file=tenants_file, stretch=stretch, seed=seed)
            before = scrape_fleet(urls)
            run.run()
            counters = scrape_fleet(urls) - before
    records = read_records(workdir / "run")
    return Run(scenario, arm, measure(f"{scenario} {arm}", records), counters,
               failed=sum(r.status != "ok" for r in records),
               took_s=time.monotonic() - started)


def ordering_runner(workdir: Path, stretch: float, seed: int) -> program_ordering.Runner:
    """program_ordering's arms, live: its stack's sidecar (DRR, prefix-aware routing, the
    arm's ordering) in front of new engines, its tenants starting programs for
    ``PROGRAMS_S`` as in virtual time (then none: an on-off arrival whose off period
    outlasts the run), the scenario stretched so the rest of the run lets them end."""
    def runner(name: str, ordering: str, shapes: list[dict[str, Any]], scale: float,
               engines: int) -> Arm:
        arm_dir = workdir / name.replace(" ", "_").replace(",", "")
        arm_dir.mkdir(parents=True, exist_ok=True)
        st = program_ordering.stack(ordering, [t["name"] for t in shapes], engines)
        live = starting_for(shapes, program_ordering.PROGRAMS_S)
        tenants_file = arm_dir / "tenants.yaml"
        tenants_file.write_text(yaml.safe_dump({"tenants": live}, sort_keys=False))
        options = EmulatorOptions.model_validate(st.engines.emulator.model_dump())
        with fleet(engines, options, arm_dir) as procs:
            urls = [p.url for p in procs]
            sidecar = sidecar_process(sidecar_config(st, urls), name="sidecar",
                                      config_dir=arm_dir)
            sidecar.log_path = arm_dir / "sidecar.log"
            with sidecar:
                LoadRun(scenario=SCENARIO, host=sidecar.url, run_dir=arm_dir / "run",
                        log_path=arm_dir / "locust.log", run_id=arm_dir.name,
                        tenants_file=tenants_file, stretch=stretch, scale=scale,
                        seed=seed).run()
        arm = measure(name, read_records(arm_dir / "run"))
        print(f"    {name}: programs {arm.started} (open {arm.open_programs()}), p50/p90 "
              f"{_s(arm.p(0.5))}/{_s(arm.p(0.9))} s", flush=True)
        return arm
    return runner


def run_all(scenarios: Sequence[str], arms: Sequence[str], rates: Rates, stretch: float,
            seed: int, log: Callable[[str], None] = print,
            starts_s: float | None = None) -> list[Run]:
    if PEER in arms and not VLLM_ROUTER.exists():
        raise RuntimeError(f"{VLLM_ROUTER} does not exist: run `make vllm-router`")
    workdir = Path(tempfile.mkdtemp(prefix="weighbridge-peer-programs-"))
    log(f"peer_programs: logs and run directories under {workdir}")
    runs = []
    for scenario in scenarios:
        for arm in arms:
            run = run_arm(scenario, arm, rates, stretch, seed, workdir / f"{scenario}-{arm}",
                          starts_s)
            runs.append(run)
            log(describe(run))
    return runs


def _s(x: float) -> str:
    return f"{x:,.1f}"


def describe(run: Run) -> str:
    a = run.programs
    per = " · ".join(f"{t} {_s(a.p(0.5, t))}/{_s(a.p(0.9, t))} s" for t in sorted(a.programs))
    lag = run.fleet.step_lag_ms
    return (f"{run.scenario}, {run.arm}: programs {a.started} (open {a.open_programs()}), "
            f"p50/p90 {per}; engines {run.fleet.generation_tokens:,.0f} output tokens, hit "
            f"{run.fleet.hit_rate or 0:.3f}, computed {run.fleet.computed_tokens:,.0f}, "
            f"preemptions {run.fleet.preemptions:,.0f}, step lag {lag or 0:.1f} ms; failed calls "
            f"{run.failed} ({run.took_s:.0f} s)")


def result(runs: Sequence[Run], rates: Rates, stretch: float, seed: int,
           starts_s: float | None = None, version: str | None = None) -> BenchResult:
    """The figures of ``runs``; ``version``: the code measured, read as the run started."""
    by = {(r.scenario, r.arm): r for r in runs}
    rows: list[tuple[str, ...]] = []
    for r in runs:
        peer = by.get((r.scenario, PEER))
        a = r.programs
        for tenant in sorted(a.programs.keys() | a.unfinished.keys()):
            over = "—"
            if peer is not None and peer.programs.completion(tenant):
                pa = peer.programs
                over = (f"{a.p(0.5, tenant) / pa.p(0.5, tenant):.2f} / "
                         f"{a.p(0.9, tenant) / pa.p(0.9, tenant):.2f}")
            out = "—" if peer is None else (
                f"{r.fleet.generation_tokens / peer.fleet.generation_tokens:.3f}")
            rows.append((r.scenario, r.arm, tenant,
                         f"{len(a.completion(tenant)):,}", f"{a.open_programs(tenant):,}",
                         _s(a.p(0.5, tenant)), _s(a.p(0.9, tenant)), over,
                         f"{r.fleet.generation_tokens:,.0f}", out,
                         f"{r.fleet.hit_rate or 0:.3f}", f"{r.fleet.preemptions:,.0f}",
                         f"{r.fleet.step_lag_ms or 0:.1f}",
                         f"{r.failed:,}"))
    table = Table(("scenario", "arm", "tenant", "programs", "open at end", "p50 s", "p90 s",
                   f"over {PEER} p50 / p90", "engines' output tokens", f"over {PEER}",
                   "hit rate", "preemptions", "step lag ms", "failed calls"), rows)
    summary, passed = [], []
    for scenario, target in (("alone", TARGET_ALONE), ("flood", TARGET_FLOOD)):
        peer = by.get((scenario, PEER))
        if peer is None:
            continue
        for arm in OURS:
            ours = by.get((scenario, arm))
            if ours is None:
                continue
            ratio = ours.programs.p(0.9, "alpha") / peer.programs.p(0.9, "alpha")
            ok = ratio <= target
            if arm == "weighbridge_las":
                passed.append(ok)
            summary.append(
                f"{scenario}: {arm}'s alpha program completion p90 **{ratio:.2f}x** "
                f"vllm-router's ({_s(ours.programs.p(0.9, 'alpha'))} vs "
                f"{_s(peer.programs.p(0.9, 'alpha'))} s; target <= {target:g}: "
                f"{'met' if ok else 'MISSED'})")
    return BenchResult(
        summary=summary, tables=[table],
        setup=[version or code_version(),
               f"engines: {ENGINES} x agent-programs.yaml's (h100-llama3-8b, 64 seqs, "
               "4,096 blocks of 16, prefix cache on), new for each arm",
               f"traffic: {SCENARIO} stretched {stretch:g} (programs start for "
               f"{45 * stretch if starts_s is None else starts_s:g} s of "
               f"{75 * stretch:g}), seed {seed}; alone: alpha "
               f"{rates.alone:g}/s; flood: alpha {rates.small:g}/s beside beta "
               f"{rates.flood:g}/s", "live: real processes on this machine"],
        notes=[" ".join(__doc__.split("\n\n")[1].split())],
        passed=all(passed) if passed else None)


def run(ctx: BenchContext) -> BenchResult:
    stretch = 1.0 if ctx.quick else STRETCH
    rates = Rates()
    return result(run_all(SCENARIOS, (PEER, *OURS), rates, stretch, SEED, log=ctx.log), rates,
                  stretch, SEED)


BENCHMARK = Benchmark("peer_programs", "agent programs live on 4 emulated engines: "
                      "weighbridge against vllm-router --enable-program-scheduling", run,
                      needs_vllm=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_programs",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--arms", default=",".join((PEER, *OURS)),
                        help=f"comma-separated, of {', '.join(ARMS)}")
    parser.add_argument("--stretch", type=float, default=STRETCH)
    parser.add_argument("--alone-rate", type=float, default=ALONE_RATE)
    parser.add_argument("--small-rate", type=float, default=SMALL_RATE)
    parser.add_argument("--flood-rate", type=float, default=FLOOD_RATE)
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--starts-seconds", type=float, default=None,
                        help="programs start for this long, then none (default: for the "
                             "whole programs phase, 45 s x the stretch)")
    parser.add_argument("--record", action="store_true",
                        help="write RESULTS.md's peer_programs section")
    parser.add_argument("--ordering", action="store_true",
                        help="instead: program_ordering's comparison, live (its acceptance "
                             "scale and the two arms of (b) its target compares)")
    a = parser.parse_args(argv)
    if a.ordering:
        return ordering_main(a.stretch, a.seed)
    scenarios = [s for s in a.scenarios.split(",") if s]
    arms = [x for x in a.arms.split(",") if x]
    unknown = [s for s in scenarios if s not in SCENARIOS] + [x for x in arms if x not in ARMS]
    if unknown:
        parser.error(f"unknown scenarios or arms: {', '.join(unknown)}")
    rates = Rates(a.alone_rate, a.small_rate, a.flood_rate)
    standalone = _results.StandaloneRun(["python", "-m", "benchmarks.peer_programs", *argv])
    version = code_version()
    outcome = result(run_all(scenarios, arms, rates, a.stretch, a.seed,
                             starts_s=a.starts_seconds), rates, a.stretch, a.seed,
                     a.starts_seconds, version)
    print(standalone.section(BENCHMARK, outcome))
    if a.record:
        standalone.record(BENCHMARK, outcome)
    return 0 if outcome.passed is not False else 1


def ordering_main(stretch: float, seed: int) -> int:
    """program_ordering, live: printed, not recorded (RESULTS.md's issue-40 section puts it
    beside the virtual-time figures)."""
    workdir = Path(tempfile.mkdtemp(prefix="weighbridge-program-ordering-live-"))
    print(f"program_ordering live: logs and run directories under {workdir}", flush=True)
    setting = (f"live: {SCENARIO} stretched {stretch:g} ({75 * stretch:g} s), programs "
               f"starting for the first {program_ordering.PROGRAMS_S:g} s, seed {seed}")
    outcome = program_ordering.compare(ordering_runner(workdir, stretch, seed),
                                       (program_ordering.ACCEPTANCE_SCALE,),
                                       lambda line: print(line, flush=True),
                                       references=False, setting=setting)
    print("\n".join([*outcome.summary, "", *outcome.setup, ""]))
    for table in outcome.tables:
        print(table.markdown() + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

