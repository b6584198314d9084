"""``weighbridge simulate``'s inputs made into simulated runs: the files a live run takes
(a stack, a scenario or a trace), one run directory per policy, and their summaries.

A simulated run directory is a live one (``weighbridge.rundir``): ``run.json`` (with
``options.simulated: true`` and ``target: simulated``) and ``requests.parquet`` in the
records' schema, so ``weighbridge report`` reads it unchanged.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import subprocess
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weighbridge.app.simulation.clients import Clients, TraceClients, WorkloadClients
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.loop import Simulation, SimulationResult
from weighbridge.app.simulation.trace import DEFAULT_TIMEOUT_S, read_trace, trace_clients
from weighbridge.app.stack import SCENARIOS_DIR, StackSpec, baseline_stack, sidecar_config
from weighbridge.loadgen.scenario import (
    Scenario,
    ScenarioError,
    Workload,
    discover_scenarios,
    load_scenario,
)
from weighbridge.loadgen.trace import TenantRule, TraceRows, read_trace_rows
from weighbridge.records import write_parquet
from weighbridge.rundir import (
    REQUESTS_PARQUET,
    PhaseInfo,
    RunInfo,
    TenantInfo,
    read_run_info,
    write_run_info,
)
from weighbridge.sidecar.config import Config, parse_config
from weighbridge.sidecar.plugins import registered
from weighbridge.sidecar.stability import step_budget

__all__ = ["BASELINE", "Inputs", "Load", "RunOutcome", "engines_for", "policy_stack",
           "run_policy", "scenario_load", "sidecar_for", "trace_load"]

BASELINE = "baseline"  # the request-level baseline (weighbridge.app.stack.baseline_stack)
# How often a run reads the sidecar's utilisation, for run.json's options.utilisation (the
# report's rho): a Prometheus scrape's cadence, a negligible share of a run's events.
UTILISATION_EVERY_S = 5.0
POLICIES = (*registered("fairness"), BASELINE)


@dataclass(frozen=True)
class Inputs:
    """What one simulated run is made of, as a live run takes it."""

    stack: StackSpec
    scenario: str | None = None  # a name in scenarios/ or a file; None: the stack's
    tenants_file: Path | None = None  # None: the stack's, else the scenario's own
    trace: Path | None = None  # replaces the scenario's clients
    trace_tenants: str = "auto"  # a Mooncake trace's tenant rule (weighbridge.loadgen.trace)
    trace_speed: float = 1.0  # divides the trace's times
    duration_s: float | None = None  # None: the scenario's (or the trace's) end
    stretch: float = 1.0
    scale: float = 1.0
    seed: int = 0


@dataclass(frozen=True)
class RunOutcome:
    policy: str
    run_dir: Path
    result: SimulationResult


def policy_stack(stack: StackSpec, policy: str | None) -> StackSpec:
    """The stack with the sidecar's scheduling policy replaced (None: as written);
    ``baseline`` is the request-level baseline of the stack."""
    if policy is None:
        return stack
    if policy == BASELINE:
        return baseline_stack(stack)
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; one of {', '.join(POLICIES)}")
    return stack.with_sidecar(scheduler={**stack.sidecar.get("scheduler", {}),
                                         "policy": policy})


def sidecar_for(stack: StackSpec) -> Config:
    """The sidecar config a live stack runs, with one backend per engine."""
    urls = [f"http://127.0.0.1:{9 + i}" for i in range(stack.engines.count)]
    return parse_config(sidecar_config(stack, urls), environ=os.environ)


def engines_for(stack: StackSpec) -> list[SimEngine]:
    return [SimEngine(f"engine-{i}", stack.engines.emulator_for(i), seed_offset=i)
            for i in range(stack.engines.count)]


def find_scenario(name_or_file: str) -> Scenario:
    path = Path(name_or_file)
    if path.suffix == ".py" and path.is_file():
        return load_scenario(path.resolve())
    scenarios = discover_scenarios(SCENARIOS_DIR, exclude=(SCENARIOS_DIR / "locustfile.py",))
    if name_or_file not in scenarios:
        raise ScenarioError(f"unknown scenario {name_or_file!r}; known: "
                            f"{', '.join(sorted(scenarios))} (or a scenario .py file)")
    return scenarios[name_or_file]


@dataclass(frozen=True)
class Load:
    """The clients of a run and what run.json says about them."""

    clients: Clients
    scenario: str
    until_s: float
    tenants: list[TenantInfo]
    phases: list[PhaseInfo]
    options: dict[str, Any]
    drain: bool = False  # end when every request has ended (until_s is then a bound)


def _workload(inputs: Inputs) -> tuple[Scenario, Path | None, Workload]:
    """The scenario, tenants file and workload a run takes (as the load generator would)."""
    scenario = find_scenario(inputs.scenario or inputs.stack.loadgen.scenario)
    tenants_file = inputs.tenants_file or (inputs.stack.tenants_file
                                           if inputs.scenario is None else None)
    return scenario, tenants_file, scenario.workload(tenants_file=tenants_file,
                                                     scale=inputs.scale, stretch=inputs.stretch)


def scenario_load(inputs: Inputs, run_id: str) -> Load:
    del run_id
    scenario, tenants_file, workload = _workload(inputs)
    until = workload.end_s if inputs.duration_s is None else min(workload.end_s,
                                                                 inputs.duration_s)
    if until == float("inf"):
        raise ScenarioError(f"scenario {scenario.name!r} is open-ended: give --duration")
    options: dict[str, Any] = {
        "scenario": scenario.name,
        "tenants_file": str(tenants_file or scenario.tenants_file),
        "scale": inputs.scale, "stretch": inputs.stretch, "seed": inputs.seed,
        "run_time_s": inputs.duration_s, "processes": 1,
        **({"victim": workload.victim} if workload.victim else {})}
    return Load(WorkloadClients(workload, inputs.seed, until), scenario.name, until,
                 workload.tenant_infos(), workload.phase_infos(until), options)


def _mooncake_load(inputs: Inputs, rows: TraceRows) -> Load:
    """A Mooncake trace sent by the tenants of the run's tenants file, as ``locust
    --trace`` sends it."""
    assert inputs.trace is not None
    scenario, tenants_file, workload = _workload(inputs)
    rule = TenantRule.parse(inputs.trace_tenants)
    trace = trace_clients(rows, workload.tenants, rule, speed=inputs.trace_speed,
                          seed=inputs.seed)
    drain = inputs.duration_s is None
    # Draining, the run ends with its last answer; this bounds it: each turn of the longest
    # session may wait its client's whole timeout.
    end = trace.end_s + trace.longest_session * max(
        (t.timeout_s for t in workload.tenants), default=DEFAULT_TIMEOUT_S) \
        if drain else inputs.duration_s
    assert end is not None
    options: dict[str, Any] = {"trace": str(inputs.trace), "trace_format": rows.format,
                               "trace_tenants": str(rule), "trace_speed": inputs.trace_speed,
                               "tenants_file": str(tenants_file or scenario.tenants_file),
                               "seed": inputs.seed, "processes": 1}
    return Load(TraceClients(trace.requests, {t.name: t for t in workload.tenants}),
                f"trace:{inputs.trace.stem}", end,
                workload.tenant_infos(), [PhaseInfo(name="trace", start_s=0.0, end_s=end)],
                options, drain)


def trace_load(inputs: Inputs, config: Config, run_id: str) -> Load:
    assert inputs.trace is not None
    rows = read_trace_rows(inputs.trace)
    if rows.format == "mooncake":
        return _mooncake_load(inputs, rows)
    trace = read_trace(inputs.trace, run_id=run_id, rows=rows)
    requests = []
    for request in trace.requests:
        tenant = config.tenants.get(request.tenant or "")
        if tenant is None:
            raise ValueError(f"{inputs.trace}: tenant {request.tenant!r} is not in the "
                             f"sidecar config (tenants: {', '.join(config.tenants)})")
        request.plan = dataclasses.replace(request.plan, tier=tenant.tier)
        requests.append(request)
    # Without --duration a replay runs until its last request ends (bounded by the clients'
    # timeout after the last send).
    drain = inputs.duration_s is None
    end = trace.end_s + DEFAULT_TIMEOUT_S if inputs.duration_s is None else inputs.duration_s
    # A recorded run's own run.json, beside its requests.parquet, gives the phases and the
    # victim, so the replay's report has the same isolation section.
    phases = [PhaseInfo(name="trace", start_s=0.0, end_s=end)]
    options: dict[str, Any] = {"trace": str(inputs.trace), "filled_prompts": trace.filled_prompts,
                               "seed": inputs.seed, "processes": 1}
    scenario = f"trace:{inputs.trace.stem}"
    recorded = inputs.trace.parent / "run.json"
    if recorded.is_file():
        info = read_run_info(inputs.trace.parent)
        phases = [p for p in info.phases if p.start_s < end] or phases
        scenario = info.scenario
        if "victim" in info.options:
            options["victim"] = info.options["victim"]
    used = {r.tenant for r in requests}
    tenants = [TenantInfo(name=name, tier=t.tier, weight=t.weight)
               for name, t in config.tenants.items() if name in used]
    return Load(TraceClients(requests), scenario, end, tenants, phases, options, drain)


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _utilisation_option(config: Config, result: SimulationResult) -> dict[str, Any]:
    """What the report's rho needs (weighbridge.analysis.stability): the step budget, and
    each backend's full-step time, the median of the sidecar's readings over the run."""
    steps: dict[str, list[float]] = {}
    for sample in result.utilisation:
        for backend, step_s in sample.step_s.items():
            steps.setdefault(backend, []).append(step_s)
    return {"step_budget_tokens": step_budget(config.admission),
            "full_step_s": {backend: statistics.median(values)
                            for backend, values in sorted(steps.items())}}


def run_policy(inputs: Inputs, policy: str | None, run_dir: Path,
               *, label: str | None = None,
               engines: Callable[[StackSpec], list[SimEngine]] = engines_for) -> RunOutcome:
    """Simulate ``inputs`` under ``policy`` into ``run_dir`` (which must be empty).
    ``engines``: the stack's engines as the run drives them (a benchmark's may also count
    what they do)."""
    if (run_dir / REQUESTS_PARQUET).exists():
        raise FileExistsError(f"{run_dir} already holds a run: choose another --out")
    stack = policy_stack(inputs.stack, policy)
    config = sidecar_for(stack)
    name = label or policy or config.scheduler.policy
    run_id = f"simulated-{name}"
    load = trace_load(inputs, config, run_id) if inputs.trace is not None \
        else scenario_load(inputs, run_id)
    simulation = Simulation(config, engines(stack), load.clients, run_id=run_id,
                            scenario=load.scenario, until_s=load.until_s, drain=load.drain,
                            utilisation_every_s=UTILISATION_EVERY_S)
    result = simulation.run()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_parquet(result.records, run_dir / REQUESTS_PARQUET)
    statuses = Counter(r.status for r in result.records)
    info = RunInfo.now(
        run_id=run_id, scenario=load.scenario, target="simulated", git_commit=_git_commit(),
        duration_s=result.end_s, tenants=load.tenants,
        phases=[p.model_copy(update={"end_s": min(p.end_s, result.end_s)})
                for p in load.phases if p.start_s < result.end_s],
        options={**load.options, "simulated": True, "policy": name, "stack": stack.name,
                 "engines": stack.engines.count, "model": stack.engines.emulator.model_name,
                 "utilisation": _utilisation_option(config, result)},
        generator={"simulated": True, "requests": len(result.records),
                   "statuses": dict(sorted(statuses.items())),
                   "engine_steps": result.engine_steps, "events": result.events,
                   "wall_s": result.wall_s,
                   "speedup": result.end_s / result.wall_s if result.wall_s > 0 else None,
                   "holds": result.holds})
    write_run_info(run_dir, info)
    return RunOutcome(name, run_dir, result)
