from __future__ import annotations

import pytest

from tests.unit.sidecar.builders import make_fleet, send
from weighbridge.sidecar.router import Router


def test_least_tokens_counts_prompt_until_first_token_then_remaining_output() -> None:
    fleet = make_fleet("a", "b")
    r = Router(fleet)
    send(fleet, "x", "a", 1000, 500)
    assert fleet["a"].outstanding_tokens == 1500
    assert r.pick() == "b"
    send(fleet, "y", "b", 100, 100)
    send(fleet, "z", "b", 100, 100)
    assert r.pick() == "b"  # 400 < 1500 although b runs two requests
    fleet.streamed("x", 0)  # first chunk: prefill done
    assert fleet["a"].outstanding_tokens == 500
    fleet.streamed("x", 600)  # beyond the estimate: never negative
    assert fleet["a"].outstanding_tokens == 0
    fleet.finished("x")
    assert fleet["a"].outstanding_tokens == 0
    fleet.finished("x")  # idempotent


def test_ties_break_on_kv_usage() -> None:
    fleet = make_fleet("a", "b")
    fleet["a"].kv_cache_usage = 0.9
    fleet["b"].kv_cache_usage = 0.2
    assert Router(fleet).pick() == "b"


def test_unhealthy_and_closed_backends_are_skipped() -> None:
    fleet = make_fleet("a", "b", "c")
    r = Router(fleet)
    fleet["a"].healthy = False
    assert r.pick(lambda name: name != "b") == "c"
    fleet["c"].healthy = False
    assert r.pick(lambda name: name != "b") is None
    fleet["a"].healthy = True
    assert r.pick() == "a"


def test_round_robin_cycles_over_takers_and_advances_on_dispatch() -> None:
    fleet = make_fleet("a", "b", "c")
    r = Router(fleet, "round_robin")
    seen = []
    for k in range(6):
        name = r.pick(lambda n: n != "b")
        assert name is not None
        seen.append(name)
        send(fleet, str(k), name, 1, 1)
        r.on_dispatched(fleet[name])
    assert seen == ["a", "c", "a", "c", "a", "c"]
    assert r.pick() == r.pick()  # pick alone has no side effect


def test_least_requests() -> None:
    fleet = make_fleet("a", "b")
    send(fleet, "1", "a", 1, 1)
    assert Router(fleet, "least_requests").pick() == "b"


def test_validation() -> None:
    fleet = make_fleet("a")
    with pytest.raises(ValueError):
        Router(fleet, "random")  # type: ignore[arg-type]
    send(fleet, "1", "a", 1, 1)
    with pytest.raises(ValueError):
        send(fleet, "1", "a", 1, 1)
