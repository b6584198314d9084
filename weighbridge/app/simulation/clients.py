"""The clients of a simulated run: who sends what and when, as the load generator would.

Open-loop send times and each request's sizes come from the load generator's own functions
(``weighbridge.loadgen.plan``: same seed, same request ids, same lengths as a live run); closed-loop
users send their next request when the previous one ends plus a think time, as
``weighbridge.loadgen.driver`` does; a multi-turn session's turns come from
``weighbridge.loadgen.sessions`` with each answer as the engine gave it, as the driver sends
them; a trace replays recorded requests at their times.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from weighbridge.loadgen.arrivals import Closed
from weighbridge.loadgen.plan import (
    RequestPlan,
    closed_request_id,
    closed_users,
    open_loop_schedule,
    open_request_id,
    plan_request,
)
from weighbridge.loadgen.scenario import Workload
from weighbridge.loadgen.sessions import Answer, Session, first_turn, next_turn, sessions_of
from weighbridge.loadgen.tenants import TenantSpec

__all__ = ["ClientRequest", "Clients", "ClosedUser", "TraceClients", "WorkloadClients",
           "client_request"]


@dataclass(slots=True, eq=False)
class ClosedUser:
    """One closed-loop user of the driver: its next request follows the previous one."""

    tenant: TenantSpec
    phase: str
    end_s: float
    user: int
    process: Closed
    rng: random.Random
    n: int = 0


@dataclass(slots=True, eq=False)
class ClientRequest:
    """One request as its client sends it."""

    plan: RequestPlan
    tenant: str | None  # the sidecar tenant when known (a trace); None: from api_key
    api_key: str | None
    timeout_s: float
    ignore_eos: bool = True
    priority: int | None = None  # the body's vLLM priority field
    headers: Mapping[str, str] = field(default_factory=dict)
    user: ClosedUser | None = None
    session: Session | None = None  # the multi-turn session the request is a turn of
    # The body as sent, for a client with one of its own (a malformed one, say): the
    # sidecar reads it as it reads live bodies. None: the plan's, as the load generator
    # builds it (its prompt counted from the plan).
    body: bytes | None = None


class Clients:
    """What the simulation asks of its clients."""

    def initial(self) -> Iterator[ClientRequest]:
        """Every request known before the run starts (any order)."""
        raise NotImplementedError

    def after(self, request: ClientRequest, end_s: float,
              answer: Answer | None = None) -> ClientRequest | None:
        """The request a closed-loop user, or a session, sends after ``request`` ended at
        ``end_s`` (with ``answer`` when it ended ok)."""
        return None


def client_request(tenant: TenantSpec, plan: RequestPlan, user: ClosedUser | None = None,
                   session: Session | None = None) -> ClientRequest:
    """``plan`` as ``tenant``'s client sends it (its key, timeout, priority and headers)."""
    return ClientRequest(plan=plan, tenant=None, api_key=tenant.api_key,
                         timeout_s=tenant.timeout_s, ignore_eos=tenant.ignore_eos,
                         priority=tenant.priority, headers=tenant.request_headers, user=user,
                         session=session)


class WorkloadClients(Clients):
    """A scenario's tenants, as ``weighbridge.loadgen.driver.TrafficDriver`` runs them in one
    process."""

    def __init__(self, workload: Workload, seed: int, until_s: float) -> None:
        self.workload = workload
        self.seed = seed
        self.until_s = min(until_s, workload.end_s)

    def initial(self) -> Iterator[ClientRequest]:
        for tenant in self.workload.tenants:
            if tenant.sessions is not None:
                for session in sessions_of(tenant, self.workload, self.seed, self.until_s):
                    yield client_request(tenant, first_turn(session, self.workload, self.seed),
                                  session=session)
                continue
            for due in open_loop_schedule(tenant, self.workload, self.seed, self.until_s):
                plan = plan_request(tenant, open_request_id(tenant.name, due.seq), due.phase,
                                    due.t, self.seed)
                yield client_request(tenant, plan)
            for phase, start, end, user, process in closed_users(tenant, self.workload, 0, 1):
                rng = random.Random(f"{self.seed}/{tenant.name}/{phase}/u{user}/think")
                closed = ClosedUser(tenant, phase, min(end, self.until_s), user, process, rng)
                if start < closed.end_s:
                    yield self._closed(closed, start)

    def _closed(self, user: ClosedUser, t: float) -> ClientRequest:
        plan = plan_request(user.tenant,
                            closed_request_id(user.tenant.name, user.phase, user.user, user.n),
                            user.phase, t, self.seed)
        user.n += 1
        return client_request(user.tenant, plan, user)

    def after(self, request: ClientRequest, end_s: float,
              answer: Answer | None = None) -> ClientRequest | None:
        if (session := request.session) is not None:
            plan = next_turn(session, request.plan, answer, end_s, self.workload, self.seed)
            return None if plan is None else client_request(session.tenant, plan, session=session)
        user = request.user
        if user is None:
            return None
        t = max(end_s, request.plan.scheduled_s) + user.process.think_time(user.rng)
        return self._closed(user, t) if t < user.end_s else None


class TraceClients(Clients):
    """Recorded requests replayed at their times (open loop)."""

    def __init__(self, requests: list[ClientRequest]) -> None:
        self.requests = requests

    def initial(self) -> Iterator[ClientRequest]:
        return iter(self.requests)
