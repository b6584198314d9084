"""Multi-turn sessions: each turn a pure function of the seed, the session and the answers.

A tenant with ``sessions`` starts a session at each of its open-loop arrivals
(:func:`~weighbridge.loadgen.plan.open_loop_schedule`: sessions arrive open loop). A session
draws its number of turns once; turn ``k`` draws its new user message and its answer's
length from the tenant's ``lengths`` and the think time that follows its answer from
``sessions.think_ms``, each from an RNG keyed by the session and the turn, so a run is the
same whatever the number of processes and whichever side (Locust or the simulator) runs it.

* turn 0's prompt is the tenant's system prompt (if any) and the first user message;
* turn ``k + 1``'s prompt is turn ``k``'s prompt, plus turn ``k``'s answer as the server
  returned it (its text, its token ids when the server sent them, its length from usage),
  plus a new user message;
* turn ``k + 1`` is due turn ``k``'s think time after turn ``k``'s answer ended;
* a turn that does not end ``ok`` ends its session: there is no answer to continue from.

Nothing here reads a clock or sends anything: the driver and the simulator give each turn's
end time and answer, and send the plan they get back.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterator
from dataclasses import dataclass

from weighbridge.loadgen.plan import (
    Answer,
    Message,
    RequestPlan,
    open_loop_schedule,
    system_message,
)
from weighbridge.loadgen.scenario import Workload
from weighbridge.loadgen.tenants import TenantSpec

__all__ = ["Answer", "Session", "SessionTurns", "first_turn", "next_turn", "phase_at",
           "sessions_of"]


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    tenant: TenantSpec
    seq: int  # among the tenant's sessions: process ``seq % count`` runs it
    turns: int  # as drawn; fewer are sent when a turn fails or the run ends
    user: str | None  # the `user` field of every turn
    start_s: float


def session_id(tenant: str, seq: int) -> str:
    return f"{tenant}-s{seq}"


def turn_request_id(session: str, turn: int) -> str:
    return f"{session}-t{turn}"


def sessions_of(tenant: TenantSpec, workload: Workload, seed: int,
                until_s: float | None = None) -> Iterator[Session]:
    """The tenant's sessions in the order they start, up to ``until_s``."""
    spec = tenant.sessions
    if spec is None:
        return
    for due in open_loop_schedule(tenant, workload, seed, until_s):
        sid = session_id(tenant.name, due.seq)
        rng = random.Random(f"{seed}/{sid}")
        turns = spec.turns.sample(rng)
        user = f"{tenant.name}-u{rng.randrange(tenant.users)}" if tenant.users else None
        yield Session(sid, tenant, due.seq, turns, user, due.t)


def phase_at(workload: Workload, t: float) -> str:
    """The phase running at ``t`` (the last one from its start on)."""
    starts = [p.start_s for p in workload.phases]
    return workload.phases[max(0, bisect.bisect_right(starts, t) - 1)].name


def _turn_draws(session: Session, turn: int, seed: int) -> tuple[int, int, int, float]:
    """(user message tokens, answer tokens, content seed, think time after the answer)."""
    spec = session.tenant.sessions
    assert spec is not None
    rng = random.Random(f"{seed}/{session.session_id}/t{turn}")
    message, output = session.tenant.lengths.draw(rng)
    content_seed = rng.getrandbits(32)
    think_s = spec.think_ms.sample(rng) / 1000
    return message, output, content_seed, think_s


def _turn(session: Session, turn: int, history: tuple[Message, ...], scheduled_s: float,
          workload: Workload, seed: int, model: str | None) -> RequestPlan:
    message, output, content_seed, _ = _turn_draws(session, turn, seed)
    messages = (*history, Message("user", message, content_seed))
    tenant = session.tenant
    return RequestPlan(
        request_id=turn_request_id(session.session_id, turn), tenant=tenant.name,
        tier=tenant.tier, phase=phase_at(workload, scheduled_s), user=session.user,
        endpoint=tenant.path, stream=tenant.stream,
        prompt_tokens=sum(m.tokens for m in messages), max_tokens=output,
        scheduled_s=scheduled_s, content_seed=content_seed, model=tenant.model or model,
        messages=messages, session_id=session.session_id, turn=turn)


def first_turn(session: Session, workload: Workload, seed: int,
               model: str | None = None) -> RequestPlan:
    """Turn 0, due when the session starts. ``model``: the run's, for a tenant naming none."""
    system = system_message(session.tenant, seed)
    return _turn(session, 0, (system,) if system else (), session.start_s, workload, seed,
                 model)


def next_turn(session: Session, previous: RequestPlan, answer: Answer | None, end_s: float,
              workload: Workload, seed: int, model: str | None = None) -> RequestPlan | None:
    """The turn after ``previous``, which ended at ``end_s`` with ``answer`` (None: it did not
    end ok); None when the session is over."""
    assert previous.turn is not None and previous.messages is not None
    if answer is None or previous.turn + 1 >= session.turns:
        return None
    _, _, _, think_s = _turn_draws(session, previous.turn, seed)
    reply = Message("assistant", answer.tokens, text=answer.text, token_ids=answer.token_ids)
    return _turn(session, previous.turn + 1, (*previous.messages, reply),
                 max(end_s, previous.scheduled_s) + think_s, workload, seed, model)


@dataclass(frozen=True, slots=True)
class SessionTurns:
    """A session as a conversation (weighbridge.loadgen.conversations): its turns, one
    after each answer."""

    session: Session
    workload: Workload
    seed: int
    model: str | None = None  # the run's, for a tenant naming none

    def first(self) -> RequestPlan:
        return first_turn(self.session, self.workload, self.seed, self.model)

    def ended(self, plan: RequestPlan, answer: Answer | None, end_s: float
              ) -> list[RequestPlan]:
        turn = next_turn(self.session, plan, answer, end_s, self.workload, self.seed,
                         self.model)
        return [] if turn is None else [turn]
