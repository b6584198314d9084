"""The endpoint picker's cost (issue 42): CPU per request of Envoy + ``weighbridge epp`` in
each body mode, against the sidecar alone, Envoy alone (the floor of the gateway path) and
HAProxy, with the TTFT each adds against direct, all at 200 streamed requests/s in one run;
and whether each mode settles usage exactly.

Each row is ``benchmarks.sidecar_overhead``'s experiment: two independent Poisson streams of
``RATE`` requests/s of 16-token streamed answers, one through the proxy under test to one
emulator, the other direct to an identical emulator, at the same moments; the difference of
their TTFT percentiles is what the proxy adds. CPU is each process group's own (Envoy's and
the picker's apart), over the requests served.

The picker's rows (docs/decisions/0013):

* ``full duplex / full duplex``: the request body held in the picker until dispatch (late
  binding), every response chunk through the picker, usage read from the stream's last chunk
  (exact, as the sidecar settles it);
* ``full duplex / NONE``: the response body never reaches the picker; the request is settled
  at its response headers' stream end with its estimate (inexact);
* ``buffered / NONE``: Envoy buffers the request body and sends it whole; the same estimate,
  and the mode in which ``failure_mode_allow`` (fail-open) applies.

"usage settled" is measured apart, on answers of varied length (no ``ignore_eos``, up to 64
tokens, 16 on average, at ``USAGE_RATE``): the picker's output tokens counted
(``weighbridge_tokens_served_total``) over the engine's own (``vllm:generation_tokens_total``);
1.00 is exact. (On the cost rows' 16-token answers with ``ignore_eos`` every estimate is
exact, which would hide the difference.)

``python -m benchmarks.epp_cost [--quick] [--rate 200] [--seconds 15] [--passes 2]``
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from benchmarks import _system
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks.sidecar_overhead import ENGINE, MODEL, drive, sidecar_config
from weighbridge.launch import (
    EnvoyModes,
    ServerProcess,
    emulator_process,
    envoy_config,
    envoy_process,
    epp_process,
    free_port,
    haproxy_process,
    sidecar_process,
)
from weighbridge.statistics import percentile

RATE = 200.0
USAGE_RATE, USAGE_SECONDS = 20.0, 10.0
USAGE_BODY = orjson.dumps({"model": MODEL, "prompt": list(range(10, 42)), "max_tokens": 64,
                           "stream": True})
# Issue 42's target, in the default mode: the picker's own CPU at most the sidecar's alone,
# and Envoy + picker at most twice the sidecar's alone.
PICKER_TARGET, GATEWAY_TARGET = 1.0, 2.0

MODES = {
    "full duplex / full duplex": EnvoyModes(),
    "full duplex / NONE": EnvoyModes(response_body="NONE"),
    "buffered / NONE": EnvoyModes(request_body="BUFFERED", response_body="NONE"),
}
DEFAULT_MODE = "full duplex / full duplex"


@dataclass(frozen=True, slots=True)
class Row:
    requests: int
    failures: int
    cpu_s: dict[str, float]  # process name -> CPU over the passes
    added_p50_s: float
    added_p99_s: float
    settled: float | None  # picker's output tokens over the engines' (1.0 exact)

    def per_request_us(self, name: str | None = None) -> float:
        cpu = self.cpu_s[name] if name is not None else sum(self.cpu_s.values())
        return cpu / max(1, self.requests) * 1e6


# A setup: the engine's URL -> its processes, the URL to send to, and the picker's /metrics.
Setup = Callable[[str], contextlib.AbstractContextManager[tuple[dict[str, ServerProcess],
                                                               str, str | None]]]


@contextlib.contextmanager
def _sidecar(engine: str) -> Iterator[tuple[dict[str, ServerProcess], str, str | None]]:
    with sidecar_process(sidecar_config(engine, {}), name="epp-cost-sidecar") as proc:
        yield {"sidecar": proc}, proc.url, None


def _endpoint(url: str) -> tuple[str, int]:
    host, _, port = url.removeprefix("http://").rpartition(":")
    return host, int(port)


@contextlib.contextmanager
def _envoy(engine: str) -> Iterator[tuple[dict[str, ServerProcess], str, str | None]]:
    port, admin = free_port(), free_port()
    with envoy_process(envoy_config(port, admin, None, fallback=[_endpoint(engine)]), port,
                       admin, name="epp-cost-envoy") as envoy:
        yield {"envoy": envoy}, envoy.url, None


def _picker(modes: EnvoyModes) -> Setup:
    @contextlib.contextmanager
    def setup(engine: str) -> Iterator[tuple[dict[str, ServerProcess], str, str | None]]:
        picker, grpc_port = epp_process(sidecar_config(engine, {}), name="epp-cost-epp")
        port, admin = free_port(), free_port()
        with picker, envoy_process(envoy_config(port, admin, [("127.0.0.1", grpc_port)], modes),
                                   port, admin, name="epp-cost-envoy") as envoy:
            yield {"envoy": envoy, "epp": picker}, envoy.url, picker.url
    return setup


@contextlib.contextmanager
def _haproxy(engine: str) -> Iterator[tuple[dict[str, ServerProcess], str, str | None]]:
    with haproxy_process([engine], Path(tempfile.mkdtemp(prefix="weighbridge-haproxy-")),
                         health_path="/health") as proc:
        yield {"haproxy": proc}, proc.url, None


def measure(setup: Setup, rate: float, seconds: float, passes: int,
            log: Callable[[str], None] = print) -> Row:
    direct: list[float] = []
    through: list[float] = []
    failures = 0
    cpu: dict[str, float] = {}
    settled = None
    with emulator_process(name="epp-cost-direct", **ENGINE, mean_output_tokens=16) as engine, \
            emulator_process(name="epp-cost-behind", **ENGINE, mean_output_tokens=16) as behind, \
            setup(behind.url) as (processes, url, metrics):
        uvloop.run(drive(engine.url, url, min(rate, 50), 1.0, seed=0, sidecar_first=False))
        for k in range(passes):
            before = {n: _system.group_sched(p.pid) for n, p in processes.items()
                      if p.pid is not None}
            d, s = uvloop.run(drive(engine.url, url, rate, seconds, seed=k + 1,
                                     sidecar_first=k % 2 == 1))
            for n, p in processes.items():
                if p.pid is not None:
                    cpu[n] = cpu.get(n, 0.0) + (_system.group_sched(p.pid) - before[n]).cpu_s
            direct += d.ttft_s
            through += s.ttft_s
            failures += d.failures + s.failures
            log(f"pass {k + 1}/{passes}: {len(s.ttft_s)} through, {s.failures} failed; CPU "
                + ", ".join(f"{n} {c / max(1, len(through)) * 1e6:.0f} µs"
                            for n, c in cpu.items()))
        if metrics is not None:
            settled = usage_settled(engine.url, behind.url, url, metrics)
    direct.sort()
    through.sort()
    return Row(len(through), failures, cpu,
               percentile(through, 0.5) - percentile(direct, 0.5),
               percentile(through, 0.99) - percentile(direct, 0.99), settled)


def usage_settled(direct: str, behind: str, url: str, metrics: str) -> float:
    """The picker's output tokens over the engine's, on answers of varied length."""
    picker_before, engine_before = _total(metrics, "weighbridge_tokens_served_total",
                                          kind="output"), _total(behind,
                                                                 "vllm:generation_tokens_total")
    uvloop.run(drive(direct, url, USAGE_RATE, USAGE_SECONDS, seed=99, sidecar_first=False,
                     body=USAGE_BODY))
    time.sleep(1.0)  # the last streams' ends reach the counters
    picker = _total(metrics, "weighbridge_tokens_served_total", kind="output") - picker_before
    engine = _total(behind, "vllm:generation_tokens_total") - engine_before
    return picker / engine if engine else float("nan")


def _total(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v
                                           for k, v in labels.items()):
                total += sample.value
    return total


def rows(rate: float, seconds: float, passes: int, log: Callable[[str], None] = print
         ) -> dict[str, Row]:
    setups: dict[str, Setup] = {"sidecar alone": _sidecar, "Envoy alone": _envoy}
    setups.update({f"Envoy + epp, {name}": _picker(modes) for name, modes in MODES.items()})
    if shutil.which("haproxy"):
        setups["HAProxy"] = _haproxy
    found = {}
    for name, setup in setups.items():
        log(f"{name}: {passes} passes of {seconds:.0f} s at {rate:.0f} req/s, and direct")
        found[name] = measure(setup, rate, seconds, passes, log)
    return found


def table(found: dict[str, Row]) -> Table:
    def us(row: Row, name: str) -> str:
        return f"{row.per_request_us(name):.0f}" if name in row.cpu_s else ""

    return Table(
        ("setup", "requests", "failed", "CPU µs/request (all)", "Envoy", "epp", "added TTFT "
         "p50 ms", "added p99 ms", "usage settled"),
        [(name, str(r.requests), str(r.failures), f"{r.per_request_us():.0f}",
          us(r, "envoy"), us(r, "epp"), f"{r.added_p50_s * 1e3:.2f}",
          f"{r.added_p99_s * 1e3:.2f}", "" if r.settled is None else f"{r.settled:.2f}")
         for name, r in found.items()])


def summary(found: dict[str, Row]) -> tuple[list[str], bool]:
    sidecar = found["sidecar alone"].per_request_us()
    lines = []
    ok = True
    for name in MODES:
        row = found[f"Envoy + epp, {name}"]
        picker, gateway = row.per_request_us("epp") / sidecar, row.per_request_us() / sidecar
        lines.append(f"{name}: the picker {picker:.2f}x the sidecar alone (target "
                     f"{PICKER_TARGET:.1f}x), Envoy + picker {gateway:.2f}x (target "
                     f"{GATEWAY_TARGET:.1f}x); usage settled "
                     f"{row.settled if row.settled is not None else float('nan'):.2f}")
        if name == DEFAULT_MODE:
            ok = picker <= PICKER_TARGET and gateway <= GATEWAY_TARGET
    return lines, ok


def run(ctx: BenchContext) -> BenchResult:
    seconds, passes = (5.0, 1) if ctx.quick else (15.0, 2)
    found = rows(RATE, seconds, passes, ctx.log)
    lines, ok = summary(found)
    return BenchResult(lines, [table(found)], notes=[__doc__.split("\n\n")[1]], passed=ok)


BENCHMARK = Benchmark("epp_cost", "epp: CPU per request of Envoy + picker at 200 req/s", run)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.epp_cost",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rate", type=float, default=RATE)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--passes", type=int, default=2)
    args = parser.parse_args(argv)
    seconds, passes = (5.0, 1) if args.quick else (args.seconds, args.passes)
    found = rows(args.rate, seconds, passes)
    print(table(found).markdown())
    lines, ok = summary(found)
    print("\n".join(lines))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
