"""One scheduling decision with 100,000 queued requests over 10,000 tenants (target: 50 µs).

Two figures, both in steady state (every decision is followed, untimed, by the request's
completion with a real count that differs from its estimate, and by a new arrival, so the
backlog stays at its size and settlement debts keep DRR re-keying flows):

* ``Scheduler.next`` — the selector chain alone: tier, DRR over the tier's tenants, the
  tenant's ordered queue;
* ``SchedulingCore.next_dispatch`` — what the HTTP shell calls per dispatch: the above plus
  admission gates (8 backends) and least-tokens routing.

Tenants are spread over three tiers (10% interactive, 80% standard, 10% batch) with weights
0.5-4, prompts 10-4000 tokens, outputs 1-1000, priorities and deadlines mixed, so requests
cost up to ~2.4 quanta and flows often need several rounds. The garbage collector stays on:
the sidecar runs with it.

``python -m benchmarks.scheduler_decision [--quick] [--policy drr|rr|fcfs]``; exit status 1
when the median decision time misses the target. The verdict is on the median because the
machines are shared: a neighbour's burst preempts a few decisions for milliseconds, which moves
the mean by tens of µs without saying anything about the code; mean, p99 and max are reported
alongside.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.core import Dispatch, SchedulingCore
from weighbridge.sidecar.queues import QueueLimits
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.scheduler import EndpointSpec, Scheduler, TenantSpec

T = TypeVar("T")
TARGET_US = 50.0
TIERS = {"interactive": 1, "standard": 2, "batch": 3}
ENDPOINT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class DecisionTiming:
    name: str
    decisions: int
    mean_us: float
    p50_us: float
    p99_us: float
    max_us: float

    def line(self) -> str:
        return (f"{self.name}: mean {self.mean_us:.1f} µs, p50 {self.p50_us:.1f} µs, "
                f"p99 {self.p99_us:.1f} µs, max {self.max_us:.0f} µs "
                f"over {self.decisions:,} decisions")


def _timing(name: str, samples_ns: list[int]) -> DecisionTiming:
    samples = sorted(samples_ns)
    return DecisionTiming(
        name=name,
        decisions=len(samples),
        mean_us=statistics.fmean(samples) / 1000,
        p50_us=samples[len(samples) // 2] / 1000,
        p99_us=samples[int(len(samples) * 0.99)] / 1000,
        max_us=samples[-1] / 1000,
    )


def _steady_state(queued: int, decisions: int, arrive: Callable[[float], None],
                  decide: Callable[[float], T], finish: Callable[[T, float], None]) -> list[int]:
    """Fill the backlog, then time ``decisions`` calls of ``decide``; each is followed,
    untimed, by its request's end and a new arrival, so the backlog keeps its size."""
    for k in range(queued):
        arrive(k * 1e-4)
    clock = time.perf_counter_ns
    samples = []
    now = 100.0
    for _ in range(decisions):
        start = clock()
        decided = decide(now)
        samples.append(clock() - start)
        finish(decided, now)
        now += 1e-4
        arrive(now)
    return samples


def _tier_of(i: int) -> str:
    return "interactive" if i % 10 == 0 else "batch" if i % 10 == 1 else "standard"


def _shape(rng: random.Random) -> dict[str, object]:
    return {
        "prompt_tokens": rng.randint(10, 4000),
        "priority": rng.choice((0, 0, 0, 1, -1)),
        "deadline": rng.choice((None, None, rng.uniform(1, 100))),
    }


def measure_scheduler(tenants: int = 10_000, queued: int = 100_000, decisions: int = 50_000,
                      policy: str = "drr", seed: int = 1) -> DecisionTiming:
    rng = random.Random(seed)
    names = [f"t{i}" for i in range(tenants)]
    specs = {
        name: TenantSpec(_tier_of(i), rng.choice((0.5, 1.0, 2.0, 4.0)), QueueLimits(10_000))
        for i, name in enumerate(names)
    }
    scheduler = Scheduler(TIERS, specs, {ENDPOINT: EndpointSpec("tokens", 2048)},
                          policy=policy)  # type: ignore[arg-type]
    counter = iter(range(10**12))

    def arrive(now: float) -> None:
        name = names[rng.randrange(tenants)]
        shape = _shape(rng)
        scheduler.enqueue(
            QueuedRequest(
                id=str(next(counter)),
                tenant=name,
                tier=specs[name].tier,
                endpoint=ENDPOINT,
                prompt_tokens=shape["prompt_tokens"],  # type: ignore[arg-type]
                max_tokens=1000,
                estimated_output_tokens=rng.randint(1, 1000),
                arrival_s=now,
                priority=shape["priority"],  # type: ignore[arg-type]
                deadline_s=shape["deadline"],  # type: ignore[arg-type]
            ),
            now,
        )

    def finish(request: QueuedRequest | None, now: float) -> None:
        assert request is not None
        if rng.random() < 0.3:
            scheduler.on_tokens_streamed(request, rng.randint(1, 1200))
        scheduler.on_finished(request, request.prompt_tokens, rng.randint(1, 1200))

    samples = _steady_state(queued, decisions, arrive, scheduler.next, finish)
    return _timing(f"Scheduler.next ({policy})", samples)


