"""The report's answer first: the gates, the victim's flood/quiet ratio, tier attainment,
fairness and throughput against the baseline, and the sentence that reads them."""

from __future__ import annotations

from html import escape
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.support.records import flood_run
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.gate import evaluate, parse_check
from weighbridge.analysis.headline import headline, reading
from weighbridge.analysis.summary import analyse, summary
from weighbridge.app.cli import app


def summaries(tmp_path: Path) -> tuple[dict, dict]:  # type: ignore[type-arg]
    # Victim p99 TTFT 50 ms quiet; 75 ms in this run's flood (1.5x), 2.15 s in the
    # baseline's (43x). 120 requests of 20 tokens each, all served inside 23 s: 2,400 / 23
    # = 104.3 tokens/s in both. Everything is in the standard tier (E2E SLO 10 s; the
    # longest request takes 3 s): 120 of 120 met.
    this = summary(analyse(load_run(flood_run(tmp_path / "wb", flood_ttft=0.075,
                                              run_id="wb")), window_s=2.0))
    base = summary(analyse(load_run(flood_run(tmp_path / "fifo", flood_ttft=2.15,
                                              run_id="fifo")), window_s=2.0))
    return this, base


def test_reading_against_the_baseline(tmp_path: Path) -> None:
    this, base = summaries(tmp_path)
    assert this["isolation"]["flood_over_quiet"] == pytest.approx(1.5)
    assert reading(this, base) == (
        "The flood multiplied victim's p99 TTFT by 1.5\u00d7 (baseline: 43\u00d7); standard "
        "met its SLO for 100.0% of its requests (baseline: 100.0%), at 104 tok/s "
        "(baseline: 104 tok/s).")
    assert reading(this) == ("The flood multiplied victim's p99 TTFT by 1.5\u00d7; standard "
                             "met its SLO for 100.0% of its requests, at 104 tok/s.")


def test_headline_rows_checks_and_undefined_fairness(tmp_path: Path) -> None:
    this, base = summaries(tmp_path)
    checks = [evaluate(parse_check("isolation.flood_over_quiet<=2"), this),
              evaluate(parse_check("fairness.jain_index>=0.9"), this)]
    head = headline(this, base, checks)
    assert head.baseline_id == "fifo" and head.passed is False
    assert [v.passed for v in head.checks] == [True, False]
    rows = {r.label: (r.this, r.baseline) for r in head.rows}
    assert rows["victim: p99 TTFT, flood over quiet"] == (
        "1.5\u00d7 (50 ms \u2192 75 ms)", "43\u00d7 (50 ms \u2192 2,150 ms)")
    assert rows["standard: SLO attainment (E2E \u2264 10,000 ms)"] == (
        "100.0% (120 of 120)", "100.0% (120 of 120)")
    assert rows["throughput: tokens served"] == ("104 tok/s", "104 tok/s")
    # No two tenants were ever backlogged for 90% of a window: the first-token waits are
    # at most 1 s per request, and the victim sends one request a second, 50-75 ms each.
    fairness = rows["fairness: Jain's index, worst tier"][0]
    assert fairness.startswith("— (no two tenants of a tier were backlogged together")


def test_no_phases_says_so(tmp_path: Path) -> None:
    this, _ = summaries(tmp_path)
    del this["isolation"]
    assert reading(this).startswith(
        "No flood to read: the run has no quiet and flood phases; standard met")


def test_the_answer_comes_first_in_every_format(tmp_path: Path) -> None:
    this = flood_run(tmp_path / "wb", flood_ttft=0.075, run_id="wb")
    base = flood_run(tmp_path / "fifo", flood_ttft=2.15, run_id="fifo")
    out = tmp_path / "o"
    result = CliRunner().invoke(app, ["report", str(this), "--baseline", str(base),
                                      "--out", str(out), "--window", "2s",
                                      "--check", "isolation.flood_over_quiet<=2"])
    assert result.exit_code == 0, result.output
    sentence = "The flood multiplied victim's p99 TTFT by 1.5\u00d7 (baseline: 43\u00d7)"
    assert result.output.lstrip().startswith(sentence)
    md = (out / "report.md").read_text()
    assert md.index(sentence) < md.index("PASS") < md.index("![") < md.index("## ")
    html = (out / "report.html").read_text()
    body = html[html.index("<body>"):]
    assert body.index("id='headline'") < body.index(escape(sentence)) \
        < body.index("class='pass'") \
        < body.index("id='chart-victim-ttft'") < body.index("<h2>")
