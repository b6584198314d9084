"""The multi_model scenario (scenarios/multi_model.py) under Locust, through a sidecar in
front of two emulated models (one with a LoRA adapter), and ``weighbridge report`` on the
run: every request reached an engine serving its model, and the report breaks the figures
down by model (issue 16)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from tests.support.ledger import settled
from tests.support.metrics import scrape
from tests.support.stack import start_emulator, start_sidecar
from weighbridge.app.cli import app
from weighbridge.records import read_parquet
from weighbridge.resources import SCENARIOS_DIR

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[3]


def test_a_multi_model_run_is_reported_by_model(processes: contextlib.ExitStack,
                                                tmp_path: Path) -> None:
    tenants = yaml.safe_load((SCENARIOS_DIR / "tenants" / "multi_model.yaml").read_text())
    a = start_emulator(processes, model_name="model-a", enable_lora=True,
                       lora_modules=["model-a-lora=/adapters/model-a-lora"],
                       max_num_seqs=16, num_kv_blocks=1024)
    b = start_emulator(processes, model_name="model-b", max_num_seqs=16, num_kv_blocks=1024)
    sidecar = start_sidecar(processes, {
        "tenants": {t["name"]: {"tier": t.get("tier", "standard"),
                                "api_keys": [f"plain:{t['api_key']}"],
                                "limits": {"max_queued": 2000}}
                    for t in tenants["tenants"]},
        "backends": [{"url": a.url, "name": "engine-a"}, {"url": b.url, "name": "engine-b"}],
    })
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "locust", "-f", "scenarios/", "--headless",
         "--scenario", "multi_model", "--stretch", "0.3", "--scale", "0.5",
         "--host", sidecar.url, "--records-dir", str(run_dir), "--run-id", "models-it",
         "--exporter-port", "0", "--seed", "3"],
        cwd=REPO, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    settled(sidecar.url, timeout_s=30)

    records = read_parquet(run_dir / "requests.parquet")
    by_model: dict[str | None, list[str]] = {}
    for r in records:
        by_model.setdefault(r.model, []).append(r.status)
    assert set(by_model) == {"model-a", "model-b", "model-a-lora"}
    for model, statuses in by_model.items():
        assert statuses.count("ok") >= 0.9 * len(statuses), (model, statuses)
    # The sidecar counted each model's requests, plus, on model-a, the load generator's one
    # chat probe before the run (it measures the chat template's tokens on the first chat
    # tenant's model: app-a's).
    arrived = scrape(sidecar.url).by("weighbridge_model_requests_arrived_total", "model")
    assert {m: arrived.get(m, 0) for m in by_model} == {
        m: len(statuses) + (m == "model-a") for m, statuses in by_model.items()}

    out = tmp_path / "report"
    result = CliRunner().invoke(app, ["report", str(run_dir), "--out", str(out),
                                      "--check", "models.model-b.ok>=1"])
    assert result.exit_code == 0, result.output
    assert "Models" in result.output
    summary = json.loads((out / "summary.json").read_text())
    models = summary["models"]
    assert set(models) == {"model-a", "model-b", "model-a-lora"}
    for model, statuses in by_model.items():
        assert models[model]["requests"] == len(statuses)
        assert models[model]["ok"] == statuses.count("ok")
    assert sum(m["token_share"] for m in models.values()) == pytest.approx(1.0, abs=1e-6)
    assert "## Models" in (out / "report.md").read_text()
