"""``python -m benchmarks.soak`` (``make soak``): ten minutes of steady multi-tenant load
with periodic bursts through the sidecar, watching for leaks.

One emulator, one sidecar, and the Locust generator running the ``burst`` scenario (an
on/off tenant: 5 s at 30 requests/s every 15 s) with three steady tenants added, stretched to
``--duration``. Every ``--sample-s`` the sidecar's resident memory, open file descriptors and
ledger are read from /proc and /metrics. Passes when:

* **no request is lost**: on the sidecar's /metrics, arrivals = completed + rejected +
  cancelled + failed with nothing in flight after the run; the generator's records say the
  same (every request it sent arrived, and each outcome matches the sidecar's count);
* **resident memory grows under 10 % after warm-up**: the peak RSS of the last
  ``--window-s`` against the peak during warm-up (which holds several bursts);
* **open file descriptors do not grow**: idle after the run, no more than idle before it.

Not part of ``make test`` or ``make bench`` (this module defines no ``BENCHMARK``); it writes
its own section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from benchmarks import _prom, _results
from benchmarks._core import REPO, Benchmark, BenchResult, Table
from weighbridge.launch import ServerProcess, emulator_process, sidecar_process
from weighbridge.loadgen.accounting import GENERATOR_PROBES, records_by_end
from weighbridge.records import RequestRecord, read_parquet

MAX_GROWTH = 0.10
# Idle upstream connections the sidecar may keep: its metrics polls (every 250 ms) and health
# probes (every 1 s) reuse the pool's most recently used connection, so few stay warm, and
# never more than keep-alive (4 s) x polls per second however long it idles: not a leak.
UPSTREAM_POOL_BOUND = 4 * (4 + 1) + 1
LOCUST = Path(sys.executable).with_name("locust")
SCENARIO_S = 60.0  # the burst scenario's own length; --stretch scales it

# Each burst: 5 s at this rate, more than the engine serves, so the sidecar's queue fills and
# the bounded queue turns part of it away (the soak exercises queueing and rejection too).
BURST_RATE = 150
MAX_QUEUED = 300
# Locust's tenants: the burst scenario's two plus three steady ones (two API tenants and an
# interactive chat), all with keys the sidecar knows.
_PROMPT = {"kind": "lognormal", "median": 256, "sigma": 0.5, "low": 16, "high": 1024}
GENERATOR_TENANTS: list[dict[str, object]] = [
    {"name": "bursty", "api_key": "sk-soak-bursty", "tier": "standard",
     "endpoint": "completions",
     "lengths": {"prompt": _PROMPT, "output": {"kind": "uniform", "low": 16, "high": 64}},
     "arrival": {"kind": "on_off", "rate": BURST_RATE, "on_s": 5, "off_s": 10}},
    {"name": "alpha", "api_key": "sk-soak-alpha", "tier": "standard",
     "endpoint": "completions",
     "lengths": {"prompt": _PROMPT, "output": {"kind": "uniform", "low": 32, "high": 128}},
     "arrival": {"kind": "poisson", "rate": 3}},
    {"name": "beta", "api_key": "sk-soak-beta", "tier": "batch", "endpoint": "completions",
     "lengths": {"prompt": _PROMPT, "output": {"kind": "uniform", "low": 32, "high": 128}},
     "arrival": {"kind": "poisson", "rate": 2}},
    {"name": "gamma", "api_key": "sk-soak-gamma", "tier": "interactive", "endpoint": "chat",
     "users": 20,
     "lengths": {"prompt": {"kind": "uniform", "low": 64, "high": 256},
                 "output": {"kind": "uniform", "low": 16, "high": 64}},
     "arrival": {"kind": "gamma", "rate": 3, "burstiness": 2}},
]
ENGINE: dict[str, object] = {"max_num_seqs": 48, "num_kv_blocks": 2048,
                             "max_model_len": 4096}


def sidecar_config(backend_url: str) -> dict[str, object]:
    tenants = {
        str(t["name"]): {"tier": t["tier"], "api_keys": [f"plain:{t['api_key']}"],
                         "limits": {"max_queued": MAX_QUEUED}}
        for t in GENERATOR_TENANTS
    }
    return {
        "tenants": tenants,
        "backends": [{"url": backend_url, "name": "engine"}],
        "admission": {"max_running_per_backend": 48, "max_inflight_per_backend": 32,
                      "max_backend_waiting": 4, "headroom_slots": 4},
    }


@dataclass(frozen=True, slots=True)
class Sample:
    at_s: float  # seconds since the load started
    rss_bytes: int
    open_fds: int
    arrived: int
    in_flight: int  # queued + dispatched


@dataclass(frozen=True, slots=True)
class Ledger:
    arrived: int
    completed: int
    rejected: int
    cancelled: int
    failed: int
    queued: int
    dispatched: int

    @property
    def in_flight(self) -> int:
        return self.queued + self.dispatched

    @property
    def unaccounted(self) -> int:
        """Arrivals that are neither ended nor in flight: lost requests (must be 0)."""
        return (self.arrived - self.completed - self.rejected - self.cancelled - self.failed
                - self.in_flight)


def read_ledger(url: str) -> Ledger:
    samples = _prom.parse(httpx.get(url + "/metrics", timeout=10).text)

    def n(name: str) -> int:
        return int(_prom.total(samples, name))

    return Ledger(n("weighbridge_requests_arrived_total"),
                  n("weighbridge_requests_completed_total"),
                  n("weighbridge_requests_rejected_total"),
                  n("weighbridge_requests_cancelled_total"),
                  n("weighbridge_requests_failed_total"),
                  n("weighbridge_requests_queued"), n("weighbridge_requests_dispatched"))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@dataclass
class Sampler:
    """Samples one process's memory, descriptors and the sidecar's ledger on a thread."""

    pid: int
    url: str
    interval_s: float
    samples: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _t0: float = 0.0

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="soak-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def take(self) -> Sample:
        ledger = read_ledger(self.url)
        return Sample(time.monotonic() - self._t0, rss_bytes(self.pid), open_fds(self.pid),
                      ledger.arrived, ledger.in_flight)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.samples.append(self.take())
            except (OSError, httpx.HTTPError):
                continue  # one missed sample; the process is checked at the end


@dataclass(frozen=True, slots=True)
class Figures:
    """The soak's verdict inputs, computed from the samples alone (no I/O)."""

    warmup_peak_rss: int
    final_peak_rss: int
    rss_growth: float  # final window's peak over warm-up's peak, minus 1
    rss_trend_per_min: float  # least-squares slope after warm-up, bytes per minute
    fds_idle_before: int
    fds_idle_after: int
    fds_peak: int
    fds_warmup_peak: int
    fds_final_peak: int  # the peak of the final window


