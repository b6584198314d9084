"""Isolation: how much a flood by others hurt a victim tenant's tail latency.

``flood_over_quiet = flood / quiet`` and ``leakage = max(0, 1 - quiet / flood)``, with
``quiet`` and ``flood`` the victim's p99 TTFT in the quiet and the flood phase: a ratio of 1
and a leakage of 0 when the flood did not slow the victim down; leakage approaches 1 as its
p99 TTFT grows without bound.

The victim is ``options.victim`` (or ``options.victim_tenant``) of run.json, else the tenant
that sent the fewest requests. The flood phase is ``options.flood_phase``, else the phase
named ``flood`` (or containing it), else the phase with the highest arrival rate; the quiet
phase likewise (``quiet``, else the lowest arrival rate among the others).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from weighbridge.rundir import RunInfo

QUANTILE = 0.99


@dataclass(frozen=True, slots=True)
class Isolation:
    victim: str
    victim_from: str  # "run.json options" or "fewest requests"
    flood_phase: str
    quiet_phase: str
    flood_ttft_p99_s: float | None
    quiet_ttft_p99_s: float | None
    flood_requests: int  # the victim's requests with a TTFT in the flood phase
    quiet_requests: int

    @property
    def flood_over_quiet(self) -> float | None:
        """The victim's p99 TTFT in the flood over the quiet phase: 1 when the flood did not
        slow it, 43 when it multiplied its tail latency by 43."""
        if self.flood_ttft_p99_s is None or not self.quiet_ttft_p99_s:
            return None
        return self.flood_ttft_p99_s / self.quiet_ttft_p99_s

    @property
    def leakage(self) -> float | None:
        if self.flood_ttft_p99_s is None or self.quiet_ttft_p99_s is None:
            return None
        return leakage(self.quiet_ttft_p99_s, self.flood_ttft_p99_s)


def leakage(quiet: float, flood: float) -> float:
    if flood <= 0:
        return 0.0
    return max(0.0, 1.0 - quiet / flood)


def isolation(frame: pd.DataFrame, info: RunInfo) -> Isolation | None:
    """``None`` when the run has fewer than two phases with requests."""
    phases = _phase_rates(frame, info)
    if len(phases) < 2 or frame.empty:
        return None
    options = info.options
    flood = _pick(phases, options.get("flood_phase"), "flood", highest=True, exclude=None)
    quiet = _pick(phases, options.get("quiet_phase"), "quiet", highest=False, exclude=flood)
    victim = options.get("victim") or options.get("victim_tenant")
    victim_from = "run.json options"
    if not victim:
        victim = str(frame["tenant"].value_counts().sort_values(kind="stable").index[0])
        victim_from = "fewest requests"
    mine = frame[frame["tenant"] == victim]
    flood_ttft = mine.loc[mine["phase"] == flood, "ttft_s"].dropna().to_numpy()
    quiet_ttft = mine.loc[mine["phase"] == quiet, "ttft_s"].dropna().to_numpy()
    return Isolation(
        victim=str(victim), victim_from=victim_from, flood_phase=flood, quiet_phase=quiet,
        flood_ttft_p99_s=_p99(flood_ttft), quiet_ttft_p99_s=_p99(quiet_ttft),
        flood_requests=int(flood_ttft.size), quiet_requests=int(quiet_ttft.size))


def _p99(values: np.ndarray) -> float | None:
    return float(np.quantile(values, QUANTILE, method="linear")) if values.size else None


def _phase_rates(frame: pd.DataFrame, info: RunInfo) -> dict[str, float]:
    """Arrival rate (requests per second) of each phase that has requests, in run order."""
    counts = frame["phase"].astype(str).value_counts()
    spans = {p.name: p.end_s - p.start_s for p in info.phases}
    rates: dict[str, float] = {}
    for name in [p.name for p in info.phases] + sorted(set(counts.index) - set(spans)):
        n = int(counts.get(name, 0))
        if n == 0:
            continue
        span = spans.get(name)
        if not span:
            times = frame.loc[frame["phase"] == name, "scheduled_s"]
            span = float(times.max() - times.min()) or 1.0
        rates[name] = n / span
    return rates


def _pick(rates: dict[str, float], named: object, word: str, *, highest: bool,
          exclude: str | None) -> str:
    candidates = {k: v for k, v in rates.items() if k != exclude}
    if isinstance(named, str) and named in candidates:
        return named
    if word in candidates:
        return word
    containing = [k for k in candidates if word in k.lower()]
    if containing:
        return containing[0]
    pick = max if highest else min
    return pick(candidates, key=lambda k: candidates[k])
