"""The baselines that do not choose among tenants: one queue over every tier and tenant, in
arrival order (sidecar.scheduler keeps it); their tiers' rings stay empty."""

from __future__ import annotations

from weighbridge.sidecar.fairness.rr import RoundRobin
from weighbridge.sidecar.plugins import register


@register("fairness", "fcfs")
class FirstComeFirstServed(RoundRobin):
    """One queue in arrival order, through the admission gate: tiers, tenants and priorities
    ignored, and the admission headroom is ordinary capacity (a baseline)."""

    per_tenant = False


@register("fairness", "passthrough")
class Passthrough(FirstComeFirstServed):
    """No queue and no gate: every request is forwarded at once, in arrival order (the
    no-sidecar baseline)."""

    holds_requests = False
