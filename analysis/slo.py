"""Per-tier SLO attainment and goodput.

A request meets its tier's SLO when it completed (status ``ok``) within every target the
tier sets: TTFT at most ``ttft_slo_s`` and end-to-end latency at most ``e2e_slo_s``. A tier
without targets counts completion alone. Rejected, failed and timed-out requests are misses;
cancelled ones (the client withdrew them) are neither hits nor misses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from weighbridge.analysis.percentiles import Percentiles, by_group
from weighbridge.rundir import RunInfo, TierInfo


@dataclass(frozen=True)
class TierStats:
    name: str
    rank: int | None
    ttft_slo_s: float | None
    e2e_slo_s: float | None
    requests: int  # every request of the tier (the record's tier)
    judged: int  # requests that count for attainment: all but the cancelled ones
    met: int
    ttft: Percentiles
    e2e: Percentiles
    goodput_tokens: float  # prompt + output tokens of the requests that met the SLO
    duration_s: float

    @property
    def slo_attainment(self) -> float | None:
        return self.met / self.judged if self.judged else None

    @property
    def goodput_tokens_per_s(self) -> float | None:
        return self.goodput_tokens / self.duration_s if self.duration_s > 0 else None


def met_slo(frame: pd.DataFrame, tiers: dict[str, TierInfo]) -> pd.Series:
    """Per record: did it meet its own tier's SLO? (Unknown tiers: completion only.)"""
    met = (frame["status"] == "ok").to_numpy().copy()
    tier = frame["tier"].astype(str).to_numpy()
    for name, spec in tiers.items():
        mine = tier == name
        if spec.ttft_slo_s is not None:
            met[mine] &= (frame["ttft_s"].to_numpy()[mine] <= spec.ttft_slo_s)
        if spec.e2e_slo_s is not None:
            met[mine] &= (frame["e2e_s"].to_numpy()[mine] <= spec.e2e_slo_s)
    return pd.Series(met, index=frame.index)


def tier_stats(frame: pd.DataFrame, info: RunInfo, duration_s: float) -> dict[str, TierStats]:
    met = met_slo(frame, info.tiers)
    judged = frame["status"] != "cancelled"
    tier = frame["tier"]
    ok = frame["status"] == "ok"
    counts = tier.value_counts()
    judged_counts = tier[judged].value_counts()
    met_counts = tier[met].value_counts()
    goodput = frame.loc[met, "tokens"].groupby(tier[met], observed=True).sum()
    ttft = by_group(frame["ttft_s"], tier)
    e2e = by_group(frame["e2e_s"].where(ok), tier)
    names = sorted(info.tiers, key=lambda n: info.tiers[n].rank)
    names += sorted(str(t) for t in counts.index if counts[t] and str(t) not in info.tiers)
    empty = Percentiles.of(np.array([]))
    out: dict[str, TierStats] = {}
    for name in names:
        spec = info.tiers.get(name)
        requests = int(counts.get(name, 0))
        if requests == 0 and not any(t.tier == name for t in info.tenants):
            continue  # a configured tier nobody used
        out[name] = TierStats(
            name=name,
            rank=spec.rank if spec else None,
            ttft_slo_s=spec.ttft_slo_s if spec else None,
            e2e_slo_s=spec.e2e_slo_s if spec else None,
            requests=requests,
            judged=int(judged_counts.get(name, 0)),
            met=int(met_counts.get(name, 0)),
            ttft=ttft.get(name, empty),
            e2e=e2e.get(name, empty),
            goodput_tokens=float(goodput.get(name, 0.0)),
            duration_s=duration_s,
        )
    return out
