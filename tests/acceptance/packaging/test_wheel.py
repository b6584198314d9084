"""The wheel works outside the checkout: built from this checkout, installed into a fresh
venv in a temporary directory, it finds its scenarios, deployment files and dashboards as
package data, runs ``weighbridge demo --quick``, and Locust runs a headless steady scenario
from the installed scenarios.

Lean on purpose: the wheel goes in with ``--no-deps`` and the venv reads the third-party
packages of this environment through a path file (which puts only that site-packages
directory on sys.path: its own path files, among them the editable install's finder, are
not processed). So weighbridge itself comes from the wheel alone, and the checkout is on
no path: the first test checks both. Resolving the dependencies is what `make` does for
`.[dev]` (which includes `weighbridge[all]`) and what test_sidecar_only.py does for the
sidecar extra.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from weighbridge.launch import ServerProcess, free_port
from weighbridge.rundir import REQUESTS_PARQUET, read_run_info

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]

WHERE = """
import json, weighbridge, weighbridge.prometheus as p, weighbridge.resources as r
from weighbridge.dashboards.generate import JSON_DIR
from weighbridge.stack import DEFAULT_STACK
print(json.dumps({"package": weighbridge.__file__, "scenarios": str(r.SCENARIOS_DIR),
                  "deploy": str(r.DEPLOY_DIR), "rules": [str(f) for f in p.rule_files()],
                  "stack": str(DEFAULT_STACK), "dashboards": str(JSON_DIR)}))
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    venv = tmp_path_factory.mktemp("installed") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "--no-compile",
                    "--no-deps", str(wheel)], check=True, timeout=300)
    (own,) = Path(subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True, text=True, check=True).stdout.strip()),
    (own / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return venv


def _run(argv: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          env={**env, "COLUMNS": "120"})


def _where(venv: Path, cwd: Path) -> dict[str, object]:
    done = _run([str(venv / "bin" / "python"), "-c", WHERE], cwd, 60)
    assert done.returncode == 0, done.stderr
    where: dict[str, object] = json.loads(done.stdout)
    return where


def test_the_installed_package_finds_its_files_in_the_venv(venv: Path, tmp_path: Path) -> None:
    where = _where(venv, tmp_path)
    for key in ("package", "scenarios", "deploy", "stack", "dashboards"):
        assert Path(str(where[key])).is_relative_to(venv), (key, where[key])
        assert not Path(str(where[key])).is_relative_to(REPO), (key, where[key])
        assert Path(str(where[key])).exists(), (key, where[key])
    rules = [Path(r) for r in where["rules"]]  # type: ignore[attr-defined]
    assert {r.name for r in rules} == {"sidecar.yml", "loadgen.yml"}
    assert (Path(str(where["scenarios"])) / "tenants" / "steady.yaml").is_file()
    # The shipped dashboards are the ones the installed definitions render.
    check = _run([str(venv / "bin" / "weighbridge"), "dashboards", "generate", "--check"],
                 tmp_path, 60)
    assert check.returncode == 0, check.stderr


@pytest.mark.timeout(240)
def test_quick_demo_from_the_installed_wheel(venv: Path, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    done = _run([str(venv / "bin" / "weighbridge"), "demo", "--quick", "--prometheus", "off",
                 "--out", str(out)], tmp_path, 230)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for arm in ("baseline", "weighbridge"):
        assert (out / arm / REQUESTS_PARQUET).is_file()
    assert json.loads((out / "summary.json").read_text())["demo"]["quick"] is True


@pytest.mark.timeout(120)
def test_headless_locust_steady_from_the_installed_scenarios(
        venv: Path, tmp_path: Path) -> None:
    python = str(venv / "bin" / "python")
    scenarios = Path(str(_where(venv, tmp_path)["scenarios"]))
    port = free_port()
    # The emulator from the installed package too (its log in tmp_path).
    with ServerProcess("emulator", [python, "-m", "weighbridge", "emulator", "--port",
                                    str(port)], f"http://127.0.0.1:{port}",
                       log_path=tmp_path / "emulator.log"):
        records = tmp_path / "steady"
        done = _run([python, "-m", "locust", "-f", f"{scenarios}/", "--headless",
                     "--scenario", "steady", "--host", f"http://127.0.0.1:{port}",
                     "-t", "5s", "--records-dir", str(records), "--only-summary"],
                    tmp_path, 90)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (records / REQUESTS_PARQUET).is_file()
    assert read_run_info(records).scenario == "steady"
