"""Analysis of a load-generator run: the fairness report (``weighbridge report``), run
comparison, and the capacity planner (``weighbridge capacity``). Definitions and formulas of
every number: docs/analysis.md.

The surface (``__all__``) is what the application uses: a run loaded as a frame, its summary
and headline, the report and its gates, and the capacity plan. ``summary`` itself (the
function) is read from its module, ``weighbridge.analysis.summary``, whose name it shares.
Each name is read from its module on first use (``weighbridge.surface``), so importing the
headline loads neither matplotlib nor bokeh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.surface import surface

if TYPE_CHECKING:
    from weighbridge.analysis.capacity import capacity_inputs, plan, plan_lines
    from weighbridge.analysis.frame import load_run
    from weighbridge.analysis.gate import parse_check
    from weighbridge.analysis.headline import HeadlineFigures, headline_figures
    from weighbridge.analysis.report import SUMMARY_JSON, ReportRequest, make_report, parse_window
    from weighbridge.analysis.summary import analyse, json_safe
else:
    __getattr__, __dir__ = surface(__name__, {
        "capacity": ("capacity_inputs", "plan", "plan_lines"),
        "frame": ("load_run",),
        "gate": ("parse_check",),
        "headline": ("HeadlineFigures", "headline_figures"),
        "report": ("SUMMARY_JSON", "ReportRequest", "make_report", "parse_window"),
        "summary": ("analyse", "json_safe"),
    })

__all__ = [
    "SUMMARY_JSON",
    "HeadlineFigures",
    "ReportRequest",
    "analyse",
    "capacity_inputs",
    "headline_figures",
    "json_safe",
    "load_run",
    "make_report",
    "parse_check",
    "parse_window",
    "plan",
    "plan_lines",
]
