"""The figures ``weighbridge simulate`` prints and writes per policy, from a run directory.

Computed by the report's own code (``weighbridge.analysis.summary``) and read out as the
report's headline figures (``weighbridge.analysis.headline.headline_figures``, as the demo
prints them): victim p99 TTFT in the flood and the quiet phase, Jain's index, tier-1 SLO
attainment, token throughput; plus rejections by reason and each tenant's p50/p99 TTFT; and,
when the run's requests are calls of agent programs, each tenant's program completion
p50/p90/p99 with the programs it completed, and Jain's index over the tenants' computed
tokens beside them (the report's ``programs`` section).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from weighbridge.analysis.frame import load_run
from weighbridge.analysis.headline import headline_figures
from weighbridge.analysis.summary import analyse, summary

__all__ = ["FIGURES", "auto_window_s", "figures", "figures_table"]

# Figures a sweep can plot: key in figures() -> label.
FIGURES = {
    "victim_flood_ttft_p99_s": "victim p99 TTFT, flood (s)",
    "victim_ttft_ratio": "victim p99 TTFT, flood / quiet",
    "jain_index": "Jain's index",
    "tier1_slo_attainment": "tier-1 SLO attainment",
    "served_tokens_per_s": "token throughput (tokens/s)",
    "rejected": "requests rejected",
}


def auto_window_s(duration_s: float) -> float:
    """The report's window: 2 s for short runs (as the demo's), else the report's 10 s."""
    return 2.0 if duration_s < 300 else 10.0


def figures(run_dir: Path, window_s: float) -> dict[str, Any]:
    s = summary(analyse(load_run(run_dir), window_s))
    head = headline_figures(s).to_json()
    rejections: Counter[str] = Counter()
    for tenant in s["tenants"].values():
        rejections.update(tenant.get("rejections") or {})
    programs = s.get("programs") or {}
    return {
        **head,
        "rejections": dict(sorted(rejections.items())),
        "rejected": sum(rejections.values()),
        "tenants": {name: {"requests": t["requests"], "ok": t["ok"],
                           "ttft_p50_s": t["ttft_p50_s"], "ttft_p99_s": t["ttft_p99_s"],
                           "output_tokens": t["output_tokens"],
                           "computed_tokens": t["computed_tokens"],
                           "rejections": t.get("rejections") or {}}
                    for name, t in s["tenants"].items()},
        "programs": {name: {key: t[key] for key in PROGRAM_FIGURES}
                     for name, t in programs.get("tenants", {}).items()},
        "computed_tokens_jain_index": programs.get("computed_tokens_jain_index"),
        "window_s": window_s,
        "run_dir": str(run_dir),
    }


PROGRAM_FIGURES = ("programs", "programs_completed", "completion_p50_s", "completion_p90_s",
                   "completion_p99_s")


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{value * 1000:,.0f} ms"


def _num(value: float | None, spec: str, suffix: str = "") -> str:
    return "—" if value is None else f"{value:{spec}}{suffix}"


def _seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:,.1f} s"


def _program_rows(runs: dict[str, dict[str, Any]]) -> list[tuple[str, list[str]]]:
    """Per tenant with programs: how many completed, and their completion p50 / p90 / p99;
    then Jain's index over the tenants' computed tokens."""
    tenants = list(dict.fromkeys(n for f in runs.values() for n in f.get("programs", {})))
    rows: list[tuple[str, list[str]]] = []
    for name in tenants:
        cells = [f.get("programs", {}).get(name) for f in runs.values()]
        rows.append((f"{name} programs completed",
                     ["—" if c is None else f"{c['programs_completed']:,}/{c['programs']:,}"
                      for c in cells]))
        rows.append((f"{name} program p50 / p90 / p99",
                     ["—" if c is None else " / ".join(_seconds(c[f"completion_{q}_s"])
                                                       for q in ("p50", "p90", "p99"))
                      for c in cells]))
    if tenants:
        rows.append(("Jain's index, computed tokens",
                     [_num(f.get("computed_tokens_jain_index"), ".3f") for f in runs.values()]))
    return rows


def figures_table(title: str, runs: dict[str, dict[str, Any]]) -> Table:
    """One column per policy (or sweep point)."""
    table = Table(title=title, box=box.SIMPLE_HEAD, title_justify="left",
                  header_style="bold")
    table.add_column("")
    for name in runs:
        table.add_column(name, justify="right")
    first = next(iter(runs.values()), {})
    victim = first.get("victim") or "victim"
    tier1 = first.get("tier1") or "tier 1"
    reasons = sorted({r for f in runs.values() for r in f["rejections"]})
    rows: list[tuple[str, list[str]]] = [
        (f"{victim} p99 TTFT, quiet", [_ms(f["victim_quiet_ttft_p99_s"]) for f in runs.values()]),
        (f"{victim} p99 TTFT, flood", [_ms(f["victim_flood_ttft_p99_s"]) for f in runs.values()]),
        ("  flood / quiet", [_num(f["victim_ttft_ratio"], ".1f", "x") for f in runs.values()]),
        ("Jain's index", [_num(f["jain_index"], ".3f") for f in runs.values()]),
        (f"{tier1} SLO attainment",
         [_num(f["tier1_slo_attainment"], ".1%") for f in runs.values()]),
        ("token throughput",
         [_num(f["served_tokens_per_s"], ",.0f", " tok/s") for f in runs.values()]),
    ]
    rows += [(f"rejected: {r}", [str(f["rejections"].get(r, 0)) for f in runs.values()])
             for r in reasons]
    rows += _program_rows(runs)
    if all("simulation" in f for f in runs.values()):
        rows.append(("simulated / wall time",
                     [_num(f["simulation"]["speedup"], ",.0f", "x") for f in runs.values()]))
    for label, cells in rows:
        table.add_row(label, *cells)
    return table
