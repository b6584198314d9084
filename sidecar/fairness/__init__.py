"""Fairness: which tenant's request a pool serves next, and in what order a tenant's own
requests leave (sidecar.scheduler drives both; sidecar.plugins registers them).

A **fairness policy** (``Fairness``) chooses among the backlogged *flows* of one tier (a
flow: one tenant's queue in that tier) and says what serving a request costs a flow in the
policy's own unit of service (DRR's turns: a request's cost over its endpoint's quantum).
That unit is what replicas sharing tenants exchange (``Scheduler.take_booked``,
``charge_foreign``). Its traits, as class attributes, tell the scheduler and admission what
it can do: hold requests behind the admission gate, choose among tenants (so the admission
headroom can go to a tenant under its share), weigh tenants, and charge tokens. A policy
that does not choose among tenants (``per_tenant`` False) is served as one FIFO over every
tier and tenant, and its tiers' flow structures stay empty.

An **ordering** (``Ordering``) ranks a tenant's own requests after their priority and
deadline by a size that delays their arrival, aged (``sidecar.request.spf_delay_s``: never
2 s or more), or by a delay of its own (``delay_s``), then by arrival
(``QueuedRequest.order_key``).

Each policy or ordering is one module here with one ``@register`` line;
tests/unit/sidecar/test_fairness_conformance.py runs over every one registered.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    from weighbridge.sidecar.request import QueuedRequest

__all__ = ["Fairness", "Ordering"]


class Fairness(Protocol):
    """One tier's choice among its backlogged flows (the interface of
    ``sidecar.drr.DeficitRoundRobin``): flows are added with their weight, activated when
    their queue fills and deactivated when it empties; ``pick`` names the flow to serve
    (passing over those ``eligible`` refuses, which are not compensated for what they could
    not use: that is ``forfeited``), ``consume`` charges what it was served (and ends the
flow's visit once it has spent ``turn``: the endpoint's turn, apart from its share), ``adjust``
    settles a charge later (positive: more; negative: a refund). Amounts are in the
    policy's unit (``service``)."""

    name: ClassVar[str]
    holds_requests: ClassVar[bool]  # queued and gated; False: forwarded at once, no gate
    # Picks among tenants' flows, so it can choose an under-share tenant (admission
    # headroom, fairness); False: one FIFO, and headroom is ordinary capacity.
    per_tenant: ClassVar[bool]
    weighted: ClassVar[bool]  # tenants' weights count (False: every weight is 1)
    costs_tokens: ClassVar[bool]  # a request costs its tokens, settled at its end

    @staticmethod
    def service(cost: float, quantum: int) -> float:
        """What a request costing ``cost`` in its endpoint's unit (tokens, or 1 a request)
        costs its flow, at the endpoint's ``quantum``."""
        ...

    @property
    def round(self) -> int: ...

    def __contains__(self, flow: object) -> bool: ...

    def add(self, flow: str, weight: float) -> None: ...

    def activate(self, flow: str) -> None: ...

    def deactivate(self, flow: str) -> None: ...

    def pick(self, eligible: Callable[[str], bool] | None = None) -> str | None: ...

    def consume(self, flow: str, cost: float, backlogged: bool,
                turn: float = math.inf) -> None: ...

    def adjust(self, flow: str, delta: float) -> None: ...

    def credit(self, flow: str) -> float: ...

    def forfeited(self, flow: str) -> float: ...

    def snapshot(self) -> dict[str, Any]: ...


class Ordering(Protocol):
    """A tenant's own queue order after priority and deadline: ``rank``, a size in tokens,
    orders the request as if it arrived ``spf_delay_s(rank)`` later (0: no delay; the delay
    stays under 2 s, so a larger rank waits a bounded time behind later arrivals), then
    arrival. One object per scheduler: an ordering that keeps state (``program_las``) also
    has ``delay_s(request)``, how much later than its arrival a request is ordered (set at
    enqueue), and ``served(request, tokens)``, told the computed tokens of each request
    that ends."""

    name: ClassVar[str]

    @staticmethod
    def rank(request: QueuedRequest) -> int: ...
