"""Fairness of token service among backlogged tenants, per tier.

Weights are shares within a tier (the sidecar serves tiers by strict priority), so every
figure is computed inside each tier; the run's headline is the worst tier.

For window ``k`` and tier ``T``: ``B_k`` is the set of the tier's tenants backlogged for at
least ``fraction`` of the window, ``s_ik`` tenant ``i``'s served tokens (prompt + output) and
``x_ik = s_ik / w_i`` its weight-normalised service. Windows with fewer than two backlogged
tenants say nothing about fairness and are left out.

* Jain's index of a window: ``(sum x)^2 / (n sum x^2)`` over ``B_k``: 1 when equal, 1/n when
  one tenant took everything.
* Overall: each tenant's service against its entitlement, summed over the windows it was
  backlogged in: ``e_ik = w_i / sum_{j in B_k} w_j * sum_{j in B_k} s_jk`` and
  ``r_i = sum_k s_ik / sum_k e_ik``; Jain's index over the ``r_i``, and the max/min share
  ratio ``max r / min r`` (infinite, reported as null, when a backlogged tenant got nothing).
* Service difference (VTC): a counter per tenant accumulates ``x_ik`` every window; a tenant
  that becomes backlogged is lifted to the smallest counter of the tenants that stayed
  backlogged (so idle time banks no credit, as in VTC). ``D_k = max - min`` of the counters
  over ``B_k``; the reported figure is ``max_k D_k``, in weight-normalised tokens.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from weighbridge.analysis.timeline import FloatArray
from weighbridge.statistics import jain_index


@dataclass(frozen=True, slots=True)
class WindowFairness:
    start_s: float
    end_s: float
    backlogged: tuple[str, ...]
    jain_index: float | None  # None: fewer than two backlogged tenants, or none served
    share_ratio: float | None  # None: as above, or a backlogged tenant got nothing
    service_difference: float | None


@dataclass(frozen=True)
class TierFairness:
    tier: str
    tenants: tuple[str, ...]
    windows: list[WindowFairness]
    service_ratio: dict[str, float]  # r_i: service received over entitlement
    jain_index: float | None
    max_min_share_ratio: float | None
    max_service_difference: float | None
    starved: tuple[str, ...]  # backlogged tenants that received nothing they were entitled to

    @property
    def judged_windows(self) -> int:
        return sum(1 for w in self.windows if w.jain_index is not None)


@dataclass(frozen=True)
class Fairness:
    fraction: float  # of a window a tenant must be backlogged for to count as backlogged
    window_s: float
    tiers: dict[str, TierFairness]

    def _judged(self) -> list[TierFairness]:
        return [t for t in self.tiers.values() if t.jain_index is not None]

    @property
    def jain_index(self) -> float | None:
        values = [t.jain_index for t in self._judged() if t.jain_index is not None]
        return min(values) if values else None

    @property
    def max_min_share_ratio(self) -> float | None:
        judged = self._judged()
        if any(t.max_min_share_ratio is None for t in judged):
            return None  # a starved tenant: unbounded
        values = [t.max_min_share_ratio for t in judged if t.max_min_share_ratio is not None]
        return max(values) if values else None

    @property
    def max_service_difference(self) -> float | None:
        values = [t.max_service_difference for t in self.tiers.values()
                  if t.max_service_difference is not None]
        return max(values) if values else None


def share_ratio(values: Sequence[float] | FloatArray) -> float | None:
    x = np.asarray(values, dtype=np.float64)
    if x.size == 0 or float(x.min()) <= 0:
        return None
    return float(x.max() / x.min())


def tier_fairness(tier: str, edges: FloatArray, service: Mapping[str, FloatArray],
                  backlogged: Mapping[str, np.ndarray], weights: Mapping[str, float]
                  ) -> TierFairness:
    """The fairness of one tier from its tenants' per-window service and backlogged flags."""
    names = tuple(service)
    windows: list[WindowFairness] = []
    received = dict.fromkeys(names, 0.0)
    entitled = dict.fromkeys(names, 0.0)
    counter = dict.fromkeys(names, 0.0)
    previous: set[str] = set()
    for k in range(len(edges) - 1):
        now = [n for n in names if backlogged[n][k]]
        stayed = [counter[n] for n in now if n in previous]
        if stayed:
            floor = min(stayed)
            for n in now:
                if n not in previous:
                    counter[n] = max(counter[n], floor)
        for n in names:
            counter[n] += float(service[n][k]) / weights[n]
        judged = len(now) >= 2
        if judged:
            x = np.array([float(service[n][k]) / weights[n] for n in now])
            total = sum(float(service[n][k]) for n in now)
            weight_sum = sum(weights[n] for n in now)
            for n in now:
                received[n] += float(service[n][k])
                entitled[n] += weights[n] / weight_sum * total
            values = [counter[n] for n in now]
            windows.append(WindowFairness(float(edges[k]), float(edges[k + 1]), tuple(now),
                                          jain_index(x.tolist()), share_ratio(x),
                                          max(values) - min(values)))
        else:
            windows.append(WindowFairness(float(edges[k]), float(edges[k + 1]), tuple(now),
                                          None, None, None))
        previous = set(now)
    ratio = {n: received[n] / entitled[n] for n in names if entitled[n] > 0}
    differences = [w.service_difference for w in windows if w.service_difference is not None]
    return TierFairness(
        tier=tier,
        tenants=names,
        windows=windows,
        service_ratio=ratio,
        jain_index=jain_index(list(ratio.values())) if len(ratio) >= 2 else None,
        max_min_share_ratio=share_ratio(list(ratio.values())) if len(ratio) >= 2 else None,
        max_service_difference=max(differences) if differences else None,
        starved=tuple(n for n, r in ratio.items() if r == 0),
    )


def fairness(edges: FloatArray, service: Mapping[str, FloatArray],
             backlogged: Mapping[str, np.ndarray], weights: Mapping[str, float],
             tiers: Mapping[str, str], fraction: float, window_s: float) -> Fairness:
    """Per-tier fairness; ``tiers`` maps each tenant to its tier."""
    if not 0 < fraction <= 1:
        raise ValueError(f"backlog fraction must be in (0, 1], got {fraction}")
    by_tier: dict[str, list[str]] = {}
    for name, tier in tiers.items():
        by_tier.setdefault(tier, []).append(name)
    return Fairness(fraction, window_s, {
        tier: tier_fairness(tier, edges, {n: service[n] for n in names},
                            {n: backlogged[n] for n in names}, weights)
        for tier, names in by_tier.items()
    })
