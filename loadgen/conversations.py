"""Conversations: requests that follow answers. A tenant's multi-turn sessions
(weighbridge.loadgen.sessions), its agent programs (weighbridge.loadgen.programs) and a
replayed trace's sessions (weighbridge.loadgen.trace) are each one, so the load generator's
driver and the simulator's clients send all three alike: the first request at its time, then
whatever the conversation plans when told how each request ended.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from weighbridge.loadgen.plan import Answer, RequestPlan
from weighbridge.loadgen.programs import ProgramRun, programs_of
from weighbridge.loadgen.scenario import Workload
from weighbridge.loadgen.sessions import SessionTurns, sessions_of
from weighbridge.loadgen.tenants import TenantSpec

__all__ = ["Conversation", "conversations_of"]


class Conversation(Protocol):
    """Pure: nothing here reads a clock or sends anything."""

    def first(self) -> RequestPlan:
        """The request that starts it."""
        ...

    def ended(self, plan: RequestPlan, answer: Answer | None, end_s: float
              ) -> list[RequestPlan]:
        """``plan`` ended at ``end_s``, with ``answer`` when it ended ok: the requests that
        follow (none when it is over, or waits for others)."""
        ...


def conversations_of(tenant: TenantSpec, workload: Workload, seed: int,
                     until_s: float | None = None, model: str | None = None
                     ) -> Iterator[Conversation] | None:
    """The tenant's sessions or agent programs, in the order they start, up to ``until_s``;
    None for a tenant whose requests follow no answers. ``model``: the run's, for a tenant
    naming none."""
    if tenant.sessions is not None:
        return (SessionTurns(session, workload, seed, model)
                for session in sessions_of(tenant, workload, seed, until_s))
    if tenant.programs is not None:
        return (ProgramRun(program, workload, seed, model)
                for program in programs_of(tenant, workload, seed, until_s))
    return None
