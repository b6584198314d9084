"""``weighbridge report`` on a real run: the Locust load generator (scenarios/, the
noisy_neighbour phases) against a real emulator on loopback, then all four formats, and the
HTML opened in headless Chromium (tests/integration/analysis/chromium.py).

Chromium is the Debian ``chromium`` package (.ci/run installs it); without it this test
fails, it does not skip.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tests.integration.analysis.test_report_in_browser import check_report_page
from weighbridge.app.cli import app
from weighbridge.launch import emulator_process
from weighbridge.rundir import read_run_info

REPO = Path(__file__).resolve().parents[3]

# A victim that sends least, two steady tenants, a flooder that bursts in the flood phase.
TENANTS = """
tenants:
  - name: victim
    tier: interactive
    endpoint: chat
    lengths:
      prompt: {kind: uniform, low: 32, high: 128}
      output: {kind: uniform, low: 8, high: 24}
    arrival: {kind: poisson, rate: 2}
  - name: steady-a
    tier: standard
    endpoint: completions
    lengths:
      prompt: {kind: uniform, low: 64, high: 256}
      output: {kind: uniform, low: 16, high: 48}
    arrival: {kind: poisson, rate: 4}
  - name: steady-b
    tier: standard
    endpoint: completions
    lengths:
      prompt: {kind: uniform, low: 64, high: 256}
      output: {kind: uniform, low: 16, high: 48}
    arrival: {kind: poisson, rate: 4}
  - name: flooder
    tier: standard
    endpoint: completions
    lengths:
      prompt: {kind: uniform, low: 128, high: 384}
      output: {kind: uniform, low: 16, high: 48}
    phases:
      flood: {kind: burst, count: 1200, at_s: 0, over_s: 20}
"""


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    width, height = struct.unpack(">II", header[16:24])
    return width, height


def test_report_on_a_locust_run_renders_everywhere(tmp_path: Path) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(TENANTS)
    run_dir = tmp_path / "run"
    # A small engine (8 sequences, 40 tokens/s each) that the flood backs up for seconds.
    with emulator_process(max_num_seqs=8, max_num_batched_tokens=1024, num_kv_blocks=1024,
                          t_fixed=0.025) as emulator:
        done = subprocess.run(
            [sys.executable, "-m", "locust", "-f", "scenarios/", "--headless",
             "--scenario", "noisy_neighbour", "--tenants-file", str(tenants),
             "--stretch", "0.3", "--host", emulator.url, "--records-dir", str(run_dir),
             "--run-id", "report-it", "--exporter-port", "0", "--seed", "7"],
            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (run_dir / "requests.parquet").is_file()
    assert [p.name for p in read_run_info(run_dir).phases] == ["quiet", "flood", "recovery"]

    out = tmp_path / "report"
    result = CliRunner().invoke(app, [
        "report", str(run_dir), "--out", str(out), "--window", "2s",
        "--check", "stability.served_tokens_per_s>0", "--check", "tenants.victim.ok>=1"])
    assert result.exit_code == 0, result.output
    assert "Fairness" in result.output and "Isolation" in result.output

    summary = json.loads((out / "summary.json").read_text())
    assert summary["run"]["run_id"] == "report-it"
    assert set(summary["tenants"]) == {"victim", "steady-a", "steady-b", "flooder"}
    assert summary["tenants"]["flooder"]["ok"] > 0
    assert summary["isolation"]["victim"] == "victim"
    assert summary["isolation"]["flood_phase"] == "flood"
    assert summary["isolation"]["quiet_phase"] == "quiet"
    for tenant in summary["littles_law"].values():
        assert tenant["request_ratio"] == pytest.approx(1.0, abs=0.2)
    # The flood backs the standard tier up: its tenants are backlogged together.
    assert summary["fairness"]["tiers"]["standard"]["judged_windows"] >= 1
    assert "## Tenants" in (out / "report.md").read_text()
    assert (out / "figures" / "victim-ttft.png").is_file()
    lengths = json.loads((out / "lengths.json").read_text())["lengths"]
    assert lengths["victim"]["/v1/chat/completions"]["output_tokens"]["kind"] == "empirical"

    html = out / "report.html"
    page = html.read_text()
    assert page.index("id='headline'") < page.index("id='chart-victim-ttft'")
    # The victim's TTFT (no baseline here: this run alone) is the first plot, on the first
    # screen, interactive and offline (test_report_in_browser.py's checks).
    shot = asyncio.run(check_report_page(html, tmp_path, "victim-ttft"))
    assert png_size(shot) == (1400, 900)
