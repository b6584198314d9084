"""How fast ``weighbridge simulate`` runs: the noisy_neighbour scenario stretched to one hour
on the demo's two engines, on one core.

The simulation is the real SchedulingCore in front of two StepModel engines in virtual time
(weighbridge/app/simulation/loop.py). Figures: simulated seconds per CPU second of the loop (the
target is >= 200x real time; 1,000x is the aim), CPU per simulated request and per engine
step, and for scale: the same engines' StepModel alone replaying the very sequences the run
sent them one step at a time (``weighbridge.emulator.engine.simulate``). The simulation takes runs
of plain decode steps at once (coasting, weighbridge/app/simulation/loop.py), so its engines cost
less than that replay; the sidecar's own code paths (the core, the meters, the records) are
the rest.

CPU time is the process's own (``time.process_time``) with the thread pinned to one core,
so neighbours' load shows as run-queue wait (reported), not as slower figures; the machine's
load average is in the note all the same (SMT siblings and caches are shared).

The fleet: the same hour (noisy_neighbour's phases stretched 60 times) on 64 engines with
100 tenants (``deploy/stacks/fleet.yaml``, whose tenants carry noisy_neighbour's own totals
on its 4 engines), scaled 16 times so that each of the 64 engines is loaded as each of the
4: about 620,000 requests, the flood's 160,000 of them in its 20 s burst. One run; the
target is an hour of it in under a minute of CPU (issue 38).

``python -m benchmarks simulate_speed [--quick]`` (quick: 5 minutes of traffic, not 60)
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks._system import choose_pinning, load_average, pin_this_thread, thread_sched
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.loop import Simulation, SimulationResult
from weighbridge.app.simulation.run import Inputs, scenario_load, sidecar_for
from weighbridge.app.simulation.sweep import apply, parse_sweep
from weighbridge.app.stack import DEFAULT_STACK, DEPLOY_DIR, StackSpec, load_stack
from weighbridge.emulator.engine import Sequence, StepModel, simulate

TARGET = 200.0
AIM = 1000.0
SCENARIO = "noisy_neighbour"
REPEATS = 3
FLEET_STACK = DEPLOY_DIR / "stacks" / "fleet.yaml"
FLEET_ENGINES, FLEET_REFERENCE = 64, 4  # engines, and the fleet its tenants file is for
FLEET_TARGET_CPU_S = 60.0  # for an hour of traffic


@dataclass(frozen=True)
class Measurement:
    result: SimulationResult
    cpu_s: float
    wait_s: float
    floor_cpu_s: float  # the engines alone, same sequences


class _Recording(SimEngine):
    """An engine that keeps a copy of every sequence it is sent (for the floor)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sent: list[Sequence] = []

    def sequence(self, *args: Any, **kwargs: Any) -> Sequence:
        seq = super().sequence(*args, **kwargs)
        self.sent.append(Sequence(seq.request_id, seq.prompt_tokens, seq.target_output_tokens,
                                  seq.max_tokens, seq.arrival_s, seq.priority))
        return seq


def _measure(stretch: float) -> Measurement:
    stack = load_stack(DEFAULT_STACK)
    inputs = Inputs(stack=stack, scenario=SCENARIO, stretch=stretch, seed=1)
    load = scenario_load(inputs, "bench")
    options = stack.engines.emulator
    engines = [_Recording(f"engine-{i}", options, seed_offset=i)
               for i in range(stack.engines.count)]
    simulation = Simulation(sidecar_for(stack), list(engines), load.clients, run_id="bench",
                            scenario=SCENARIO, until_s=load.until_s)
    before = thread_sched()
    result = simulation.run()
    spent = thread_sched() - before
    floor = 0.0
    for engine in engines:
        # What the engine was sent (at the time it was sent), through the StepModel alone.
        model = StepModel(options.engine(), options.step_profile())
        started = time.process_time()
        for _ in simulate(model, engine.sent, until_s=load.until_s):
            pass
        floor += time.process_time() - started
    return Measurement(result, spent.cpu_s, spent.wait_s, floor)


