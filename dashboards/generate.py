"""Render the dashboard definitions to the JSON files committed in ``dashboards/json/``
(what Grafana's file provisioning and ``weighbridge dashboards push`` read).

The output is deterministic (sorted keys, fixed indentation, trailing newline), so a test
can compare the committed files byte for byte with a fresh rendering.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from weighbridge.dashboards.backends import BACKENDS
from weighbridge.dashboards.model import Dashboard
from weighbridge.dashboards.queueing import QUEUEING
from weighbridge.dashboards.tenants import TENANTS
from weighbridge.dashboards.tiers import TIERS

__all__ = ["DASHBOARDS", "JSON_DIR", "file_name", "load", "render", "stale_files", "write"]

DASHBOARDS: tuple[Dashboard, ...] = (TENANTS, TIERS, BACKENDS, QUEUEING)
JSON_DIR = Path(__file__).resolve().parent / "json"


def file_name(dashboard: Dashboard) -> str:
    return f"{dashboard.uid.removeprefix('weighbridge-')}.json"


def render(dashboard: Dashboard) -> str:
    return json.dumps(dashboard.to_json(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def write(out_dir: Path = JSON_DIR) -> list[Path]:
    """Write every dashboard's JSON into ``out_dir``; the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for dashboard in DASHBOARDS:
        path = out_dir / file_name(dashboard)
        path.write_text(render(dashboard), encoding="utf-8")
        written.append(path)
    return written


def stale_files(out_dir: Path = JSON_DIR) -> list[Path]:
    """Files in ``out_dir`` that differ from a fresh rendering (or are missing)."""
    return [out_dir / file_name(d) for d in DASHBOARDS
            if not (out_dir / file_name(d)).is_file()
            or (out_dir / file_name(d)).read_text(encoding="utf-8") != render(d)]


def load(path: Path) -> dict[str, Any]:
    """A dashboard JSON file, as Grafana's API takes it."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict) or "uid" not in data or "panels" not in data:
        raise ValueError(f"{path}: not a Grafana dashboard (no uid or panels)")
    return data
