"""Exact percentiles from the records (not histogram buckets).

Interpolation is linear between closest ranks (Hyndman and Fan type 7, numpy's and pandas'
default): with ``n`` sorted values ``x_0 <= ... <= x_{n-1}``, the q-quantile is at rank
``h = (n - 1) q``: ``x_floor(h) + (h - floor(h)) (x_ceil(h) - x_floor(h))``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import pandas as pd

QUANTILES: dict[str, float] = {"p50": 0.50, "p90": 0.90, "p99": 0.99, "p999": 0.999}


@dataclass(frozen=True, slots=True)
class Percentiles:
    count: int  # values the percentiles are taken over
    p50: float | None
    p90: float | None
    p99: float | None
    p999: float | None

    @classmethod
    def of(cls, values: npt.ArrayLike) -> Percentiles:
        v = np.asarray(values, dtype=np.float64)
        v = v[~np.isnan(v)]
        if v.size == 0:
            return cls(0, None, None, None, None)
        q = np.quantile(v, list(QUANTILES.values()), method="linear")
        return cls(int(v.size), *(float(x) for x in q))


def by_group(values: pd.Series, groups: pd.Series) -> dict[str, Percentiles]:
    """Percentiles of ``values`` per group label, NaN values left out, in one group-by."""
    known = values.notna()
    v, g = values[known], groups[known]
    if v.empty:
        return {}
    grouped = v.groupby(g, observed=True)
    counts = grouped.size()
    table = grouped.quantile(list(QUANTILES.values()), interpolation="linear").unstack()
    out: dict[str, Percentiles] = {}
    for label, row in table.iterrows():
        out[str(label)] = Percentiles(int(counts[label]), *(_finite(x) for x in row.to_numpy()))
    return out


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None
