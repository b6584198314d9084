"""A real Prometheus server on loopback for integration tests: a generated configuration
scraping a list of targets (the emulator, the sidecar, later the load generator's
exporters) with the project's rules files loaded, and a small client of its HTTP API.

The binary is Debian's ``prometheus`` package (``.ci/run`` installs it). A missing binary is a
failure with that hint, never a skip. The package also installs a system service; tests never
use it: every server here has its own port, configuration and data directory.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

# The configuration and the child process are production code (the local stack uses them);
# this module re-exports them for the tests and adds the checks and the API client.
from weighbridge.prometheus import (
    INSTALL_HINT,
    RULES_DIR,
    ScrapeTarget,
    binary,
    prometheus_config,
    prometheus_process,
    rule_files,
)

__all__ = [
    "INSTALL_HINT",
    "REPO",
    "RULES_DIR",
    "PrometheusApi",
    "ScrapeTarget",
    "binary",
    "check_config",
    "check_rules",
    "prometheus_config",
    "prometheus_process",
    "rule_files",
]

REPO = Path(__file__).resolve().parents[2]


def check_rules(paths: Sequence[Path]) -> str:
    """``promtool check rules``; raises AssertionError with its output when a file is bad."""
    result = subprocess.run([binary("promtool"), "check", "rules", *map(str, paths)],
                            capture_output=True, text=True, timeout=60, check=False)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise AssertionError(f"promtool check rules failed:\n{output}")
    return output


def check_config(path: Path) -> str:
    result = subprocess.run([binary("promtool"), "check", "config", str(path)],
                            capture_output=True, text=True, timeout=60, check=False)
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise AssertionError(f"promtool check config failed:\n{output}")
    return output


class PrometheusApi:
    """The HTTP API of a running server (``/api/v1``), over httpx."""

    def __init__(self, url: str) -> None:
        self.client = httpx.Client(base_url=url.rstrip("/") + "/api/v1", timeout=10)

    def close(self) -> None:
        self.client.close()

    def _get(self, path: str, **params: Any) -> Any:
        response = self.client.get(path, params=params)
        body = response.json()
        if response.status_code != 200 or body.get("status") != "success":
            raise AssertionError(f"GET {path} {params}: {response.status_code} {body}")
        return body["data"]

    def query(self, expr: str, at_unix_s: float | None = None) -> list[dict[str, Any]]:
        """An instant vector (or scalar) query, now or at ``at_unix_s``: the result list."""
        params: dict[str, Any] = {"query": expr}
        if at_unix_s is not None:
            params["time"] = at_unix_s
        data = self._get("/query", **params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        return list(data["result"])

    def series(self, match: str, window_s: float = 600) -> list[dict[str, str]]:
        """Label sets of the series ``match`` selects seen in the last ``window_s``."""
        now = time.time()
        return list(self._get("/series", **{"match[]": match, "start": now - window_s,
                                            "end": now}))

    def targets(self) -> list[dict[str, Any]]:
        return list(self._get("/targets")["activeTargets"])

    def rule_groups(self) -> list[dict[str, Any]]:
        return list(self._get("/rules")["groups"])

    def wait_until_up(self, jobs: Sequence[str], timeout_s: float = 30) -> None:
        """Every target of ``jobs`` scraped successfully at least once."""
        deadline = time.monotonic() + timeout_s
        while True:
            targets = self.targets()
            up = {t["labels"]["job"] for t in targets if t["health"] == "up"}
            if set(jobs) <= up:
                return
            if time.monotonic() > deadline:
                states = [(t["labels"]["job"], t["health"], t.get("lastError")) for t in targets]
                raise AssertionError(f"targets not up after {timeout_s} s: {states}")
            time.sleep(0.2)

    def wait_for(self, expr: str, timeout_s: float = 30) -> list[dict[str, Any]]:
        """The first non-empty result of ``expr`` (bounded wait)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise AssertionError(f"{expr!r} still empty after {timeout_s} s")
            time.sleep(0.25)

    def wait_past(self, at_unix_s: float, timeout_s: float = 30) -> None:
        """Every target scraped, then every rule group evaluated, after ``at_unix_s``: the
        queries that follow see what the targets showed at that time."""
        deadline = time.monotonic() + timeout_s

        def settled(stamps: list[str], after: float) -> bool:
            return all(_unix_s(s) > after for s in stamps)

        while not settled([t["lastScrape"] for t in self.targets()], at_unix_s):
            if time.monotonic() > deadline:
                raise AssertionError(f"targets not scraped after {at_unix_s} in {timeout_s} s")
            time.sleep(0.2)
        scraped = time.time()
        while not settled([g["lastEvaluation"] for g in self.rule_groups()], scraped):
            if time.monotonic() > deadline:
                raise AssertionError(f"rules not evaluated after {scraped} in {timeout_s} s")
            time.sleep(0.2)


def _unix_s(stamp: str) -> float:
    """Prometheus' RFC 3339 times carry nanoseconds; datetime takes microseconds."""
    match = re.fullmatch(r"([^.]+?)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    if match is None:
        raise ValueError(f"not an RFC 3339 time: {stamp!r}")
    head, frac, zone = match.groups()
    zone = "+00:00" if zone == "Z" else zone
    return datetime.fromisoformat(f"{head}.{(frac or '0')[:6]:0<6}{zone}").timestamp()
