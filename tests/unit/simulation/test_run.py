"""weighbridge simulate end to end in virtual time: a stack and a scenario become a live-format
run directory that the report reads; the sidecar's ledger balances against the client
records; the same inputs give byte-identical records; traces replay."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pytest

from weighbridge.analysis.frame import load_run
from weighbridge.analysis.summary import analyse, summary
from weighbridge.app.simulation.run import Inputs, policy_stack, run_policy
from weighbridge.app.simulation.sweep import apply, parse_sweep
from weighbridge.app.stack import DEFAULT_STACK, load_stack
from weighbridge.records import read_parquet
from weighbridge.rundir import REQUESTS_PARQUET, read_run_info

# The demo's stack and scenario, phases at a fifth of their length (3 + 4 + 5 s): the flood
# still outruns the two engines, so queues, gates and rejections are all exercised.
STRETCH = 0.2


@pytest.fixture(scope="module")
def inputs() -> Inputs:
    return Inputs(stack=load_stack(DEFAULT_STACK), seed=3, stretch=STRETCH)


@pytest.fixture(scope="module")
def demo_run(inputs: Inputs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_policy(inputs, None, tmp_path_factory.mktemp("sim") / "drr").run_dir


def test_run_directory_is_a_live_one_marked_simulated(demo_run: Path) -> None:
    info = read_run_info(demo_run)
    assert info.options["simulated"] is True and info.target == "simulated"
    assert info.options["victim"] == "victim"
    assert [p.name for p in info.phases] == ["quiet", "flood", "recovery"]
    assert info.duration_s == pytest.approx(12.0)
    records = read_parquet(demo_run / REQUESTS_PARQUET)
    statuses = Counter(r.status for r in records)
    assert statuses["ok"] > 100
    assert set(statuses) <= {"ok", "rejected", "cancelled"}
    for r in records:
        if r.status == "ok":
            assert r.first_token_s is not None and r.first_token_s >= r.sent_s
            assert r.output_tokens == r.max_tokens == r.chunks  # ignore_eos, a chunk a token
            assert r.backend in ("engine-0", "engine-1") and r.queue_s is not None
    # The report's own analysis reads it unchanged.
    s = summary(analyse(load_run(demo_run), window_s=2.0))
    assert s["isolation"]["victim"] == "victim"
    assert s["stability"]["served_tokens_per_s"] > 0


def test_every_request_ends_once_in_the_ledger_and_in_the_records(
        inputs: Inputs, tmp_path: Path) -> None:
    outcome = run_policy(inputs, None, tmp_path / "run")
    total = outcome.result.ledger["total"]
    records = outcome.result.records
    assert total["queued"] == total["dispatched"] == 0  # nothing left behind
    assert total["arrivals"] == len(records)
    statuses = Counter(r.status for r in records)
    assert total["completed"] == statuses["ok"]
    assert sum(total["rejected"].values()) == statuses["rejected"]
    assert total["cancelled"] == statuses["cancelled"] + statuses["timeout"]
    assert len({r.request_id for r in records}) == len(records)


def test_same_inputs_and_seed_give_byte_identical_records(
        inputs: Inputs, demo_run: Path, tmp_path: Path) -> None:
    again = run_policy(inputs, None, tmp_path / "again").run_dir
    assert (again / REQUESTS_PARQUET).read_bytes() == (demo_run / REQUESTS_PARQUET).read_bytes()
    other_seed = Inputs(stack=inputs.stack, seed=inputs.seed + 1, stretch=STRETCH)
    different = run_policy(other_seed, None, tmp_path / "other").run_dir
    assert (different / REQUESTS_PARQUET).read_bytes() != \
        (demo_run / REQUESTS_PARQUET).read_bytes()


def test_a_recorded_run_replays_as_a_trace(inputs: Inputs, demo_run: Path,
                                           tmp_path: Path) -> None:
    trace = Inputs(stack=inputs.stack, trace=demo_run / REQUESTS_PARQUET)
    replay = run_policy(trace, "fcfs", tmp_path / "replay")
    original = read_parquet(demo_run / REQUESTS_PARQUET)
    replayed = replay.result.records
    assert sorted(r.request_id for r in replayed) == sorted(r.request_id for r in original)
    info = read_run_info(replay.run_dir)
    assert [p.name for p in info.phases] == ["quiet", "flood", "recovery"]
    assert info.options["victim"] == "victim" and info.options["policy"] == "fcfs"
    # Without --duration a replay runs until its last request has ended: none is cut off.
    assert "cancelled" not in Counter(r.status for r in replayed)
    assert info.duration_s == max(r.end_s for r in replayed)
    # The same requests through a request-level FIFO: the victim waits behind the flood.
    by_status = Counter(r.status for r in replayed)
    assert by_status["ok"] > 100


def test_a_csv_trace_with_the_minimal_columns(inputs: Inputs, tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    pacsv.write_csv(pa.table({"arrival_s": [0.0, 0.1, 0.2, 0.3],
                              "tenant": ["victim", "steady-a", "victim", "steady-b"],
                              "prompt_tokens": [100, 200, 300, 50],
                              "output_tokens": [10, 20, 30, 40]}), path)
    outcome = run_policy(Inputs(stack=inputs.stack, trace=path, duration_s=5.0), None,
                         tmp_path / "csv")
    records = sorted(outcome.result.records, key=lambda r: r.scheduled_s)
    assert [r.status for r in records] == ["ok"] * 4
    assert [(r.prompt_tokens, r.output_tokens) for r in records] == \
        [(100, 10), (200, 20), (300, 30), (50, 40)]
    assert [r.tier for r in records] == ["interactive", "standard", "interactive", "standard"]


def test_client_timeouts_cut_requests_off_and_the_sidecar_lets_go(
        inputs: Inputs, tmp_path: Path) -> None:
    path = tmp_path / "trace.csv"
    # Two long generations on an otherwise idle stack, then the run ends mid-stream.
    pacsv.write_csv(pa.table({"t": [0.0, 0.0], "tenant": ["victim", "steady-a"],
                              "prompt_tokens": [100, 100], "output_tokens": [3000, 3000]}),
                    path)
    outcome = run_policy(Inputs(stack=inputs.stack, trace=path, duration_s=2.0), None,
                         tmp_path / "cut")
    assert [r.status for r in outcome.result.records] == ["cancelled", "cancelled"]
    assert all(r.reason == "run_ended" and r.chunks > 0 for r in outcome.result.records)
    assert outcome.result.ledger["total"]["cancelled"] == 2


def test_policies_and_sweeps_change_the_stack_as_the_demo_does(inputs: Inputs) -> None:
    base = policy_stack(inputs.stack, "baseline")
    assert base.sidecar["scheduler"]["policy"] == "fcfs"
    assert base.sidecar["routing"] == "round_robin"
    assert policy_stack(inputs.stack, "rr").sidecar["scheduler"]["policy"] == "rr"
    sweep = parse_sweep("admission.headroom_slots=0,2,8")
    assert sweep.values == (0, 2, 8) and sweep.path[:2] == ("sidecar", "admission")
    assert apply(inputs.stack, sweep, 8).sidecar["admission"]["headroom_slots"] == 8
    engines = parse_sweep("engines.count=1,3")
    assert apply(inputs.stack, engines, 3).engines.count == 3
    with pytest.raises(ValueError):
        parse_sweep("engines.count")
