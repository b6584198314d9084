"""The report's tables, built once from summary.json's content; the text, Markdown and HTML
renderers only lay them out.

Every number is shown in the unit analysis/units.py declares for its key (latencies in
milliseconds, rates in tokens per second, attainment in percent), and every undefined value
says why in its own cell (analysis/explain.py). Tables come in groups, in the order a reader
asks: tiers and fairness, isolation, tenants, models (when the run's requests name two or
more), the run's health, the comparison with the baseline (collapsed: it is long), and the
run's metadata.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from weighbridge.analysis import explain
from weighbridge.analysis.compare import PREFIX_CACHE_KEYS, Difference
from weighbridge.analysis.headline import slo_target
from weighbridge.analysis.units import (
    INDEX,
    MINUS,
    RATIO,
    TIMES,
    TOKENS,
    WEIGHTED_TOKENS,
    Unit,
    number,
    unit_of,
)

SERVICE = "Service: tiers and fairness"
ISOLATION = "Isolation"
TENANTS = "Tenants"
MODELS = "Models"
PROGRAMS = "Agent programs"
HEALTH = "The run's health: Little's Law and stability"
COMPARISON = "Against the baseline"
RUN = "Run"


@dataclass(frozen=True, slots=True)
class Table:
    title: str
    columns: tuple[str, ...]
    rows: Sequence[tuple[str, ...]]
    notes: list[str] = field(default_factory=list)
    group: str = ""
    collapsed: bool = False  # HTML and Markdown: folded under its title until opened


def cell(value: float | None, unit: Unit, why: str | None) -> str:
    """A value in its unit (the unit's label is in the column header), or why it is
    undefined."""
    if value is None:
        return explain.undefined(why or "not measured")
    return unit.format(value)


def count(x: int | float) -> str:
    return f"{x:,.0f}"


def report_tables(s: dict[str, Any], comparison: list[Difference] | None = None,
                  baseline_id: str | None = None) -> list[Table]:
    tables = [tier_table(s), fairness_table(s)]
    if "isolation" in s:
        tables.append(isolation_table(s))
    tables += [tenant_table(s), latency_table(s)]
    if "models" in s:
        tables.append(model_table(s))
    if "programs" in s:
        tables += [program_table(s), program_fairness_table(s)]
    tables += [littles_law_table(s), stability_table(s)]
    if comparison is not None:
        tables.append(comparison_table(comparison, s["run"]["run_id"], baseline_id or "baseline"))
    tables.append(run_table(s))
    return tables


def run_table(s: dict[str, Any]) -> Table:
    r = s["run"]
    rows = [("run", r["run_id"]), ("scenario", r["scenario"]), ("started", r["started_at"]),
            ("target", r["target"]), ("duration", f"{r['duration_s']:.1f} s"),
            ("records", f"{r['records']:,}"), ("window", f"{r['window_s']:g} s")]
    if r.get("git_commit"):
        rows.append(("commit", r["git_commit"]))
    return Table("Run", ("", ""), rows, group=RUN)


def tenant_table(s: dict[str, Any]) -> Table:
    rows = []
    for name, t in s["tenants"].items():
        rejections = ", ".join(f"{k} {v:,}" for k, v in t["rejections"].items()) or "none"
        rows.append((name, t["tier"], number(t["weight"]), count(t["requests"]),
                     count(t["ok"]), count(t["rejected"]), count(t["failed"]),
                     count(t["cancelled"]), count(t["prompt_tokens"]),
                     *(cell(t[k], unit_of(k), explain.tenant_figure(t, k))
                       for k in PREFIX_CACHE_KEYS),
                     count(t["output_tokens"]), rejections))
    return Table("Tenants: requests and tokens",
                 ("tenant", "tier", "weight", "requests", "ok", "rejected", "failed",
                  "cancelled", "prompt tokens", "computed", "cached", "hit rate %",
                  "output tokens", "rejections"), rows,
                 ["Prompt tokens computed and cached: of the requests whose server reported "
                  "usage.prompt_tokens_details.cached_tokens; hit rate = cached / (computed "
                  "+ cached)."],
                 group=TENANTS)


LATENCY_KEYS = ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "ttft_p999_s", "e2e_p50_s",
                "e2e_p99_s", "itl_p50_s", "itl_p99_s", "decode_tps_p50")


def latency_table(s: dict[str, Any]) -> Table:
    rows = []
    for name, t in s["tenants"].items():
        rows.append((name, *(cell(t[k], unit_of(k), explain.tenant_figure(t, k))
                             for k in LATENCY_KEYS)))
    return Table("Tenants: latency and decode speed",
                 ("tenant", "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "TTFT p99.9 ms",
                  "E2E p50 ms", "E2E p99 ms", "ITL p50 ms", "ITL p99 ms",
                  "decode p50 tok/s"), rows,
                 ["TTFT over requests that got a first token; E2E over ok requests; "
                  "ITL p50 over the requests' median gaps, p99 over their p99 gaps."],
                 group=TENANTS)


MODEL_KEYS = ("ttft_p50_s", "ttft_p99_s", "output_tokens_per_s", "token_share")


def model_table(s: dict[str, Any]) -> Table:
    rows = []
    for name, m in s["models"].items():
        rejections = ", ".join(f"{k} {v:,}" for k, v in m["rejections"].items()) or "none"
        rows.append((name, count(m["requests"]), count(m["ok"]), count(m["rejected"]),
                     count(m["failed"]),
                     *(cell(m[k], unit_of(k), explain.model_figure(m, k)) for k in MODEL_KEYS),
                     rejections))
    return Table("Models: requests, latency and token share",
                 ("model", "requests", "ok", "rejected", "failed", "TTFT p50 ms",
                  "TTFT p99 ms", "output tok/s", "token share %", "rejections"), rows,
                 ["The model each request named (a base model or a LoRA adapter); "
                  "(none): requests that named none. Output tok/s over the run's duration; "
                  "token share: of all prompt and output tokens served."],
                 group=MODELS)


PROGRAM_KEYS = ("completion_p50_s", "completion_p90_s", "completion_p99_s",
                "programs_in_progress", "programs_per_s", "program_time_in_system_s",
                "program_ratio")


def program_table(s: dict[str, Any]) -> Table:
    rows = []
    for name, t in s["programs"]["tenants"].items():
        rows.append((name, count(t["programs"]), count(t["programs_completed"]),
                     count(t["programs_failed"]), count(t["programs_unfinished"]),
                     count(t["subagents"]),
                     *(cell(t[k], unit_of(k), explain.program_figure(t, k))
                       for k in PROGRAM_KEYS)))
    return Table("Agent programs: completion time and Little's Law",
                 ("tenant", "programs", "completed", "failed", "unfinished", "subagents",
                  "completion p50 s", "completion p90 s", "completion p99 s",
                  "L programs", "\u03bb programs/s", "W s", "L / \u03bbW"), rows,
                 ["A program is what a person started, with every subagent it forked; its "
                  "completion time runs from its first call's scheduled send to its last "
                  "call's end, tool runs and subagents included. Failed: a call ended "
                  "neither ok nor cut off by the run; unfinished: the run ended first (in "
                  "the system until then, for L and W)."],
                 group=PROGRAMS)


def program_fairness_table(s: dict[str, Any]) -> Table:
    p = s["programs"]
    rows = [(name, number(t["weight"]), count(t["computed_tokens"]),
             number(t["computed_tokens"] / t["weight"]))
            for name, t in s["tenants"].items() if t["requests"]]
    rows.append(("Jain's index", "", "", cell(p["computed_tokens_jain_index"], INDEX,
                                              explain.program_fairness(p))))
    return Table("Tenant fairness beside the programs: tokens the server computed",
                 ("tenant", "weight", f"computed {TOKENS.name}", "per unit of weight"), rows,
                 ["Computed: output tokens, and the prompt tokens the server's prefix cache "
                  "did not answer (all of them where it reported no cached tokens). Jain's "
                  "index over the tenants that sent requests, per unit of weight, over the "
                  "whole run."],
                 group=PROGRAMS)


def tier_table(s: dict[str, Any]) -> Table:
    rows = []
    for name, t in s["tiers"].items():
        def c(key: str, t: dict[str, Any] = t) -> str:
            return cell(t[key], unit_of(key), explain.tier_figure(t, key))

        rows.append((name, slo_target(t), count(t["requests"]),
                     f"{t['met']:,}/{t['judged']:,}", c("slo_attainment"),
                     c("goodput_tokens_per_s"), c("ttft_p50_s"), c("ttft_p99_s"),
                     c("ttft_p999_s"), c("e2e_p99_s")))
    return Table("Tiers", ("tier", "SLO", "requests", "met/judged", "attainment %",
                           "goodput tok/s", "TTFT p50 ms", "TTFT p99 ms", "TTFT p99.9 ms",
                           "E2E p99 ms"), rows,
                 ["Rejected and failed requests are misses; cancelled ones are not judged. "
                  "Goodput: tokens of the requests that met the SLO, per second of the run."],
                 group=SERVICE)


def fairness_table(s: dict[str, Any]) -> Table:
    f = s["fairness"]
    window, fraction = s["run"]["window_s"], f["backlog_fraction"]
    run_why = explain.run_fairness(f, window)
    rows = [("run (worst tier)", "", "", cell(f["jain_index"], INDEX, run_why),
             cell(f["max_min_share_ratio"], RATIO, explain.run_share_ratio(f, window)),
             cell(f["max_service_difference"], WEIGHTED_TOKENS, run_why), "")]
    for name, t in f["tiers"].items():
        why = explain.tier_fairness(t, window, fraction)
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in t["service_over_entitlement"].items())
        rows.append((name, ", ".join(t["tenants"]), str(t["judged_windows"]),
                     cell(t["jain_index"], INDEX, why),
                     cell(t["max_min_share_ratio"], RATIO,
                          explain.share_ratio(t, window, fraction)),
                     cell(t["max_service_difference"], WEIGHTED_TOKENS, why),
                     ratios or explain.undefined(why or "no tenant was backlogged")))
    return Table("Fairness (weight-normalised token service of backlogged tenants)",
                 ("tier", "tenants", "judged windows", "Jain", f"max/min share {TIMES}",
                  "max service diff tokens/weight", "service / entitlement"), rows,
                 [f"Backlogged: a request waiting for its first token during at least "
                  f"{fraction:.0%} of a {window:g} s window. A window is judged when two or "
                  f"more tenants of the tier were backlogged in it."],
                 group=SERVICE)


def isolation_table(s: dict[str, Any]) -> Table:
    i = s["isolation"]

    def c(key: str) -> str:
        return cell(i[key], unit_of(key), explain.isolation_figure(i, key))

    return Table("Isolation", ("victim", "quiet phase", "quiet TTFT p99 ms", "flood phase",
                               "flood TTFT p99 ms", f"flood / quiet {TIMES}", "leakage"),
                 [(f"{i['victim']} ({i['victim_from']})", i["quiet_phase"],
                   c("quiet_ttft_p99_s"), i["flood_phase"], c("flood_ttft_p99_s"),
                   c("flood_over_quiet"), c("leakage"))],
                 [f"flood / quiet and leakage = max(0, 1 {MINUS} quiet / flood) of the victim's "
                  "p99 TTFT."], group=ISOLATION)


def littles_law_table(s: dict[str, Any]) -> Table:
    rows = []
    for name, v in s["littles_law"].items():
        w, wk = v["time_in_system_s"], v["token_time_in_system_s"]
        why_r, why_k = explain.littles_law(v, "request_ratio"), explain.littles_law(v,
                                                                                   "token_ratio")
        rows.append((name, count(v["arrivals"]), number(v["in_flight"]),
                     cell(v["arrival_rate"] * w if w is not None else None, INDEX, why_r),
                     cell(v["request_ratio"], INDEX, why_r), number(v["tokens_in_flight"]),
                     cell(v["token_arrival_rate"] * wk if wk is not None else None, INDEX,
                          why_k),
                     cell(v["token_ratio"], INDEX, why_k)))
    return Table("Little's Law (L against λ·W over the run)",
                 ("tenant", "arrivals", "L requests", "λ·W requests", "ratio", "L tokens",
                  "λ·W tokens", "ratio"), rows,
                 ["Tokens: every prompt token (cached ones too) plus the output."],
                 group=HEALTH)


def stability_table(s: dict[str, Any]) -> Table:
    st = s["stability"]
    verdict = {True: "stable", False: "UNSTABLE",
               None: explain.undefined(explain.stability(st, "stability_ratio") or "")}
    notes = ["Offered and served count every prompt token, cached ones too (as vLLM's "
             "vllm:prompt_tokens_total does): the load asked for, not the compute it took.",
             "\u03c1: offered tokens/s over the engines' capacity, the step budget B over the time "
             "of a full step t_step summed over the backends (the seed's λ(m_p + m_d) < "
             "B / t_step); it warns before the ratio does, which stays near 1 until the "
             "backlog grows."]
    by_backend = st.get("utilisation_by_backend") or {}
    if by_backend:
        notes.append("\u03c1 per backend (the tokens it computed): " + ", ".join(
            f"{b} {v:.2f}" for b, v in sorted(by_backend.items())) + ".")
    return Table("Stability", ("offered tok/s", "served tok/s", "offered / served",
                               "\u03c1 offered / (B / t_step)", "verdict"),
                 [(*(cell(st.get(k), unit_of(k), explain.stability(st, k))
                     for k in ("offered_tokens_per_s", "served_tokens_per_s",
                               "stability_ratio", "utilisation")), verdict[st["stable"]])],
                 notes, group=HEALTH)


def _size(r: Difference) -> tuple[int, float, str]:
    """Sort key: the largest relative change first; undefined ones last, by path."""
    rel = r.relative
    return (0, -abs(rel), r.path) if rel is not None else (1, 0.0, r.path)


def comparison_table(rows: list[Difference], this_id: str, baseline_id: str) -> Table:
    out = []
    for r in sorted(rows, key=_size):
        if r.this is None and r.baseline is None:
            continue
        unit = unit_of(r.path)
        label = f"{r.path} ({unit.name})" if unit.name else r.path
        why_this = "undefined in this run" if r.this is None else None
        why_base = "undefined in the baseline" if r.baseline is None else None
        relative = (explain.undefined(explain.relative(r.this, r.baseline) or "")
                    if r.relative is None else f"{r.relative:+.1%}".replace("-", MINUS))
        out.append((label, cell(r.this, unit, why_this), cell(r.baseline, unit, why_base),
                    explain.undefined(explain.difference(r.this, r.baseline) or "")
                    if r.difference is None else unit.format_difference(r.difference),
                    relative))
    return Table(f"Comparison: {this_id} against baseline {baseline_id} "
                 f"({len(out)} figures, largest relative change first)",
                 ("metric (unit)", this_id, baseline_id, "difference", "relative"), out,
                 [f"difference = this {MINUS} baseline; relative = difference / |baseline|."],
                 group=COMPARISON, collapsed=True)


