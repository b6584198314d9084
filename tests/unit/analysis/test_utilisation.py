"""The report's utilisation rho (issue 41, point 3): the offered tokens per second over the
engines' capacity B / t_step, from the step budget and full-step times run.json records; and
why it is undefined when a run directory lacks them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.records import rec, write_run
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.summary import analyse, summary
from weighbridge.analysis.tables import stability_table
from weighbridge.records import RequestRecord

RECORDED = {"utilisation": {"step_budget_tokens": 2048,
                            "full_step_s": {"e0": 0.1, "e1": 0.2}}}


def _records() -> list[RequestRecord]:
    # Over 10 s: e0 computes 3 requests of 1,000 prompt tokens (400 of one cached) and 100
    # output tokens; e1 one of 500 + 100.
    records = [rec("a", scheduled=float(i), prompt=1000, output=100, backend="e0",
                   cached_tokens=400 if i == 0 else 0) for i in range(3)]
    records.append(rec("b", scheduled=5.0, prompt=500, output=100, backend="e1"))
    return records


def test_rho_is_offered_over_the_sum_of_budget_over_full_step(tmp_path: Path) -> None:
    run = load_run(write_run(tmp_path, _records(), duration=10.0, options=RECORDED))
    st = summary(analyse(run))["stability"]
    offered = (3 * 1100 + 600) / 10  # every prompt token, cached ones too
    capacity = 2048 / 0.1 + 2048 / 0.2
    assert st["utilisation"] == pytest.approx(offered / capacity)
    # Per backend, what it computed (its cached prompt tokens are free) over its own B/t_step.
    assert st["utilisation_by_backend"]["e0"] == pytest.approx((3 * 1100 - 400) / 10 * 0.1 / 2048)
    assert st["utilisation_by_backend"]["e1"] == pytest.approx(600 / 10 * 0.2 / 2048)
    table = stability_table(summary(analyse(run)))
    assert table.rows[0][3] == "0.0127"  # 390 / 30,720
    assert any("e0 0.01, e1 0.01" in note for note in table.notes)


def test_without_a_recorded_step_time_rho_is_undefined_and_says_why(tmp_path: Path) -> None:
    """A live run's records hold no full-step time (their inter-token gaps are the mean step
    at the run's load, which reads low): the report says where rho is found instead."""
    run = load_run(write_run(tmp_path, _records(), duration=10.0))
    s = summary(analyse(run))
    assert s["stability"]["utilisation"] is None
    assert s["stability"]["utilisation_by_backend"] is None
    cell = stability_table(s).rows[0][3]
    assert "weighbridge_pool_utilisation_ratio" in cell and "options.utilisation" in cell
