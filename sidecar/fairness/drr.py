from __future__ import annotations

from weighbridge.sidecar.drr import DeficitRoundRobin
from weighbridge.sidecar.plugins import register


@register("fairness", "drr")
class WeightedDrr(DeficitRoundRobin):
    """Weighted deficit round robin over the tenants of each tier, in tokens: each request
    costs its computed prompt and output tokens over its endpoint's quantum (turns), a tenant
    gets ``weight`` turns a round, streamed output beyond the estimate is charged as it
    passes and the real counts settle the charge at the end (sidecar.drr states the bound).
    Tiers are served strictly by rank. The product's policy."""

    holds_requests = True
    per_tenant = True
    weighted = True
    costs_tokens = True

    @staticmethod
    def service(cost: float, quantum: int) -> float:
        return cost / quantum
