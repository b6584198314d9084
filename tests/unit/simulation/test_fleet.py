"""A fleet in virtual time (deploy/stacks/fleet.yaml: 100 tenants, the flood's tenants
queueing without bound) on 8 engines is deterministic: the same inputs and seed give
byte-identical records, the same engine steps, events and dispatch holds, and another seed
gives other records. Every engine serves, and the sidecar refuses nothing."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from weighbridge.app.simulation.run import Inputs, RunOutcome, run_policy
from weighbridge.app.simulation.sweep import apply, parse_sweep
from weighbridge.app.stack import DEPLOY_DIR, load_stack
from weighbridge.rundir import REQUESTS_PARQUET, read_run_info

ENGINES = 8
# Phases at a fifth of noisy_neighbour's (3 + 4 + 5 s), half the reference fleet's load per
# engine: the flood's 4 s still outrun the engines, so requests queue and gates hold.
STRETCH, SCALE = 0.2, ENGINES / 4 / 2


def _inputs(seed: int) -> Inputs:
    sweep = parse_sweep(f"engines.count={ENGINES}")
    stack = apply(load_stack(DEPLOY_DIR / "stacks" / "fleet.yaml"), sweep, ENGINES)
    return Inputs(stack=stack, stretch=STRETCH, scale=SCALE, seed=seed)


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> RunOutcome:
    return run_policy(_inputs(4), None, tmp_path_factory.mktemp("fleet") / "first")


def test_a_fleet_run_serves_on_every_engine_and_refuses_nothing(first: RunOutcome) -> None:
    assert len(read_run_info(first.run_dir).tenants) == 100
    records = first.result.records
    # The steady tenants send one request in 16 s each here: about half of them do.
    assert len({r.tenant for r in records}) > 30
    statuses = Counter(r.status for r in records)
    assert statuses["ok"] > 1000 and "rejected" not in statuses
    assert {r.backend for r in records if r.status == "ok"} == {
        f"engine-{i}" for i in range(ENGINES)}


def test_the_same_seed_gives_the_same_fleet_run(first: RunOutcome, tmp_path: Path) -> None:
    again = run_policy(_inputs(4), None, tmp_path / "again")
    assert (again.run_dir / REQUESTS_PARQUET).read_bytes() == \
        (first.run_dir / REQUESTS_PARQUET).read_bytes()
    assert (again.result.engine_steps, again.result.events, again.result.holds) == \
        (first.result.engine_steps, first.result.events, first.result.holds)
    other = run_policy(_inputs(5), None, tmp_path / "other")
    assert (other.run_dir / REQUESTS_PARQUET).read_bytes() != \
        (first.run_dir / REQUESTS_PARQUET).read_bytes()
