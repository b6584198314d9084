"""The bound on an engine's own waiting queue (``max_backend_waiting``) on large engines, in
virtual time (issue 41, point 8): the derived default against the seed's 2-3.

Seed 000 keeps vLLM's waiting queue at 2-3 requests: what waits in the engine is served in
arrival order whatever the sidecar's fairness, so every request queued there is one a
victim may wait behind. The sidecar's derived bound is ``max(2, slots/8)``: 32 on a
256-slot engine. A shorter queue can cost output: when many sequences end in one step, the
engine starts only what is already waiting, and the rest of the freed slots idle until the
sidecar's next dispatch arrives.

Points: 256 slots (and 64, for contrast) x step budget 2,048 / 8,192 x fcfs / priority x a
flood of short (64 + 32) or long (512 + 192) requests, KV ample, the victim in the flood's
tier (``benchmarks/isolation_sim.py``'s shapes). Arms: the defaults, then the defaults with
``max_backend_waiting`` set to each of ``BOUNDS``. Per arm, over the measurement window: the
engine's waiting queue right after each step chose its batch (mean, p90, max), the engine's
output over the ideal's, and the victim's TTFT p50/p90 over the ideal's.

``python -m benchmarks.queue_bound [--slots 256] [--bounds 2 3 8] [--json FILE] [--record]``
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks import _results
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks.isolation_sim import (
    ArmFigures,
    IsolationPoint,
    WindowEngine,
    run_defaults,
    run_ideal,
)
from weighbridge.app.simulation.ideal import IdealPoint
from weighbridge.emulator.engine import Coast, StepResult
from weighbridge.statistics import percentile

SLOTS = (256, 64)
BUDGETS = (2048, 8192)
POLICIES = ("fcfs", "priority")
FLOODS = ("short", "long")
BOUNDS = (2, 3, 8)  # the seed's 2-3, and the derived bound before slots are learned
WARMUP_S, WINDOW_S, TAIL_S = 10.0, 30.0, 10.0


class QueueEngine(WindowEngine):
    """A WindowEngine that also keeps its waiting queue after each step in the window chose
    its batch (a coasted run of plain decode steps has nothing waiting)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.waiting: list[int] = []

    def advance(self, end_s: float) -> tuple[StepResult, float | None]:
        out = super().advance(end_s)
        if self.window[0] <= end_s < self.window[1]:
            self.waiting.append(self.model.num_waiting)
        return out

    def coast(self, plan: Coast, steps: int) -> tuple[list[float], float]:
        ends, following = super().coast(plan, steps)
        start, end = self.window
        self.waiting.extend([0] * sum(1 for e in ends if start <= e < end))
        return ends, following


@dataclass(frozen=True, slots=True)
class Arm:
    bound: int | None  # None: the derived default
    victim: ArmFigures
    waiting_mean: float
    waiting_p90: float
    waiting_max: int


@dataclass(frozen=True, slots=True)
class Point:
    point: IsolationPoint
    ideal: IdealPoint
    arms: tuple[Arm, ...]


def run_point(point: IsolationPoint, bounds: tuple[int, ...]) -> Point:
    ideal = run_ideal(point, WARMUP_S, WINDOW_S, seed=1)
    arms = []
    for bound in (None, *bounds):
        admission = None if bound is None else {"max_backend_waiting": bound}
        figures, _sim, engines = run_defaults(point, WARMUP_S, WINDOW_S, TAIL_S, 1,
                                              admission, QueueEngine)
        waiting = [w for e in engines if isinstance(e, QueueEngine) for w in e.waiting]
        arms.append(Arm(bound, figures, statistics.fmean(waiting) if waiting else 0.0,
                        percentile(sorted(waiting), 0.9) if waiting else 0.0,
                        max(waiting, default=0)))
    return Point(point, ideal, tuple(arms))


def points(slots: tuple[int, ...] = SLOTS) -> list[IsolationPoint]:
    return [IsolationPoint(s, b, "ample", p, "same", f)  # type: ignore[arg-type]
            for s, b, p, f in itertools.product(slots, BUDGETS, POLICIES, FLOODS)]


