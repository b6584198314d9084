"""One headless load-generator run (``locust -f scenarios/ --headless``) as a child process.

The demo and the scheduling-quality benchmark send a scenario through a running stack and
read the run directory it leaves. Locust runs in its own process group so that a Ctrl-C
reaches only the parent, which then stops the whole group: nothing outlives the caller.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from weighbridge.launch import log_tail
from weighbridge.loadgen.scenario import discover_scenarios
from weighbridge.resources import SCENARIOS_DIR
from weighbridge.rundir import REQUESTS_PARQUET

__all__ = ["LoadRun", "LoadRunError", "scenario_duration_s"]

_FINISH_GRACE_S = 60.0  # after the scenario's end: in-flight requests, merging the records


class LoadRunError(RuntimeError):
    """The load generator failed, or left no records."""


def scenario_duration_s(name: str, stretch: float = 1.0, tenants_file: Path | None = None,
                        scenarios_dir: Path = SCENARIOS_DIR) -> float:
    """How long scenario ``name`` runs (its phases, stretched); raises ValueError when it
    is unknown or open-ended."""
    # The locustfile is not a scenario and importing it would load Locust (and gevent's
    # monkey-patching) into this process.
    scenarios = discover_scenarios(scenarios_dir, exclude=(scenarios_dir / "locustfile.py",))
    if name not in scenarios:
        raise ValueError(f"scenario: unknown {name!r}; known: {', '.join(sorted(scenarios))}")
    end = scenarios[name].workload(tenants_file=tenants_file, stretch=stretch).end_s
    if not math.isfinite(end):
        raise ValueError(f"scenario {name!r} has an open-ended last phase; it needs -t")
    return end


@dataclass
class LoadRun:
    """``locust`` sending ``scenario`` to ``host``, records into ``run_dir``."""

    scenario: str
    host: str
    run_dir: Path
    log_path: Path
    run_id: str | None = None
    tenants_file: Path | None = None
    stretch: float = 1.0
    scale: float = 1.0
    seed: int = 0
    exporter_port: int = 0  # 0: no per-tenant exporter

    def argv(self) -> list[str]:
        argv = [sys.executable, "-m", "locust", "-f", str(SCENARIOS_DIR) + "/", "--headless",
                "--scenario", self.scenario, "--host", self.host,
                "--records-dir", str(self.run_dir), "--stretch", repr(self.stretch),
                "--scale", repr(self.scale), "--seed", str(self.seed),
                "--exporter-port", str(self.exporter_port), "--only-summary",
                "--loglevel", "WARNING"]
        if self.run_id:
            argv += ["--run-id", self.run_id]
        if self.tenants_file is not None:
            argv += ["--tenants-file", str(self.tenants_file)]
        return argv

    def duration_s(self) -> float:
        return scenario_duration_s(self.scenario, self.stretch, self.tenants_file)

    def run(self, on_tick: Callable[[float], None] | None = None,
            tick_s: float = 0.25) -> Path:
        """Run to the scenario's end; ``on_tick(elapsed_s)`` while it runs. Returns the run
        directory. Whatever happens (an exception, Ctrl-C), the child is gone on return."""
        deadline_s = self.duration_s() + _FINISH_GRACE_S
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.argv()) + "\n").encode())
            log.flush()
            proc = subprocess.Popen(self.argv(), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            try:
                while proc.poll() is None:
                    elapsed = time.monotonic() - started
                    if elapsed > deadline_s:
                        raise LoadRunError(
                            f"locust still running {elapsed:.0f} s after it started "
                            f"(scenario {self.scenario}); log {self.log_path}")
                    if on_tick is not None:
                        on_tick(elapsed)
                    time.sleep(tick_s)
            finally:
                _stop_group(proc)
        # Locust exits 1 when any request failed, which a flood through the sidecar does on
        # purpose (queue_full rejections): the records decide, not the status.
        if proc.returncode not in (0, 1) or not (self.run_dir / REQUESTS_PARQUET).is_file():
            raise LoadRunError(
                f"locust exited with status {proc.returncode} and "
                f"{'no' if not (self.run_dir / REQUESTS_PARQUET).is_file() else 'a'} "
                f"{REQUESTS_PARQUET}; log {self.log_path}:\n{log_tail(self.log_path)}")
        return self.run_dir


def _stop_group(proc: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM to the group (Locust then ends its run), SIGKILL what is left."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
