"""``weighbridge demo``: the noisy-neighbour problem and its fix, side by side, in one command.

Two arms on the same local stack (``deploy/stacks/noisy-neighbour.yaml``: two emulated
engines and the sidecar, Prometheus when installed), each started fresh so both begin on
idle engines: the request-level **baseline** (``policy: fcfs``, ``routing: round_robin``, none
of the fairness admission settings, no tier priorities sent to the engines) and
**weighbridge** (the stack file as written: DRR, least-tokens routing, headroom and prefill
pacing, vLLM priorities). The noisy_neighbour scenario runs headless through each; then one
report compares them. Output directory::

    DIR/baseline/  DIR/weighbridge/   run directories (run.json, requests.parquet)
    DIR/report.html DIR/report.md     the weighbridge run against the baseline
    DIR/figures/*.png                 report.md's plots (victim-ttft.png: the README's)
    DIR/summary.json                  the report's summary, plus "demo": the headline
    DIR/stacks/<arm>/                 logs, the sidecar config, Prometheus's data
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from weighbridge.analysis.frame import load_run
from weighbridge.analysis.headline import HeadlineFigures, headline_figures
from weighbridge.analysis.report import SUMMARY_JSON, ReportRequest, make_report
from weighbridge.analysis.summary import analyse, summary
from weighbridge.app.loadrun import LoadRun
from weighbridge.app.stack import (
    DEFAULT_STACK,
    LocalStack,
    Ports,
    PrometheusMode,
    StackSpec,
    baseline_stack,
    load_stack,
)
from weighbridge.launch import free_port, sigterm_as_interrupt

__all__ = ["ARMS", "DemoOptions", "headline_rows", "run_demo", "verdict"]

ARMS = ("baseline", "weighbridge")
QUICK_STRETCH = 0.4  # noisy_neighbour's 15 + 20 + 25 s phases become 6 + 8 + 10 s
REPORT_WINDOW_S = 2.0  # short phases need short windows for the fairness figures


@dataclass(frozen=True)
class DemoOptions:
    out: Path
    quick: bool = False
    stack_file: Path = DEFAULT_STACK
    prometheus: PrometheusMode = "auto"
    seed: int = 1

    @property
    def stretch(self) -> float:
        return QUICK_STRETCH if self.quick else 1.0


# ----------------------------------------------------------------------------- headline


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.0f} ms"


def _fmt(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def headline_rows(base: HeadlineFigures, fair: HeadlineFigures) -> list[tuple[str, str, str]]:
    """(figure, baseline, weighbridge) rows of the side-by-side table."""
    victim = fair.victim or base.victim or "victim"
    tier1 = fair.tier1 or base.tier1 or "tier 1"
    return [
        (f"{victim} p99 TTFT, quiet", _ms(base.victim_quiet_ttft_p99_s),
         _ms(fair.victim_quiet_ttft_p99_s)),
        (f"{victim} p99 TTFT, flood", _ms(base.victim_flood_ttft_p99_s),
         _ms(fair.victim_flood_ttft_p99_s)),
        ("  flood / quiet", _fmt(base.victim_ratio, ".1f", "x"),
         _fmt(fair.victim_ratio, ".1f", "x")),
        ("Jain's index", _fmt(base.jain_index, ".3f"), _fmt(fair.jain_index, ".3f")),
        (f"{tier1} p99 TTFT", _ms(base.tier1_ttft_p99_s), _ms(fair.tier1_ttft_p99_s)),
        (f"{tier1} SLO attainment", _fmt(base.tier1_slo_attainment, ".1%"),
         _fmt(fair.tier1_slo_attainment, ".1%")),
        ("token throughput", _fmt(base.served_tokens_per_s, ",.0f", " tok/s"),
         _fmt(fair.served_tokens_per_s, ",.0f", " tok/s")),
    ]


def headline_table(base: HeadlineFigures, fair: HeadlineFigures) -> Table:
    table = Table(title="noisy neighbour: request-level baseline (fcfs, round robin) vs "
                        "weighbridge (drr, least tokens)",
                  box=box.SIMPLE_HEAD, title_justify="left", header_style="bold",
                  caption="Jain's index is over tenants of one tier backlogged together "
                          "(—: none were); tier 1's SLO is the run's (report.html).",
                  caption_justify="left")
    table.add_column("")
    table.add_column("baseline", justify="right")
    table.add_column("weighbridge", justify="right")
    for row in headline_rows(base, fair):
        table.add_row(*row)
    return table


def verdict(base: HeadlineFigures, fair: HeadlineFigures) -> str:
    b, f = base.victim_ratio, fair.victim_ratio
    if b is None or f is None:
        return "the victim's TTFT ratio is missing from a run (see the report)"
    if f < b:
        return (f"the flood multiplied the victim's p99 TTFT by {b:.1f}x through the "
                f"request-level baseline and by {f:.1f}x through weighbridge")
    return (f"weighbridge did not help here: the victim's p99 TTFT ratio was {f:.1f}x against "
            f"the baseline's {b:.1f}x (a loaded machine? see the report)")


# ----------------------------------------------------------------------------- running


@dataclass(frozen=True)
class DemoResult:
    baseline: HeadlineFigures
    weighbridge: HeadlineFigures
    written: list[Path]


def _arm_spec(options: DemoOptions, spec: StackSpec, arm: str, ports: Ports) -> StackSpec:
    chosen = baseline_stack(spec) if arm == "baseline" else spec
    return chosen.with_ports(ports).model_copy(update={"prometheus": options.prometheus})


def _run_arm(spec: StackSpec, arm: str, options: DemoOptions, progress: Progress) -> Path:
    out = options.out
    stack_dir = out / "stacks" / arm
    task = progress.add_task(f"{arm}: starting", total=None)
    stack = LocalStack(spec, stack_dir,
                       on_event=lambda m: progress.update(task, description=f"{arm}: {m}"))
    with stack:
        urls = stack.urls
        run = LoadRun(scenario=spec.loadgen.scenario, host=urls.sidecar, run_dir=out / arm,
                      log_path=stack_dir / "logs" / "locust.log", run_id=f"demo-{arm}",
                      tenants_file=spec.tenants_file, stretch=options.stretch,
                      seed=options.seed,
                      exporter_port=free_port() if stack.prometheus is not None else 0)
        duration = run.duration_s()
        where = f" (Prometheus {urls.prometheus})" if urls.prometheus else ""
        progress.update(task, total=duration, completed=0,
                        description=f"{arm}: {spec.loadgen.scenario} through {urls.sidecar}"
                                    f"{where}")
        run.run(on_tick=lambda elapsed: progress.update(task, completed=min(elapsed, duration)))
        progress.update(task, description=f"{arm}: stopping the stack", completed=duration)
    progress.update(task, description=f"{arm}: done, records in {out / arm}")
    return out / arm


def run_demo(options: DemoOptions, console: Console) -> DemoResult:
    spec = load_stack(options.stack_file)
    out = options.out
    for arm in ARMS:
        if (out / arm).exists() and any((out / arm).iterdir()):
            raise FileExistsError(f"{out / arm} is not empty: choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    # Free ports (a `weighbridge up` may hold the stack file's), the same for both arms so
    # the sidecar and Prometheus keep their URLs.
    ports = Ports(sidecar=free_port(), engines=0, prometheus=free_port())
    progress = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                        TimeElapsedColumn(), console=console)
    with sigterm_as_interrupt():
        with progress:
            for arm in ARMS:
                _run_arm(_arm_spec(options, spec, arm, ports), arm, options, progress)
        request = ReportRequest(run_dir=out / "weighbridge", baseline_dir=out / "baseline",
                                out_dir=out, formats=("md", "html", "json"),
                                window_s=REPORT_WINDOW_S)
        result = make_report(request, console)
    summaries = {arm: _summary_of(out, arm, result.summary) for arm in ARMS}
    heads = {arm: headline_figures(s) for arm, s in summaries.items()}
    merged = {**result.summary,
              "demo": {arm: heads[arm].to_json() for arm in ARMS}
              | {"stack": str(options.stack_file), "quick": options.quick,
                 "stretch": options.stretch}}
    (out / SUMMARY_JSON).write_text(json.dumps(merged, indent=2) + "\n")
    console.print(headline_table(heads["baseline"], heads["weighbridge"]))
    console.print(verdict(heads["baseline"], heads["weighbridge"]))
    for path in result.written:
        console.print(f"wrote {path}", highlight=False)
    return DemoResult(heads["baseline"], heads["weighbridge"], result.written)


def _summary_of(out: Path, arm: str, report_summary: dict[str, Any]) -> dict[str, Any]:
    """The arm's own summary: the report's for weighbridge; for the baseline, computed
    again (the report keeps only its headline differences)."""
    if arm == "weighbridge":
        return report_summary
    return summary(analyse(load_run(out / arm), REPORT_WINDOW_S))
