"""Coasting (weighbridge/app/simulation/loop.py, ``Simulation._coast_steps``) changes nothing: the
same inputs and seed give a byte-identical requests.parquet, the same engine steps and the
same event count with runs of plain decode steps taken at once as with every step an event
of its own. It guards the simulator's speed work (benchmarks/simulate_speed.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from weighbridge.app.simulation.loop import Simulation
from weighbridge.app.simulation.run import (
    Inputs,
    engines_for,
    policy_stack,
    scenario_load,
    sidecar_for,
)
from weighbridge.app.simulation.sweep import apply, parse_sweep
from weighbridge.app.stack import DEPLOY_DIR, StackSpec, load_stack
from weighbridge.records import write_parquet

STACKS = DEPLOY_DIR / "stacks"


def _stack(name: str, *changes: str) -> StackSpec:
    stack = load_stack(STACKS / name)
    for change in changes:
        sweep = parse_sweep(change)
        stack = apply(stack, sweep, sweep.values[0])
    return stack


CASES = [  # stack, policy, scenario, stretch, duration, seed, changes
    ("noisy-neighbour.yaml", None, None, 0.3, None, 1, ()),
    ("noisy-neighbour.yaml", "rr", None, 0.3, None, 2, ()),
    ("noisy-neighbour.yaml", "baseline", None, 0.3, None, 2, ()),
    # Its own tenants (a 10,000-request flood) on fcfs engines with a streaming front end.
    ("noisy-neighbour.yaml", None, "noisy_neighbour", 1.0, 25.0, 1,
     ("engines.emulator.scheduling_policy=fcfs", "engines.emulator.t_api_token=0.00002",
      "engines.count=3")),
    ("tiers.yaml", None, None, 1.0, 20.0, 1, ()),
    ("bimodal.yaml", None, None, 1.0, 20.0, 1, ()),
    # KV-tight engines: coasting stops where a step would preempt.
    ("bimodal.yaml", "passthrough", None, 1.0, 15.0, 3, ("engines.emulator.num_kv_blocks=256",)),
]


def _run(inputs: Inputs, policy: str | None, coast: bool, out: Path) -> tuple[bytes, int, int]:
    stack = policy_stack(inputs.stack, policy)
    load = scenario_load(inputs, "coast")
    result = Simulation(sidecar_for(stack), engines_for(stack), load.clients, run_id="coast",
                        scenario=load.scenario, until_s=load.until_s, coast=coast).run()
    write_parquet(result.records, out)
    return out.read_bytes(), result.engine_steps, result.events


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1] or c[2] or 'stack'}-{c[5]}"
                                             for c in CASES])
def test_coasting_gives_the_same_records_as_one_event_per_step(
        case: tuple, tmp_path: Path) -> None:
    stack_file, policy, scenario, stretch, duration, seed, changes = case
    inputs = Inputs(stack=_stack(stack_file, *changes), scenario=scenario, stretch=stretch,
                    duration_s=duration, seed=seed)
    stepped = _run(inputs, policy, False, tmp_path / "stepped.parquet")
    coasted = _run(inputs, policy, True, tmp_path / "coasted.parquet")
    assert stepped[1] > 1000  # steps enough to coast through
    assert coasted[1:] == stepped[1:]
    assert coasted[0] == stepped[0]