def measure_core(tenants: int = 10_000, queued: int = 100_000, decisions: int = 50_000,
                 policy: str = "drr", seed: int = 2, backends: int = 8) -> DecisionTiming:
    rng = random.Random(seed)
    names = [f"t{i}" for i in range(tenants)]
    config = parse_config({
        "tenants": {
            name: {
                "tier": _tier_of(i),
                "weight": rng.choice((0.5, 1.0, 2.0, 4.0)),
                "api_keys": [f"sha256:{i:064x}"],
                "limits": {"max_queued": 10_000},
            }
            for i, name in enumerate(names)
        },
        "backends": [{"url": f"http://127.0.0.1:{9000 + b}"} for b in range(backends)],
        "scheduler": {"policy": policy},
    })
    # Caps far above the in-flight count: every timed decision dispatches.
    core = SchedulingCore(config, gate_limits=GateLimits(max_inflight=10**6))
    counter = iter(range(10**12))
    tier_of = {name: config.tenants[name].tier for name in names}

    def arrive(now: float) -> None:
        name = names[rng.randrange(tenants)]
        shape = _shape(rng)
        core.arrive(
            request_id=str(next(counter)),
            tenant=name,
            tier=tier_of[name],
            endpoint=ENDPOINT,
            prompt_tokens=shape["prompt_tokens"],  # type: ignore[arg-type]
            max_tokens=rng.randint(1, 1000),
            now=now,
            priority=shape["priority"],  # type: ignore[arg-type]
            deadline_s=shape["deadline"],  # type: ignore[arg-type]
        )

    def finish(dispatch: Dispatch | None, now: float) -> None:
        assert dispatch is not None
        request = dispatch.request
        core.on_tokens_streamed(request, rng.randint(1, 50), now)
        core.on_completed(request, request.prompt_tokens, rng.randint(1, 1200), now)

    samples = _steady_state(queued, decisions, arrive, core.next_dispatch, finish)
    return _timing(f"SchedulingCore.next_dispatch ({policy}, {backends} backends)", samples)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.scheduler_decision",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10x smaller, for a smoke run")
    parser.add_argument("--policy", default="drr", choices=("drr", "rr", "fcfs"))
    args = parser.parse_args(argv)
    scale = 10 if args.quick else 1
    sizes = {"tenants": 10_000 // scale, "queued": 100_000 // scale,
             "decisions": 50_000 // scale}
    print(f"{sizes['queued']:,} queued requests over {sizes['tenants']:,} tenants, "
          f"target {TARGET_US:.0f} µs per decision")
    results = [measure_scheduler(policy=args.policy, **sizes),
               measure_core(policy=args.policy, **sizes)]
    for result in results:
        print(result.line())
    passed = all(r.p50_us <= TARGET_US for r in results)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


def run(ctx: BenchContext) -> BenchResult:
    """For ``make bench``: drr's decision against the plain FIFO decision (``fcfs``) measured
    in the same run as the baseline, and against the 50 µs target."""
    scale = 10 if ctx.quick else 1
    sizes = {"tenants": 10_000 // scale, "queued": 100_000 // scale,
             "decisions": 50_000 // scale}
    ctx.log(f"{sizes['queued']:,} queued over {sizes['tenants']:,} tenants")
    baseline = measure_scheduler(policy="fcfs", **sizes)
    timings = [measure_scheduler(policy="drr", **sizes), measure_core(policy="drr", **sizes),
               measure_scheduler(policy="rr", **sizes)]
    rows = [(t.name, f"{t.p50_us:.1f}", f"{t.mean_us:.1f}", f"{t.p99_us:.1f}",
             f"**{t.p50_us / baseline.p50_us:.2f}**") for t in [baseline, *timings]]
    passed = all(t.p50_us <= TARGET_US for t in timings[:2])
    core = timings[1]
    return BenchResult(
        summary=[f"One dispatch decision (`SchedulingCore.next_dispatch`, drr) with "
                 f"{sizes['queued']:,} requests queued over {sizes['tenants']:,} tenants: "
                 f"median **{core.p50_us:.1f} µs** (target <= {TARGET_US:.0f} µs) = "
                 f"**{core.p50_us / baseline.p50_us:.2f}x** a plain FIFO pop measured in the "
                 "same run."],
        tables=[Table(("decision", "p50 µs", "mean µs", "p99 µs", "p50 ratio to fcfs"), rows)],
        notes=["Steady state: each timed decision is followed, untimed, by the request's "
               "completion (a real count differing from the estimate, so DRR settles) and a "
               "new arrival. GC on. The verdict is on the median: neighbours on the shared "
               "machine preempt a few decisions for milliseconds."],
        passed=passed,
    )


BENCHMARK = Benchmark("scheduler_decision", "sidecar: one scheduling decision at scale", run)


if __name__ == "__main__":
    sys.exit(main())
