"""Scheduling quality: the sidecar's policies on the noisy-neighbour, tiers and bimodal
scenarios, every figure from the run's own report (summary.json), throughput relative to
``passthrough`` measured in the same benchmark run.

Each (scenario, policy) is one fresh local stack — the demo's (deploy/stacks/noisy-neighbour
.yaml: two emulated H100 engines of 32 sequences, priority scheduling, the sidecar's
admission gate with headroom and prefill pacing) with the scenario's tenants — and one
headless Locust run through it. Only ``scheduler`` changes between the policies:
``passthrough`` (no queue, no gate: straight to the engines), ``fcfs``, ``rr``, ``drr`` and
``drr`` without live charging of streamed tokens.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.headline import HeadlineFigures, headline_figures
from weighbridge.analysis.summary import analyse, summary
from weighbridge.app.loadrun import LoadRun
from weighbridge.app.stack import DEFAULT_STACK, Loadgen, LocalStack, Ports, StackSpec, load_stack
from weighbridge.loadgen.tenants import load_tenants
from weighbridge.resources import SCENARIOS_DIR

REPORT_WINDOW_S = 2.0
FULL_STRETCH = 0.3  # phases of ~60 s become ~18 s: 15 runs in about 6 minutes
QUICK_STRETCH = 0.15


@dataclass(frozen=True)
class ScenarioCase:
    name: str
    tenants_file: Path
    scale: float = 1.0
    why: str = ""


CASES = (
    ScenarioCase("noisy_neighbour", DEFAULT_STACK.parent / "noisy-neighbour-tenants.yaml",
                 why="the demo's sizing of the flood (1,200 requests in 20 s)"),
    # Twice the scenario's load: 64 closed-loop batch users fill both engines.
    ScenarioCase("tiers", SCENARIOS_DIR / "tenants" / "tiers.yaml", scale=2.0,
                 why="--scale 2: 64 closed-loop batch users, twice the rates"),
    # Three times the scenario's rates: the essays saturate the engines, so the four
    # tenants queue together and fairness among them is measured.
    ScenarioCase("bimodal", SCENARIOS_DIR / "tenants" / "bimodal.yaml", scale=3.0,
                 why="--scale 3: the essays saturate both engines, every tenant queues"),
)

POLICIES: dict[str, dict[str, Any]] = {
    "passthrough": {"policy": "passthrough"},
    "fcfs": {"policy": "fcfs"},
    "rr": {"policy": "rr"},
    "drr": {"policy": "drr", "charge_streamed_tokens": True},
    "drr, no live charging": {"policy": "drr", "charge_streamed_tokens": False},
}
BASELINE_POLICY = "passthrough"


def sidecar_tenants(tenants_file: Path) -> dict[str, Any]:
    """The sidecar's tenants for a load-generator tenants file: same names, tiers, weights
    and keys; queues deep enough that a flood is queued, not turned away at once."""
    out: dict[str, Any] = {}
    for t in load_tenants(tenants_file).tenants:
        if t.api_key is None:
            raise ValueError(f"{tenants_file}: tenant {t.name} has no api_key")
        out[t.name] = {"tier": t.tier, "weight": t.weight,
                       "api_keys": [f"plain:{t.api_key}"], "limits": {"max_queued": 2000}}
    return out


def case_stack(base: StackSpec, case: ScenarioCase, scheduler: dict[str, Any]) -> StackSpec:
    spec = base.with_sidecar(tenants=sidecar_tenants(case.tenants_file), scheduler=scheduler)
    return spec.model_copy(update={
        "name": f"{case.name}-{scheduler['policy']}",
        "loadgen": Loadgen(scenario=case.name, tenants_file=str(case.tenants_file),
                           exporter_port=0),
        "prometheus": "off", "ports": Ports()})


def run_case(spec: StackSpec, case: ScenarioCase, stretch: float, directory: Path,
             ctx: BenchContext, label: str) -> HeadlineFigures:

    task = ctx.progress.add_task(f"{label}: starting", total=None)
    with LocalStack(spec, directory / "stack") as stack:
        run = LoadRun(scenario=case.name, host=stack.urls.sidecar, run_dir=directory / "run",
                      log_path=directory / "stack" / "logs" / "locust.log",
                      tenants_file=case.tenants_file, stretch=stretch, scale=case.scale,
                      seed=1)
        duration = run.duration_s()
        ctx.progress.update(task, description=label, total=duration, completed=0)
        run.run(on_tick=lambda s: ctx.progress.update(task, completed=min(s, duration)))
    ctx.progress.update(task, description=f"{label}: report", completed=duration)
    result = headline_figures(summary(analyse(load_run(directory / "run"), REPORT_WINDOW_S)))
    ctx.progress.remove_task(task)
    return result


def _ratio(value: float | None, spec: str = ".2f", suffix: str = "x") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.0f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def table_rows(case: str, results: dict[str, HeadlineFigures]) -> list[tuple[str, ...]]:
    base = results.get(BASELINE_POLICY)
    base_tps = base.served_tokens_per_s if base else None
    rows = []
    for policy, head in results.items():
        tps = head.served_tokens_per_s
        relative = tps / base_tps if tps is not None and base_tps else None
        label = f"{policy} (baseline)" if policy == BASELINE_POLICY else policy
        rows.append((
            case, label, head.victim or "—", _ratio(head.victim_ratio, ".1f"),
            _ratio(head.jain_index, ".3f", ""), head.tier1 or "—",
            _ms(head.tier1_ttft_p99_s), _pct(head.tier1_slo_attainment),
            "—" if tps is None else f"{tps:,.0f}", f"**{_ratio(relative)}**"))
    return rows


def run(ctx: BenchContext) -> BenchResult:
    stretch = QUICK_STRETCH if ctx.quick else FULL_STRETCH
    base = load_stack(DEFAULT_STACK)
    root = Path(tempfile.mkdtemp(prefix="weighbridge-scheduling-quality-"))
    results: dict[str, dict[str, HeadlineFigures]] = {}
    task = ctx.progress.add_task("scheduling quality", total=len(CASES) * len(POLICIES))
    for case in CASES:
        results[case.name] = {}
        for policy, scheduler in POLICIES.items():
            slug = f"{case.name}-{policy.replace(', ', '-').replace(' ', '-')}"
            results[case.name][policy] = run_case(
                case_stack(base, case, scheduler), case, stretch, root / slug, ctx,
                f"{case.name} / {policy}")
            ctx.progress.advance(task)
    ctx.progress.remove_task(task)
    shutil.rmtree(root, ignore_errors=True)  # kept above only when a run failed

    rows = [row for case in CASES for row in table_rows(case.name, results[case.name])]
    summary = []
    for case in CASES:
        by = results[case.name]
        ratios = {p: h.victim_ratio for p, h in by.items() if h.victim_ratio is not None}
        if ratios:
            best = min(ratios, key=lambda p: ratios[p])
            worst = max(ratios, key=lambda p: ratios[p])
            summary.append(f"{case.name}: victim p99 TTFT flood/quiet {ratios[best]:.1f}x "
                           f"with {best}, {ratios[worst]:.1f}x with {worst}")
        slo = {p: h.tier1_slo_attainment for p, h in by.items()
               if h.tier1_slo_attainment is not None}
        if slo:
            tier = next(h.tier1 for h in by.values() if h.tier1)
            summary.append(f"{case.name}: {tier} SLO attainment "
                           + ", ".join(f"{p} {v:.0%}" for p, v in slo.items()))
    columns = ("scenario", "policy", "victim", "victim p99 TTFT flood/quiet",
               "Jain's index", "tier 1", "tier-1 p99 TTFT ms", "tier-1 SLO attainment",
               "tokens/s", "throughput vs passthrough")
    notes = [
        f"Each row is one fresh stack (deploy/stacks/noisy-neighbour.yaml: 2 emulated "
        f"h100-llama3-8b engines x 32 sequences, step budget 512, 1,024 KV blocks, priority "
        f"scheduling; no admission section: every admission setting derived from the "
        f"engines) and one headless Locust run with --stretch {stretch} --seed 1; only "
        f"`scheduler` changes.",
        *[f"{c.name}: {c.why}." for c in CASES],
        "victim: the run's tenant with the fewest requests (the report's isolation "
        "section); flood/quiet: its p99 TTFT in the flood phase (or the busiest) over the "
        "quiet phase (or the calmest); — when the scenario has one loaded phase (bimodal).",
        "Jain's index is over the tenants of a tier backlogged together (waiting for a first "
        "token) in 2 s windows, worst tier; — when no two were.",
        "tier 1: the best-ranked tier with requests; its SLO is the run's (interactive: "
        "TTFT <= 500 ms; standard: end to end <= 10 s).",
        "tokens/s: prompt + output tokens served per second of the run; relative to "
        "passthrough in the same scenario of this benchmark run.",
        "The machine runs engines, sidecar and generator on 2 shared cores: tail latencies "
        "are partly CPU contention; compare rows of one run, not runs.",
    ]
    return BenchResult(summary=summary, tables=[Table(columns, rows)], notes=notes,
                       passed=None)


BENCHMARK = Benchmark(
    name="scheduling_quality",
    title="sidecar policies on noisy_neighbour, tiers and bimodal (emulated engines)",
    run=run,
)
