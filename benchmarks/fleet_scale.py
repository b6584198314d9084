"""Protection that costs no throughput, at fleet scale, in virtual time (issue 38, part 4).

``weighbridge simulate`` of ``deploy/stacks/fleet.yaml``: emulated H100 engines (the demo's:
32 sequences, a 512-token step budget, 1,024 KV blocks, priority scheduling, prefix cache
on) behind the sidecar with a plain config (tiers, tenants, backends: every admission
setting derived from the engines, ``drr`` and ``prefix_aware`` by default), and 100 tenants
(``deploy/stacks/fleet-tenants.yaml``): an interactive victim, 96 steady tenants and three
flood tenants (a half, a quarter and a quarter of the flood), loaded per engine as the
4-engine fleet (``--scale engines/4``), except that the victim sends ``VICTIM_RPS`` per
engine (the demo's 4 requests/s on 2 engines), so that its percentiles rest on 30 requests
or more even on one engine. The flood tenants may queue without bound, so nothing is
refused. Phases are the noisy_neighbour scenario's: 15 s quiet, then the flood's 20 s
burst; the run ends 5 s after it.

Axes: the fleet size (1, 4, 8, 16, 64 engines) at a flood of 2x; the flood's size (1x, 2x,
4x) and the prefix share (0, 0.5, 0.8) at 16 engines. A flood of 1x offers
``FLOOD_CAPACITY_RPS`` requests per engine per second, about what an engine of this shape
finishes of them (the table's "offered / finished" is the measured ratio, against
passthrough's finished flood requests). A prefix share ``s`` gives each tenant a system
prompt of its own before every prompt, of ``s / (1 - s)`` times its mean prompt: the part
the engines compute stays the same, and ``s`` of every prompt can be a prefix-cache hit.

Arms, in the same run on the same engines' model: ``weighbridge`` (the stack as written),
``passthrough`` (the same sidecar forwarding every request at once: the engines' own
scheduling, the output reference), and ``ideal`` (``weighbridge simulate --ideal``,
weighbridge/app/simulation/ideal.py: per engine, the victim's share of its requests sent
at once to the front of the engine's queue beside the flood held at the admission cap, its
prompts one at a time; the fleet's bound is that engine's output times the engines; it
ignores the system prompts, i.e. takes them as cached).

Per point, over the flood's last 15 s (``[20 s, 35 s)``, where every arm's flood is
backlogged): the engines' generated tokens per second (steps ending in the window), the
victim's TTFT p50 / p90 over the requests it sends in the window (one unanswered at the
run's end counts as infinite) and before the flood (``[5 s, 15 s)``), Jain's index of the
report (``weighbridge report``'s fairness: the worst tier's index over the backlogged
tenants' weight-normalised served tokens, 2 s windows), the dispatches the sidecar held by
reason, and the simulation's wall time. A point passes when weighbridge's output is at
least ``OUTPUT_TARGET`` of passthrough's while the victim stays protected: its flood TTFT
p50 and p90 within ``VICTIM_TARGET`` of the ideal's (the isolation matrix's bar). Issue
38's live bar, the flood p90 within 2x of the victim's own before the flood, is shown but
not judged: here the ideal itself does not meet it (its flood p90 is about 50 ms; the
victim's quiet p90 20-30 ms), since every step the victim shares carries the flood.

``python -m benchmarks fleet_scale [--quick]``, or ``python -m benchmarks.fleet_scale
[--engines 4 16] [--flood 2] [--prefix 0] [--json out.json] [--record]``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from benchmarks import _results
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks.isolation_sim import WindowEngine
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.figures import figures
from weighbridge.app.simulation.ideal import ideal_for
from weighbridge.app.simulation.run import Inputs, run_policy
from weighbridge.app.simulation.sweep import apply, parse_sweep
from weighbridge.app.stack import DEPLOY_DIR, StackSpec, load_stack
from weighbridge.loadgen.arrivals import Burst, Poisson
from weighbridge.loadgen.lengths import Fixed
from weighbridge.loadgen.tenants import SystemPrompt, TenantsFile, TenantSpec, load_tenants
from weighbridge.records import RequestRecord
from weighbridge.statistics import percentile

STACK = DEPLOY_DIR / "stacks" / "fleet.yaml"
REFERENCE_ENGINES = 4  # the fleet the tenants file's rates are for
FLEET_SIZES = (1, 4, 8, 16, 64)
FLOOD_SIZES = (1.0, 2.0, 4.0)
PREFIX_SHARES = (0.0, 0.5, 0.8)
FLEET_FLOOD, AXIS_ENGINES = 2.0, 16  # where the other axes are held
FLOOD_CAPACITY_RPS = 55.0  # flood requests an engine of the stack finishes a second, about
FLOOD_PHASE, FLOOD_START_S, FLOOD_S = "flood", 15.0, 20.0
WINDOW_S = (20.0, 35.0)  # the flood's last 15 s
QUIET_S = (5.0, 15.0)
DURATION_S = 40.0
OUTPUT_TARGET = 0.95  # weighbridge's engine output over passthrough's
VICTIM_TARGET = 1.3  # the victim's flood TTFT p50 and p90 over the ideal's
VICTIM, VICTIM_RPS = "victim", 2.0  # the victim's requests/s per engine
SEED = 1
ARMS = ("weighbridge", "passthrough")


@dataclass(frozen=True, slots=True)
class FleetPoint:
    engines: int
    flood: float  # the flood's offered rate in FLOOD_CAPACITY_RPS per engine
    prefix_share: float

    @property
    def label(self) -> str:
        return f"engines={self.engines} flood={self.flood:g}x prefix={self.prefix_share:g}"


@dataclass(frozen=True, slots=True)
class ArmResult:
    output_tokens_per_s: float  # the engines', in the window
    victim_p50_s: float
    victim_p90_s: float
    victim_requests: int  # sent in the window
    victim_quiet_p90_s: float
    jain_index: float | None
    flood_finished_per_s: float  # flood requests ended ok in the window, a second
    requests: int
    wall_s: float
    holds: dict[str, int] = field(default_factory=dict)  # by reason, every backend
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class PointResult:
    point: FleetPoint
    arms: dict[str, ArmResult]
    ideal_output_tokens_per_s: float  # the fleet's: one engine's times the engines
    ideal_p50_s: float
    ideal_p90_s: float
    flood_offered_per_s: float

    @property
    def output_ratio(self) -> float:
        """weighbridge's engine output over passthrough's."""
        return _ratio(self.arms["weighbridge"].output_tokens_per_s,
                      self.arms["passthrough"].output_tokens_per_s)

    @property
    def output_of_ideal(self) -> float:
        return _ratio(self.arms["weighbridge"].output_tokens_per_s,
                      self.ideal_output_tokens_per_s)

    def victim_ratio(self, q: int) -> float:
        """weighbridge's victim TTFT percentile ``q`` (50 or 90) over the ideal's."""
        arm = self.arms["weighbridge"]
        if q == 50:
            return _ratio(arm.victim_p50_s, self.ideal_p50_s)
        return _ratio(arm.victim_p90_s, self.ideal_p90_s)

    @property
    def protected(self) -> bool:
        return self.victim_ratio(50) <= VICTIM_TARGET and self.victim_ratio(90) <= VICTIM_TARGET

    @property
    def passes(self) -> bool:
        return self.output_ratio >= OUTPUT_TARGET and self.protected


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def points(engines: Iterable[int] = FLEET_SIZES, floods: Iterable[float] = FLOOD_SIZES,
           shares: Iterable[float] = PREFIX_SHARES) -> list[FleetPoint]:
    """The fleet axis at the held flood and no prefix, then the flood and prefix axes at
    ``AXIS_ENGINES`` (each point once)."""
    engines, floods, shares = list(engines), list(floods), list(shares)
    fleet = AXIS_ENGINES if AXIS_ENGINES in engines else engines[-1]
    flood = FLEET_FLOOD if FLEET_FLOOD in floods else floods[0]
    out = [FleetPoint(n, flood, shares[0]) for n in engines]
    out += [FleetPoint(fleet, f, shares[0]) for f in floods]
    out += [FleetPoint(fleet, flood, s) for s in shares]
    return list(dict.fromkeys(out))


def _floods(tenants: TenantsFile) -> dict[str, int]:
    """The flood tenants and their burst sizes, as the tenants file has them."""
    out = {}
    for t in tenants.tenants:
        burst = t.phases.get(FLOOD_PHASE)
        if isinstance(burst, Burst):
            out[t.name] = burst.count
    return out


def point_tenants(base: TenantsFile, point: FleetPoint) -> TenantsFile:
    """The tenants file for ``point``, at the reference fleet (the run scales it to the
    point's engines): the flood's bursts resized, the victim at ``VICTIM_RPS`` per engine, a
    system prompt for the prefix share."""
    floods = _floods(base)
    total = sum(floods.values())
    offered = point.flood * FLOOD_CAPACITY_RPS * REFERENCE_ENGINES * FLOOD_S
    tenants: list[TenantSpec] = []
    for t in base.tenants:
        update: dict[str, Any] = {}
        if t.name == VICTIM:
            update["arrival"] = Poisson(rate=VICTIM_RPS * REFERENCE_ENGINES)
        if t.name in floods:
            update["phases"] = {FLOOD_PHASE: Burst(
                count=max(1, round(offered * floods[t.name] / total)), over_s=FLOOD_S)}
        if point.prefix_share > 0:
            mean_prompt = t.lengths.mean_tokens()[0]
            length = round(point.prefix_share / (1 - point.prefix_share) * mean_prompt)
            update["system_prompt"] = SystemPrompt(length=Fixed(value=length))
        tenants.append(t.model_copy(update=update))
    return TenantsFile(tenants=tenants)


def _stack(engines: int) -> StackSpec:
    sweep = parse_sweep(f"engines.count={engines}")
    return apply(load_stack(STACK), sweep, engines)


def _window_engines(stack: StackSpec) -> list[WindowEngine]:
    return [WindowEngine(f"engine-{i}", stack.engines.emulator_for(i), *WINDOW_S,
                         seed_offset=i) for i in range(stack.engines.count)]


def _victim_ttfts(records: list[RequestRecord], victim: str,
                  span: tuple[float, float]) -> list[float]:
    return sorted(math.inf if r.ttft_s is None else r.ttft_s for r in records
                  if r.tenant == victim and span[0] <= r.scheduled_s < span[1])


def _holds_by_reason(holds: dict[str, int]) -> dict[str, int]:
    by_reason: Counter[str] = Counter()
    for key, n in holds.items():
        by_reason[key.split("/", 1)[1]] += n
    return dict(by_reason.most_common())


def run_arm(inputs: Inputs, policy: str | None, out: Path, victim: str,
            floods: set[str]) -> ArmResult:
    engines: list[WindowEngine] = []

    def made(stack: StackSpec) -> list[SimEngine]:
        engines.extend(_window_engines(stack))
        return list(engines)

    outcome = run_policy(inputs, policy, out, engines=made)
    result = outcome.result
    window = WINDOW_S[1] - WINDOW_S[0]
    flood = _victim_ttfts(result.records, victim, WINDOW_S)
    quiet = _victim_ttfts(result.records, victim, QUIET_S)
    finished = sum(1 for r in result.records if r.tenant in floods and r.status == "ok"
                   and WINDOW_S[0] <= r.end_s < WINDOW_S[1])
    head = figures(outcome.run_dir, 2.0)
    return ArmResult(
        output_tokens_per_s=sum(e.window_tokens for e in engines) / window,
        victim_p50_s=percentile(flood, 0.5), victim_p90_s=percentile(flood, 0.9),
        victim_requests=len(flood), victim_quiet_p90_s=percentile(quiet, 0.9),
        jain_index=head["jain_index"],
        flood_finished_per_s=finished / window, requests=len(result.records),
        wall_s=result.wall_s, holds=_holds_by_reason(result.holds),
        preemptions=sum(e.model.counters.preemptions for e in engines))


def run_point(point: FleetPoint, work: Path, seed: int = SEED,
              log: Callable[[str], None] = print) -> PointResult:
    stack = _stack(point.engines)
    base = load_tenants(stack.tenants_file or STACK.parent / "fleet-tenants.yaml")
    tenants = point_tenants(base, point)
    tenants_file = work / "tenants.yaml"
    tenants_file.write_text(yaml.safe_dump(tenants.model_dump(mode="json"), sort_keys=False))
    inputs = Inputs(stack=stack, tenants_file=tenants_file, duration_s=DURATION_S,
                    scale=point.engines / REFERENCE_ENGINES, seed=seed)
    floods = set(_floods(tenants))
    arms = {}
    for arm in ARMS:
        policy = None if arm == "weighbridge" else arm
        arms[arm] = run_arm(inputs, policy, work / arm, VICTIM, floods)
        log(f"  {arm}: {arms[arm].requests:,} requests simulated in {arms[arm].wall_s:.1f} s")
    ideal = ideal_for(inputs)
    flooded = ideal["flooded"]
    offered = sum(_floods(tenants).values()) * point.engines / REFERENCE_ENGINES / FLOOD_S
    return PointResult(point, arms, flooded["output_tokens_per_s"] * point.engines,
                       flooded["ttft_p50_s"], flooded["ttft_p90_s"], offered)


def run_all(selected: list[FleetPoint], seed: int = SEED,
            log: Callable[[str], None] = print) -> list[PointResult]:
    results = []
    for i, point in enumerate(selected, 1):
        log(f"[{i}/{len(selected)}] {point.label}")
        with tempfile.TemporaryDirectory(prefix="fleet-scale-") as work:
            result = run_point(point, Path(work), seed, log)
        wb = result.arms["weighbridge"]
        log(f"  output {result.output_ratio:.2f}x passthrough, {result.output_of_ideal:.2f}x "
            f"ideal; victim p50/p90 {_ms(wb.victim_p50_s)}/{_ms(wb.victim_p90_s)} ms "
            f"(ideal {_ms(result.ideal_p50_s)}/{_ms(result.ideal_p90_s)}); "
            f"{'pass' if result.passes else 'FAIL'}")
        results.append(result)
    return results


def _ms(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else "nan" if math.isnan(seconds) \
        else f"{seconds * 1e3:,.0f}"


def _num(value: float | None, spec: str = ".2f") -> str:
    return "—" if value is None or math.isnan(value) else format(value, spec)


def _top_holds(holds: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n:,}" for reason, n in list(holds.items())[:2]) or "none"


def table(results: list[PointResult]) -> Table:
    rows: list[tuple[str, ...]] = []
    for r in results:
        p, wb, pt = r.point, r.arms["weighbridge"], r.arms["passthrough"]
        rows.append((
            str(p.engines), f"{p.flood:g}x", f"{p.prefix_share:g}",
            _num(_ratio(r.flood_offered_per_s, pt.flood_finished_per_s)),
            f"{wb.output_tokens_per_s:,.0f} / {pt.output_tokens_per_s:,.0f} / "
            f"{r.ideal_output_tokens_per_s:,.0f}",
            f"**{_num(r.output_ratio)}**", _num(r.output_of_ideal),
            f"{_ms(wb.victim_p50_s)} / {_ms(wb.victim_p90_s)} ({wb.victim_requests:,})",
            f"{_ms(pt.victim_p50_s)} / {_ms(pt.victim_p90_s)}",
            f"{_ms(r.ideal_p50_s)} / {_ms(r.ideal_p90_s)}",
            f"{_num(r.victim_ratio(50))} / {_num(r.victim_ratio(90))}",
            _ms(wb.victim_quiet_p90_s),
            f"{_num(wb.jain_index, '.3f')} / {_num(pt.jain_index, '.3f')}",
            f"{wb.wall_s:.1f} / {pt.wall_s:.1f}", _top_holds(wb.holds),
            "pass" if r.passes else "**FAIL**"))
    return Table(("engines", "flood", "prefix share", "flood offered / finished",
                  "output tok/s: weighbridge / passthrough / ideal", "output / passthrough",
                  "output / ideal", "victim TTFT ms p50 / p90 (requests)",
                  "passthrough victim ms",
                  "ideal victim ms", "victim / ideal p50 / p90", "victim p90 before flood ms",
                  "Jain: weighbridge / passthrough", "wall s: weighbridge / passthrough",
                  "weighbridge holds", f"output >= {OUTPUT_TARGET}x, victim <= "
                  f"{VICTIM_TARGET}x ideal"), rows)


def summary(results: list[PointResult]) -> list[str]:
    failed = [r for r in results if not r.passes]
    lines = [f"{len(results) - len(failed)} of {len(results)} points: weighbridge's engine "
             f"output at least {OUTPUT_TARGET}x passthrough's with the victim's flood TTFT "
             f"p50 and p90 within {VICTIM_TARGET}x of the ideal's"]
    fleet = [r for r in results if r.point.flood == FLEET_FLOOD and r.point.prefix_share == 0]
    if fleet:
        lines.append("output / passthrough by fleet size: " + ", ".join(
            f"{r.point.engines} engines {r.output_ratio:.2f}x" for r in fleet))
        lines.append("victim TTFT p90 / ideal's by fleet size: " + ", ".join(
            f"{r.point.engines} engines {r.victim_ratio(90):.2f}x" for r in fleet))
    return lines


def bench_result(results: list[PointResult], wall_s: float) -> BenchResult:
    notes = [__doc__.split("\n\n")[1].replace("\n", " "),
             __doc__.split("\n\n")[4].replace("\n", " "),
             f"{len(results)} points in {wall_s:.0f} s of wall time; the wall column is "
             "each arm's simulation loop alone."]
    return BenchResult(summary=summary(results), tables=[table(results)], notes=notes,
                       passed=all(r.passes for r in results))


def run(ctx: BenchContext) -> BenchResult:
    selected = points((1, 4, 16), (FLEET_FLOOD,), (0.0,)) if ctx.quick else points()
    started = time.perf_counter()
    results = run_all(selected, log=ctx.log)
    return bench_result(results, time.perf_counter() - started)


BENCHMARK = Benchmark("fleet_scale",
                      "protection that costs no throughput, 1-64 engines (virtual time)", run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fleet_scale",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", type=int, nargs="+", default=list(FLEET_SIZES))
    parser.add_argument("--flood", type=float, nargs="+", default=list(FLOOD_SIZES),
                        help="flood sizes, in FLOOD_CAPACITY_RPS per engine")
    parser.add_argument("--prefix", type=float, nargs="+", default=list(PREFIX_SHARES),
                        help="prefix shares, in [0, 1)")
    parser.add_argument("--seed", type=int, default=SEED)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--record", action="store_true",
                        help="write the result into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    selected = points(args.engines, args.flood, args.prefix)
    standalone = _results.StandaloneRun(["python", "-m", "benchmarks.fleet_scale",
                                         *(sys.argv[1:] if argv is None else argv)])
    started = time.perf_counter()
    results = run_all(selected, args.seed, log=lambda m: print(m, file=sys.stderr, flush=True))
    result = bench_result(results, time.perf_counter() - started)
    print("\n".join(result.summary) + "\n")
    print(result.tables[0].markdown())
    if args.record:
        standalone.record(BENCHMARK, result)
    if args.json is not None:
        args.json.write_text(json.dumps(
            [{**asdict(r), "output_ratio": r.output_ratio, "output_of_ideal": r.output_of_ideal,
              "passes": r.passes} for r in results], indent=1, default=str))
    return 0 if all(r.passes for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
