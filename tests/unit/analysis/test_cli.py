"""``weighbridge report`` and ``weighbridge capacity`` through typer's CliRunner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.support.records import flood_run, rec, write_run
from weighbridge.app.cli import app

runner = CliRunner()


def fair_run(run_dir: Path, *, skew: float = 1.0, run_id: str = "r") -> Path:
    """Two interactive tenants backlogged all run long (a request waits 1.5 s, one is
    scheduled every second): b's outputs are ``skew`` times a's."""
    records = [rec(t, scheduled=float(i), ttft=1.5, duration=2.0, tier="interactive",
                   prompt=10, output=int(20 * (skew if t == "b" else 1)))
               for i in range(30) for t in ("a", "b")]
    return write_run(run_dir, records, tenants=[("a", "interactive", 1.0),
                                                ("b", "interactive", 1.0)],
                     duration=30.0, run_id=run_id)


def test_report_writes_every_format(tmp_path: Path) -> None:
    run_dir = fair_run(tmp_path / "run")
    out = tmp_path / "out"
    result = runner.invoke(app, ["report", str(run_dir), "--out", str(out), "--window", "5s"])
    assert result.exit_code == 0, result.output
    assert "Fairness" in result.output and "Tenants" in result.output
    assert {p.name for p in out.iterdir()} == {"summary.json", "lengths.json", "report.md",
                                              "report.html", "figures"}
    summary = json.loads((out / "summary.json").read_text())
    assert summary["fairness"]["jain_index"] == pytest.approx(1.0)
    assert summary["run"]["window_s"] == 5.0
    md = (out / "report.md").read_text()
    assert "### Fairness" in md
    # report.md shows the static PNGs beside it; report.html the interactive charts, with
    # bokeh's library inlined: nothing is fetched from anywhere.
    pngs = sorted(p.name for p in (out / "figures").iterdir())
    assert pngs == ["in-flight.png", "tenant-ttft.png", "token-share.png", "ttft-cdf.png"]
    assert all(f"](figures/{name})" in md for name in pngs)
    html = (out / "report.html").read_text()
    assert "<img" not in html and "Bokeh" in html
    assert "<script src" not in html and "<link" not in html
    assert [key for key in ("token-share", "ttft-cdf", "in-flight", "tenant-ttft")
            if f"id='chart-{key}'" in html] == ["token-share", "ttft-cdf", "in-flight",
                                                 "tenant-ttft"]
    lengths = json.loads((out / "lengths.json").read_text())
    assert lengths["lengths"]["a"]["/v1/completions"]["output_tokens"] == {
        "kind": "empirical", "bins": [[20, 21, 30]]}


def test_check_gates_the_exit_status(tmp_path: Path) -> None:
    run_dir = fair_run(tmp_path / "run", skew=3.0)
    ok = runner.invoke(app, ["report", str(run_dir), "--format", "json",
                             "--check", "fairness.jain_index>=0.5",
                             "--check", "tiers.interactive.ttft_p99_s<=2"])
    assert ok.exit_code == 0, ok.output
    failed = runner.invoke(app, ["report", str(run_dir), "--format", "json",
                                 "--check", "fairness.jain_index>=0.95",
                                 "--check", "tiers.interactive.ttft_p99_s<=2"])
    assert failed.exit_code == 1
    assert "FAIL fairness.jain_index >= 0.95: fairness.jain_index = 0.8" in failed.output
    assert "1 of 2 check(s) failed" in failed.output
    bad = runner.invoke(app, ["report", str(run_dir), "--check", "jain is high"])
    assert bad.exit_code == 2 and "bad check" in bad.output


def test_baseline_side_by_side(tmp_path: Path) -> None:
    this = fair_run(tmp_path / "drr", run_id="drr")
    base = fair_run(tmp_path / "fcfs", skew=3.0, run_id="fcfs")
    result = runner.invoke(app, ["report", str(this), "--baseline", str(base),
                                 "--format", "text,json", "--out", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "Comparison: drr against baseline fcfs" in result.output
    s = json.loads((tmp_path / "o" / "summary.json").read_text())
    diff = s["baseline"]["differences"]["fairness.jain_index"]
    assert diff["this"] == pytest.approx(1.0) and diff["baseline"] < 1.0
    assert diff["difference"] == pytest.approx(1.0 - diff["baseline"])


def test_a_multi_model_run_is_broken_down_by_model_in_every_format(tmp_path: Path) -> None:
    records = [rec(t, scheduled=float(i), ttft=0.1 if t == "a" else 0.4, duration=1.0,
                   tier="interactive", prompt=10, output=20, model=f"model-{t}")
               for i in range(10) for t in ("a", "b")]
    run_dir = write_run(tmp_path / "run", records, duration=10.0)
    out = tmp_path / "out"
    result = runner.invoke(app, ["report", str(run_dir), "--out", str(out),
                                 "--format", "text,md,html,json",
                                 "--check", "models.model-b.ttft_p99_s<=0.5"])
    assert result.exit_code == 0, result.output
    title = "Models: requests, latency and token share"
    assert title in result.output and "model-b" in result.output
    assert f"## Models\n\n### {title}\n\n| model |" in (out / "report.md").read_text()
    assert f"<h2>Models</h2>\n<h3>{title}</h3>" in (out / "report.html").read_text()
    models = json.loads((out / "summary.json").read_text())["models"]
    assert models["model-a"]["token_share"] == pytest.approx(0.5)
    assert models["model-b"]["ttft_p50_s"] == pytest.approx(0.4)
    # A single-model run's report has no such table.
    single = runner.invoke(app, ["report", str(fair_run(tmp_path / "one")), "--format", "text"])
    assert single.exit_code == 0 and "Models" not in single.output


def test_report_errors_are_clear(tmp_path: Path) -> None:
    missing = runner.invoke(app, ["report", str(tmp_path)])
    assert missing.exit_code == 2 and "no run.json" in missing.output
    bad_window = runner.invoke(app, ["report", str(tmp_path), "--window", "soon"])
    assert bad_window.exit_code == 2 and "window" in bad_window.output
    bad_format = runner.invoke(app, ["report", str(tmp_path), "--format", "pdf"])
    assert bad_format.exit_code == 2 and "format" in bad_format.output


def test_capacity_json_and_text() -> None:
    args = ["capacity", "--requests-per-day", "100000", "--avg-tokens", "1500",
            "--tokens-per-second-per-gpu", "200", "--peak-to-average", "4"]
    result = runner.invoke(app, [*args, "--format", "json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert set(plan) >= {"tokens_per_day", "gpu_hours_per_day", "average_gpus", "peak_gpus",
                         "kv_bytes_per_sequence", "max_concurrent_sequences",
                         "binding_constraint"}
    assert round(plan["gpu_hours_per_day"]) == 208
    text = runner.invoke(app, [*args, "--layers", "80", "--heads", "64", "--head-dim", "128",
                               "--context", "2048"])
    assert text.exit_code == 0, text.output
    assert "assuming all 64 attention heads" in text.output
    assert "binding constraint" in text.output
    missing = runner.invoke(app, ["capacity", "--avg-tokens", "1"])
    assert missing.exit_code == 2 and "--requests-per-day" in missing.output


def test_baseline_report_plots_the_victim_against_the_baseline(tmp_path: Path) -> None:
    this = flood_run(tmp_path / "wb", flood_ttft=0.08, run_id="wb")
    base = flood_run(tmp_path / "fifo", flood_ttft=4.0, run_id="fifo")
    out = tmp_path / "o"
    result = runner.invoke(app, ["report", str(this), "--baseline", str(base),
                                 "--format", "html", "--out", str(out), "--window", "2s"])
    assert result.exit_code == 0, result.output
    html = (out / "report.html").read_text()
    # The victim against the baseline is the first chart, right after the headline.
    assert html.index("id='headline'") < html.index("id='chart-victim-ttft'") \
        < html.index("id='chart-token-share'")
    assert "p99 TTFT per 2 s window against the baseline" in html
