"""What the report's plots show, as data: one :class:`Chart` per plot, in the order a reader
asks (the victim against the baseline, token share against entitlement, TTFT per tier against
its SLO, agent programs' completion times per tenant when the run has them, requests in
flight, TTFT per tenant over time).

Two renderers draw the same charts: analysis/plots.py as static PNGs (report.md, the README)
and analysis/interactive.py as interactive HTML. Neither computes anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from weighbridge.analysis.summary import Analysis
from weighbridge.analysis.timeline import FloatArray

CDF_POINTS = 2000  # a CDF drawn from a million points looks the same from 2,000 quantiles
LOG_SPAN = 50.0  # latencies spanning more than this factor get a log axis


@dataclass(frozen=True)
class Line:
    name: str  # in the legend and the hover
    x: FloatArray
    y: FloatArray  # NaN: no value (a gap)
    group: str = ""  # lines of one group toggle together (a tenant's share and entitlement)
    dashed: bool = False
    step: bool = False  # y holds from x[i] to x[i + 1]


@dataclass(frozen=True)
class Chart:
    key: str  # file name of its PNG, id of its HTML element
    title: str
    x_label: str
    y_label: str
    lines: list[Line]
    phases: list[tuple[str, float, float]] = field(default_factory=list)
    marks: list[tuple[float, str]] = field(default_factory=list)  # vertical lines: x, label
    x_log: bool = False
    y_log: bool = False
    y_range: tuple[float, float] | None = None
    note: str = ""  # one sentence under the title: how to read it


def _phases(a: Analysis) -> list[tuple[str, float, float]]:
    return [(p.name, p.start_s, p.end_s) for p in a.run.info.phases]


def _mid(a: Analysis) -> FloatArray:
    e = a.windows.edges
    return (e[:-1] + e[1:]) / 2


def log_scale(series: list[FloatArray]) -> bool:
    """A log axis when the values span more than LOG_SPAN (a flood moves TTFT by orders of
    magnitude); NaN ignored."""
    values = np.concatenate([v[~np.isnan(v)] for v in series] + [np.array([])])
    return bool(values.size and values.min() > 0 and values.max() / values.min() > LOG_SPAN)


def victim_ttft(a: Analysis, base: Analysis | None) -> Chart | None:
    """The isolation victim's p99 TTFT per window, in this run and the baseline's."""
    if a.isolation is None:
        return None
    victim = a.isolation.victim
    runs = [(f"this run ({a.run.info.run_id})", a)]
    if base is not None:
        runs.insert(0, (f"baseline ({base.run.info.run_id})", base))
    lines = [Line(label, _mid(run), run.windows.ttft_p99_s[victim] * 1000, group=label)
             for label, run in runs if victim in run.windows.ttft_p99_s]
    if not lines:
        return None
    against = " against the baseline" if base is not None else ""
    return Chart("victim-ttft", f"{victim}'s p99 TTFT per {a.window_s:g} s window{against}",
                 "seconds since run start (request scheduled)", "p99 TTFT (ms)", lines,
                 _phases(a), y_log=log_scale([ln.y for ln in lines]),
                 note="The victim's tail latency through the phases: a flat line is isolation.")


def share_and_entitlement(a: Analysis) -> dict[str, tuple[FloatArray, FloatArray]]:
    """Per tenant, per window: its share of its tier's served tokens, and the share it was
    entitled to (its weight over the weights of the tier's backlogged tenants, times their
    share of the tier's tokens); the entitlement is NaN where fairness did not judge the
    window (fewer than two of the tier's tenants backlogged, or the tenant not among them).
    Their ratio summed over judged windows is ``service_over_entitlement``. Tenants alone in
    their tier are left out: nothing to share."""
    out: dict[str, tuple[FloatArray, FloatArray]] = {}
    service = a.windows.service
    for tier in a.fairness.tiers.values():
        if len(tier.tenants) < 2:
            continue  # alone in its tier: its share is all of it, and nobody to share with
        total = np.sum([service[n] for n in tier.tenants], axis=0)
        safe = np.where(total > 0, total, np.nan)
        for n in tier.tenants:
            share = service[n] / safe
            entitled = np.full(share.size, np.nan)
            for k, w in enumerate(tier.windows):
                if w.jain_index is None or n not in w.backlogged:
                    continue
                weights = sum(a.tenants[m].weight for m in w.backlogged)
                served = sum(float(service[m][k]) for m in w.backlogged)
                entitled[k] = a.tenants[n].weight / weights * served / safe[k]
            out[n] = (share, entitled)
    return out


def token_share(a: Analysis) -> Chart:
    mid = _mid(a)
    lines = []
    for n, (share, entitled) in share_and_entitlement(a).items():
        label = f"{n} ({a.tenants[n].tier})"
        lines.append(Line(f"{label}: share", mid, share, group=label))
        lines.append(Line(f"{label}: entitled", mid, entitled, group=label, dashed=True))
    return Chart("token-share",
                 f"Each tenant's share of its tier's tokens per {a.window_s:g} s window, "
                 "against its entitlement (dashed)",
                 "seconds since run start", "share of the tier's tokens", lines, _phases(a),
                 y_range=(0.0, 1.02),
                 note="Entitlement: its weight's share among the tier's backlogged tenants, "
                      "drawn where two or more were backlogged; a solid line below its dashed "
                      "one got less than its due. Tenants alone in their tier are not drawn.")


def ttft_cdf(a: Analysis) -> Chart:
    frame = a.run.frame
    lines, marks = [], []
    for tier, g in frame.groupby("tier", observed=True):
        values = np.sort(g["ttft_s"].dropna().to_numpy())
        if values.size == 0:
            continue
        q = np.linspace(0, 1, min(values.size, CDF_POINTS))
        name = f"{tier} ({values.size:,} requests)"
        lines.append(Line(name, np.quantile(values, q) * 1000, q, group=name))
        slo = a.run.info.tiers.get(str(tier))
        if slo is not None and slo.ttft_slo_s:
            marks.append((slo.ttft_slo_s * 1000, f"{tier} SLO {slo.ttft_slo_s * 1000:g} ms"))
    positive = all(float(ln.x[0]) > 0 for ln in lines)
    return Chart("ttft-cdf", "TTFT CDF per tier (dashed: the tier's TTFT SLO)", "TTFT (ms)",
                 "fraction of requests", lines, marks=marks, y_range=(0.0, 1.01),
                 x_log=positive and log_scale([ln.x for ln in lines]),
                 note="Where a tier's curve crosses its SLO line is its attainment by TTFT.")


def program_completion(a: Analysis, base: Analysis | None) -> Chart | None:
    """Per tenant, the CDF of its completed programs' completion times (the baseline's
    dashed), with each tenant's p50, p90 and p99 in the legend; None without programs."""
    runs = [("", a)] + ([(" (baseline)", base)] if base is not None else [])
    lines = []
    for suffix, run in runs:
        if run.programs is None:
            continue
        families = run.programs.families
        done = families[families["outcome"] == "completed"]
        for tenant, stats in run.programs.tenants.items():
            values = np.sort((done["end_s"] - done["start_s"])[done["tenant"] == tenant]
                             .to_numpy())
            if values.size == 0:
                continue
            c = stats.completion
            name = (f"{tenant}{suffix}: p50 {c.p50:.1f} s, p90 {c.p90:.1f} s, "
                    f"p99 {c.p99:.1f} s ({values.size:,} programs)")
            q = np.linspace(0, 1, min(values.size, CDF_POINTS))
            # A tenant's colour in both runs, the baseline's dashed.
            lines.append(Line(name, np.quantile(values, q), q, group=tenant,
                              dashed=bool(suffix)))
    if not lines:
        return None
    positive = all(float(ln.x[0]) > 0 for ln in lines)
    against = " (dashed: the baseline)" if base is not None else ""
    return Chart("program-completion",
                 f"Agent program completion time per tenant, CDF{against}",
                 "completion time (s): first call scheduled to last call ended",
                 "fraction of completed programs", lines, y_range=(0.0, 1.01),
                 x_log=positive and log_scale([ln.x for ln in lines]),
                 note="What the person who started a program waited: a curve to the left "
                      "finished its programs sooner.")


def in_flight(a: Analysis) -> Chart:
    w = a.windows
    lines = [Line(n, w.edges, np.append(s, s[-1:]), group=n, step=True)
             for n, s in w.in_flight.items()]
    return Chart("in-flight",
                 f"Requests in flight per tenant (scheduled to end), {a.window_s:g} s mean",
                 "seconds since run start", "requests in flight (mean)", lines, _phases(a),
                 note="A tenant's backlog and service together: Little's Law's L per window.")


def ttft_over_time(a: Analysis) -> Chart:
    w = a.windows
    mid = _mid(a)
    lines = [Line(n, mid, s * 1000, group=n) for n, s in w.ttft_p99_s.items()]
    return Chart("tenant-ttft", f"Per-tenant p99 TTFT per {a.window_s:g} s window",
                 "seconds since run start (request scheduled)", "p99 TTFT (ms)", lines,
                 _phases(a), y_log=log_scale([ln.y for ln in lines]))


def charts(a: Analysis, base: Analysis | None = None) -> list[Chart]:
    """The report's plots, in reading order."""
    first = victim_ttft(a, base)
    programs = program_completion(a, base)
    return ([first] if first is not None else []) + [token_share(a), ttft_cdf(a)] + (
        [programs] if programs is not None else []) + [in_flight(a), ttft_over_time(a)]
