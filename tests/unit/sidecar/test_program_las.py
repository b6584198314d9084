"""``program_las`` (sidecar.fairness.program_las): least attained service per program inside a
tenant, aged so that no call waits behind later arrivals longer than the stated bound, and
tenants' shares left to the fairness policy. Virtual time throughout: the server below
dispatches one call per unit of time, whatever the machine does."""

from __future__ import annotations

import itertools
import math

from hypothesis import event, given, settings
from hypothesis import strategies as st

from tests.unit.sidecar.builders import make_request
from weighbridge.sidecar.fairness.program_las import (
    PROGRAM_HALF_TOKENS,
    PROGRAM_MAX_DELAY_S,
    PROGRAMS,
    ProgramLas,
    program_delay_s,
)
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.scheduler import Scheduler, TenantSpec

BOUND = PROGRAM_MAX_DELAY_S


def scheduler(ordering: str = "program_las", tenants: tuple[str, ...] = ("a",)) -> Scheduler:
    return Scheduler({"standard": 1}, {t: TenantSpec("standard") for t in tenants},
                     ordering=ordering)


@given(a=st.integers(0, 10**9), b=st.integers(0, 10**9))
def test_the_delay_grows_with_service_and_stays_below_the_bound(a: int, b: int) -> None:
    low, high = sorted((a, b))
    assert 0 <= program_delay_s(low) <= program_delay_s(high) < BOUND
    assert program_delay_s(0) == 0
    assert math.isclose(program_delay_s(PROGRAM_HALF_TOKENS), BOUND / 2)


def test_a_new_programs_call_goes_before_a_long_programs_earlier_one() -> None:
    s = scheduler()
    first = make_request(arrival=0.0, program="long", id="l0")
    s.enqueue(first, 0.0)
    assert s.next(0.0) is first
    s.on_finished(first, 20_000, 500)  # the long program has had much service
    s.enqueue(make_request(arrival=1.0, program="long", id="l1"), 1.0)
    s.enqueue(make_request(arrival=2.0, program="new", id="n0"), 2.0)
    s.enqueue(make_request(arrival=2.5, id="single"), 2.5)  # a program of one call
    assert [s.next(3.0).id for _ in range(3)] == ["n0", "single", "l1"]  # type: ignore[union-attr]


def test_a_fork_join_family_is_one_program() -> None:
    s = scheduler()
    parent = make_request(arrival=0.0, program="root", session="root", id="p")
    s.enqueue(parent, 0.0)
    s.next(0.0)
    s.on_finished(parent, 8_000, 200)
    child = make_request(arrival=1.0, program="root", session="root/child", id="c")
    s.enqueue(child, 1.0)
    assert child.order_delay_s == program_delay_s(8_200)


def test_the_service_held_per_program_is_bounded() -> None:
    order = ProgramLas()
    for k in range(PROGRAMS + 100):
        order.served(make_request(program=f"p{k}"), 10)
    assert len(order) == PROGRAMS


# -- the starvation bound, in virtual time ------------------------------------------------

# (arrival, program, computed tokens it costs): 6 programs, up to 150 calls of a tenant in
# 60 s, one served a second: a backlog that outlasts the bound, where aging decides.
CALLS = st.lists(st.tuples(st.floats(0, 60, allow_nan=False), st.integers(0, 5),
                           st.integers(1, 50_000)), min_size=1, max_size=150)


def serve(calls: list[tuple[float, int, int]]) -> dict[str, tuple[QueuedRequest, int]]:
    """Each call's request and the integer instant it was dispatched: one dispatch per
    unit of time when anything is queued, each call ending (its service counted) one unit
    after its dispatch."""
    s = scheduler()
    requests = sorted((make_request(arrival=t, program=f"p{p}", prompt=cost, output=0,
                                    id=f"r{k}") for k, (t, p, cost) in enumerate(calls)),
                      key=lambda r: (r.arrival_s, r.id))
    dispatched: dict[str, tuple[QueuedRequest, int]] = {}
    pending = iter(requests)
    upcoming = next(pending, None)
    running: QueuedRequest | None = None
    for now in itertools.count():
        if running is not None:
            s.on_finished(running, running.prompt_tokens, 0)
            running = None
        while upcoming is not None and upcoming.arrival_s <= now:
            s.enqueue(upcoming, upcoming.arrival_s)
            upcoming = next(pending, None)
        running = s.next(float(now))
        if running is not None:
            dispatched[running.id] = (running, now)
        elif upcoming is None:
            return dispatched
    raise AssertionError("unreachable")  # pragma: no cover


@settings(max_examples=150, deadline=None)
@given(CALLS)
def test_no_call_is_passed_by_one_arriving_the_bound_or_more_after_it(
        calls: list[tuple[float, int, int]]) -> None:
    dispatched = serve(calls)
    assert len(dispatched) == len(calls)
    waits = [at - r.arrival_s for r, at in dispatched.values()]
    event("waited longer than the bound" if max(waits) > BOUND else "within the bound")
    for (a, at), (b, bt) in itertools.permutations(dispatched.values(), 2):
        if bt < at:  # b left before a: it arrived less than the bound after a
            assert b.arrival_s < a.arrival_s + BOUND


@settings(max_examples=150, deadline=None)
@given(CALLS)
def test_no_program_waits_longer_than_the_bound(calls: list[tuple[float, int, int]]) -> None:
    """The bound, stated: a call waits at most one unit (the next dispatch instant), plus one
    unit per call queued when it arrived, plus one per call of its tenant arriving within
    ``PROGRAM_MAX_DELAY_S`` after it, however much service its program has had. FIFO's
    wait is the first two terms; least attained service adds at most the third."""
    dispatched = serve(calls)
    for request, at in dispatched.values():
        arrival = request.arrival_s
        queued = sum(1 for other, ot in dispatched.values() if other is not request
                     and other.arrival_s <= arrival and ot >= arrival)
        within = sum(1 for other in (o for o, _ in dispatched.values())
                     if arrival < other.arrival_s < arrival + BOUND)
        assert at - arrival <= 1 + queued + within


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ab"), st.integers(0, 5)), min_size=1, max_size=40))
def test_tenants_take_turns_exactly_as_without_it(sent: list[tuple[str, int]]) -> None:
    """DRR across tenants is unchanged: with calls of equal cost, the tenants are served in
    the same sequence as under fifo; only which of a tenant's calls goes differs."""
    sequences = []
    for ordering in ("fifo", "program_las"):
        s = scheduler(ordering, ("a", "b"))
        for k, (tenant, program) in enumerate(sent):
            s.enqueue(make_request(tenant, arrival=k * 0.01, program=f"p{program}",
                                   id=f"r{k}"), k * 0.01)
        served = []
        while (r := s.next(1.0)) is not None:
            served.append(r.tenant)
            s.on_finished(r, r.prompt_tokens, r.estimated_output_tokens)
        sequences.append(served)
    assert sequences[0] == sequences[1]
