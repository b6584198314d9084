"""DRR turn size apart from price (issue 41, point 5): how tenants interleave, in virtual time.

A DRR round gives each backlogged tenant its weight in quanta of credit (``endpoints.<path>
.quantum``, 2,048 tokens: its share, and the price of a token against the tenant's other
endpoints). How much of that credit one visit spends is the endpoint's *turn*
(``endpoints.<path>.turn``; sidecar/drr.py, "Turn size"): by default one request on the
generating kinds, so tenants rotate about one request each as seed 001 rotates streaming
endpoints; before, a visit spent the whole quantum, ~17 requests of a ~120-token chat tenant.

Workload, through the sidecar's SchedulingCore in front of one emulated h100-llama3-8b
engine (32 sequences, step budget 2,048; benchmarks/scheduling_quality.py's claim engine):
three chat tenants of one tier, each a closed loop of 48 users sending 100 + 20 tokens
(backlogged at the sidecar throughout), and a light chat tenant, Poisson 2/s of 64 + 16.
Arms: the default turn (one request), and a turn of one quantum (2,048 tokens: the whole
round's credit, as before).

Per arm, over the requests sent in the window: the backlogged tenants' dispatches per visit
(runs of consecutive dispatches of one backlogged tenant, mean and p90), Jain's index over
their served tokens, the light tenant's TTFT p50 / p99 and every tenant's output.

``python -m benchmarks.drr_turns [--record]``
"""

from __future__ import annotations

import itertools
import statistics
import sys
from collections.abc import Iterator
from typing import Any

from benchmarks import _results
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks.scheduling_quality import (
    CLAIM_SEEDS,
    CLAIM_WARMUP_S,
    CLAIM_WINDOW_S,
    _lengths,
    _ms_q,
    _rank,
    claim_run,
    in_window,
    output_tps,
    ttfts,
)
from weighbridge.app.simulation.loop import Simulation
from weighbridge.loadgen.arrivals import Closed, Poisson
from weighbridge.loadgen.tenants import TenantSpec
from weighbridge.sidecar.core import Dispatch

BACKLOGGED = ("chat-a", "chat-b", "chat-c")
LIGHT = "light"
CHAT = "/v1/chat/completions"
ARMS: dict[str, int | None] = {"one request (default)": None, "one quantum (before)": 2048}


class DispatchRecorder(Simulation):
    """A Simulation that keeps the tenant of every dispatch, in order, with its time."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dispatched: list[tuple[float, str]] = []
        ready = self.core.dispatch_ready

        def recorded(now: float) -> Iterator[Dispatch]:
            for d in ready(now):
                self.dispatched.append((now, d.request.tenant))
                yield d

        self.core.dispatch_ready = recorded  # type: ignore[method-assign]


def tenants() -> list[TenantSpec]:
    return [TenantSpec(name=name, api_key=f"sk-{name}", tier="shared", endpoint="chat",
                       arrival=Closed(users=48), lengths=_lengths(100, 20))
            for name in BACKLOGGED] + [
        TenantSpec(name=LIGHT, api_key=f"sk-{LIGHT}", tier="shared", endpoint="chat",
                   arrival=Poisson(rate=2.0), lengths=_lengths(64, 16))]


def sidecar(turn: int | None) -> dict[str, Any]:
    return {"tiers": {"shared": {"rank": 1}},
            "tenants": {t.name: {"tier": "shared", "api_keys": [f"plain:{t.api_key}"],
                                 "limits": {"max_queued": 1000}} for t in tenants()},
            **({"endpoints": {CHAT: {"turn": turn}}} if turn is not None else {})}


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 1.0


def run_arm(label: str, turn: int | None) -> tuple[tuple[str, ...], str]:
    runs: list[int] = []
    records = []
    for seed in CLAIM_SEEDS:
        sim = claim_run(sidecar(turn), tenants(), seed, simulation=DispatchRecorder)
        assert isinstance(sim, DispatchRecorder)
        records += sim.records
        end = CLAIM_WARMUP_S + CLAIM_WINDOW_S
        order = [t for at, t in sim.dispatched
                 if CLAIM_WARMUP_S <= at < end and t in BACKLOGGED]
        runs += [len(list(group)) for _, group in itertools.groupby(order)]
    served = [output_tps(records, t) for t in BACKLOGGED]
    light = ttfts(in_window(records, LIGHT))
    row = (label, f"{statistics.fmean(runs):.1f}", f"{_rank(sorted(runs), 0.9):.0f}",
           f"{jain(served):.4f}", _ms_q(light, 0.5, 0.99),
           " / ".join(f"{v / len(CLAIM_SEEDS):,.0f}" for v in served),
           f"{output_tps(records, LIGHT) / len(CLAIM_SEEDS):,.0f}")
    line = (f"turn {label}: {statistics.fmean(runs):.1f} dispatches per visit of a "
            f"~120-token chat tenant, Jain {jain(served):.4f}, light TTFT p50 / p99 "
            f"{_ms_q(light, 0.5, 0.99)} ms")
    return row, line


def run_all(log: Any) -> BenchResult:
    rows, lines = [], []
    for label, turn in ARMS.items():
        row, line = run_arm(label, turn)
        rows.append(row)
        lines.append(line)
        log(line)
    table = Table(("turn", "dispatches per visit, mean", "p90", "Jain's index (output)",
                   "light TTFT ms p50 / p99", "backlogged output tok/s a / b / c",
                   "light output tok/s"), rows,
                  caption="**DRR turns**: three backlogged chat tenants of ~120 tokens a "
                          "request and a light one, one engine")
    notes = [" ".join(__doc__.split("\n\n")[i].split()) for i in (1, 2, 3)] + [
        f"Virtual time, seeds {', '.join(map(str, CLAIM_SEEDS))} pooled; requests sent in "
        f"[{CLAIM_WARMUP_S:g}, {CLAIM_WARMUP_S + CLAIM_WINDOW_S:g}) s; output per second "
        "of the window, per seed."]
    return BenchResult(summary=lines, tables=[table], notes=notes)


def run(ctx: BenchContext) -> BenchResult:
    return run_all(ctx.log)


BENCHMARK = Benchmark("drr_turns", "DRR turn size apart from price: how tenants interleave "
                      "(virtual time)", run)


def main(argv: list[str] | None = None) -> int:
    return _results.standalone_main("drr_turns", BENCHMARK, run_all, __doc__.splitlines()[0],
                                    argv)


if __name__ == "__main__":
    sys.exit(main())