def figures(samples: Sequence[Sample], warmup_s: float, window_s: float,
            fds_idle_before: int, fds_idle_after: int) -> Figures:
    warm = [s for s in samples if s.at_s <= warmup_s]
    after = [s for s in samples if s.at_s > warmup_s]
    if not warm or not after:
        raise ValueError("need samples both in and after the warm-up")
    end = samples[-1].at_s
    final = [s for s in after if s.at_s >= end - window_s] or after[-1:]
    warm_peak = max(s.rss_bytes for s in warm)
    final_peak = max(s.rss_bytes for s in final)
    slope = 0.0
    if len(after) >= 2:
        xs = [s.at_s / 60 for s in after]
        ys = [float(s.rss_bytes) for s in after]
        mx, my = statistics.fmean(xs), statistics.fmean(ys)
        den = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else 0
    return Figures(warm_peak, final_peak, final_peak / warm_peak - 1, slope, fds_idle_before,
                   fds_idle_after, max(s.open_fds for s in samples),
                   max(s.open_fds for s in warm), max(s.open_fds for s in final))




def wait_drained(url: str, timeout_s: float = 60.0) -> Ledger:
    deadline = time.monotonic() + timeout_s
    while True:
        ledger = read_ledger(url)
        if ledger.in_flight == 0 or time.monotonic() > deadline:
            return ledger
        time.sleep(0.5)


