"""One Locust run of a scenario from scenarios/, as the README runs it: headless, with the
project's records directory and exporter flags. ``argv`` for a run the test drives itself
(``subprocess.Popen``), ``run`` for one that runs to its end, ``process`` for one served in
the background until the test's stack closes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from weighbridge.launch import ServerProcess

REPO = Path(__file__).resolve().parents[2]
LOCUST = Path(sys.executable).with_name("locust")


def argv(host: str, records_dir: Path, duration: str, *extra: str, scenario: str = "steady",
         exporter_port: int = 0) -> list[str]:
    """``locust`` with ``--scenario``, ``-t duration`` (e.g. ``"20s"``), ``--records-dir``
    and ``--exporter-port`` (0: any free port), then ``extra`` flags."""
    return [str(LOCUST), "-f", "scenarios/", "--headless", "--scenario", scenario,
            "--host", host, "-t", duration, "--records-dir", str(records_dir),
            "--exporter-port", str(exporter_port), "--only-summary", *extra]


def run(host: str, records_dir: Path, duration: str, *extra: str, scenario: str = "steady",
        timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """Run to the end (bounded by ``timeout_s``); the caller checks the exit code."""
    return subprocess.run(argv(host, records_dir, duration, *extra, scenario=scenario),
                          cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                          check=False)


def process(host: str, records_dir: Path, duration: str, exporter_port: int, log_path: Path,
            *extra: str, scenario: str = "steady") -> ServerProcess:
    """A run in the background; healthy once its exporter answers on ``exporter_port``
    (the run has started). Enter it as a context (``ExitStack.enter_context``)."""
    return ServerProcess(
        name="locust", url=f"http://127.0.0.1:{exporter_port}", health_path="/metrics",
        argv=argv(host, records_dir, duration, *extra, scenario=scenario,
                  exporter_port=exporter_port),
        cwd=REPO, log_path=log_path)
