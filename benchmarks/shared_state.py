"""What sharing the sidecar's state through Redis costs a replica (issue 15): the same
streaming load through a sidecar with its state in process and through one with
`state.backend: redis` (a real redis-server on loopback), each beside an engine reached
directly (``sidecar_overhead.measure``), in interleaved passes.

Targets: the Redis round trip adds at most 0.5 ms p50 to TTFT over in-process state at 200
streaming requests/s, and a replica's CPU per request with Redis is at most 1.2x without
(the CPU of the Redis server itself is reported beside it, not counted in the ratio).

    python -m benchmarks shared_state
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks import _system
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks.sidecar_overhead import RATE, Overhead, measure, sidecar
from weighbridge.launch import redis_process

TARGET_ADDED_P50_S = 0.5e-3
TARGET_CPU_RATIO = 1.2
LOCAL = "state in process"
SHARED = "state in Redis"


def run(ctx: BenchContext) -> BenchResult:
    seconds, passes = (5.0, 1) if ctx.quick else (15.0, 2)
    rounds = 1 if ctx.quick else 2
    directory = Path(tempfile.mkdtemp(prefix="weighbridge-bench-redis-"))
    results: dict[str, list[Overhead]] = {LOCAL: [], SHARED: []}
    redis_cpu_s = 0.0
    with redis_process(directory) as redis:
        overlays: dict[str, dict[str, object]] = {
            LOCAL: {}, SHARED: {"state": {"backend": "redis", "url": redis.url}}}
        for k in range(rounds):
            # Interleaved, each arm first in turn: drift in the host's speed hits both.
            for name in (LOCAL, SHARED) if k % 2 == 0 else (SHARED, LOCAL):
                ctx.log(f"{name}: {passes} passes of {seconds:.0f} s at {RATE:.0f} req/s")
                assert redis.pid is not None
                before = _system.group_sched(redis.pid)
                results[name].append(measure(RATE, seconds, passes, sidecar(overlays[name]),
                                             log=ctx.log))
                if name == SHARED:
                    redis_cpu_s += (_system.group_sched(redis.pid) - before).cpu_s

    def mean(name: str, attr: str) -> float:
        values = [getattr(o, attr) for o in results[name]]
        return sum(values) / len(values)

    local_p50, shared_p50 = mean(LOCAL, "added_p50_s"), mean(SHARED, "added_p50_s")
    local_cpu, shared_cpu = mean(LOCAL, "cpu_per_request_s"), mean(SHARED, "cpu_per_request_s")
    extra_p50 = shared_p50 - local_p50
    ratio = shared_cpu / local_cpu if local_cpu else float("inf")
    served = sum(o.requests for o in results[SHARED])
    rows: list[tuple[str, ...]] = [
        (name, str(i + 1), f"{o.direct_p50_s * 1e3:.2f}", f"{o.sidecar_p50_s * 1e3:.2f}",
         f"{o.added_p50_s * 1e3:.2f}", f"{o.added_p99_s * 1e3:.2f}",
         f"{o.cpu_per_request_s * 1e6:.0f}", str(o.failures))
        for name, runs in results.items() for i, o in enumerate(runs)]
    failures = sum(o.failures for runs in results.values() for o in runs)
    passed = (failures == 0 and extra_p50 <= TARGET_ADDED_P50_S and ratio <= TARGET_CPU_RATIO)
    return BenchResult(
        summary=[
            f"Redis-shared state adds **{extra_p50 * 1e3:+.2f} ms** p50 TTFT over in-process "
            f"state at {RATE:.0f} streaming req/s (target at most "
            f"{TARGET_ADDED_P50_S * 1e3:.1f} ms); the replica's CPU per request is "
            f"**{ratio:.2f}x** ({shared_cpu * 1e6:.0f} against {local_cpu * 1e6:.0f} µs; "
            f"target at most {TARGET_CPU_RATIO}x). redis-server itself: "
            f"{redis_cpu_s / max(1, served) * 1e6:.0f} µs per request."],
        tables=[Table(("state", "round", "direct p50 ms", "proxied p50 ms", "added p50 ms",
                       "added p99 ms", "sidecar CPU µs/req", "failures"), rows)],
        notes=["Each round measures both arms with sidecar_overhead's method (an engine "
               "reached directly beside the one behind the sidecar, same Poisson rate), the "
               "plain config (tiers, tenants, backends) with and without `state`; figures are "
               "means over rounds. One replica: the round trip per admission, the 10 ms "
               "sync (load, service, estimates, settlements) and the heartbeat are all it "
               "pays; more replicas add no per-request work."],
        passed=passed,
    )


BENCHMARK = Benchmark("shared_state", "sidecar: the cost of state shared through Redis", run)
