"""The per-model breakdown: figures worked out by hand from records built in memory, absent
for single-model runs, and runs recorded before records had a model still load."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.support.records import rec, write_run
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.models import UNNAMED, model_stats
from weighbridge.analysis.summary import analyse, summary
from weighbridge.analysis.tables import MODELS, report_tables
from weighbridge.records import ADDED_FIELDS
from weighbridge.rundir import REQUESTS_PARQUET


def _records() -> list:
    return [
        # model-a: two ok (TTFT 0.1, 0.3), one rejected
        rec("app-a", scheduled=0, ttft=0.1, prompt=100, output=20, model="model-a"),
        rec("flooder-a", scheduled=1, ttft=0.3, prompt=50, output=30, model="model-a"),
        rec("flooder-a", scheduled=2, ttft=None, prompt=None, output=None, status="rejected",
            reason="queue_full", http_status=429, model="model-a"),
        # model-b: one ok, one error
        rec("app-b", scheduled=0, ttft=0.2, prompt=100, output=100, model="model-b"),
        rec("app-b", scheduled=3, ttft=None, prompt=None, output=None, status="error",
            duration=0.5, model="model-b"),
        # the adapter: one timeout that got a first token
        rec("tuned-a", scheduled=4, ttft=0.5, prompt=50, output=50, status="timeout",
            model="model-a-lora"),
        # a request that named no model
        rec("app-b", scheduled=5, ttft=0.4, prompt=25, output=25),
    ]


def test_per_model_requests_latency_throughput_and_share(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, _records(), duration=10.0))
    stats = model_stats(run.frame, run.duration_s)
    assert list(stats) == ["model-a", "model-a-lora", "model-b", UNNAMED]
    a, lora, b, none = stats.values()
    assert (a.requests, a.ok, a.rejected, a.failed) == (3, 2, 1, 0)
    assert a.rejections == {"queue_full": 1}
    assert (b.requests, b.ok, b.failed) == (2, 1, 1) and (lora.failed, lora.ok) == (1, 0)
    assert a.ttft.p50 == pytest.approx(0.2) and a.ttft.p99 == pytest.approx(0.298)
    assert (a.output_tokens, a.output_tokens_per_s) == (50, pytest.approx(5.0))
    # tokens served: a 200, lora 100, b 200, none 50 of 550
    assert a.token_share == pytest.approx(200 / 550)
    assert lora.token_share == pytest.approx(100 / 550)
    assert none.requests == 1 and none.token_share == pytest.approx(50 / 550)
    assert sum(m.token_share or 0 for m in stats.values()) == pytest.approx(1.0)


def test_the_report_has_a_models_table_only_when_two_models_are_named(tmp_path: Path) -> None:
    many = summary(analyse(load_run(write_run(tmp_path / "many", _records(), duration=10.0))))
    assert set(many["models"]) == {"model-a", "model-a-lora", "model-b", UNNAMED}
    assert many["models"]["model-b"]["token_share"] == pytest.approx(200 / 550)
    (table,) = [t for t in report_tables(many) if t.group == MODELS]
    rows = {r[0]: r for r in table.rows}
    assert rows["model-a"][1:8] == ("3", "2", "1", "0", "200", "298", "5")
    assert rows["model-a"][8:] == ("36.4", "queue_full 1")
    assert rows["model-a-lora"][5] == "500"  # TTFT of a request that then timed out

    one = [rec("a", model="model-a"), rec("b", model="model-a"), rec("c")]
    single = summary(analyse(load_run(write_run(tmp_path / "one", one, duration=10.0))))
    assert "models" not in single
    assert all(t.group != MODELS for t in report_tables(single))


def test_a_run_recorded_before_records_had_a_model_is_one_model(tmp_path: Path) -> None:
    run_dir = write_run(tmp_path, _records(), duration=10.0)
    parquet = run_dir / REQUESTS_PARQUET
    pq.write_table(pq.read_table(parquet).drop_columns(list(ADDED_FIELDS)), parquet)
    run = load_run(run_dir)
    assert run.records == 7 and run.frame["model"].isna().all()
    assert "models" not in summary(analyse(run))
