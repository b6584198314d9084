from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.sidecar.builders import make_request
from weighbridge.sidecar.queues import QueueLimits, TenantQueue
from weighbridge.sidecar.rejection import QUEUE_FULL


def test_order_and_lazy_cancel() -> None:
    q = TenantQueue()
    reqs = [make_request(arrival=k, seq=k, id=f"q{k}") for k in range(5)]
    for r in reqs:
        q.push(r)
    assert q.remove("q0") is reqs[0]
    assert q.remove("q0") is None
    assert len(q) == 4 and q.tokens == 4 * 120
    assert q.peek() is reqs[1]
    assert [q.pop().id for _ in range(4)] == ["q1", "q2", "q3", "q4"]
    assert not q and q.peek() is None


def test_heap_is_compacted_when_cancels_pile_up() -> None:
    q = TenantQueue()
    for k in range(500):
        q.push(make_request(seq=k, id=f"c{k}"))
    for k in range(1, 500):
        q.remove(f"c{k}")
    assert len(q._heap) <= 2 * len(q) + 32


def test_limits() -> None:
    limits = QueueLimits(max_queued=2, max_queued_tokens=100)
    assert limits.check(0, 0, 1000) is None  # an empty queue takes any single request
    assert limits.check(1, 50, 60).reason == QUEUE_FULL
    assert limits.check(1, 50, 50) is None
    assert limits.check(2, 0, 1).reason == QUEUE_FULL


@settings(max_examples=200, deadline=None)
@given(
    items=st.lists(
        st.tuples(st.integers(-2, 2), st.one_of(st.none(), st.floats(0, 10)), st.floats(0, 10)),
        min_size=1,
        max_size=40,
    ),
    cancels=st.sets(st.integers(0, 39)),
)
def test_pops_in_priority_deadline_arrival_order(items, cancels) -> None:
    q = TenantQueue()
    live = []
    for k, (priority, deadline, arrival) in enumerate(items):
        r = make_request(priority=priority, deadline_s=deadline, arrival=arrival, seq=k,
                         id=f"p{k}")
        q.push(r)
        live.append(r)
    for k in cancels:
        if k < len(live):
            q.remove(f"p{k}")
    expected = sorted(
        (r for k, r in enumerate(live) if k not in cancels), key=lambda r: r.order_key()
    )
    assert [q.pop() for _ in range(len(q))] == expected
