"""Grafana dashboards for weighbridge, defined in Python and rendered to the JSON files in
``dashboards/json/`` (``weighbridge dashboards generate``); docs/dashboards.md describes
them.

The surface (``__all__``) is what ``weighbridge dashboards`` uses: the dashboards, rendering
them to ``JSON_DIR`` and finding stale files, and pushing them to a Grafana. ``push`` itself
(the function) is read from its module, ``weighbridge.dashboards.push``, whose name it shares.
Each name is read from its module on first use (``weighbridge.surface``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.surface import surface

if TYPE_CHECKING:
    from weighbridge.dashboards.generate import DASHBOARDS, JSON_DIR, load, stale_files, write
    from weighbridge.dashboards.push import PushError, connect
else:
    __getattr__, __dir__ = surface(__name__, {
        "generate": ("DASHBOARDS", "JSON_DIR", "load", "stale_files", "write"),
        "push": ("PushError", "connect"),
    })

__all__ = [
    "DASHBOARDS",
    "JSON_DIR",
    "PushError",
    "connect",
    "load",
    "stale_files",
    "write",
]
