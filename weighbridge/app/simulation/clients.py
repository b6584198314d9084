"""The clients of a simulated run: who sends what and when, as the load generator would.

Open-loop send times and each request's sizes come from the load generator's own functions
(``weighbridge.loadgen.plan``: same seed, same request ids, same lengths as a live run); closed-loop
users send their next request when the previous one ends plus a think time, as
``weighbridge.loadgen.driver`` does; a conversation's requests (a multi-turn session's turns,
an agent program's calls and subagents, a replayed trace's session:
``weighbridge.loadgen.conversations``) come from its own pure rules with each answer as
the engine gave it, as the driver sends them; a trace replays recorded requests at their
times. Each request's headers and body fields are the load generator's
(``weighbridge.loadgen.identity.request_headers``, ``weighbridge.loadgen.bodies``).
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from weighbridge.loadgen.arrivals import Closed
from weighbridge.loadgen.bodies import BodyOptions
from weighbridge.loadgen.conversations import Conversation, conversations_of
from weighbridge.loadgen.identity import request_headers
from weighbridge.loadgen.plan import (
    Answer,
    RequestPlan,
    closed_request_id,
    closed_users,
    open_loop_schedule,
    open_request_id,
    plan_request,
)
from weighbridge.loadgen.scenario import Workload
from weighbridge.loadgen.tenants import TenantSpec

__all__ = ["ClientRequest", "Clients", "ClosedUser", "TraceClients", "WorkloadClients",
           "client_request", "conversation_after"]


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
    options: BodyOptions = field(default_factory=BodyOptions)  # what its body adds
    headers: Mapping[str, str] = field(default_factory=dict)
    user: ClosedUser | None = None
    conversation: Conversation | None = None  # the conversation the request is a turn of
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
              answer: Answer | None = None) -> list[ClientRequest]:
        """The requests a closed-loop user, or a conversation, sends after ``request`` ended
        at ``end_s`` (with ``answer`` when it ended ok)."""
        return []


def client_request(tenant: TenantSpec, plan: RequestPlan, user: ClosedUser | None = None,
                   conversation: Conversation | None = None) -> ClientRequest:
    """``plan`` as ``tenant``'s client sends it (its key, timeout, body options and
    headers)."""
    return ClientRequest(plan=plan, tenant=None, api_key=tenant.api_key,
                         timeout_s=tenant.timeout_s, options=BodyOptions.of(tenant),
                         headers=request_headers(plan, tenant), user=user,
                         conversation=conversation)


class WorkloadClients(Clients):
    """A scenario's tenants, as ``weighbridge.loadgen.driver.TrafficDriver`` runs them in one
    process."""

    def __init__(self, workload: Workload, seed: int, until_s: float) -> None:
        self.workload = workload
        self.seed = seed
        self.until_s = min(until_s, workload.end_s)
        self.tenants = {t.name: t for t in workload.tenants}

    def initial(self) -> Iterator[ClientRequest]:
        for tenant in self.workload.tenants:
            conversations = conversations_of(tenant, self.workload, self.seed, self.until_s)
            if conversations is not None:
                for conversation in conversations:
                    yield client_request(tenant, conversation.first(),
                                         conversation=conversation)
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
              answer: Answer | None = None) -> list[ClientRequest]:
        if request.conversation is not None:
            return conversation_after(request, end_s, answer, self.tenants)
        user = request.user
        if user is None:
            return []
        t = max(end_s, request.plan.scheduled_s) + user.process.think_time(user.rng)
        return [self._closed(user, t)] if t < user.end_s else []


def conversation_after(request: ClientRequest, end_s: float, answer: Answer | None,
                       tenants: Mapping[str, TenantSpec]) -> list[ClientRequest]:
    """What ``request``'s conversation sends after it, each request as its tenant's client
    sends it."""
    conversation = request.conversation
    assert conversation is not None
    return [client_request(tenants[plan.tenant], plan, conversation=conversation)
            for plan in conversation.ended(request.plan, answer, end_s)]


class TraceClients(Clients):
    """Recorded requests replayed at their times (open loop), and a trace's sessions, each
    turn after the previous answer."""

    def __init__(self, requests: list[ClientRequest],
                 tenants: Mapping[str, TenantSpec] | None = None) -> None:
        """``tenants``: those the sessions' requests are sent by."""
        self.requests = requests
        self.tenants = dict(tenants or {})

    def initial(self) -> Iterator[ClientRequest]:
        return iter(self.requests)

    def after(self, request: ClientRequest, end_s: float,
              answer: Answer | None = None) -> list[ClientRequest]:
        if request.conversation is None:
            return []
        return conversation_after(request, end_s, answer, self.tenants)
