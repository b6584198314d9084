"""The baselines that do not choose among tenants: one queue over every tier and tenant, in
arrival order (sidecar.scheduler keeps it); their tiers' rings stay empty."""

from __future__ import annotations

from weighbridge.sidecar.drr import DeficitRoundRobin
from weighbridge.sidecar.plugins import register


@register("fairness", "fcfs")
class FirstComeFirstServed(DeficitRoundRobin):
    """One queue in arrival order, through the admission gate: tiers, tenants and priorities
    ignored, and the admission headroom is ordinary capacity (a baseline)."""

    holds_requests = True
    per_tenant = False
    weighted = False
    costs_tokens = False

    @staticmethod
    def service(cost: float, quantum: int) -> float:
        del cost, quantum
        return 1.0


@register("fairness", "passthrough")
class Passthrough(FirstComeFirstServed):
    """No queue and no gate: every request is forwarded at once, in arrival order (the
    no-sidecar baseline)."""

    holds_requests = False
