"""Trace replay of a run's records: a run recorded before records had ``model`` is still
read as records (its ``max_tokens`` is what each request asked for), and a trace's models are
kept in the requests it replays."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from tests.support.records import rec
from weighbridge.app.simulation.trace import read_trace
from weighbridge.records import ADDED_FIELDS, records_to_table


def test_records_of_either_schema_replay_with_their_models(tmp_path: Path) -> None:
    records = [rec("a", scheduled=0.0, output=None, max_tokens=40, model="model-a"),
               rec("b", scheduled=1.0, output=None, max_tokens=30)]
    table = records_to_table(records)
    new, old = tmp_path / "new.parquet", tmp_path / "old.parquet"
    pq.write_table(table, new)
    pq.write_table(table.drop_columns(list(ADDED_FIELDS)), old)

    replayed = read_trace(new, run_id="sim").requests
    assert [r.plan.max_tokens for r in replayed] == [40, 30]  # records: max_tokens
    assert [r.plan.model for r in replayed] == ["model-a", None]
    before = read_trace(old, run_id="sim").requests
    assert [r.plan.max_tokens for r in before] == [40, 30]
    assert [r.plan.model for r in before] == [None, None]
