"""Exporters: the load generator's Prometheus metrics and the queueing-theory checks behind
them (Little's Law, per-tenant token share and Jain's index, offered load against served
throughput). The computations are pure modules; ``weighbridge.exporters.loadgen`` wires them to
``prometheus_client``.

The surface (``__all__``) is what the load generator's Locust plugin serves,
``LoadgenExporter``, read from its module on first use (``weighbridge.surface``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.surface import surface

if TYPE_CHECKING:
    from weighbridge.exporters.loadgen import LoadgenExporter
else:
    __getattr__, __dir__ = surface(__name__, {"loadgen": ("LoadgenExporter",)})

__all__ = ["LoadgenExporter"]
