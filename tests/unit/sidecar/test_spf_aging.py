"""Shortest-prompt-first ages: a long prompt waits behind shorter ones only while they arrive
within the bound (``sidecar.request.spf_delay_s``), never behind a stream of them forever."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.sidecar.builders import make_request
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.queues import TenantQueue
from weighbridge.sidecar.request import SPF_MAX_DELAY_S, QueuedRequest, spf_delay_s
from weighbridge.sidecar.scheduler import Scheduler, TenantSpec

ARRIVALS = st.floats(0, 30, allow_nan=False)
PROMPTS = st.integers(1, 100_000)


@given(a=st.integers(0, 100_000), b=st.integers(0, 100_000),
       bound=st.floats(0.01, 100, allow_nan=False))
def test_the_delay_grows_with_the_prompt_and_stays_below_its_bound(a: int, b: int,
                                                                    bound: float) -> None:
    low, high = sorted((a, b))
    assert 0 <= spf_delay_s(low, bound) <= spf_delay_s(high, bound) < bound
    assert spf_delay_s(0, bound) == 0


def drained(sent: list[tuple[float, int]]) -> list[QueuedRequest]:
    """Requests of (arrival, prompt) in the order a tenant's queue gives them (as the
    scheduler sets them under shortest_prompt_first: the prompt is the size rank)."""
    queue = TenantQueue()
    for seq, (t, p) in enumerate(sent):
        r = make_request(arrival=t, prompt=p, id=f"r{seq}")
        r.seq, r.size_rank = seq, p
        queue.push(r)
    return [queue.pop() for _ in sent]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(ARRIVALS, PROMPTS), min_size=1, max_size=40))
def test_no_request_is_passed_by_one_arriving_the_bound_or_more_after_it(
        sent: list[tuple[float, int]]) -> None:
    for earlier, later in itertools.combinations(drained(sent), 2):
        # `later` left the queue after `earlier`: it arrived no more than the bound after.
        assert earlier.arrival_s < later.arrival_s + SPF_MAX_DELAY_S


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(ARRIVALS, PROMPTS), min_size=1, max_size=40))
def test_a_shorter_prompt_sent_no_later_is_never_behind_a_longer_one(
        sent: list[tuple[float, int]]) -> None:
    order = drained(sent)
    position = {r.id: i for i, r in enumerate(order)}
    for a, b in itertools.permutations(order, 2):
        if a.arrival_s <= b.arrival_s and a.prompt_tokens < b.prompt_tokens:
            assert position[a.id] < position[b.id]


@settings(max_examples=100, deadline=None)
@given(long_at=st.floats(0, 5, allow_nan=False), gap=st.floats(0.01, 1, allow_nan=False))
def test_a_long_prompt_leaves_before_the_short_ones_sent_after_the_bound(
        long_at: float, gap: float) -> None:
    """A backlog the scheduler fills with short prompts every ``gap`` seconds: the long
    prompt leaves before every short one sent ``SPF_MAX_DELAY_S`` or more after it."""
    s = Scheduler({"standard": 1}, {"a": TenantSpec("standard")}, shortest_prompt_first=True)
    s.enqueue(make_request(arrival=long_at, prompt=100_000, id="long"), long_at)
    shorts = [long_at + gap * k for k in range(1, int(2 * SPF_MAX_DELAY_S / gap) + 2)]
    for k, t in enumerate(shorts):
        s.enqueue(make_request(arrival=t, prompt=10, id=f"s{k}"), t)
    order = []
    while (r := s.next(shorts[-1])) is not None:
        order.append(r.id)
    after = {f"s{k}" for k, t in enumerate(shorts) if t >= long_at + SPF_MAX_DELAY_S}
    assert after  # the bound was reached within the backlog
    assert all(order.index("long") < order.index(rid) for rid in after)


def test_without_shortest_prompt_first_the_order_is_arrival() -> None:
    s = Scheduler({"standard": 1}, {"a": TenantSpec("standard")})
    s.enqueue(make_request(arrival=0, prompt=5000, id="long"), 0)
    s.enqueue(make_request(arrival=0.001, prompt=5, id="short"), 0.001)
    assert [s.next(1).id, s.next(1).id] == ["long", "short"]  # type: ignore[union-attr]


def _first_of(scheduler: dict[str, object]) -> list[str]:
    config = parse_config({"tenants": {"a": {"tier": "standard", "api_keys": ["plain:k"]}},
                           "backends": [{"url": "http://127.0.0.1:1"}],
                           "scheduler": scheduler})
    s = Scheduler.from_config(config)
    s.enqueue(make_request(arrival=0, prompt=5000, id="long"), 0)
    s.enqueue(make_request(arrival=0.001, prompt=5, id="short"), 0.001)
    return [s.next(1).id, s.next(1).id]  # type: ignore[union-attr]


def test_shortest_prompt_first_with_aging_is_the_configurations_default() -> None:
    """Decision 0019 (c): on by default; the older switch set false, or `ordering: fifo`,
    keeps arrival order; set true, it wins over `ordering`."""
    assert _first_of({}) == ["short", "long"]
    assert _first_of({"shortest_prompt_first": False}) == ["long", "short"]
    assert _first_of({"ordering": "fifo"}) == ["long", "short"]
    assert _first_of({"ordering": "fifo", "shortest_prompt_first": True}) == ["short", "long"]
