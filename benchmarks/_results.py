"""benchmarks/RESULTS.md: one section per benchmark, rewritten by its latest recorded run.

Sections sit between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` markers so a run of
one benchmark leaves the others' sections (and any hand-written text outside them) alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import _system
from benchmarks._core import PACKAGE_DIR, Benchmark, BenchResult

RESULTS_PATH = PACKAGE_DIR / "RESULTS.md"

HEADER = """# Benchmark results

Written by `python -m benchmarks` (`make bench`); each section below is rewritten by the latest
full run of its benchmark (`--quick` runs are not recorded). The machines are shared and noisy,
so every figure is reported as a ratio against a baseline measured in the same run, with the
raw numbers beside it for context. Issue 2, section 5 sets the targets.
"""


def render(bench: Benchmark, result: BenchResult, *, date: str, command: str,
           machine: str) -> str:
    verdict = {True: "target met", False: "TARGET MISSED", None: "comparison"}[result.passed]
    parts = [
        f"## {bench.name}: {bench.title}",
        "",
        f"- date: {date}",
        f"- command: `{command}`",
        f"- machine: {machine}",
        *[f"- {line}" for line in result.setup],
        f"- verdict: **{verdict}**",
        "",
        *[f"{line}  " if not line.endswith("  ") else line for line in result.summary],
        "",
    ]
    for table in result.tables:
        parts += [table.markdown(), ""]
    if result.notes:
        parts += ["Notes:", "", *[f"- {n}" for n in result.notes], ""]
    body = "\n".join(parts).rstrip() + "\n"
    return f"<!-- bench:{bench.name} -->\n{body}<!-- /bench:{bench.name} -->\n"


def write_section(name: str, section: str, path: Path = RESULTS_PATH) -> None:
    text = path.read_text() if path.exists() else HEADER
    key = re.escape(name)
    pattern = re.compile(rf"<!-- bench:{key} -->\n.*?<!-- /bench:{key} -->\n", re.DOTALL)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section, text, count=1)
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


@dataclass
class StandaloneRun:
    """A benchmark module run on its own (``python -m benchmarks.NAME ...``, not through
    ``python -m benchmarks``): when it started and the load then, for its record. Create it
    before the measurement, ``section`` or ``record`` after."""

    command: Sequence[str]  # the command line as the record shows it
    date: str = field(default_factory=_now)
    load_before: str = field(default_factory=_system.load_average)

    def section(self, bench: Benchmark, result: BenchResult) -> str:
        machine = (f"{_system.machine_note()}; load average (1, 5, 15 min) "
                   f"{self.load_before} before, {_system.load_average()} after")
        return render(bench, result, date=self.date, command=shlex.join(self.command),
                      machine=machine)

    def record(self, bench: Benchmark, result: BenchResult) -> None:
        write_section(bench.name, self.section(bench, result))

    def finish(self, bench: Benchmark, result: BenchResult, record: bool) -> None:
        """Print the result's summary and tables; with ``record``, write its section."""
        print("\n".join(result.summary) + "\n")
        for table in result.tables:
            print(table.markdown() + "\n")
        if record:
            self.record(bench, result)


def standalone_main(module: str, bench: Benchmark,
                    run_all: Callable[[Callable[[str], None]], BenchResult],
                    description: str, argv: list[str] | None = None) -> int:
    """``python -m benchmarks.<module> [--record]`` for a benchmark with no options of its
    own: runs it with its progress on stderr, prints the result, and with ``--record``
    writes its section of RESULTS.md."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{module}",
                                     description=description)
    parser.add_argument("--record", action="store_true",
                        help="write the result into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    standalone = StandaloneRun(["python", "-m", f"benchmarks.{module}", *argv])
    result = run_all(lambda line: print(line, file=sys.stderr, flush=True))
    standalone.finish(bench, result, args.record)
    return 0
