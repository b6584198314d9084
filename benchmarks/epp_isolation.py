"""Isolation through Envoy and ``weighbridge epp`` against the same flood through
``weighbridge sidecar`` (issue 42): the noisy-neighbour experiment of
``benchmarks.isolation`` (issue 14's KV-tight emulated engine, the plain config, the flood of
500 streams and the Poisson victim), with its ``sidecar`` arm run twice per repeat, once
through the sidecar and once through Envoy + picker (both bodies full duplex, decision
0013), interleaved, on one engine drained between arms.

Target (issue 42's acceptance): the victim's TTFT p50 and p90 through Envoy within 1.1x of
the sidecar's, and the engine's output at least 0.95x, in the same run.

The picker's arm reads its figures (the victim's queue wait, the holds) from the picker's
``/metrics`` through Envoy, on a route that skips the ext_proc filter.

``python -m benchmarks.epp_isolation [--repeats 2] [--warmup 4] [--window 12]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from benchmarks import isolation
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from weighbridge.launch import (
    EnvoyModes,
    envoy_config,
    envoy_process,
    epp_process,
    free_port,
    sidecar_process,
)
from weighbridge.statistics import percentile

P50_TARGET, P90_TARGET, OUTPUT_TARGET = 1.1, 1.1, 0.95
Front = Callable[[str, Path, str], contextlib.AbstractContextManager[tuple[str, int | None]]]


@contextlib.contextmanager
def sidecar_front(engine_url: str, workdir: Path, name: str
                  ) -> Iterator[tuple[str, int | None]]:
    config = {**isolation.plain_config(engine_url, isolation.ISSUE_14.keys),
              **isolation.ISSUE_14.overlay}
    with sidecar_process(config, config_dir=workdir, name=name) as proc:
        yield proc.url, proc.pid


@contextlib.contextmanager
def epp_front(engine_url: str, workdir: Path, name: str) -> Iterator[tuple[str, int | None]]:
    config = {**isolation.plain_config(engine_url, isolation.ISSUE_14.keys),
              **isolation.ISSUE_14.overlay}
    picker, grpc_port = epp_process(config, name=name, config_dir=workdir)
    port, admin = free_port(), free_port()
    http_port = int(picker.url.rpartition(":")[2])
    with picker, envoy_process(envoy_config(port, admin, [("127.0.0.1", grpc_port)],
                                            EnvoyModes(), metrics=("127.0.0.1", http_port)),
                               port, admin, directory=workdir, name=f"envoy-{name}") as envoy:
        # The CPU counted is the picker's; Envoy's is the gateway's, apart.
        yield envoy.url, picker.pid


FRONTS: dict[str, Front] = {"sidecar": sidecar_front, "envoy+epp": epp_front}


def run_all(repeats: int, warmup_s: float, window_s: float, seed: int = 1,
            log: Callable[[str], None] = print) -> dict[str, list[isolation.ArmResult]]:
    setup = isolation.ISSUE_14
    workdir = Path(tempfile.mkdtemp(prefix="weighbridge-epp-isolation-"))
    results: dict[str, list[isolation.ArmResult]] = {name: [] for name in FRONTS}
    with isolation.engine("emulator", workdir, setup.engine, setup.profile) as (url, pid):
        for r in range(repeats):
            order = list(FRONTS) if r % 2 == 0 else list(reversed(FRONTS))
            for i, name in enumerate(order):
                with FRONTS[name](url, workdir, f"{name.replace('+', '-')}-{r}") as (
                        front, front_pid):
                    result = asyncio.run(isolation.run_arm(
                        "sidecar", r, url, front, warmup_s, window_s, seed + 2 * r + i,
                        workdir, pid, front_pid, setup.flood, setup.victims()))
                results[name].append(result)
                log(f"{name} #{r}: victim p50 {result.p(50) * 1e3:.0f} ms, p90 "
                    f"{result.p(90) * 1e3:.0f} ms ({len(result.ttft_s)} ok, {result.failed} "
                    f"failed), engine {result.output_tokens_per_s:.0f} tok/s, front CPU "
                    f"{result.sidecar_cores:.2f} cores")
    return results


def figures(results: dict[str, list[isolation.ArmResult]]) -> dict[str, dict[str, float]]:
    """Per front: the victim's p50 and p90 over every repeat's window, and the mean output."""
    out = {}
    for name, arms in results.items():
        ttfts = sorted(t for a in arms for t in a.ttft_s)
        out[name] = {"p50_s": percentile(ttfts, 0.5) if ttfts else float("nan"),
                     "p90_s": percentile(ttfts, 0.9) if ttfts else float("nan"),
                     "output_tokens_per_s": statistics.fmean(a.output_tokens_per_s
                                                              for a in arms),
                     "failed": sum(a.failed for a in arms),
                     "front_cores": statistics.fmean(a.sidecar_cores for a in arms)}
    return out


def ratios(f: dict[str, dict[str, float]]) -> dict[str, float]:
    side, epp = f["sidecar"], f["envoy+epp"]
    return {"p50": epp["p50_s"] / side["p50_s"], "p90": epp["p90_s"] / side["p90_s"],
            "output": epp["output_tokens_per_s"] / side["output_tokens_per_s"]}


def passed(r: dict[str, float]) -> bool:
    return r["p50"] <= P50_TARGET and r["p90"] <= P90_TARGET and r["output"] >= OUTPUT_TARGET


def run(ctx: BenchContext) -> BenchResult:
    repeats, warmup, window = (1, 4.0, 8.0) if ctx.quick else (2, 4.0, 12.0)
    f = figures(run_all(repeats, warmup, window, log=ctx.log))
    r = ratios(f)
    table = Table(("front", "victim TTFT p50 ms", "p90 ms", "failed", "engine tok/s",
                   "front CPU cores"),
                  [(name, f"{v['p50_s'] * 1e3:.0f}", f"{v['p90_s'] * 1e3:.0f}",
                    f"{v['failed']:.0f}", f"{v['output_tokens_per_s']:.0f}",
                    f"{v['front_cores']:.2f}") for name, v in f.items()])
    return BenchResult([f"through Envoy + epp against the sidecar: victim p50 {r['p50']:.2f}x, "
                        f"p90 {r['p90']:.2f}x (target {P50_TARGET}x), engine output "
                        f"{r['output']:.2f}x (target {OUTPUT_TARGET}x)"], [table],
                       passed=passed(r))


BENCHMARK = Benchmark("epp_isolation", "epp: isolation through Envoy against the sidecar", run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.epp_isolation",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--warmup", type=float, default=4.0)
    parser.add_argument("--window", type=float, default=12.0)
    a = parser.parse_args(argv)
    f = figures(run_all(a.repeats, a.warmup, a.window))
    r = ratios(f)
    print(json.dumps({"fronts": f, "ratios": r}, indent=1))
    ok = passed(r)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
