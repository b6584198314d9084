"""Agent programs in the report (weighbridge.analysis.programs): families found by their
parents, outcomes by the record's own rule (``RequestRecord.program_end``), completion time
per tenant worked out by hand, Little's Law over programs, Jain's index over the tenants'
computed tokens, and the summary keys, tables, comparison and chart that show them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.records import rec, write_run
from weighbridge.analysis.compare import compare
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.programs import program_families
from weighbridge.analysis.series import charts
from weighbridge.analysis.summary import analyse, summary
from weighbridge.analysis.tables import PROGRAMS, report_tables
from weighbridge.analysis.units import unit_of
from weighbridge.records import RequestRecord


def _call(tenant: str, program: str, turn: int, calls: int, *, parent: str | None = None,
          scheduled: float, duration: float = 1.0, status: str = "ok",
          prompt: int = 100, cached: int | None = None, output: int = 10) -> RequestRecord:
    ok = status == "ok"
    return rec(tenant, scheduled=scheduled, duration=duration, status=status,
               ttft=0.1 if ok else None, prompt=prompt if ok else None,
               output=output if ok else None, cached_tokens=cached if ok else None,
               program_id=program, parent_program_id=parent, program_calls=calls, turn=turn,
               session_id=program)


def _records() -> list[RequestRecord]:
    return [
        # a-p0: 3 calls; after call 0 it forks two subagents (2 calls and 1 call), resumes
        # with call 1 at the last subagent's end (6.0), ends at 9.0: completion 9 s.
        _call("a", "a-p0", 0, 3, scheduled=0.0, cached=0),
        _call("a", "a-p0-c0.0", 0, 2, parent="a-p0", scheduled=1.0, cached=80),
        _call("a", "a-p0-c0.0", 1, 2, parent="a-p0", scheduled=3.0, duration=3.0, cached=90),
        _call("a", "a-p0-c0.1", 0, 1, parent="a-p0", scheduled=1.0, duration=2.0,
              status="error"),  # a subagent failing ends only itself
        _call("a", "a-p0", 1, 3, scheduled=6.0, cached=100),
        _call("a", "a-p0", 2, 3, scheduled=8.0, cached=100),
        # a-p1: 2 calls, done in 4 s.
        _call("a", "a-p1", 0, 2, scheduled=2.0),
        _call("a", "a-p1", 1, 2, scheduled=5.0),
        # b-p0: its second call is rejected: failed at 4.5.
        _call("b", "b-p0", 0, 4, scheduled=1.0, output=50),
        _call("b", "b-p0", 1, 4, scheduled=4.0, duration=0.5, status="rejected"),
        # b-p1: in a tool run when the run ends at 20: unfinished, in the system until 20.
        _call("b", "b-p1", 0, 5, scheduled=12.0, output=50),
        # b-p2: its call cut off by the run's end.
        _call("b", "b-p2", 0, 2, scheduled=15.0, duration=5.0, status="cancelled"),
        # A request of no program.
        rec("b", scheduled=3.0, prompt=1000, output=0),
    ]


def _run(tmp_path: Path, records: list[RequestRecord] | None = None) -> Any:
    return write_run(tmp_path, _records() if records is None else records, duration=20.0,
                     tenants=[("a", "standard", 1.0), ("b", "standard", 2.0)])


def test_families_their_outcomes_and_completion_times(tmp_path: Path) -> None:
    run = load_run(_run(tmp_path))
    families = program_families(run.frame, run.duration_s)
    assert families.loc["a-p0"].to_dict() == {
        "tenant": "a", "start_s": 0.0, "end_s": 9.0, "outcome": "completed",
        "tokens": 4 * 110 + 110, "subagents": 2}
    got = {k: (row.outcome, row.start_s, row.end_s) for k, row in families.iterrows()}
    assert got == {"a-p0": ("completed", 0.0, 9.0), "a-p1": ("completed", 2.0, 6.0),
                   "b-p0": ("failed", 1.0, 4.5), "b-p1": ("unfinished", 12.0, 20.0),
                   "b-p2": ("unfinished", 15.0, 20.0)}


def test_the_summary_per_tenant(tmp_path: Path) -> None:
    s = summary(analyse(load_run(_run(tmp_path))))
    a, b = s["programs"]["tenants"]["a"], s["programs"]["tenants"]["b"]
    assert (a["programs"], a["programs_completed"], a["subagents"]) == (2, 2, 2)
    assert a["completion_p50_s"] == pytest.approx(6.5)  # of 9 and 4
    assert a["completion_p90_s"] == pytest.approx(8.5)
    assert (b["programs"], b["programs_failed"], b["programs_unfinished"]) == (3, 1, 2)
    assert b["completion_p50_s"] is None
    # Little's Law over programs: b's are in the system 3.5 + 8 + 5 s of 20, 3 started.
    assert b["programs_in_progress"] == pytest.approx(16.5 / 20)
    assert b["programs_per_s"] == pytest.approx(3 / 20)
    assert b["program_time_in_system_s"] == pytest.approx(16.5 / 3)
    assert b["program_ratio"] == pytest.approx(1.0)
    # Computed tokens: each ok call's prompt less its cached tokens (none reported: all of
    # it), plus its output.
    computed = {n: t["computed_tokens"] for n, t in s["tenants"].items()}
    assert computed == {"a": 110 + 30 + 20 + 10 + 10 + 110 + 110, "b": 150 + 150 + 1000}
    x = [computed["a"] / 1.0, computed["b"] / 2.0]
    assert s["programs"]["computed_tokens_jain_index"] == pytest.approx(
        sum(x) ** 2 / (2 * sum(v * v for v in x)))
    for key, value in [*a.items(), ("computed_tokens_jain_index", 0.0)]:
        assert unit_of(f"programs.tenants.a.{key}") is not None, (key, value)


def test_tables_comparison_and_chart(tmp_path: Path) -> None:
    analysis = analyse(load_run(_run(tmp_path)))
    s = summary(analysis)
    tables = [t for t in report_tables(s) if t.group == PROGRAMS]
    assert [len(t.rows) for t in tables] == [2, 3]  # a and b; a, b and Jain's index
    assert tables[0].rows[1][6].startswith("—")  # b completed none: says why in place
    assert "completed" in tables[0].rows[1][6]
    paths = {d.path for d in compare(s, s)}
    assert {"programs.tenants.a.completion_p90_s", "programs.computed_tokens_jain_index",
            "tenants.b.computed_tokens"} <= paths
    (chart,) = [c for c in charts(analysis, analysis) if c.key == "program-completion"]
    assert [ln.name.split(":")[0] for ln in chart.lines] == ["a", "a (baseline)"]
    assert chart.lines[0].x[-1] == pytest.approx(9.0)


def test_a_run_without_programs_has_no_programs_section(tmp_path: Path) -> None:
    analysis = analyse(load_run(write_run(tmp_path, [rec("a"), rec("b")], duration=5.0)))
    s = summary(analysis)
    assert "programs" not in s and analysis.programs is None
    assert not [t for t in report_tables(s) if t.group == PROGRAMS]
    assert "program-completion" not in {c.key for c in charts(analysis)}


_CALL = st.tuples(st.integers(0, 2), st.booleans(), st.integers(0, 3), st.integers(1, 4),
                  st.sampled_from(["ok", "ok", "ok", "cancelled", "error", "rejected"]),
                  st.floats(0, 30))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(st.lists(_CALL, min_size=1, max_size=25))
def test_the_outcome_is_the_record_s_own_rule(tmp_path: Path, calls: list[Any]) -> None:
    """Over any records, a family completed or failed exactly when one of its root's records
    says so (``program_end``), and ends there."""
    records = []
    for i, (program, child, turn, planned, status, at) in enumerate(calls):
        root = f"a-p{program}"
        records.append(_call("a", f"{root}-c0.0" if child else root, turn, planned,
                             parent=root if child else None, scheduled=at, status=status,
                             duration=1.0 + i / 100))
    run_dir = tmp_path / f"run-{len(list(tmp_path.iterdir()))}"
    run = load_run(write_run(run_dir, records, duration=40.0))
    families = program_families(run.frame, run.duration_s)
    for root, row in families.iterrows():
        own = [r for r in records if r.program_id == root]
        completed = [r.end_s for r in own if r.program_end == "completed"]
        failed = [r.end_s for r in own if r.program_end == "failed"]
        if completed:
            assert (row.outcome, row.end_s) == ("completed", min(completed))
        elif failed:
            assert (row.outcome, row.end_s) == ("failed", min(failed))
        else:
            assert (row.outcome, row.end_s) == ("unfinished", 40.0)
