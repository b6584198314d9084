"""``weighbridge report`` over 1,000,000 records (target: under 15 s end to end).

A synthetic run directory (20 tenants over three tiers, quiet/flood/recovery phases, every
status, 1 h of arrivals) is written as the load generator leaves one: run.json and a
``requests.parquet`` in 50,000-row groups, as ``finish_run`` writes it. The figure is the
whole report — read, analyse, text, Markdown with its PNG plots, HTML with its interactive
plots, summary.json and lengths.json — against the baseline of reading the same file with
``pyarrow.parquet.read_table`` in the same run.

``python -m benchmarks report_speed [--quick]`` (``--quick``: 100,000 records).
"""

from __future__ import annotations

import io
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from rich.console import Console

from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from weighbridge.analysis.report import ReportRequest, make_report
from weighbridge.records import RECORD_SCHEMA
from weighbridge.rundir import PhaseInfo, RunInfo, TenantInfo, write_run_info

TARGET_S = 15.0
DURATION_S = 3600.0
TIERS = ("interactive", "standard", "batch")


def write_synthetic_run(run_dir: Path, records: int, seed: int = 1) -> None:
    rng = np.random.default_rng(seed)
    tenants = [f"tenant-{i:02d}" for i in range(20)]
    tier_of = {t: TIERS[i % 3] for i, t in enumerate(tenants)}
    phases = [("quiet", 0.0, 1200.0), ("flood", 1200.0, 2400.0), ("recovery", 2400.0, 3600.0)]
    write_run_info(run_dir, RunInfo.now(
        run_id="bench", scenario="synthetic", target="http://127.0.0.1:1", duration_s=DURATION_S,
        tenants=[TenantInfo(name=t, tier=tier_of[t], weight=float(1 + i % 4))
                 for i, t in enumerate(tenants)],
        phases=[PhaseInfo(name=n, start_s=s, end_s=e) for n, s, e in phases]))
    n = records
    scheduled = np.sort(rng.uniform(0, DURATION_S - 30, n))
    tenant = rng.choice(tenants, n)
    status = rng.choice(np.array(["ok", "rejected", "error", "cancelled", "timeout"]), n,
                        p=[0.9, 0.05, 0.02, 0.02, 0.01])
    ok = status == "ok"
    started = ok | (status == "cancelled")
    ttft = rng.lognormal(-2.0, 1.0, n)
    output = rng.integers(2, 512, n)
    prompt = rng.integers(16, 4096, n)
    decode = output / rng.uniform(20, 60, n)
    first = np.where(started, scheduled + ttft, np.nan)
    last = np.where(started, first + decode, np.nan)
    end = np.where(started, last + 0.001, scheduled + 0.005)
    phase = np.select([scheduled < 1200, scheduled < 2400], ["quiet", "flood"], "recovery")
    reason = np.where(status == "rejected", "queue_full",
                      np.where(status == "ok", None, status)).astype(object)
    known = lambda values: pa.array(np.where(started, values, 0), mask=~started)  # noqa: E731
    columns = {
        "run_id": pa.array(["bench"] * n), "scenario": pa.array(["synthetic"] * n),
        "phase": pa.array(phase), "request_id": pa.array([f"r{i}" for i in range(n)]),
        "tenant": pa.array(tenant), "tier": pa.array([tier_of[t] for t in tenant]),
        "user": pa.nulls(n, pa.string()), "endpoint": pa.array(["/v1/completions"] * n),
        "stream": pa.array(np.ones(n, dtype=bool)), "max_tokens": pa.array(np.full(n, 512)),
        "scheduled_s": pa.array(scheduled), "sent_s": pa.array(scheduled + 0.001),
        "first_token_s": pa.array(first, mask=~started),
        "last_token_s": pa.array(last, mask=~started), "end_s": pa.array(end),
        "prompt_tokens": known(prompt), "output_tokens": known(output),
        "chunks": pa.array(np.where(started, output, 0)),
        "itl_p50_s": known(1 / 40), "itl_p99_s": known(0.08), "itl_max_s": known(0.2),
        "status": pa.array(status), "http_status": pa.array(np.where(ok, 200, 500)),
        "reason": pa.array(reason, type=pa.string()), "backend": pa.nulls(n, pa.string()),
        "queue_s": pa.array(ttft / 2), "model": pa.nulls(n, pa.string()),
    }
    table = pa.Table.from_pydict(columns).cast(RECORD_SCHEMA)
    pq.write_table(table, run_dir / "requests.parquet", compression="zstd",
                   row_group_size=50_000)


def _time(fn: object, repeats: int) -> list[float]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        samples.append(time.perf_counter() - start)
    return samples


def run(ctx: BenchContext) -> BenchResult:
    records = 100_000 if ctx.quick else 1_000_000
    work = Path(tempfile.mkdtemp(prefix="weighbridge-report-bench-"))
    try:
        run_dir = work / "run"
        run_dir.mkdir()
        ctx.log(f"writing {records:,} synthetic records")
        write_synthetic_run(run_dir, records)
        size_mb = (run_dir / "requests.parquet").stat().st_size / 1e6
        request = ReportRequest(run_dir=run_dir, out_dir=work / "out")
        quiet = Console(file=io.StringIO(), width=160)
        baseline = _time(lambda: pq.read_table(run_dir / "requests.parquet"), 3)
        report = _time(lambda: make_report(request, quiet), 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    base, full = statistics.median(baseline), statistics.median(report)
    passed = full < TARGET_S
    return BenchResult(
        summary=[f"report over {records:,} records: {full:.2f} s median of 3 "
                 f"(target < {TARGET_S:.0f} s); {full / base:.1f}x a plain "
                 f"pyarrow.parquet.read_table of the same file ({base:.2f} s)"],
        tables=[Table(("step", "median s", "min s", "max s", "ratio to read_table"), [
            ("pyarrow.parquet.read_table (baseline)", f"{base:.2f}", f"{min(baseline):.2f}",
             f"{max(baseline):.2f}", "1.0"),
            ("weighbridge report, all four formats", f"{full:.2f}", f"{min(report):.2f}",
             f"{max(report):.2f}", f"{full / base:.1f}"),
        ], caption=f"{records:,} records, {size_mb:.1f} MB of Parquet, 20 tenants, 3 tiers, "
                   f"3 phases, 1 h run, 10 s windows")],
        notes=["The report reads only the columns it needs, labels as dictionaries "
               "(pandas categoricals), and never builds RequestRecord objects.",
               "End to end as the CLI runs it, minus interpreter start-up and imports: read, "
               "analyse, rich text (into a buffer), Markdown with its PNG plots, HTML with its "
               "interactive plots, "
               "summary.json and lengths.json written to disk."],
        passed=passed,
    )


BENCHMARK = Benchmark("report_speed", "analysis: weighbridge report over 1M records", run)
