"""The statistics every part shares, each defined once: percentiles, Jain's fairness index,
the stability ratio and the step-budget utilisation.

Pure functions on plain numbers. The run analysis computes the same percentile over whole
columns with numpy (``weighbridge.analysis.percentiles``: the same definition, vectorised, and
tested to agree with this one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["jain_index", "percentile", "stability_ratio", "step_capacity", "utilisation"]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (0 <= q <= 1) of *sorted* ``values``, NaN when there are none.

    Linear interpolation between closest ranks (Hyndman and Fan's type 7, numpy's and pandas'
    default): with ``n`` values the quantile sits at rank ``h = (n - 1) q``, between
    ``x[floor(h)]`` and ``x[ceil(h)]``.
    """
    if not values:
        return math.nan
    pos = (len(values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    if values[lo] == values[hi]:
        return values[lo]  # also when both are infinite (inf - inf would be nan)
    return values[lo] + (values[hi] - values[lo]) * (pos - lo)


def jain_index(values: Sequence[float]) -> float | None:
    """Jain's fairness index ``(sum x)^2 / (n sum x^2)`` of non-negative values: 1 when all
    are equal, ``1/n`` when one value has everything. None when empty or all zero (nothing
    was shared, so nothing was shared unfairly)."""
    if any(v < 0 or not math.isfinite(v) for v in values):
        raise ValueError(f"values: must be finite and non-negative, got {list(values)}")
    top = max(values, default=0.0)
    if top <= 0:
        return None
    # Scaled by the largest so squares neither overflow nor underflow (tiny or huge counts).
    scaled = [v / top for v in values]
    total = math.fsum(scaled)
    squares = math.fsum(v * v for v in scaled)
    # Rounding can push the quotient a hair past 1 for equal values.
    return min(1.0, total * total / (len(values) * squares))


def stability_ratio(offered: float, served: float) -> float | None:
    """Offered load over served load (tokens/s, or tokens over the same interval): the one
    direction everywhere. Above 1, work arrives faster than it is served and the backlog
    grows without bound. ``inf`` when something was offered and nothing served; None when
    nothing was offered and nothing served (idle: nothing to judge)."""
    if served > 0:
        return offered / served
    return math.inf if offered > 0 else None


def utilisation(offered_tokens_per_s: float, capacities_tokens_per_s: Sequence[float]
                ) -> float | None:
    """rho, the seed's stability condition λ(m_prefill + m_decode) < B / t_step as one number:
    offered tokens/s over the sum of the engines' B / t_step (one engine: offered x t_step /
    B). Below 1 the offered work fits in the step budget; it reaches 1 as the steps fill.
    None without a capacity (no engine's step time is known: nothing to judge against)."""
    capacity = math.fsum(c for c in capacities_tokens_per_s if c > 0 and math.isfinite(c))
    if capacity <= 0:
        return None
    return offered_tokens_per_s / capacity


def step_capacity(budget_tokens: float, step_s: float | None) -> float | None:
    """B / t_step: the tokens per second an engine computes with every step full; None while
    its step time is unknown (or not positive)."""
    if step_s is None or not step_s > 0 or budget_tokens <= 0:
        return None
    return budget_tokens / step_s