def run(duration_s: float, warmup_s: float, window_s: float, sample_s: float,
        work_dir: Path, log: Callable[[str], None] = print) -> BenchResult:
    tenants_file = work_dir / "soak-tenants.yaml"
    tenants_file.write_text(yaml.safe_dump({"tenants": GENERATOR_TENANTS}, sort_keys=False))
    run_dir = work_dir / "run"
    with emulator_process(name="soak-emulator", **ENGINE) as emulator, \
            sidecar_process(sidecar_config(emulator.url), name="soak-sidecar",
                            config_dir=work_dir) as sidecar:
        assert sidecar.pid is not None
        time.sleep(2)
        fds_before = open_fds(sidecar.pid)
        start_ledger = read_ledger(sidecar.url)
        argv = [str(LOCUST), "-f", "scenarios/", "--headless", "--scenario", "burst",
                "--tenants-file", str(tenants_file), "--stretch", f"{duration_s / SCENARIO_S}",
                "--host", sidecar.url, "--records-dir", str(run_dir), "--exporter-port", "0",
                "--only-summary"]
        log(f"$ {shlex.join(argv)}")
        sampler = Sampler(sidecar.pid, sidecar.url, sample_s)
        sampler.start()
        with open(work_dir / "locust.log", "w") as locust_log:
            locust = subprocess.run(argv, cwd=REPO, stdout=locust_log,
                                    stderr=subprocess.STDOUT, timeout=duration_s + 300,
                                    check=False)
        sampler.stop()
        end_ledger = wait_drained(sidecar.url)
        time.sleep(6)  # upstream keep-alive connections close after 4 s idle
        fds_after = open_fds(sidecar.pid)
        rss_after = rss_bytes(sidecar.pid)
        _check_alive(sidecar)
    if not (run_dir / "requests.parquet").is_file():
        raise RuntimeError(f"locust exited {locust.returncode} without a run directory; "
                           f"see {work_dir / 'locust.log'}")
    records = read_parquet(run_dir / "requests.parquet")
    return verdict(sampler.samples, start_ledger, end_ledger, records, fds_before, fds_after,
                   rss_after, duration_s, warmup_s, window_s, run_dir)


def _check_alive(process: ServerProcess) -> None:
    if not process.is_running():
        raise RuntimeError(f"{process.name} died during the soak; log {process.log_path}")


