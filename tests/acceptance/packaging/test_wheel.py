"""The wheel works outside the checkout: built from this checkout, installed into a fresh
venv in a temporary directory, it finds its scenarios, deployment files and dashboards as
package data, runs ``weighbridge demo --quick``, and Locust runs a headless steady scenario
from the installed scenarios.

The demo runs here, once, as a user runs it from an install: it starts two emulated
engines, the sidecar (and Prometheus when installed), runs noisy_neighbour through the
request-level baseline and through weighbridge, and writes the report; the weighbridge
run's victim TTFT ratio (flood / quiet p99) is better than the baseline's (acceptance 1 of
issue 7). And Ctrl-C mid-run leaves no child process behind.

Lean on purpose: the wheel goes in with ``--no-deps`` and the venv reads the third-party
packages of this environment through a path file (which puts only that site-packages
directory on sys.path: its own path files, among them the editable install's finder, are
not processed). So weighbridge itself comes from the wheel alone, and the checkout is on
no path: the first test checks both. Resolving the dependencies is what `make` does for
`.[dev]` (which includes `weighbridge[all]`) and what test_sidecar_only.py does for the
sidecar extra.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import psutil
import pytest

from weighbridge.launch import ServerProcess, free_port
from weighbridge.rundir import REQUESTS_PARQUET, read_run_info

REPO = Path(__file__).resolve().parents[3]

WHERE = """
import json, weighbridge, weighbridge.prometheus as p, weighbridge.resources as r
from weighbridge.dashboards.generate import JSON_DIR
from weighbridge.app.stack import DEFAULT_STACK
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


def _env() -> dict[str, str]:
    """This environment without what would put the checkout's packages on the path."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    return {**env, "COLUMNS": "120"}


def _run(argv: list[str], cwd: Path, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout_s,
                          env=_env())


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
    started = time.monotonic()
    done = _run([str(venv / "bin" / "weighbridge"), "demo", "--quick", "--out", str(out)],
                tmp_path, 230)
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(f"\nweighbridge demo --quick took {took:.0f} s\n{done.stdout[-2500:]}")

    for arm in ("baseline", "weighbridge"):
        assert (out / arm / REQUESTS_PARQUET).is_file()
        info = read_run_info(out / arm)
        assert info.scenario == "noisy_neighbour"
        assert [p.name for p in info.phases] == ["quiet", "flood", "recovery"]
    html = (out / "report.html").read_text()
    # The answer first (issue 18), and the README's picture beside report.md.
    assert html.index("id='headline'") < html.index("id='chart-victim-ttft'")
    assert (out / "figures" / "victim-ttft.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((out / "summary.json").read_text())
    # The report's own summary (the weighbridge run, the baseline beside it) ...
    assert summary["run"]["run_id"] == "demo-weighbridge"
    assert summary["baseline"]["run"]["run_id"] == "demo-baseline"
    # ... and the demo's headline of both arms.
    demo = summary["demo"]
    assert demo["quick"] is True
    base, fair = demo["baseline"], demo["weighbridge"]
    for head in (base, fair):
        assert head["victim"] == "victim"
        assert head["tier1"] == "interactive"
        assert head["served_tokens_per_s"] > 0
        assert head["victim_quiet_ttft_p99_s"] > 0
    # Every victim request got its first token in both runs (a starved request would have
    # none and drop out of the p99): the flood's backlog drains within the run.
    for arm in ("baseline", "weighbridge"):
        by_status = json.loads((out / "summary.json").read_text())["demo"][arm]
        assert by_status["victim_flood_ttft_p99_s"] is not None
    assert fair["victim_ttft_ratio"] < base["victim_ttft_ratio"]
    # Not by a hair: the baseline queues the victim behind the flood (seconds), weighbridge
    # serves it first (tens of milliseconds on top of the quiet phase).
    assert fair["victim_ttft_ratio"] * 3 < base["victim_ttft_ratio"]
    assert "flood / quiet" in done.stdout


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


def descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def alive(proc: psutil.Process) -> bool:
    """Still there (the same process, not a reused pid) and not a zombie awaiting reaping."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(120)
def test_ctrl_c_during_the_demo_stops_every_child(venv: Path, tmp_path: Path) -> None:
    out = tmp_path / "demo"
    # Its own process group, as a shell's foreground job: Ctrl-C signals the whole group.
    # A foreground job also has Ctrl-C's default action, whatever this test inherited: a
    # runner started in the background of a script ignores SIGINT, children inherit that,
    # and Python then never raises KeyboardInterrupt (the demo ran on to its end).
    demo = subprocess.Popen([str(venv / "bin" / "weighbridge"), "demo", "--quick", "--out",
                             str(out)], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    children: list[psutil.Process] = []
    try:
        # Wait until the stack runs and the load generator has started its run.
        deadline = time.monotonic() + 60
        while not (out / "baseline" / "run.json").is_file():
            assert demo.poll() is None, demo.communicate(timeout=5)
            assert time.monotonic() < deadline, "the demo never started its first run"
            time.sleep(0.2)
        # Mid-flight: two engines, the sidecar and Locust at least (Prometheus too when
        # installed) are running.
        while True:
            children = descendants(demo.pid)
            names = " ".join(" ".join(p.cmdline()) for p in children if alive(p))
            if (names.count(" emulator ") == 2 and " sidecar " in names
                    and "locust" in names):
                break
            assert demo.poll() is None, demo.communicate(timeout=5)
            assert time.monotonic() < deadline, f"the stack never ran whole: {names}"
            time.sleep(0.2)
        os.killpg(demo.pid, signal.SIGINT)
        _, stderr = demo.communicate(timeout=60)
    finally:
        if demo.poll() is None:
            # The demo did not stop in time: kill it and what it started (its servers run
            # in sessions of their own), so that a failure here does not load the tests
            # after it.
            children = [*children, *descendants(demo.pid)]
            os.killpg(demo.pid, signal.SIGKILL)
            demo.wait()
            for child in children:
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
    assert demo.returncode == 130, stderr.decode()[-2000:]
    assert b"interrupted" in stderr
    deadline = time.monotonic() + 10
    while (left := [p for p in children if alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, [" ".join(p.cmdline()) for p in left]
