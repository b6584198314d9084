"""How well a simulated run agrees with a live one: per-tenant TTFT quantiles, token
throughput and rejections by reason, each against a relative tolerance, and (when both sides
report cached tokens) the prefix cache's hit rate against an absolute one.

A live figure is itself a sample: a p99 from 100 requests is the 99th of 100 draws and
moves a lot from run to run. So a figure agrees when the simulated value is within the
tolerance of the live value *or of the live value's own 95% sampling interval*: for a
quantile, the order statistics a distribution-free binomial interval picks
(``n q +- 1.96 sqrt(n q (1 - q))`` ranks); for a count, Poisson's ``+- 1.96 sqrt(n)``.
Throughput is the tokens served over the scenario's length on both sides (completed
requests' usage plus what cut-off ones streamed), so the live run's shutdown grace does not
dilute it.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from weighbridge.records import RequestRecord
from weighbridge.rundir import read_records, read_run_info
from weighbridge.statistics import percentile

__all__ = ["TOLERANCES", "Check", "compare", "hit_rate", "markdown"]

# The tolerances: TTFT quantiles, token throughput, rejections by reason.
TOLERANCES = {"ttft": 0.20, "throughput": 0.05, "rejections": 0.10,
              "hit_rate": 0.05}  # points: the share of prompt tokens the cache supplied
Z95 = 1.96


@dataclass(frozen=True)
class Check:
    figure: str
    live: float
    simulated: float
    low: float  # the accepted range
    high: float

    @property
    def ok(self) -> bool:
        return self.low <= self.simulated <= self.high

    @property
    def error(self) -> float | None:
        return None if self.live == 0 else self.simulated / self.live - 1


def _quantile_interval(values: list[float], q: float) -> tuple[float, float]:
    n = len(values)
    spread = Z95 * math.sqrt(n * q * (1 - q))
    lo = max(0, math.floor(n * q - spread) - 1)
    hi = min(n - 1, math.ceil(n * q + spread) - 1)
    return values[lo], values[hi]


def _ttfts(records: list[RequestRecord]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {}
    for r in records:
        if r.status == "ok" and r.ttft_s is not None:
            out.setdefault(r.tenant, []).append(r.ttft_s)
    return {t: sorted(v) for t, v in out.items()}


def _throughput(records: list[RequestRecord], end_s: float) -> float:
    """Tokens served per second: completed requests' usage, and the chunks a request cut
    off by the run's end had streamed (long generations straddle the end)."""
    served = 0
    for r in records:
        if r.status == "ok" and r.end_s <= end_s:
            served += (r.prompt_tokens or 0) + (r.output_tokens or 0)
        elif r.status == "cancelled":
            served += r.chunks
    return served / end_s


def hit_rate(records: list[RequestRecord]) -> float | None:
    """Cached over prompt tokens of the requests that reported cached tokens (the report's
    ``prefix_cache_hit_rate``, from the records alone)."""
    reported = [r for r in records if r.computed_prompt_tokens is not None]
    cached = sum(r.cached_tokens or 0 for r in reported)
    total = cached + sum(r.computed_prompt_tokens or 0 for r in reported)
    return cached / total if total else None


def compare(live_dir: Path, sim_dir: Path,
            tolerances: dict[str, float] = TOLERANCES) -> list[Check]:
    live, sim = read_records(live_dir), read_records(sim_dir)
    info = read_run_info(live_dir)
    end = max(p.end_s for p in info.phases)
    checks: list[Check] = []
    tol = tolerances["ttft"]
    live_ttft, sim_ttft = _ttfts(live), _ttfts(sim)
    for tenant in sorted(live_ttft):
        values = live_ttft[tenant]
        for q in (0.5, 0.99):
            mine = sim_ttft.get(tenant)
            lo, hi = _quantile_interval(values, q)
            checks.append(Check(f"{tenant} TTFT p{q * 100:g}", percentile(values, q),
                                percentile(mine, q) if mine else math.nan,
                                lo * (1 - tol), hi * (1 + tol)))
    tol = tolerances["throughput"]
    rate = _throughput(live, end)
    checks.append(Check("token throughput (tok/s)", rate, _throughput(sim, end),
                        rate * (1 - tol), rate * (1 + tol)))
    tol = tolerances["rejections"]
    live_rej = Counter(r.reason or "-" for r in live if r.status == "rejected")
    sim_rej = Counter(r.reason or "-" for r in sim if r.status == "rejected")
    for reason in sorted(set(live_rej) | set(sim_rej)):
        n = live_rej[reason]
        spread = Z95 * math.sqrt(n)
        checks.append(Check(f"rejected: {reason}", n, sim_rej[reason],
                            max(0.0, (n - spread) * (1 - tol)), (n + spread) * (1 + tol)))
    live_hits, sim_hits = hit_rate(live), hit_rate(sim)
    if live_hits is not None and sim_hits is not None:
        tol = tolerances["hit_rate"]
        checks.append(Check("prefix cache hit rate (%)", live_hits * 100, sim_hits * 100,
                            (live_hits - tol) * 100, (live_hits + tol) * 100))
    return checks


def markdown(case: str, checks: list[Check]) -> str:
    def fmt(figure: str, value: float) -> str:
        if "TTFT" in figure:
            return f"{value * 1000:,.0f} ms"
        if "(%)" in figure:
            return f"{value:.1f}%"
        return f"{value:,.0f}"

    lines = [f"| {case} | live | simulated | error | accepted range | agrees |",
             "|---|---|---|---|---|---|"]
    for c in checks:
        error = "—" if c.error is None or math.isnan(c.error) else f"{c.error:+.0%}"
        lines.append(f"| {c.figure} | {fmt(c.figure, c.live)} | {fmt(c.figure, c.simulated)} "
                     f"| {error} | {fmt(c.figure, c.low)} to {fmt(c.figure, c.high)} "
                     f"| {'yes' if c.ok else '**no**'} |")
    return "\n".join(lines)
