"""The generator's own health: schedule lag, actual minus scheduled send time.

A request sent late was not sent at the rate the scenario asked for, and its latency, which
starts at the scheduled time, includes the generator's delay. When the p99 lag passes
:data:`LAG_WARN_S` the numbers describe the generator more than the server.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from weighbridge.statistics import percentile

__all__ = ["LAG_WARN_S", "LagSummary", "lag_warning"]

LAG_WARN_S = 0.010


@dataclass(frozen=True, slots=True)
class LagSummary:
    count: int  # requests that were sent (never-sent ones have no lag)
    mean_s: float
    p50_s: float
    p99_s: float
    max_s: float

    @classmethod
    def of(cls, lags: Iterable[float]) -> LagSummary:
        ordered = sorted(lags)
        if not ordered:
            return cls(0, math.nan, math.nan, math.nan, math.nan)
        return cls(
            count=len(ordered),
            mean_s=sum(ordered) / len(ordered),
            p50_s=percentile(ordered, 0.5),
            p99_s=percentile(ordered, 0.99),
            max_s=ordered[-1],
        )

    def to_dict(self) -> dict[str, float | int | None]:
        # run.json is JSON: NaN becomes null.
        return {k: (None if isinstance(v, float) and math.isnan(v) else v)
                for k, v in asdict(self).items()}


def lag_warning(summary: LagSummary, limit_s: float = LAG_WARN_S) -> str | None:
    if summary.count == 0 or not summary.p99_s > limit_s:
        return None
    return (f"schedule lag p99 {summary.p99_s * 1000:.1f} ms exceeds {limit_s * 1000:.0f} ms "
            f"(max {summary.max_s * 1000:.1f} ms over {summary.count} requests): the load "
            "generator could not keep up, so these latencies are partly the generator's. "
            "Use more processes (--processes N) or less load.")
