"""The report's answer, first: the ``--check`` verdicts, four figures against the baseline,
and one sentence that reads them.

The figures, from summary.json (docs/analysis.md defines each):

* the victim's p99 TTFT in the flood over the quiet phase (``isolation.flood_over_quiet``),
  with both latencies;
* each tier's SLO attainment (``tiers.<tier>.slo_attainment``), with met/judged;
* fairness: the worst tier's Jain index (``fairness.jain_index``);
* throughput: tokens served per second (``stability.served_tokens_per_s``);
* with a baseline whose prefix-cache hit rate differs from this run's (``prefix_cache``):
  the share of prompt tokens the server's cache supplied, in each.

An undefined figure carries its reason (analysis/explain.py), never a bare dash.
``headline_figures`` gives the same figures as numbers (None where undefined): what
``weighbridge demo`` prints side by side and ``weighbridge simulate`` writes per policy.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from weighbridge.analysis import explain
from weighbridge.analysis.gate import Verdict
from weighbridge.analysis.units import MILLISECONDS, PERCENT, TIMES, TOKENS_PER_S, number


@dataclass(frozen=True, slots=True)
class Row:
    label: str
    this: str
    baseline: str | None  # None: no baseline given


@dataclass(frozen=True)
class Headline:
    reading: str
    rows: list[Row]
    checks: list[Verdict] = field(default_factory=list)
    baseline_id: str | None = None

    @property
    def passed(self) -> bool | None:
        """None without checks."""
        return all(v.passed for v in self.checks) if self.checks else None


def times(x: float) -> str:
    """A multiplier: 1.5 times, 43 times (with the times sign)."""
    return f"{x:.1f}{TIMES}" if abs(x) < 10 else f"{x:,.0f}{TIMES}"


def _victim(s: dict[str, Any]) -> str:
    i = s.get("isolation")
    if i is None:
        return explain.undefined("the run has no quiet and flood phases")
    ratio = i.get("flood_over_quiet")
    if ratio is None:
        return explain.undefined(explain.isolation_figure(i, "flood_over_quiet") or "")
    return (f"{times(ratio)} ({MILLISECONDS.with_label(i['quiet_ttft_p99_s'])} → "
            f"{MILLISECONDS.with_label(i['flood_ttft_p99_s'])})")


def _attainment(s: dict[str, Any], tier: str) -> str:
    t = s.get("tiers", {}).get(tier)
    if t is None:
        return explain.undefined("no requests in this tier")
    why = explain.tier_figure(t, "slo_attainment")
    if why is not None:
        return explain.undefined(why)
    return f"{PERCENT.with_label(t['slo_attainment'])} ({t['met']:,} of {t['judged']:,})"


def _fairness(s: dict[str, Any]) -> str:
    f = s["fairness"]
    why = explain.run_fairness(f, s["run"]["window_s"])
    return explain.undefined(why) if why else number(f["jain_index"])


def _throughput(s: dict[str, Any]) -> str:
    st = s["stability"]
    why = explain.stability(st, "served_tokens_per_s")
    return explain.undefined(why) if why else TOKENS_PER_S.with_label(st["served_tokens_per_s"])


def _prefix_cache(s: dict[str, Any]) -> str:
    c = s.get("prefix_cache") or {}
    why = explain.prefix_cache_figure(c, "prefix_cache_hit_rate")
    if why is not None:
        return explain.undefined(why)
    prompt = c["computed_prompt_tokens"] + c["cached_prompt_tokens"]
    return (f"{PERCENT.with_label(c['prefix_cache_hit_rate'])} "
            f"({c['cached_prompt_tokens']:,} of {prompt:,} prompt tokens)")


def _hit_rates_differ(this: dict[str, Any], baseline: dict[str, Any]) -> bool:
    """Worth a headline row: the two runs' hit rates differ by a tenth of a point or more,
    or one run has one and the other none."""
    rates = [(s.get("prefix_cache") or {}).get("prefix_cache_hit_rate")
             for s in (this, baseline)]
    if rates[0] is None or rates[1] is None:
        return rates[0] is not rates[1]
    return bool(abs(rates[0] - rates[1]) >= 0.001)


def slo_target(t: dict[str, Any]) -> str:
    targets = [f"TTFT ≤ {MILLISECONDS.with_label(t['ttft_slo_s'])}" if t.get("ttft_slo_s")
               else "",
               f"E2E ≤ {MILLISECONDS.with_label(t['e2e_slo_s'])}" if t.get("e2e_slo_s") else ""]
    return ", ".join(x for x in targets if x) or "completion"


def tier_one(s: Mapping[str, Any]) -> str | None:
    """The best-ranked tier that had requests."""
    ranked = sorted((n for n, t in s.get("tiers", {}).items()
                     if t.get("rank") is not None and t.get("requests")),
                    key=lambda n: s["tiers"][n]["rank"])
    return ranked[0] if ranked else None


def _tiers(this: dict[str, Any], baseline: dict[str, Any] | None) -> list[str]:
    names = [n for n, t in this.get("tiers", {}).items() if t.get("requests")]
    if baseline is not None:
        names += [n for n, t in baseline.get("tiers", {}).items()
                  if t.get("requests") and n not in names]
    return names


def headline(this: dict[str, Any], baseline: dict[str, Any] | None = None,
             checks: Sequence[Verdict] = ()) -> Headline:
    def pair(label: str, value: Any) -> Row:
        return Row(label, value(this), None if baseline is None else value(baseline))

    victim = (this.get("isolation") or (baseline or {}).get("isolation") or {}).get("victim")
    figures = [pair(f"{victim or 'victim'}: p99 TTFT, flood over quiet", _victim)]
    for tier in _tiers(this, baseline):
        t = this.get("tiers", {}).get(tier) or (baseline or {}).get("tiers", {}).get(tier, {})
        figures.append(pair(f"{tier}: SLO attainment ({slo_target(t)})",
                            lambda s, tier=tier: _attainment(s, tier)))
    figures.append(pair("fairness: Jain's index, worst tier", _fairness))
    figures.append(pair("throughput: tokens served", _throughput))
    if baseline is not None and _hit_rates_differ(this, baseline):
        figures.append(pair("prefix cache: prompt tokens cached", _prefix_cache))
    return Headline(reading(this, baseline), figures, list(checks),
                    None if baseline is None else baseline["run"]["run_id"])


def reading(this: dict[str, Any], baseline: dict[str, Any] | None = None) -> str:
    """One sentence: what the flood did to the victim, how tier 1 fared, at what
    throughput; each against the baseline when there is one."""
    def against(value: str | None) -> str:
        return f" (baseline: {value})" if baseline is not None and value is not None else ""

    def ratio(s: dict[str, Any] | None) -> float | None:
        return ((s or {}).get("isolation") or {}).get("flood_over_quiet")

    parts = []
    i = this.get("isolation")
    if i is None:
        parts.append("no flood to read: the run has no quiet and flood phases")
    elif (r := ratio(this)) is None:
        parts.append(f"no flood reading: {explain.isolation_figure(i, 'flood_over_quiet')}")
    else:
        b = ratio(baseline)
        parts.append(f"the flood multiplied {i['victim']}'s p99 TTFT by {times(r)}"
                     + against(times(b) if b is not None else "undefined"))
    tier = tier_one(this)
    if tier is not None:
        att = this["tiers"][tier]["slo_attainment"]
        if att is not None:
            b_att = ((baseline or {}).get("tiers", {}).get(tier) or {}).get("slo_attainment")
            parts.append(f"{tier} met its SLO for {PERCENT.with_label(att)} of its requests"
                         + against(PERCENT.with_label(b_att) if b_att is not None
                                   else "undefined"))
    served = this["stability"]["served_tokens_per_s"]
    tail = ""
    if served is not None:
        b_served = ((baseline or {}).get("stability") or {}).get("served_tokens_per_s")
        tail = (f", at {TOKENS_PER_S.with_label(served)}"
                + against(TOKENS_PER_S.with_label(b_served) if b_served is not None
                          else "undefined"))
    text = "; ".join(parts) + tail
    return text[0].upper() + text[1:] + "."


@dataclass(frozen=True)
class HeadlineFigures:
    """The headline's figures as numbers, from one run's summary.json; None where a figure
    is undefined."""

    victim: str | None
    victim_quiet_ttft_p99_s: float | None
    victim_flood_ttft_p99_s: float | None
    jain_index: float | None  # None: no two tenants of a tier were backlogged together
    tier1: str | None
    tier1_ttft_p99_s: float | None
    tier1_slo_attainment: float | None
    served_tokens_per_s: float | None

    @property
    def victim_ratio(self) -> float | None:
        """Victim p99 TTFT in the flood over the quiet phase (1 = the flood did not hurt)."""
        quiet, flood = self.victim_quiet_ttft_p99_s, self.victim_flood_ttft_p99_s
        if quiet is None or flood is None or quiet <= 0:
            return None
        ratio = flood / quiet
        return ratio if math.isfinite(ratio) else None  # a quiet p99 near 0 overflows

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "victim_ttft_ratio": self.victim_ratio}


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def headline_figures(s: Mapping[str, Any]) -> HeadlineFigures:
    """The figures of ``headline``'s rows, as numbers; tier 1 is ``tier_one``'s."""
    isolation = s.get("isolation") or {}
    tier1 = tier_one(s)
    tier = (s.get("tiers") or {}).get(tier1, {}) if tier1 is not None else {}
    return HeadlineFigures(
        victim=isolation.get("victim"),
        victim_quiet_ttft_p99_s=_finite(isolation.get("quiet_ttft_p99_s")),
        victim_flood_ttft_p99_s=_finite(isolation.get("flood_ttft_p99_s")),
        jain_index=_finite((s.get("fairness") or {}).get("jain_index")),
        tier1=tier1,
        tier1_ttft_p99_s=_finite(tier.get("ttft_p99_s")),
        tier1_slo_attainment=_finite(tier.get("slo_attainment")),
        served_tokens_per_s=_finite((s.get("stability") or {}).get("served_tokens_per_s")),
    )