@dataclass(frozen=True)
class FleetMeasurement:
    result: SimulationResult
    cpu_s: float
    wait_s: float
    floor_cpu_s: float  # the engines alone, same sequences, one step at a time


def _measure_fleet(stretch: float) -> FleetMeasurement:
    stack = apply(load_stack(FLEET_STACK), parse_sweep(f"engines.count={FLEET_ENGINES}"),
                  FLEET_ENGINES)
    inputs = Inputs(stack=stack, stretch=stretch, scale=FLEET_ENGINES / FLEET_REFERENCE,
                    seed=1)
    load = scenario_load(inputs, "bench")
    engines = [_Recording(f"engine-{i}", stack.engines.emulator_for(i), seed_offset=i)
               for i in range(stack.engines.count)]
    simulation = Simulation(sidecar_for(stack), list(engines), load.clients,
                            run_id="bench", scenario=load.scenario, until_s=load.until_s)
    before = thread_sched()
    result = simulation.run()
    spent = thread_sched() - before
    return FleetMeasurement(result, spent.cpu_s, spent.wait_s,
                            _floor(engines, stack, load.until_s))


def _floor(engines: list[_Recording], stack: StackSpec, until_s: float) -> float:
    """CPU seconds of the StepModel alone stepping what each engine was sent: the part of a
    simulation no sidecar or loop work can remove."""
    floor = 0.0
    for i, engine in enumerate(engines):
        options = stack.engines.emulator_for(i)
        model = StepModel(options.engine(), options.step_profile())
        started = time.process_time()
        for _ in simulate(model, engine.sent, until_s=until_s):
            pass
        floor += time.process_time() - started
        engine.sent.clear()  # 64 engines' sequences are memory the next engine needs
    return floor


def _fleet_table(m: FleetMeasurement, stretch: float) -> Table:
    r = m.result
    holds: dict[str, int] = {}
    for key, n in r.holds.items():
        reason = key.split("/", 1)[1]
        holds[reason] = holds.get(reason, 0) + n
    held = ", ".join(f"{k} {v:,}" for k, v in sorted(holds.items(), key=lambda kv: -kv[1])[:3])
    return Table(("engines", "tenants", "simulated s", "requests", "engine steps", "events",
                  "CPU s", "waited s", "speed-up", f"CPU s for an hour (target <= "
                  f"{FLEET_TARGET_CPU_S:.0f})", "StepModel alone, stepwise, CPU s for an hour",
                  "CPU / StepModel alone", "µs CPU / request", "sidecar holds"),
                 [(str(FLEET_ENGINES), "100", f"{r.end_s:,.0f}", f"{len(r.records):,}",
                   f"{r.engine_steps:,}", f"{r.events:,}", f"{m.cpu_s:.1f}",
                   f"{m.wait_s:.1f}", f"{r.end_s / m.cpu_s:,.1f}x",
                   f"**{m.cpu_s * 3600 / r.end_s:,.0f}**",
                   f"{m.floor_cpu_s * 3600 / r.end_s:,.0f}",
                   f"{m.cpu_s / m.floor_cpu_s:.1f}x" if m.floor_cpu_s > 0 else "-",
                   f"{m.cpu_s / len(r.records) * 1e6:,.0f}", held or "none")],
                 caption=f"The fleet: deploy/stacks/fleet.yaml on {FLEET_ENGINES} engines, "
                         f"noisy_neighbour stretched x{stretch:g}, --scale "
                         f"{FLEET_ENGINES // FLEET_REFERENCE} (one run)")


