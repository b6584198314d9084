"""Several runs from one command: policies side by side over a sweep, the summary and the
sweep page; and the ideal bound computed for a stack's shape."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv

from weighbridge.app.simulation.batch import SUMMARY_JSON, SWEEP_HTML, BatchRequest, run_batch
from weighbridge.app.simulation.ideal import ideal_for
from weighbridge.app.simulation.run import Inputs
from weighbridge.app.simulation.sweep import parse_sweep
from weighbridge.app.stack import DEFAULT_STACK, load_stack


def test_a_sweep_of_two_policies_writes_every_run_the_summary_and_the_page(
        tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    n = 40
    pacsv.write_csv(pa.table({"t": [i * 0.05 for i in range(n)],
                              "tenant": ["victim" if i % 4 == 0 else "flooder"
                                         for i in range(n)],
                              "prompt_tokens": [200] * n, "output_tokens": [50] * n}), trace)
    request = BatchRequest(
        inputs=Inputs(stack=load_stack(DEFAULT_STACK), trace=trace, duration_s=4.0),
        out=tmp_path / "out", policies=("drr", "baseline"),
        sweep=parse_sweep("engines.count=1,2"))
    summary = run_batch(request)
    points = summary["sweep"]["points"]
    assert list(points) == ["engines.count=1", "engines.count=2"]
    for label, point in points.items():
        assert set(point["runs"]) == {"drr", "baseline"}
        for policy, figures in point["runs"].items():
            assert (tmp_path / "out" / label / policy / "requests.parquet").is_file()
            assert figures["tenants"]["victim"]["ok"] == n // 4
            assert figures["simulation"]["requests"] == n
    assert json.loads((tmp_path / "out" / SUMMARY_JSON).read_text())["simulated"] is True
    page = (tmp_path / "out" / SWEEP_HTML).read_text()
    assert page.count("data:image/png;base64,") >= 4 and "engines.count" in page


def test_the_ideal_bound_for_the_demo_stack() -> None:
    bound = ideal_for(Inputs(stack=load_stack(DEFAULT_STACK), seed=1))
    assert bound["victim"] == "victim" and bound["flood_tenant"] == "flooder"
    assert bound["cap_per_engine"] == 32 - 4  # max_running_per_backend - headroom_slots
    assert bound["victim_rate_per_engine"] == 2.0  # 4 requests/s over 2 engines
    alone, flooded = bound["alone"], bound["flooded"]
    assert 0 < alone["ttft_p50_s"] <= flooded["ttft_p50_s"]
    assert bound["victim_ttft_ratio"] >= 1.0


def test_the_command_line(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from weighbridge.app.cli import app

    trace = tmp_path / "trace.csv"
    pacsv.write_csv(pa.table({"t": [0.0, 0.5, 1.0], "tenant": ["victim", "steady-a", "victim"],
                              "prompt_tokens": [100, 200, 300], "output_tokens": [10, 20, 30]}),
                    trace)
    out = tmp_path / "cli"
    result = CliRunner().invoke(app, ["simulate", "--trace", str(trace), "--duration", "3",
                                      "--policy", "drr,fcfs", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "token throughput" in result.output and "fcfs" in result.output
    assert (out / "drr" / "requests.parquet").is_file()
    assert (out / "fcfs" / "requests.parquet").is_file()
    bad = CliRunner().invoke(app, ["simulate", "--policy", "lottery", "--out",
                                   str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "unknown policy" in bad.output
