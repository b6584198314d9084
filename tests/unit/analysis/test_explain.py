"""Every undefined figure says why, in its own cell (issue 18: fairness showed a bare '-' for
every tier, and the reader could not tell good news from a failure)."""

from __future__ import annotations

from pathlib import Path

from tests.support.records import rec, write_run
from weighbridge.analysis import explain
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.headline import headline
from weighbridge.analysis.render import to_html
from weighbridge.analysis.summary import analyse, summary
from weighbridge.analysis.tables import report_tables


def undefined_run(tmp_path: Path) -> dict:  # type: ignore[type-arg]
    # solo is alone in its tier; a and b share theirs but take turns (a in 0-10 s, b in
    # 10-20 s, each request served 0.1 s after it is scheduled): never backlogged together;
    # dead's two requests were both rejected.
    records = [rec("solo", scheduled=float(i), tier="interactive") for i in range(20)]
    records += [rec("a", scheduled=i * 0.5, ttft=0.1) for i in range(20)]
    records += [rec("b", scheduled=10 + i * 0.5, ttft=0.1) for i in range(20)]
    records += [rec("dead", scheduled=float(i), ttft=None, duration=0.01, prompt=None,
                    output=None, status="rejected", reason="queue_full") for i in (3, 4)]
    run = write_run(tmp_path, records, tenants=[("solo", "interactive", 1.0),
                                                ("a", "standard", 1.0),
                                                ("b", "standard", 1.0),
                                                ("dead", "standard", 1.0)], duration=20.0)
    return summary(analyse(load_run(run), window_s=5.0))


def test_fairness_dashes_say_why(tmp_path: Path) -> None:
    s = undefined_run(tmp_path)
    tables = {t.title.split(" (")[0]: t for t in report_tables(s)}
    fairness = {row[0]: row for row in tables["Fairness"].rows}
    assert fairness["run (worst tier)"][3] == (
        "— (no two tenants of a tier were backlogged together in any 5 s window: nothing "
        "was contended)")
    assert fairness["interactive"][3] == "— (one tenant in this tier: no one to share with)"
    assert fairness["standard"][3] == (
        "— (no two of its tenants were backlogged together (waiting ≥ 90% of a 5 s window) "
        "in any window: nothing was contended)")
    assert fairness["standard"][2] == "0"  # judged windows


def test_tenant_dashes_say_why(tmp_path: Path) -> None:
    s = undefined_run(tmp_path)
    table = next(t for t in report_tables(s) if t.title.startswith("Tenants: latency"))
    latency = {row[0]: row for row in table.rows}
    assert latency["dead"][1] == "— (none of its 2 requests got a first token)"  # TTFT p50
    assert latency["dead"][5] == "— (no request completed ok)"  # E2E p50
    assert latency["a"][1] == "100"  # defined: 0.1 s


def test_no_bare_dash_anywhere(tmp_path: Path) -> None:
    s = undefined_run(tmp_path)
    tables = report_tables(s)
    cells = [c for t in tables for row in t.rows for c in row]
    assert any(c.startswith("— (") for c in cells)
    for c in cells:
        assert c not in ("—", "-"), c
        assert not c.startswith("—") or (c.startswith("— (") and c.endswith(")")), c
    page = to_html("t", headline(s), tables, [], None)
    assert "— <span class='why'>one tenant in this tier: no one to share with</span>" in page


def test_unbounded_share_names_the_starved() -> None:
    tier = {"tenants": ["a", "b"], "judged_windows": 3, "jain_index": 0.5,
            "max_min_share_ratio": None, "starved": ["b"]}
    assert explain.share_ratio(tier, 10.0, 0.9) == "unbounded: b got nothing while backlogged"
    assert explain.relative(3.0, 0.0) == "the baseline is 0"
    assert explain.difference(None, 1.0) == "undefined in this run"
