"""The report's charts (analysis/series.py) as static PNGs, for report.md and the README
(matplotlib's object API, no global pyplot state, so building a report in a server or a test
leaves no figures behind)."""

from __future__ import annotations

import io
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from weighbridge.analysis.series import Chart


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def _shade_phases(ax: Axes, chart: Chart) -> None:
    for i, (name, start, end) in enumerate(chart.phases):
        ax.axvspan(start, end, color="0.85" if i % 2 else "0.93", zorder=0)
        ax.text((start + end) / 2, 1.0, name, ha="center", va="bottom",
                transform=ax.get_xaxis_transform(), fontsize=8, color="0.3")


def png(chart: Chart) -> bytes:
    fig = Figure(figsize=(11, 3.6))
    ax = fig.add_subplot()
    _shade_phases(ax, chart)
    colours: dict[str, Any] = {}
    for line in chart.lines:
        # A group shares its colour (a tenant's share and its entitlement).
        colour = colours.get(line.group)
        dash = "--" if line.dashed else "-"
        if line.step:
            drawn = ax.step(line.x, line.y, where="post", linestyle=dash, label=line.name,
                            color=colour)
        else:
            drawn = ax.plot(line.x, line.y, marker="." if line.x.size < 200 else None,
                            linestyle=dash, label=line.name, color=colour)
        colours.setdefault(line.group, drawn[0].get_color())
    for x, _label in chart.marks:
        ax.axvline(x, linestyle="--", linewidth=1, color="0.4")
    ax.set(xlabel=chart.x_label, ylabel=chart.y_label)
    ax.set_title(chart.title, pad=14 if chart.phases else 6)
    if chart.x_log:
        ax.set_xscale("log")
    if chart.y_log:
        ax.set_yscale("log")
    elif chart.y_range is not None:
        ax.set_ylim(*chart.y_range)
    else:
        ax.set_ylim(bottom=0)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _png(fig)
