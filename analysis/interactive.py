"""The report's charts (analysis/series.py) as interactive HTML: values on hover, a tenant
(or run, or tier) shown or hidden by clicking its legend entry, zoom and pan.

Bokeh, with its core JavaScript inlined (``Resources(mode="inline")``): report.html opens offline,
from a file, with no CDN. Bokeh over plotly for size and load time: four charts of four
tenants make a 1.3 MB page with bokeh against 4.9 MB with plotly.js, and Chromium showed it
sooner (docs/analysis.md, "Interactive plots").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from bokeh.embed import components
from bokeh.model import Model
from bokeh.models import ColumnDataSource, HoverTool, Range1d
from bokeh.models.annotations import BoxAnnotation, Label, Legend, LegendItem, Span
from bokeh.models.renderers import GlyphRenderer
from bokeh.palettes import Category10_10
from bokeh.plotting import figure
from bokeh.resources import Resources

from weighbridge.analysis.series import Chart


@dataclass(frozen=True)
class Rendered:
    """What report.html embeds: the library once, then a script and a div per chart."""

    library: str  # <script> tags with bokeh's JS inlined
    script: str  # the charts' data and their placement
    divs: dict[str, str]  # chart key -> its <div>


def _figure(chart: Chart) -> figure:
    p = figure(height=320, sizing_mode="stretch_width", title=chart.title,
               x_axis_label=chart.x_label, y_axis_label=chart.y_label,
               x_axis_type="log" if chart.x_log else "linear",
               y_axis_type="log" if chart.y_log else "linear",
               tools="pan,box_zoom,wheel_zoom,reset,save", name=chart.key)
    p.toolbar.logo = None
    for i, (name, start, end) in enumerate(chart.phases):
        p.add_layout(BoxAnnotation(left=start, right=end, fill_color="#888888",
                                   fill_alpha=0.08 if i % 2 else 0.16, level="underlay"))
        p.add_layout(Label(x=(start + end) / 2, y=0, y_units="screen", text=name,
                           text_font_size="9pt", text_color="#555555", text_align="center"))
    for x, label in chart.marks:
        p.add_layout(Span(location=x, dimension="height", line_dash="dashed",
                          line_color="#555555"))
        p.add_layout(Label(x=x, y=4, y_units="screen", text=label, text_font_size="8pt",
                           text_color="#555555", x_offset=3))
    if chart.y_range is not None and not chart.y_log:
        p.y_range = Range1d(start=chart.y_range[0], end=chart.y_range[1])
    return p


def figure_of(chart: Chart) -> figure:
    p = _figure(chart)
    colours: dict[str, str] = {}
    items: dict[str, list[GlyphRenderer[Any]]] = {}
    for line in chart.lines:
        colour = colours.setdefault(line.group or line.name,
                                    Category10_10[len(colours) % len(Category10_10)])
        # numpy arrays, not lists: bokeh sends them as typed arrays that keep NaN, which it
        # draws as a gap (a list's None would arrive as 0).
        source = ColumnDataSource({"x": np.asarray(line.x, dtype=np.float64),
                                   "y": np.asarray(line.y, dtype=np.float64),
                                   "name": [line.name] * len(line.x)})
        dash = "dashed" if line.dashed else "solid"
        drawn = (p.step(x="x", y="y", source=source, mode="after", line_color=colour,
                        line_width=2, line_dash=dash) if line.step
                 else p.line(x="x", y="y", source=source, line_color=colour, line_width=2,
                             line_dash=dash))
        items.setdefault(line.group or line.name, []).append(drawn)
    hover = HoverTool(tooltips=[("", "@name"), (chart.x_label, "@x{0,0.[00]}"),
                                (chart.y_label, "@y{0,0.[000]}")],
                      mode="mouse", line_policy="nearest")
    p.add_tools(hover)
    legend = Legend(items=[LegendItem(label=name, renderers=drawn)
                           for name, drawn in items.items()],
                    click_policy="hide", label_text_font_size="9pt")
    p.add_layout(legend, "right")
    return p


def render(charts: Sequence[Chart]) -> Rendered:
    figures: dict[str, Model] = {c.key: figure_of(c) for c in charts}
    script, divs = components(figures)
    # Bokeh's core library alone: these charts use no widgets, tables, WebGL or MathJax
    # (INLINE would add all of them: 4 MB instead of 1.3).
    library = Resources(mode="inline", components=["bokeh"]).render_js()
    return Rendered(library, script, dict(divs))
