"""The report's layouts: a rich terminal view, Markdown, and one self-contained HTML file
(figures embedded as base64 PNG, no external resources)."""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable, Mapping

from rich import box
from rich.console import Console
from rich.table import Table as RichTable

from analysis.tables import Table


def to_terminal(tables: Iterable[Table], console: Console) -> None:
    for t in tables:
        rich = RichTable(title=t.title, box=box.SIMPLE_HEAD, title_justify="left",
                         show_header=any(t.columns), header_style="bold",
                         caption="\n".join(t.notes) or None,
                         caption_justify="left")
        for i, column in enumerate(t.columns):
            rich.add_column(column, justify="left" if i == 0 else "right",
                            overflow="fold")
        for row in t.rows:
            rich.add_row(*row)
        console.print(rich)


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(title: str, tables: Iterable[Table]) -> str:
    lines = [f"# {title}", ""]
    for t in tables:
        lines += [f"## {t.title}", ""]
        columns = t.columns if any(t.columns) else ("", "")
        lines.append("| " + " | ".join(_md_cell(c) for c in columns) + " |")
        lines.append("|" + "|".join(":--" if i == 0 else "--:" for i in range(len(columns)))
                     + "|")
        lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in t.rows]
        lines.append("")
        lines += [f"{note}  " for note in t.notes]
        if t.notes:
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; }
table { border-collapse: collapse; margin: 8px 0 4px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
p.note { font-size: 12px; color: #555; margin: 2px 0 16px; }
img { max-width: 100%; display: block; margin: 8px 0 24px; }
"""


def to_html(title: str, tables: Iterable[Table], figures: Mapping[str, bytes]) -> str:
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
             f"<style>{_STYLE}</style></head><body><h1>{e(title)}</h1>"]
    for t in tables:
        parts.append(f"<h2>{e(t.title)}</h2><table>")
        if any(t.columns):
            parts.append("<tr>" + "".join(f"<th>{e(c)}</th>" for c in t.columns) + "</tr>")
        parts += ["<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>" for row in t.rows]
        parts.append("</table>")
        parts += [f"<p class='note'>{e(n)}</p>" for n in t.notes]
    if figures:
        parts.append("<h2>Plots</h2>")
    for name, png in figures.items():
        data = base64.b64encode(png).decode("ascii")
        parts.append(f"<h3>{e(name)}</h3><img alt='{e(name)}' "
                     f"src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
