"""One Locust run of a scenario from scenarios/, as the README runs it: headless, with the
project's records directory and exporter flags. ``argv`` for a run the test drives itself
(``subprocess.Popen``), ``run`` for one that runs to its end, ``run_scraped`` for one that
runs to its end with its exporter read meanwhile, ``process`` for one served in the
background until the test's stack closes."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from tests.support import loopback
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


def run_scraped(argv: list[str], exporter_port: int, until: Callable[[str], bool],
                wait_s: float = 30.0, timeout_s: float = 120.0
                ) -> tuple[subprocess.CompletedProcess[str], str]:
    """Run ``argv`` (from :func:`argv`, with ``exporter_port``) to its end, scraping its
    exporter while it runs: the result and the first exposition ``until`` accepts (the last
    read when none did within ``wait_s``)."""
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        text = ""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and not until(text):
            time.sleep(0.5)
            with contextlib.suppress(httpx.HTTPError):
                text = loopback.get(f"http://127.0.0.1:{exporter_port}/metrics",
                                    timeout=2).text
        stdout, stderr = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr), text
