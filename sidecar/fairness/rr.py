from __future__ import annotations

from weighbridge.sidecar.drr import DeficitRoundRobin
from weighbridge.sidecar.plugins import register


@register("fairness", "rr")
class RoundRobin(DeficitRoundRobin):
    """Round robin over the tenants of each tier, one request a turn: weights and token
    costs ignored (a baseline to compare ``drr`` with). Tiers are served strictly by rank."""

    holds_requests = True
    per_tenant = True
    weighted = False
    costs_tokens = False

    @staticmethod
    def service(cost: float, quantum: int) -> float:
        del cost, quantum
        return 1.0
