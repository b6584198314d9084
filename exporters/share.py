"""Per-tenant token share over a sliding window, the share each tenant is entitled to, and
Jain's fairness index on weight-normalised service.

Definitions (docs/metrics.md, "Load generator", repeats them):

* **Served tokens** of a request are its prompt + output tokens from the server's usage,
  counted when the request ends (rejected requests serve 0). A tenant's **share** is its
  served tokens in the window over all tenants' served tokens in the window.
* A tenant is **active** when it had a request in flight at some moment of the window: it
  has one in flight now, or one of its requests ended (with any status) in the window.
* The **entitled share** of an active tenant is its weight over the sum of the active
  tenants' weights; inactive tenants are entitled to 0. Tenants without a configured weight
  weigh 1. Tiers are not taken into account: under strict tier priority a lower tier gets
  less than its entitlement by design, so compare tenants of one tier (``jain_index`` over a
  subset does that).
* **Jain's index** over the active tenants of x_i = served_i / weight_i is
  (Σ x)² / (n · Σ x²): 1 when service is exactly proportional to weight, 1/n when one
  tenant took everything. Undefined (None) with no active tenant or nothing served.

Pure: times are passed in; nothing reads a clock.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from weighbridge.statistics import jain_index

__all__ = ["ShareReading", "TokenShareWindow", "entitled_shares"]


def entitled_shares(weights: Mapping[str, float], active: Collection[str]) -> dict[str, float]:
    """Each active tenant's weight over the active tenants' total weight (missing weights
    count 1)."""
    chosen = {t: weights.get(t, 1.0) for t in active}
    total = math.fsum(chosen.values())
    if total <= 0:
        return dict.fromkeys(chosen, 0.0)
    return {t: w / total for t, w in chosen.items()}


@dataclass(frozen=True, slots=True)
class ShareReading:
    served: dict[str, float]  # tokens served in the window, per tenant that ended requests
    share: dict[str, float]  # served over total served (0 for all when nothing was served)
    entitled: dict[str, float]  # per active tenant
    jain: float | None  # over active tenants, on served / weight

    def jain_among(self, tenants: Collection[str],
                   weights: Mapping[str, float]) -> float | None:
        """Jain's index restricted to the active tenants in ``tenants`` (e.g. one tier)."""
        active = [t for t in self.entitled if t in tenants]
        return jain_index([self.served.get(t, 0.0) / weights.get(t, 1.0) for t in active])


class TokenShareWindow:
    """Served tokens per tenant over the last ``window_s`` seconds."""

    def __init__(self, window_s: float, weights: Mapping[str, float] | None = None) -> None:
        if not window_s > 0:
            raise ValueError(f"window_s: must be positive, got {window_s}")
        for tenant, weight in (weights or {}).items():
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError(f"weights.{tenant}: must be a positive number, got {weight}")
        self.window_s = float(window_s)
        self.weights: dict[str, float] = dict(weights or {})
        self._ended: list[tuple[float, int, str, float]] = []  # heap by time
        self._served: dict[str, float] = {}
        self._ends: dict[str, int] = {}  # requests ended in the window, any status
        self._seq = 0

    def ended(self, tenant: str, tokens: float, at: float) -> None:
        """A request of ``tenant`` ended at ``at`` having been served ``tokens``."""
        if tokens < 0:
            raise ValueError(f"tokens: must be >= 0, got {tokens}")
        self._seq += 1
        heapq.heappush(self._ended, (at, self._seq, tenant, float(tokens)))
        self._served[tenant] = self._served.get(tenant, 0.0) + tokens
        self._ends[tenant] = self._ends.get(tenant, 0) + 1

    def reading(self, at: float, in_flight: Collection[str] = ()) -> ShareReading:
        """The window ending at ``at``; ``in_flight``: tenants with a request in flight now."""
        self.expire(at)
        served = dict(self._served)
        total = math.fsum(served.values())
        share = {t: (s / total if total > 0 else 0.0) for t, s in served.items()}
        active = set(self._ends) | set(in_flight)
        entitled = entitled_shares(self.weights, sorted(active))
        jain = jain_index([served.get(t, 0.0) / self.weights.get(t, 1.0) for t in entitled])
        return ShareReading(served, share, entitled, jain)

    def expire(self, at: float) -> None:
        """Forget ends that left the window ending at ``at``."""
        start = at - self.window_s
        while self._ended and self._ended[0][0] <= start:
            _, _, tenant, tokens = heapq.heappop(self._ended)
            self._ends[tenant] -= 1
            if self._ends[tenant] == 0:
                # Dropping the tenant also drops rounding left in its running sum.
                del self._ends[tenant], self._served[tenant]
            else:
                self._served[tenant] -= tokens
