"""``weighbridge demo`` end to end, as a user runs it: a subprocess that starts two emulated
engines, the sidecar (and Prometheus when installed), runs noisy_neighbour through the
request-level baseline and through weighbridge, and writes the report.

Acceptance 1 of issue 7: the files are there and the weighbridge run's victim TTFT ratio
(flood / quiet p99) is better than the baseline's. And Ctrl-C mid-run leaves no child
process behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from weighbridge.rundir import read_run_info

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[3]


def demo_argv(out: Path) -> list[str]:
    return [sys.executable, "-m", "weighbridge", "demo", "--quick", "--out", str(out)]


@pytest.mark.timeout(180)
def test_quick_demo_writes_the_report_and_weighbridge_protects_the_victim(
        tmp_path: Path) -> None:
    out = tmp_path / "demo"
    started = time.monotonic()
    done = subprocess.run(demo_argv(out), cwd=REPO, capture_output=True, text=True,
                          timeout=170, env={**os.environ, "COLUMNS": "120"})
    took = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    print(f"\nweighbridge demo --quick took {took:.0f} s\n{done.stdout[-2500:]}")

    for arm in ("baseline", "weighbridge"):
        assert (out / arm / "requests.parquet").is_file()
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
def test_ctrl_c_during_the_demo_stops_every_child(tmp_path: Path) -> None:
    out = tmp_path / "demo"
    # Its own process group, as a shell's foreground job: Ctrl-C signals the whole group.
    # A foreground job also has Ctrl-C's default action, whatever this test inherited: a
    # runner started in the background of a script ignores SIGINT, children inherit that,
    # and Python then never raises KeyboardInterrupt (the demo ran on to its end).
    demo = subprocess.Popen(demo_argv(out), cwd=REPO, stdout=subprocess.PIPE,
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
