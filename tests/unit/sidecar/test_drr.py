"""DeficitRoundRobin: ring order, weights, turns, debt, idle policy, eligibility."""

from __future__ import annotations

import pytest

from weighbridge.sidecar.drr import DeficitRoundRobin


def drr_with(**quanta: float) -> DeficitRoundRobin:
    drr = DeficitRoundRobin()
    for name, quantum in quanta.items():
        drr.add(name, quantum)
    return drr


def serve(drr: DeficitRoundRobin, queues: dict[str, list[float]], n: int) -> list[str]:
    """Run n decisions over FIFO cost lists; returns who was served."""
    out = []
    for _ in range(n):
        flow = drr.pick()
        if flow is None:
            break
        cost = queues[flow].pop(0)
        drr.consume(flow, cost, backlogged=bool(queues[flow]))
        out.append(flow)
    return out


def test_equal_weights_alternate_in_ring_order() -> None:
    drr = drr_with(a=1, b=1, c=1)
    queues = {name: [1.0] * 3 for name in "abc"}
    for name in "abc":
        drr.activate(name)
    assert "".join(serve(drr, queues, 9)) == "abcabcabc"


def test_weight_two_gets_two_turns_worth() -> None:
    drr = drr_with(a=1, b=2)
    queues = {"a": [0.5] * 8, "b": [0.5] * 16}
    drr.activate("a")
    drr.activate("b")
    assert "".join(serve(drr, queues, 12)) == "aabbbbaabbbb"


def test_a_request_costing_several_quanta_skips_rounds_without_spinning() -> None:
    drr = drr_with(a=1, b=1)
    queues = {"a": [5.0, 5.0], "b": [1.0] * 20}
    drr.activate("a")
    drr.activate("b")
    order = serve(drr, queues, 22)
    # a is served first (credit 1 > 0), goes 4 in debt, then sits out 4 rounds.
    assert order[:6] == ["a", "b", "b", "b", "b", "b"]
    assert order[6] == "a"
    assert len(order) == 22
    assert drr.active_count == 0


def test_newcomer_joins_at_the_tail_after_the_current_turn() -> None:
    drr = drr_with(a=1, b=1)
    queues = {"a": [0.25] * 8, "b": [0.25]}
    drr.activate("a")
    assert drr.pick() == "a"
    drr.consume("a", queues["a"].pop(0), backlogged=True)  # a mid-turn, credit 0.75
    drr.activate("b")
    # a finishes its turn (3 more), then b, not a's next turn.
    assert serve(drr, queues, 4) == ["a", "a", "a", "b"]


def test_idle_flow_drops_surplus_but_keeps_debt() -> None:
    drr = drr_with(a=1)
    drr.activate("a")
    assert drr.pick() == "a"
    drr.consume("a", 0.25, backlogged=False)
    assert drr.credit("a") == 0.0  # surplus 0.75 dropped
    drr.activate("a")
    assert drr.pick() == "a"
    drr.consume("a", 3.5, backlogged=False)
    assert drr.credit("a") == pytest.approx(-2.5)  # debt kept
    drr.adjust("a", -10)  # refund to an idle flow cancels debt, never makes surplus
    assert drr.credit("a") == 0.0


def test_settlement_debt_is_paid_in_skipped_rounds() -> None:
    drr = drr_with(a=1, b=1)
    queues = {"a": [1.0] * 10, "b": [1.0] * 10}
    drr.activate("a")
    drr.activate("b")
    assert serve(drr, queues, 2) == ["a", "b"]
    drr.settle("a", charged=1.0, actual=4.0)  # a's request was 3 turns longer
    order = serve(drr, queues, 5)
    assert order == ["b", "b", "b", "a", "b"]


def test_refund_gives_a_bigger_next_turn() -> None:
    drr = drr_with(a=1, b=1)
    queues = {"a": [1.0] * 10, "b": [1.0] * 10}
    drr.activate("a")
    drr.activate("b")
    assert serve(drr, queues, 2) == ["a", "b"]
    drr.settle("a", charged=1.0, actual=0.0)
    assert serve(drr, queues, 4) == ["a", "a", "b", "a"]


def test_ineligible_flows_keep_their_place_and_gain_nothing() -> None:
    drr = drr_with(a=1, b=1, c=1)
    for name in "abc":
        drr.activate(name)
    assert drr.pick(lambda f: f != "a") == "b"
    assert drr.key("a") == (1, 0)  # untouched
    drr.consume("b", 1.0, backlogged=True)
    assert drr.pick(lambda f: f != "a") == "c"
    drr.consume("c", 1.0, backlogged=True)
    assert drr.pick() == "a"  # first in ring order again once eligible
    assert drr.credit("a") == 1.0


def test_nobody_eligible_returns_none_and_restores_the_ring() -> None:
    drr = drr_with(a=1, b=1)
    drr.activate("a")
    drr.activate("b")
    assert drr.pick(lambda f: False) is None
    assert drr.pick() == "a"


def test_pick_on_empty_ring_is_none() -> None:
    assert DeficitRoundRobin().pick() is None


def test_errors_are_loud() -> None:
    drr = drr_with(a=1)
    with pytest.raises(ValueError):
        drr.add("b", 0)
    with pytest.raises(ValueError):
        drr.deactivate("a")
    drr.activate("a")
    with pytest.raises(ValueError):
        drr.activate("a")
    with pytest.raises(ValueError):
        drr.consume("a", 0, backlogged=True)


def test_heap_does_not_grow_with_dead_entries() -> None:
    drr = DeficitRoundRobin()
    for i in range(100):
        drr.add(str(i), 1)
        drr.activate(str(i))
    for _ in range(50):
        for i in range(0, 100, 2):  # cancel-and-return from deep in the heap
            drr.deactivate(str(i))
            drr.activate(str(i))
    assert len(drr._heap) <= 2 * drr.active_count + 64


def test_snapshot_is_plain() -> None:
    drr = drr_with(a=1)
    drr.activate("a")
    snap = drr.snapshot()
    assert snap["flows"]["a"]["credit"] == 1.0
    assert snap["active"] == 1
