"""Several simulated runs from one command: policies side by side, optionally over a sweep.

Layout of ``--out DIR``::

    DIR/<policy>/                 one run directory per policy (no sweep)
    DIR/<key>=<value>/<policy>/   one per sweep value and policy
    DIR/summary.json              the figures of every run (and the ideal bound's)
    DIR/sweep.html                with --sweep: the figures against the swept value
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from weighbridge.analysis.summary import json_safe
from weighbridge.app.simulation.figures import FIGURES, auto_window_s, figures
from weighbridge.app.simulation.ideal import ideal_for
from weighbridge.app.simulation.run import Inputs, run_policy
from weighbridge.app.simulation.sweep import Sweep, apply, sweep_html

__all__ = ["SUMMARY_JSON", "BatchRequest", "run_batch"]

SUMMARY_JSON = "summary.json"
SWEEP_HTML = "sweep.html"


@dataclass(frozen=True)
class BatchRequest:
    inputs: Inputs
    out: Path
    policies: tuple[str | None, ...] = (None,)  # None: the stack's own policy
    sweep: Sweep | None = None
    ideal: bool = False
    window_s: float | None = None  # None: auto_window_s of the run's length


def _point(request: BatchRequest, inputs: Inputs, out: Path,
           note: Callable[[str], None]) -> dict[str, Any]:
    runs: dict[str, Any] = {}
    for policy in request.policies:
        name = policy or "stack"
        outcome = run_policy(inputs, policy, out / name, label=policy)
        result = outcome.result
        window = request.window_s or auto_window_s(result.end_s)
        figs = figures(outcome.run_dir, window)
        figs["simulation"] = {
            "requests": len(result.records), "engine_steps": result.engine_steps,
            "events": result.events, "wall_s": result.wall_s,
            "simulated_s": result.end_s,
            "speedup": result.end_s / result.wall_s if result.wall_s > 0 else None,
        }
        runs[name] = figs
        note(f"{out / name}: {len(result.records):,} requests, {result.end_s:,.0f} s "
             f"simulated in {result.wall_s:.2f} s")
    point: dict[str, Any] = {"runs": runs}
    if request.ideal:
        point["ideal"] = ideal_for(inputs)
    return point


def run_batch(request: BatchRequest, note: Callable[[str], None] = lambda _m: None
              ) -> dict[str, Any]:
    """Run everything the request asks; returns (and writes) the summary."""
    out = request.out
    out.mkdir(parents=True, exist_ok=True)
    summary: dict[str, Any] = {"simulated": True}
    sweep = request.sweep
    if sweep is None:
        summary.update(_point(request, request.inputs, out, note))
    else:
        points: dict[str, Any] = {}
        for value in sweep.values:
            label = sweep.label(value)
            inputs = replace(request.inputs, stack=apply(request.inputs.stack, sweep, value))
            points[label] = {"value": value, **_point(request, inputs, out / label, note)}
        summary["sweep"] = {"key": sweep.key, "values": list(sweep.values), "points": points}
        page = sweep_html(sweep, {label: p["runs"] for label, p in points.items()}, FIGURES)
        (out / SWEEP_HTML).write_text(page)
    (out / SUMMARY_JSON).write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    return summary