def run(ctx: BenchContext) -> BenchResult:
    stretch = 5.0 if ctx.quick else 60.0
    pinning = choose_pinning()
    ctx.log(f"{SCENARIO} stretched x{stretch:g} on the demo stack, {REPEATS} runs, "
            f"{pinning.describe()}")
    runs: list[Measurement] = []
    with pin_this_thread(pinning.server):
        for i in range(REPEATS):
            m = _measure(stretch)
            runs.append(m)
            ctx.log(f"run {i + 1}: {m.result.end_s / m.cpu_s:,.0f}x real time "
                    f"({m.cpu_s:.1f} s CPU, {m.wait_s:.1f} s waiting for the core)")
        ctx.log(f"the fleet: {FLEET_ENGINES} engines, stretched x{stretch:g}")
        fleet = _measure_fleet(stretch)
        ctx.log(f"fleet: {fleet.result.end_s:,.0f} s simulated in {fleet.cpu_s:.1f} s CPU")
    median = sorted(runs, key=lambda m: m.cpu_s)[len(runs) // 2]
    r = median.result
    speedup = r.end_s / median.cpu_s
    per_request = median.cpu_s / len(r.records) * 1e6
    per_step = median.cpu_s / r.engine_steps * 1e6
    floor_step = median.floor_cpu_s / r.engine_steps * 1e6
    rows: list[tuple[str, ...]] = [(f"{m.result.end_s:,.0f}", f"{len(m.result.records):,}",
             f"{m.result.engine_steps:,}", f"{m.cpu_s:.1f}", f"{m.wait_s:.1f}",
             f"**{m.result.end_s / m.cpu_s:,.0f}x**",
             f"{m.cpu_s / len(m.result.records) * 1e6:,.0f}",
             f"{m.cpu_s / m.result.engine_steps * 1e6:.1f}",
             f"{m.floor_cpu_s / m.result.engine_steps * 1e6:.1f}") for m in runs]
    tables = [Table(("simulated s", "requests", "engine steps", "CPU s", "waited s",
                     "speed-up", "µs CPU / request", "µs CPU / step",
                     "StepModel alone, stepwise, µs / step"), rows),
              _fleet_table(fleet, stretch)]
    fleet_hour_s = fleet.cpu_s * 3600 / fleet.result.end_s
    passed = speedup >= TARGET and fleet_hour_s <= FLEET_TARGET_CPU_S
    return BenchResult(
        summary=[f"{SCENARIO} stretched to {r.end_s:,.0f} s on 2 engines: **{speedup:,.0f}x** "
                 f"real time on one core (median of {REPEATS}; target >= {TARGET:,.0f}x, aim "
                 f"{AIM:,.0f}x): {per_request:,.0f} µs CPU per simulated request, "
                 f"{per_step:.1f} µs per engine step; the StepModel alone, one step at a "
                 f"time, takes {floor_step:.1f} µs a step.",
                 f"The fleet, {FLEET_ENGINES} engines and 100 tenants: "
                 f"**{fleet_hour_s:,.0f} s of CPU for an hour** of traffic (target <= "
                 f"{FLEET_TARGET_CPU_S:.0f} s; {fleet.result.end_s / fleet.cpu_s:,.1f}x real "
                 f"time); the StepModel alone, stepping what the engines were sent, takes "
                 f"{fleet.floor_cpu_s * 3600 / fleet.result.end_s:,.0f} s of it."],
        tables=tables,
        notes=[f"Load average at the end: {load_average()} (per-thread CPU time from "
               "schedstat; 'waited' is time runnable but not running).",
               "Everything the loop does is counted: client plans, the core's arrive/"
               "dispatch/accounting, engine steps, scrapes every metrics_poll_ms, records. "
               "Writing the run directory (Parquet) is not.",
               "Runs of plain decode steps (nothing queued, every running sequence "
               "decodes, none finishes) are taken at once (coasting); the records are "
               "identical to one event per step (tests/unit/simulation/test_coast.py).",
               "Median run by CPU time; spread (standard deviation) "
               f"{statistics.pstdev([m.cpu_s for m in runs]):.2f} s."],
        passed=passed,
        setup=[pinning.describe()],
    )


BENCHMARK = Benchmark("simulate_speed",
                      "weighbridge simulate: an hour of noisy_neighbour in virtual time", run)
