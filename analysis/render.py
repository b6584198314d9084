"""The report's layouts: a rich terminal view, Markdown, and one self-contained HTML file.

All three read top down in the same order: the answer (analysis/headline.py), then the plots
(HTML: interactive; Markdown: PNG files beside it; the terminal has none), then the tables in
their groups, the long comparison with the baseline folded away.
"""

from __future__ import annotations

import html
import re
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table as RichTable

from weighbridge.analysis.headline import Headline
from weighbridge.analysis.series import Chart
from weighbridge.analysis.tables import Table
from weighbridge.analysis.units import DASH

if TYPE_CHECKING:  # bokeh is imported only when report.html is drawn
    from weighbridge.analysis.interactive import Rendered

# An undefined cell: the dash, then why in parentheses (analysis/explain.py).
_WHY = re.compile(rf"^{DASH} \((?P<why>.*)\)$", re.S)


def _check_lines(head: Headline) -> list[tuple[bool, str]]:
    return [(v.passed, v.message.split(" ", 1)[1].strip()) for v in head.checks]


def _head_columns(head: Headline) -> tuple[str, ...]:
    if head.baseline_id is None:
        return ("", "this run")
    return ("", "this run", f"baseline ({head.baseline_id})")


def _head_rows(head: Headline) -> list[tuple[str, ...]]:
    return [(r.label, r.this) if r.baseline is None else (r.label, r.this, r.baseline)
            for r in head.rows]


def to_terminal(head: Headline, tables: Iterable[Table], console: Console) -> None:
    console.print(f"[bold]{head.reading}[/bold]", highlight=False)
    for passed, text in _check_lines(head):
        console.print(f"{'[green]PASS' if passed else '[red]FAIL'}[/] {text}", highlight=False)
    for t in [Table("Headline", _head_columns(head), _head_rows(head)), *tables]:
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


def _md_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    columns = columns if any(columns) else ("", "")
    lines = ["| " + " | ".join(_md_cell(c) for c in columns) + " |",
             "|" + "|".join(":--" if i == 0 else "--:" for i in range(len(columns))) + "|"]
    return lines + ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in rows]


def to_markdown(title: str, head: Headline, tables: Iterable[Table],
                images: Sequence[tuple[Chart, str]] = ()) -> str:
    """``images``: each chart with the path of its PNG, relative to report.md."""
    lines = [f"# {title}", "", f"**{head.reading}**", ""]
    for passed, text in _check_lines(head):
        lines.append(f"- {'✅ PASS' if passed else '❌ FAIL'} `{text}`")
    if head.checks:
        lines.append("")
    lines += [*_md_table(_head_columns(head), _head_rows(head)), ""]
    for chart, path in images:
        lines += [f"![{chart.title}]({path})", ""]
    group = None
    for t in tables:
        if t.group != group:
            group = t.group
            lines += [f"## {group}", ""]
        if t.collapsed:
            lines += [f"<details><summary>{html.escape(t.title)}</summary>", ""]
        elif t.title != group:  # a group of one table is titled once
            lines += [f"### {t.title}", ""]
        lines += [*_md_table(t.columns, t.rows), ""]
        lines += [f"{note}  " for note in t.notes]
        if t.notes:
            lines.append("")
        if t.collapsed:
            lines += ["</details>", ""]
    return "\n".join(lines).rstrip() + "\n"


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 16px 24px; color: #222; }
h1 { font-size: 20px; margin: 0 0 8px; }
h2 { font-size: 17px; margin: 24px 0 6px; border-bottom: 1px solid #ddd; }
h3 { font-size: 14px; margin: 14px 0 4px; }
table { border-collapse: collapse; margin: 6px 0 4px; font-size: 13px; }
th, td { border: 1px solid #ccc; padding: 3px 8px; text-align: right; vertical-align: top; }
th { background: #f0f0f0; } td:first-child, th:first-child { text-align: left; }
span.why { color: #8a5a00; font-size: 11px; }
p.note { font-size: 12px; color: #555; margin: 2px 0 12px; }
section.headline { background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px;
  padding: 8px 14px; margin-bottom: 8px; }
section.headline p.reading { font-size: 17px; font-weight: 600; margin: 4px 0 8px; }
section.headline table { font-size: 14px; margin: 4px 0; }
ul.checks { list-style: none; padding: 0; margin: 4px 0; font-size: 14px; }
li.pass::before { content: "PASS "; color: #1a7f37; font-weight: 700; }
li.fail::before { content: "FAIL "; color: #cf222e; font-weight: 700; }
div.chart { margin: 4px 0 2px; }
details > summary { cursor: pointer; font-weight: 600; margin: 12px 0 4px; }
"""


def _html_cell(text: str) -> str:
    m = _WHY.match(text)
    if m is None:
        return html.escape(text)
    return f"{DASH} <span class='why'>{html.escape(m['why'])}</span>"


def _html_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    parts = ["<table>"]
    if any(columns):
        parts.append("<tr>" + "".join(f"<th>{html.escape(c)}</th>" for c in columns) + "</tr>")
    parts += ["<tr>" + "".join(f"<td>{_html_cell(c)}</td>" for c in row) + "</tr>"
              for row in rows]
    parts.append("</table>")
    return "".join(parts)


def _html_headline(head: Headline) -> str:
    e = html.escape
    parts = ["<section class='headline' id='headline'>",
             f"<p class='reading'>{e(head.reading)}</p>"]
    if head.checks:
        parts.append("<ul class='checks'>" + "".join(
            f"<li class='{'pass' if passed else 'fail'}'><code>{e(text)}</code></li>"
            for passed, text in _check_lines(head)) + "</ul>")
    parts.append(_html_table(_head_columns(head), _head_rows(head)))
    parts.append("</section>")
    return "".join(parts)


def to_html(title: str, head: Headline, tables: Iterable[Table], charts: Sequence[Chart],
            rendered: Rendered | None) -> str:
    e = html.escape
    parts = [f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
             f"<title>{e(title)}</title><style>{_STYLE}</style>"]
    if rendered is not None and charts:
        parts.append(rendered.library)
    parts.append(f"</head><body><h1>{e(title)}</h1>")
    parts.append(_html_headline(head))
    if rendered is not None:
        for chart in charts:
            parts.append(f"<div class='chart' id='chart-{e(chart.key)}'>"
                         f"{rendered.divs[chart.key]}"
                         + (f"<p class='note'>{e(chart.note)}</p>" if chart.note else "")
                         + "</div>")
    group = None
    for t in tables:
        if t.group != group:
            group = t.group
            parts.append(f"<h2>{e(group)}</h2>")
        if t.collapsed:
            parts.append(f"<details><summary>{e(t.title)}</summary>")
        elif t.title != group:
            parts.append(f"<h3>{e(t.title)}</h3>")
        parts.append(_html_table(t.columns, t.rows))
        parts += [f"<p class='note'>{e(n)}</p>" for n in t.notes]
        if t.collapsed:
            parts.append("</details>")
    if rendered is not None and charts:
        parts.append(rendered.script)
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