def table(results: list[Point]) -> Table:
    rows: list[tuple[str, ...]] = []
    for r in results:
        ideal = r.ideal
        for arm in r.arms:
            rows.append((
                str(r.point.slots), f"{r.point.budget:,}", r.point.policy, r.point.flood,
                "derived" if arm.bound is None else str(arm.bound),
                f"{arm.waiting_mean:.1f} / {arm.waiting_p90:.0f} / {arm.waiting_max}",
                f"{arm.victim.output_tokens_per_s / ideal.output_tokens_per_s:.2f}",
                f"{arm.victim.p50_s / ideal.victim_p50_s:.2f} / "
                f"{arm.victim.p90_s / ideal.victim_p90_s:.2f}",
                f"{arm.victim.p50_s * 1000:.0f} / {arm.victim.p90_s * 1000:.0f}"))
    return Table(("seqs", "budget", "sched", "flood", "max_backend_waiting",
                  "engine waiting after schedule: mean / p90 / max", "output / ideal",
                  "victim TTFT / ideal p50 / p90", "victim TTFT ms p50 / p90"), rows)


def summary(results: list[Point]) -> list[str]:
    lines = []
    for slots in sorted({r.point.slots for r in results}, reverse=True):
        mine = [r for r in results if r.point.slots == slots]
        for k, arm in enumerate(mine[0].arms):
            label = "derived" if arm.bound is None else f"{arm.bound}"
            outputs = [r.arms[k].victim.output_tokens_per_s / r.ideal.output_tokens_per_s
                       for r in mine]
            victims = [max(r.arms[k].victim.p50_s / r.ideal.victim_p50_s,
                           r.arms[k].victim.p90_s / r.ideal.victim_p90_s) for r in mine]
            waits = [r.arms[k].waiting_mean for r in mine]
            lines.append(f"{slots} slots, max_backend_waiting {label}: engine waiting mean "
                         f"{min(waits):.1f}-{max(waits):.1f}, output {min(outputs):.2f}-"
                         f"{max(outputs):.2f} of the ideal's, victim worst p50/p90 ratio "
                         f"{max(victims):.2f}x")
    return lines


def bench_result(results: list[Point], wall_s: float) -> BenchResult:
    notes = [__doc__.split("\n\n")[1].replace("\n", " "),
             f"{len(results)} points in {wall_s:.0f} s of wall time."]
    return BenchResult(summary=summary(results), tables=[table(results)], notes=notes)


def run_all(shapes: list[IsolationPoint], bounds: tuple[int, ...],
            log: Callable[[str], None]) -> list[Point]:
    results = []
    for point in shapes:
        started = time.perf_counter()
        results.append(run_point(point, bounds))
        log(f"{point.label}: {time.perf_counter() - started:.0f} s")
    return results


def run(ctx: BenchContext) -> BenchResult:
    shapes = points((256,))[:2] if ctx.quick else points()
    started = time.perf_counter()
    return bench_result(run_all(shapes, BOUNDS, ctx.log), time.perf_counter() - started)


BENCHMARK = Benchmark("queue_bound",
                      "the engine's waiting-queue bound on large engines (virtual time)", run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.queue_bound",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--slots", type=int, nargs="+", default=list(SLOTS))
    parser.add_argument("--bounds", type=int, nargs="+", default=list(BOUNDS))
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--record", action="store_true",
                        help="write the result into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    standalone = _results.StandaloneRun(["python", "-m", "benchmarks.queue_bound",
                                         *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    results = run_all(points(tuple(args.slots)), tuple(args.bounds),
                      lambda line: print(line, file=sys.stderr, flush=True))
    result = bench_result(results, time.perf_counter() - started)
    print("\n".join(result.summary) + "\n")
    print(result.tables[0].markdown())
    if args.record:
        standalone.record(BENCHMARK, result)
    if args.json is not None:
        args.json.write_text(json.dumps(
            [{"point": r.point.label, "arms": [
                {"bound": a.bound, "waiting_mean": a.waiting_mean, "waiting_p90": a.waiting_p90,
                 "waiting_max": a.waiting_max, "output_tokens_per_s": a.victim.output_tokens_per_s,
                 "victim_p50_s": a.victim.p50_s, "victim_p90_s": a.victim.p90_s}
                for a in r.arms],
              "ideal_output_tokens_per_s": r.ideal.output_tokens_per_s,
              "ideal_victim_p50_s": r.ideal.victim_p50_s,
              "ideal_victim_p90_s": r.ideal.victim_p90_s} for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
