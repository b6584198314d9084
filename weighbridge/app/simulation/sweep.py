"""``--sweep KEY=V1,V2,...``: one stack or sidecar value varied over a list, and the page
that plots the chosen figures against it.

KEY is a dotted path into the stack file (``engines.count``, ``engines.emulator.max_num_seqs``)
or, when its first part is not a stack section, into the sidecar config
(``admission.headroom_slots`` is ``weighbridge.sidecar.admission.headroom_slots``). Values are YAML
scalars (``4``, ``0.5``, ``drr``, ``null``).
"""

from __future__ import annotations

import base64
import html
import io
import math
from dataclasses import dataclass
from typing import Any, cast

import yaml

from weighbridge.app.stack import StackSpec, parse_stack

__all__ = ["Sweep", "apply", "parse_sweep", "sweep_html"]


@dataclass(frozen=True)
class Sweep:
    key: str  # as given
    path: tuple[str, ...]  # in the stack file
    values: tuple[Any, ...]

    def label(self, value: Any) -> str:
        return f"{self.key}={value}"


def parse_sweep(text: str) -> Sweep:
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or not raw.strip():
        raise ValueError(f"--sweep {text!r}: expected KEY=V1,V2,...")
    values = tuple(yaml.safe_load(v.strip()) for v in raw.split(","))
    parts = tuple(key.split("."))
    if parts[0] not in StackSpec.model_fields:
        parts = ("sidecar", *parts)
    return Sweep(key, parts, values)


def apply(stack: StackSpec, sweep: Sweep, value: Any) -> StackSpec:
    """The stack with the swept value set (validated again, as a stack file would be)."""
    data = stack.model_dump()
    node = data
    for part in sweep.path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise ValueError(f"--sweep {sweep.key}: {part} is not a section")
        node = child
    node[sweep.path[-1]] = value
    return parse_stack(data, source=f"{stack.name} with {sweep.label(value)}")


def _png_data(figure: Any) -> str:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(figure)
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return base64.b64encode(buffer.getvalue()).decode()


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        and math.isfinite(value) else math.nan


def sweep_html(sweep: Sweep, points: dict[str, dict[str, dict[str, Any]]],
               figures: dict[str, str]) -> str:
    """``points``: sweep value label -> policy -> figures. One plot per figure, one line per
    policy, the swept value on the x axis (categorical when the values are not numbers)."""
    from matplotlib.figure import Figure

    labels = list(points)
    values = list(sweep.values)
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)
    xs = [float(v) for v in values] if numeric else list(range(len(values)))
    policies = list(dict.fromkeys(p for runs in points.values() for p in runs))
    parts = [f"<h1>Sweep of {html.escape(sweep.key)}</h1>"]
    for key, title in figures.items():
        fig = Figure(figsize=(7, 3.4))
        ax = fig.add_subplot()
        for policy in policies:
            ys = [_number(points[label].get(policy, {}).get(key)) for label in labels]
            ax.plot(xs, ys, marker="o", label=policy)
        ax.set(xlabel=sweep.key, ylabel=title, title=title)
        ax.set_xticks(xs, [str(v) for v in values])
        # Line2D types its data as any array-like; these lines were drawn from floats.
        seen = [v for line in ax.get_lines() for v in cast("list[float]", line.get_ydata())
                if v > 0]
        if key.endswith("_s") and seen and max(seen) / min(seen) > 50:
            ax.set_yscale("log")  # a flood moves latencies by orders of magnitude
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        parts.append(f'<img alt="{html.escape(title)}" '
                     f'src="data:image/png;base64,{_png_data(fig)}">')
    head = "".join(f"<th>{html.escape(p)}: {html.escape(t)}</th>"
                   for t in figures.values() for p in policies)
    rows = []
    for label, value in zip(labels, values, strict=True):
        cells = "".join(
            f"<td>{_number(points[label].get(p, {}).get(k)):.4g}</td>"
            for k in figures for p in policies)
        rows.append(f"<tr><th>{html.escape(str(value))}</th>{cells}</tr>")
    parts.append(f"<table><tr><th>{html.escape(sweep.key)}</th>{head}</tr>"
                 + "".join(rows) + "</table>")
    style = ("body{font-family:sans-serif;margin:2em}img{display:block;margin:1em 0}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;"
             "text-align:right}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>weighbridge simulate: "
            f"sweep of {html.escape(sweep.key)}</title><style>{style}</style></head><body>"
            + "\n".join(parts) + "</body></html>\n")
