"""``weighbridge report``: read a run (and optionally a baseline), compute, write the chosen
formats, evaluate ``--check`` gates. The CLI only parses flags into a :class:`ReportRequest`."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from weighbridge.analysis.compare import compare, comparison_json
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.gate import Check, Verdict, evaluate
from weighbridge.analysis.headline import headline
from weighbridge.analysis.lengths import length_histograms
from weighbridge.analysis.render import to_html, to_markdown, to_terminal
from weighbridge.analysis.series import charts
from weighbridge.analysis.summary import (
    DEFAULT_BACKLOG_FRACTION,
    DEFAULT_WINDOW_S,
    Analysis,
    analyse,
    summary,
)
from weighbridge.analysis.tables import report_tables

FORMATS = ("text", "md", "html", "json")
SUMMARY_JSON = "summary.json"
LENGTHS_JSON = "lengths.json"
REPORT_MD = "report.md"
REPORT_HTML = "report.html"
FIGURES_DIR = "figures"  # report.md's PNGs, one per chart: figures/<chart key>.png


@dataclass(frozen=True)
class ReportRequest:
    run_dir: Path
    baseline_dir: Path | None = None
    out_dir: Path | None = None  # default: RUN_DIR/report
    formats: tuple[str, ...] = FORMATS
    window_s: float = DEFAULT_WINDOW_S
    backlog_fraction: float = DEFAULT_BACKLOG_FRACTION
    checks: Sequence[Check] = ()

    def __post_init__(self) -> None:
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            raise ValueError(f"format: unknown {', '.join(unknown) or '(none given)'}; "
                             f"choose from {', '.join(FORMATS)}")
        if self.window_s <= 0:
            raise ValueError(f"window: must be positive, got {self.window_s:g} s")
        if not 0 < self.backlog_fraction <= 1:
            raise ValueError(f"backlog-fraction: must be in (0, 1], got {self.backlog_fraction}")

    @property
    def out(self) -> Path:
        return self.out_dir if self.out_dir is not None else self.run_dir / "report"


@dataclass
class ReportResult:
    summary: dict[str, Any]
    written: list[Path] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)


def _analyse(path: Path, request: ReportRequest, progress: Progress) -> Analysis:
    run = load_run(path, progress)
    task = progress.add_task(f"analysing {run.records:,} records of {path.name}", total=None)
    analysis = analyse(run, request.window_s, request.backlog_fraction)
    progress.update(task, total=1, completed=1)
    return analysis


def make_report(request: ReportRequest, console: Console) -> ReportResult:
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                        console=Console(stderr=True), transient=True)
    with progress:
        analysis = _analyse(request.run_dir, request, progress)
        this = summary(analysis)
        rows = baseline_id = base_analysis = base = None
        if request.baseline_dir is not None:
            base_analysis = _analyse(request.baseline_dir, request, progress)
            base = summary(base_analysis)
            rows = compare(this, base)
            baseline_id = base["run"]["run_id"]
            this["baseline"] = comparison_json(base, rows)
        # The gates are the first thing the report says, so they are judged before it is
        # written.
        result = ReportResult(this, verdicts=[evaluate(c, this) for c in request.checks])
        head = headline(this, base, result.verdicts)
        tables = report_tables(this, rows, baseline_id)
        title = f"weighbridge report: {this['run']['scenario']} ({this['run']['run_id']})"
        out = request.out
        if set(request.formats) - {"text"}:
            out.mkdir(parents=True, exist_ok=True)
        if "json" in request.formats:
            result.written.append(_write(out / SUMMARY_JSON, json.dumps(this, indent=2)))
            lengths = {"run_id": this["run"]["run_id"],
                       "lengths": length_histograms(analysis.run.frame)}
            result.written.append(_write(out / LENGTHS_JSON, json.dumps(lengths, indent=2)))
        drawn = charts(analysis, base_analysis) if {"md", "html"} & set(request.formats) \
            else []
        if "md" in request.formats:
            from weighbridge.analysis import plots  # matplotlib: imported only when a format draws

            task = progress.add_task("plotting PNGs", total=len(drawn))
            images = []
            (out / FIGURES_DIR).mkdir(exist_ok=True)
            for chart in drawn:
                path = out / FIGURES_DIR / f"{chart.key}.png"
                path.write_bytes(plots.png(chart))
                result.written.append(path)
                images.append((chart, f"{FIGURES_DIR}/{path.name}"))
                progress.advance(task)
            result.written.append(_write(out / REPORT_MD,
                                         to_markdown(title, head, tables, images)))
        if "html" in request.formats:
            from weighbridge.analysis import (
                interactive,  # bokeh: likewise (a --check gate needs neither)
            )

            task = progress.add_task("plotting interactive charts", total=None)
            rendered = interactive.render(drawn)
            progress.update(task, total=1, completed=1)
            result.written.append(_write(out / REPORT_HTML,
                                         to_html(title, head, tables, drawn, rendered)))
    if "text" in request.formats:
        to_terminal(head, tables, console)
    return result


def _write(path: Path, text: str) -> Path:
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_window(text: str) -> float:
    """``10s``, ``500ms``, ``2m``, ``1h`` or plain seconds, as seconds."""
    raw = text.strip().lower()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if raw.endswith(unit):
            number, scale = raw[: -len(unit)], _UNITS[unit]
            break
    else:
        number, scale = raw, 1.0
    try:
        seconds = float(number) * scale
    except ValueError:
        raise ValueError(f"window: {text!r} is not a duration (e.g. 10s, 500ms, 2m)") from None
    if not seconds > 0:
        raise ValueError(f"window: must be positive, got {text!r}")
    return seconds
