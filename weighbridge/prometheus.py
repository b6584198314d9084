"""A local Prometheus server as a child process: a generated configuration that scrapes a
list of targets (the sidecar, the engines, the load generator's exporters) with the project's
recording rules loaded.

Used by the local stack (``weighbridge up``, ``weighbridge demo``) and by the integration
tests' real-Prometheus harness. The binary is whatever ``prometheus`` is on PATH (Debian's
``prometheus`` package in CI); every server started here has its own port, configuration and
data directory, never the system service's.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from weighbridge.launch import LaunchError, ServerProcess, free_port
from weighbridge.resources import DEPLOY_DIR

__all__ = [
    "INSTALL_HINT",
    "RULES_DIR",
    "ScrapeTarget",
    "binary",
    "prometheus_config",
    "prometheus_process",
    "rule_files",
]

RULES_DIR = DEPLOY_DIR / "prometheus" / "rules"
INSTALL_HINT = ("install Debian's prometheus package (apt-get install --no-install-recommends "
                "prometheus), as .ci/run does")


def binary(name: str) -> str:
    """Path of ``prometheus`` or ``promtool``; raises LaunchError with a hint when missing."""
    path = shutil.which(name)
    if path is None:
        raise LaunchError(f"{name} not found on PATH: {INSTALL_HINT}")
    return path


@dataclass(frozen=True)
class ScrapeTarget:
    """One job of one target: ``url`` is the server's base URL (``http://host:port``)."""

    job: str
    url: str
    metrics_path: str = "/metrics"

    @property
    def address(self) -> str:
        return httpx.URL(self.url).netloc.decode()


def rule_files(directory: Path = RULES_DIR) -> list[Path]:
    """Every rules file the project ships (the sidecar's, the load generator's, ...)."""
    return sorted(directory.glob("*.yml"))


def prometheus_config(targets: Sequence[ScrapeTarget], rules: Sequence[Path],
                      interval_s: float = 1.0) -> dict[str, Any]:
    """The configuration: every target scraped and every rule evaluated each ``interval_s``;
    one job per distinct ``job`` name, in the order given."""
    interval = f"{int(interval_s * 1000)}ms"
    jobs: dict[tuple[str, str], list[str]] = {}
    for target in targets:
        jobs.setdefault((target.job, target.metrics_path), []).append(target.address)
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval,
                   "scrape_timeout": interval},
        "rule_files": [str(p) for p in rules],
        "scrape_configs": [
            {"job_name": job, "metrics_path": path,
             "static_configs": [{"targets": addresses}]}
            for (job, path), addresses in jobs.items()
        ],
    }


def prometheus_process(targets: Sequence[ScrapeTarget], rules: Sequence[Path] = (),
                       interval_s: float = 1.0, directory: Path | None = None,
                       port: int | None = None, host: str = "127.0.0.1") -> ServerProcess:
    """A Prometheus child with its own configuration and data directory in ``directory``."""
    executable = binary("prometheus")
    port = port or free_port(host)
    directory = Path(directory or tempfile.mkdtemp(prefix="weighbridge-prometheus-"))
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "prometheus.yml"
    config.write_text(yaml.safe_dump(prometheus_config(targets, rules, interval_s),
                                     sort_keys=False))
    argv = [executable, f"--config.file={config}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address={host}:{port}",
            "--storage.tsdb.retention.time=1h", "--log.level=warn"]
    return ServerProcess(name="prometheus", argv=argv, url=f"http://{host}:{port}",
                         health_path="/-/ready", log_path=directory / "prometheus.log")
