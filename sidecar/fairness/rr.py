from __future__ import annotations

from weighbridge.sidecar.fairness.drr import WeightedDrr
from weighbridge.sidecar.plugins import register


@register("fairness", "rr")
class RoundRobin(WeightedDrr):
    """Round robin over the tenants of each tier, one request a turn: weights and token
    costs ignored (a baseline to compare ``drr`` with; DRR with every weight and every
    request's cost one). Tiers are served strictly by rank."""

    weighted = False
    costs_tokens = False

    @staticmethod
    def service(cost: float, quantum: int) -> float:
        del cost, quantum
        return 1.0