def verdict(samples: Sequence[Sample], start: Ledger, end: Ledger,
            records: Sequence[RequestRecord], fds_before: int, fds_after: int,
            rss_after: int, duration_s: float, warmup_s: float, window_s: float,
            run_dir: Path) -> BenchResult:
    f = figures(samples, warmup_s, window_s, fds_before, fds_after)
    delta = {
        "arrived": end.arrived - start.arrived, "completed": end.completed - start.completed,
        "rejected": end.rejected - start.rejected, "cancelled": end.cancelled - start.cancelled,
        "failed": end.failed - start.failed,
    }
    seen = records_by_end(records)
    seen["completed"] = seen.get("completed", 0) + GENERATOR_PROBES
    sent = sum(seen.values())
    lost = end.unaccounted + end.in_flight
    records_agree = sent == delta["arrived"] and all(
        seen.get(k, 0) == delta[k] for k in ("completed", "rejected", "cancelled", "failed"))
    memory_ok = f.rss_growth < MAX_GROWTH
    # A leaked descriptor stays open when the load is gone; under load the count follows the
    # number of concurrent requests (reported, not judged).
    fds_ok = f.fds_idle_after <= f.fds_idle_before + UPSTREAM_POOL_BOUND
    mib = 1 << 20
    summary = [
        f"lost requests: **{lost}** (sidecar: {delta['arrived']:,} arrived = "
        f"{delta['completed']:,} completed + {delta['rejected']:,} rejected + "
        f"{delta['cancelled']:,} cancelled + {delta['failed']:,} failed, {end.in_flight} in "
        f"flight after the run); generator records "
        f"{'agree' if records_agree else 'DISAGREE'} ({sent:,} sent)",
        f"resident memory growth after warm-up: **{f.rss_growth:+.1%}** (peak "
        f"{f.final_peak_rss / mib:.1f} MiB in the last {window_s:.0f} s vs "
        f"{f.warmup_peak_rss / mib:.1f} MiB in the first {warmup_s:.0f} s; limit "
        f"{MAX_GROWTH:.0%}); trend {f.rss_trend_per_min / mib:+.2f} MiB/min",
        f"open file descriptors: peak **{f.fds_final_peak}** in the last {window_s:.0f} s vs "
        f"{f.fds_warmup_peak} in warm-up; **{f.fds_idle_before} idle before, "
        f"{f.fds_idle_after} idle after** the run (at most {UPSTREAM_POOL_BOUND} warm upstream "
        f"connections are expected, see notes)",
    ]
    by_status = collections.Counter(r.status for r in records)
    rows = [(status, f"{by_status.get(status, 0):,}") for status in
            ("ok", "rejected", "error", "cancelled", "timeout")]
    step = max(1, len(samples) // 12)
    trace = [(f"{s.at_s:.0f}", f"{s.rss_bytes / mib:.1f}", str(s.open_fds), f"{s.arrived:,}",
              str(s.in_flight)) for s in samples[::step]]
    reasons = collections.Counter(r.reason for r in records if r.status == "rejected")
    return BenchResult(
        summary=summary,
        tables=[Table(("generator status", "requests"), rows, "The generator's records:"),
                Table(("t (s)", "RSS (MiB)", "open fds", "arrived", "in flight"), trace,
                      "The sidecar over the run (every few samples):")],
        notes=[
            f"{duration_s:.0f} s of load: the `burst` scenario stretched "
            f"{duration_s / SCENARIO_S:g}x (bursts stay 5 s on / 10 s off, at {BURST_RATE} "
            "requests/s) with three steady tenants added (benchmarks/soak.py "
            "GENERATOR_TENANTS), one cpu-tiny emulator of 48 sequences, every tenant "
            f"`max_queued: {MAX_QUEUED}`.",
            "rejections by reason: " + (", ".join(f"{k} {v}" for k, v in
                                                  sorted(reasons.items())) or "none"),
            f"RSS idle after the run: {rss_after / mib:.1f} MiB. Warm-up peak is the highest "
            "sample of the first minutes, which include several bursts.",
            "Open descriptors idle after the run include the upstream connections the "
            "sidecar's metrics polls and health probes keep warm: aiohttp reuses pooled "
            "connections first-in first-out, so with 5 polls/s and a 4 s keep-alive about 20 "
            "stay open however long the sidecar idles; the count does not grow with load.",
            f"the sidecar's ledger counts the generator's one chat request before the run "
            f"(its template measurement, {GENERATOR_PROBES}), which has no record",
            f"run directory: {run_dir} (kept until the temporary directory is removed)",
        ],
        passed=lost == 0 and records_agree and memory_ok and fds_ok,
        setup=[f"duration {duration_s:.0f} s, warm-up {warmup_s:.0f} s, samples every "
               f"{samples[1].at_s - samples[0].at_s if len(samples) > 1 else 0:.0f} s"],
    )


SOAK = Benchmark(name="soak", title="sidecar soak: steady load with bursts, leaks and losses",
                 run=lambda _ctx: BenchResult([], []))  # run() is called directly


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    parser.add_argument("--warmup", type=float, default=120.0,
                        help="seconds of load before memory is a baseline")
    parser.add_argument("--window", type=float, default=120.0,
                        help="final seconds whose peak memory is compared")
    parser.add_argument("--sample", type=float, default=5.0, help="seconds between samples")
    parser.add_argument("--record", action=argparse.BooleanOptionalAction, default=None,
                        help="write RESULTS.md (default: only for a full 600 s run)")
    parser.add_argument("--work-dir", type=Path, default=None)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    record = args.duration >= 600 if args.record is None else args.record
    work_dir = args.work_dir or Path(tempfile.mkdtemp(prefix="weighbridge-soak-"))
    work_dir.mkdir(parents=True, exist_ok=True)
    standalone = _results.StandaloneRun([os.path.relpath(sys.executable, REPO), "-m",
                                         "benchmarks.soak", *(argv or sys.argv[1:])])
    result = run(args.duration, args.warmup, args.window, args.sample, work_dir)
    section = standalone.section(SOAK, result)
    print(section)
    if record:
        _results.write_section(SOAK.name, section)
        print(f"recorded in {_results.RESULTS_PATH}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
