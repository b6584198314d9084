"""Which tier a dispatch decision serves: strictly by rank, with an optional share for the
tiers below so that a saturating higher tier cannot starve them forever.

With ``anti_starvation_weight = a``, each backlogged tier that has a backlogged tier below it
yields a fraction ``a`` of its decisions downward (deterministically, by a credit counter, so
the share holds over short windows and tests are reproducible). With three backlogged tiers
the split is ``1-a``, ``a(1-a)``, ``a^2``. Without it, tiers are strict.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping


class TierSelector:
    def __init__(self, ranks: Mapping[str, int], anti_starvation_weight: float | None = None):
        if anti_starvation_weight is not None and not 0 < anti_starvation_weight < 1:
            raise ValueError(f"anti_starvation_weight must be in (0, 1), got "
                             f"{anti_starvation_weight}")
        if len(set(ranks.values())) != len(ranks):
            raise ValueError("tier ranks must be unique")
        self._by_rank = sorted(ranks, key=ranks.__getitem__)
        self._weight = anti_starvation_weight
        self._yield_credit = dict.fromkeys(self._by_rank, 0.0)

    def order(self, backlogged: Callable[[str], bool]) -> list[str]:
        """The backlogged tiers in the order this decision should try them.

        The first is the tier whose turn it is; the rest are fallbacks (strict rank order)
        for when it cannot use the capacity at hand, so the selection stays work-conserving.
        """
        ready = [tier for tier in self._by_rank if backlogged(tier)]
        if self._weight is None or len(ready) < 2:
            return ready
        yielded: list[str] = []
        for i, tier in enumerate(ready[:-1]):
            credit = self._yield_credit[tier] + self._weight
            if credit >= 1.0:
                self._yield_credit[tier] = credit - 1.0
                yielded.append(tier)  # this decision goes to the tiers below
                continue
            self._yield_credit[tier] = credit
            return [tier, *yielded, *ready[i + 1 :]]
        return [ready[-1], *yielded]

    def snapshot(self) -> dict[str, float]:
        return dict(self._yield_credit)
