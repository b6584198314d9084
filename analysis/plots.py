"""The HTML report's figures as PNG bytes (matplotlib's object API, no global pyplot state,
so building a report in a server or a test leaves no figures behind)."""

from __future__ import annotations

import io

import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from analysis.summary import Analysis

CDF_POINTS = 2000  # a CDF drawn from a million points looks the same from 2,000 quantiles


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    return buffer.getvalue()


def _shade_phases(ax: Axes, a: Analysis) -> None:
    for i, phase in enumerate(a.run.info.phases):
        ax.axvspan(phase.start_s, phase.end_s, color="0.85" if i % 2 else "0.93", zorder=0)
        ax.text((phase.start_s + phase.end_s) / 2, 1.0, phase.name, ha="center", va="bottom",
                transform=ax.get_xaxis_transform(), fontsize=8, color="0.3")


def _latency_axis(ax: Axes, series: list[np.ndarray]) -> None:
    """Log scale when the latencies span more than 50x (a flood moves TTFT by orders of
    magnitude), else linear from 0. NaN (windows without requests) is ignored."""
    values = np.concatenate([v[~np.isnan(v)] for v in series] + [np.array([])])
    if values.size and values.min() > 0 and values.max() / values.min() > 50:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0)


def token_share(a: Analysis) -> bytes:
    w = a.windows
    names = list(w.service)
    stacked = np.array([w.service[n] for n in names])
    total = stacked.sum(axis=0)
    share = np.divide(stacked, total, out=np.zeros_like(stacked), where=total > 0)
    fig = Figure(figsize=(11, 3.6))
    ax = fig.add_subplot()
    mid = (w.edges[:-1] + w.edges[1:]) / 2
    ax.stackplot(mid, share, labels=names, step=None, alpha=0.85)
    ax.set(xlabel="seconds since run start", ylabel="share of tokens served", ylim=(0, 1),
           title=f"Per-tenant token share per {a.window_s:g} s window")
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _png(fig)


def ttft_cdf(a: Analysis) -> bytes:
    frame = a.run.frame
    fig = Figure(figsize=(11, 3.6))
    ax = fig.add_subplot()
    for tier, g in frame.groupby("tier", observed=True):
        values = np.sort(g["ttft_s"].dropna().to_numpy())
        if values.size == 0:
            continue
        q = np.linspace(0, 1, min(values.size, CDF_POINTS))
        ax.plot(np.quantile(values, q) * 1000, q, label=f"{tier} ({values.size:,})")
        slo = a.run.info.tiers.get(str(tier))
        if slo is not None and slo.ttft_slo_s:
            ax.axvline(slo.ttft_slo_s * 1000, linestyle="--", linewidth=1, color="0.4")
    ax.set(xlabel="TTFT (ms)", ylabel="fraction of requests", ylim=(0, 1.01),
           title="TTFT CDF per tier (dashed: TTFT SLO)")
    ax.set_xscale("symlog", linthresh=10)
    ax.set_xlim(left=0)
    ax.legend(fontsize=8)
    return _png(fig)


def ttft_over_time(a: Analysis) -> bytes:
    w = a.windows
    fig = Figure(figsize=(11, 3.6))
    ax = fig.add_subplot()
    _shade_phases(ax, a)
    mid = (w.edges[:-1] + w.edges[1:]) / 2
    for name, p99 in w.ttft_p99_s.items():
        ax.plot(mid, p99 * 1000, marker=".", label=name)
    ax.set(xlabel="seconds since run start (request scheduled)", ylabel="p99 TTFT (ms)")
    ax.set_title(f"Per-tenant p99 TTFT per {a.window_s:g} s window, phases shaded", pad=14)
    _latency_axis(ax, list(w.ttft_p99_s.values()))
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _png(fig)


def in_flight(a: Analysis) -> bytes:
    w = a.windows
    fig = Figure(figsize=(11, 3.6))
    ax = fig.add_subplot()
    _shade_phases(ax, a)
    for name, series in w.in_flight.items():
        ax.step(w.edges, np.append(series, series[-1:]), where="post", label=name)
    ax.set(xlabel="seconds since run start", ylabel="requests in flight (mean)")
    ax.set_title(f"Per-tenant requests in flight (scheduled to end), {a.window_s:g} s mean",
                 pad=14)
    ax.set_ylim(bottom=0)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    return _png(fig)


def victim_ttft_against_baseline(a: Analysis, base: Analysis) -> bytes | None:
    """The isolation victim's p99 TTFT per window in this run and in the baseline, on one
    axis: the noisy-neighbour story in one picture. None without a victim in both runs."""
    if a.isolation is None or base.isolation is None:
        return None
    victim = a.isolation.victim
    fig = Figure(figsize=(11, 3.6))
    ax = fig.add_subplot()
    _shade_phases(ax, a)
    series = []
    for label, run in ((f"baseline ({base.run.info.run_id})", base),
                       (f"this run ({a.run.info.run_id})", a)):
        p99 = run.windows.ttft_p99_s.get(victim)
        if p99 is None:
            continue
        mid = (run.windows.edges[:-1] + run.windows.edges[1:]) / 2
        ax.plot(mid, p99 * 1000, marker=".", label=label)
        series.append(p99)
    if not series:
        return None
    ax.set(xlabel="seconds since run start (request scheduled)", ylabel="p99 TTFT (ms)")
    ax.set_title(f"Victim ({victim}) p99 TTFT per {a.window_s:g} s window: this run against "
                 "the baseline, phases shaded", pad=14)
    _latency_axis(ax, series)
    ax.legend(loc="upper left", fontsize=8)
    return _png(fig)


FIGURES = {
    "Per-tenant token share over time": token_share,
    "TTFT CDF per tier": ttft_cdf,
    "Per-tenant TTFT over time": ttft_over_time,
    "Requests in flight per tenant": in_flight,
}
