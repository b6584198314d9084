"""Replicas agree on where a program's calls go: each replica (sidecar.replica) hands over
the (tenant, session, backend) of the requests its core sent (``take_sent_sessions``) and
learns the others' (``learn_session``), so another replica's session_affinity sends the
program's next call to the backend the first replica chose."""

from __future__ import annotations

from tests.unit.sidecar.test_core import arrive, make_config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.replica import Replica
from weighbridge.sidecar.request import QueuedRequest

ROUTE = {"picker": "bounded_load", "scorers": {"least_tokens": 1.0, "session_affinity": 1.0}}


def core() -> SchedulingCore:
    return SchedulingCore(make_config(routing=ROUTE))


def call(c: SchedulingCore, session: str, now: float) -> str:
    request = arrive(c, "a", now, session=session, prompt_tokens=400, max_tokens=8)
    assert isinstance(request, QueuedRequest)
    (dispatch,) = c.dispatch_ready(now)
    assert dispatch.request is request
    return dispatch.backend


def test_a_replica_sends_a_programs_call_where_another_sent_the_last() -> None:
    a, b = core(), core()
    replica_a, replica_b = Replica(a), Replica(b)
    call(a, "other", 0.0)  # keeps a's first backend busy
    first = call(a, "prog", 0.1)
    assert first != a.fleet.names[0]
    sent = replica_a.take_sent_sessions()
    assert ("a", "prog", first) in sent
    assert replica_a.take_sent_sessions() == []  # taken once
    # Unknown to b, the program's call goes where load sends it: b's first backend.
    assert call(core(), "prog", 0.2) == a.fleet.names[0]
    for tenant, session, backend in sent:
        replica_b.learn_session(tenant, session, backend, 0.2)
    assert call(b, "prog", 0.3) == first


def test_a_binding_to_an_unknown_backend_is_not_learned() -> None:
    b = core()
    Replica(b).learn_session("a", "prog", "no-such-backend", 0.0)
    assert call(b, "prog", 0.1) == b.fleet.names[0]


def test_a_replica_alone_keeps_no_sessions_for_others() -> None:
    c = core()
    call(c, "prog", 0.0)
    assert c.record_for_replicas().sent_sessions == []  # kept only from sharing on
