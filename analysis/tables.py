"""The report's tables, built once from summary.json's content; the text, Markdown and HTML
renderers only lay them out. Latencies are shown in milliseconds, tokens in tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from analysis.compare import Difference


@dataclass(frozen=True, slots=True)
class Table:
    title: str
    columns: tuple[str, ...]
    rows: list[tuple[str, ...]]
    notes: list[str] = field(default_factory=list)


def ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:,.0f}" if abs(x) >= 0.1 else f"{x * 1000:.1f}"


def num(x: float | None, digits: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, int) or (float(x).is_integer() and abs(x) >= 1):
        return f"{int(x):,}"
    return f"{x:,.{digits}g}" if abs(x) < 1000 else f"{x:,.0f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x * 100:.1f}%"


def report_tables(s: dict[str, Any], comparison: list[Difference] | None = None,
                  baseline_id: str | None = None) -> list[Table]:
    tables = [run_table(s), tenant_table(s), latency_table(s), tier_table(s),
              fairness_table(s)]
    if "isolation" in s:
        tables.append(isolation_table(s))
    tables += [littles_law_table(s), stability_table(s)]
    if comparison is not None:
        tables.append(comparison_table(comparison, s["run"]["run_id"], baseline_id or "baseline"))
    return tables


def run_table(s: dict[str, Any]) -> Table:
    r = s["run"]
    rows = [("run", r["run_id"]), ("scenario", r["scenario"]), ("started", r["started_at"]),
            ("target", r["target"]), ("duration", f"{r['duration_s']:.1f} s"),
            ("records", f"{r['records']:,}"), ("window", f"{r['window_s']:g} s")]
    if r.get("git_commit"):
        rows.append(("commit", r["git_commit"]))
    return Table("Run", ("", ""), rows)


def tenant_table(s: dict[str, Any]) -> Table:
    rows = []
    for name, t in s["tenants"].items():
        rejections = ", ".join(f"{k} {v}" for k, v in t["rejections"].items()) or "-"
        rows.append((name, t["tier"], num(t["weight"]), num(t["requests"]), num(t["ok"]),
                     num(t["rejected"]), num(t["failed"]), num(t["cancelled"]),
                     num(t["prompt_tokens"]), num(t["output_tokens"]), rejections))
    return Table("Tenants: requests and tokens",
                 ("tenant", "tier", "weight", "requests", "ok", "rejected", "failed",
                  "cancelled", "prompt tok", "output tok", "rejections"), rows)


def latency_table(s: dict[str, Any]) -> Table:
    rows = []
    for name, t in s["tenants"].items():
        rows.append((name, ms(t["ttft_p50_s"]), ms(t["ttft_p90_s"]), ms(t["ttft_p99_s"]),
                     ms(t["ttft_p999_s"]), ms(t["e2e_p50_s"]), ms(t["e2e_p99_s"]),
                     ms(t["itl_p50_s"]), ms(t["itl_p99_s"]), num(t["decode_tps_p50"])))
    return Table("Tenants: latency (ms) and decode speed",
                 ("tenant", "TTFT p50", "TTFT p90", "TTFT p99", "TTFT p99.9", "E2E p50",
                  "E2E p99", "ITL p50", "ITL p99", "decode tok/s p50"), rows,
                 ["TTFT over requests that got a first token; E2E over ok requests; "
                  "ITL p50 over the requests' median gaps, p99 over their p99 gaps."])


def tier_table(s: dict[str, Any]) -> Table:
    rows = []
    for name, t in s["tiers"].items():
        targets = [f"TTFT ≤ {ms(t['ttft_slo_s'])} ms" if t["ttft_slo_s"] else "",
                   f"E2E ≤ {ms(t['e2e_slo_s'])} ms" if t["e2e_slo_s"] else ""]
        slo = ", ".join(x for x in targets if x) or "completion"
        rows.append((name, slo, num(t["requests"]), f"{t['met']:,}/{t['judged']:,}",
                     pct(t["slo_attainment"]), num(t["goodput_tokens_per_s"]),
                     ms(t["ttft_p50_s"]), ms(t["ttft_p99_s"]), ms(t["ttft_p999_s"]),
                     ms(t["e2e_p99_s"])))
    return Table("Tiers", ("tier", "SLO", "requests", "met/judged", "attainment",
                           "goodput tok/s", "TTFT p50 ms", "TTFT p99 ms", "TTFT p99.9 ms",
                           "E2E p99 ms"), rows,
                 ["Rejected and failed requests are misses; cancelled ones are not judged."])


def fairness_table(s: dict[str, Any]) -> Table:
    f = s["fairness"]
    rows = [("run (worst tier)", "", "", num(f["jain_index"]), num(f["max_min_share_ratio"]),
             num(f["max_service_difference"]), "")]
    for name, t in f["tiers"].items():
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in t["service_over_entitlement"].items())
        rows.append((name, ", ".join(t["tenants"]), str(t["judged_windows"]),
                     num(t["jain_index"]), num(t["max_min_share_ratio"]),
                     num(t["max_service_difference"]), ratios or "-"))
    return Table("Fairness (weight-normalised token service of backlogged tenants)",
                 ("tier", "tenants", "judged windows", "Jain", "max/min share",
                  "max service diff (tok)", "service / entitlement"), rows,
                 [f"Backlogged: a request waiting for its first token during at least "
                  f"{f['backlog_fraction']:.0%} of a {s['run']['window_s']:g} s window; "
                  f"'-' means no window had two backlogged tenants (or one was starved: "
                  f"max/min unbounded)."])


def isolation_table(s: dict[str, Any]) -> Table:
    i = s["isolation"]
    return Table("Isolation", ("victim", "quiet phase", "quiet TTFT p99 ms", "flood phase",
                               "flood TTFT p99 ms", "leakage"),
                 [(f"{i['victim']} ({i['victim_from']})", i["quiet_phase"],
                   ms(i["quiet_ttft_p99_s"]), i["flood_phase"], ms(i["flood_ttft_p99_s"]),
                   num(i["leakage"]))],
                 ["leakage = max(0, 1 - quiet / flood) of the victim's p99 TTFT."])


def littles_law_table(s: dict[str, Any]) -> Table:
    rows = []
    for name, v in s["littles_law"].items():
        w = v["time_in_system_s"]
        wk = v["token_time_in_system_s"]
        rows.append((name, num(v["arrivals"]), num(v["in_flight"]),
                     num(v["arrival_rate"] * w if w is not None else None),
                     num(v["request_ratio"]), num(v["tokens_in_flight"]),
                     num(v["token_arrival_rate"] * wk if wk is not None else None),
                     num(v["token_ratio"])))
    return Table("Little's Law (L against λ·W over the run)",
                 ("tenant", "arrivals", "L requests", "λ·W requests", "ratio", "L tokens",
                  "λ·W tokens", "ratio"), rows)


def stability_table(s: dict[str, Any]) -> Table:
    st = s["stability"]
    verdict = {True: "stable", False: "UNSTABLE", None: "-"}[st["stable"]]
    return Table("Stability", ("offered tok/s", "served tok/s", "served / offered", "verdict"),
                 [(num(st["offered_tokens_per_s"]), num(st["served_tokens_per_s"]),
                   num(st["served_over_offered"]), verdict)])


def comparison_table(rows: list[Difference], this_id: str, baseline_id: str) -> Table:
    def cell(path: str, x: float | None) -> str:
        return ms(x) if path.endswith("_s") else num(x)

    out = []
    for r in rows:
        if r.this is None and r.baseline is None:
            continue
        unit = " (ms)" if r.path.endswith("_s") else ""
        out.append((r.path + unit, cell(r.path, r.this), cell(r.path, r.baseline),
                    cell(r.path, r.difference), pct(r.relative)))
    return Table(f"Comparison: {this_id} against baseline {baseline_id}",
                 ("metric", this_id, baseline_id, "difference", "relative"), out)
