from __future__ import annotations

import pytest

from weighbridge.sidecar.router import Router


def test_least_tokens_counts_prompt_until_first_token_then_remaining_output() -> None:
    r = Router(["a", "b"])
    r.on_dispatched("x", "a", prompt_tokens=1000, expected_output_tokens=500)
    assert r.outstanding_tokens("a") == 1500
    assert r.pick() == "b"
    r.on_dispatched("y", "b", prompt_tokens=100, expected_output_tokens=100)
    r.on_dispatched("z", "b", prompt_tokens=100, expected_output_tokens=100)
    assert r.pick() == "b"  # 400 < 1500 although b runs two requests
    r.on_tokens("x", 0)  # first chunk: prefill done
    assert r.outstanding_tokens("a") == 500
    r.on_tokens("x", 600)  # beyond the estimate: never negative
    assert r.outstanding_tokens("a") == 0
    r.on_finished("x")
    assert r.outstanding_tokens("a") == 0 and r.inflight("a") == 0
    r.on_finished("x")  # idempotent


def test_ties_break_on_kv_usage() -> None:
    r = Router(["a", "b"])
    r.observe_kv("a", 0.9)
    r.observe_kv("b", 0.2)
    assert r.pick() == "b"


def test_unhealthy_and_closed_backends_are_skipped() -> None:
    r = Router(["a", "b", "c"])
    r.mark_unhealthy("a")
    assert r.pick(lambda name: name != "b") == "c"
    r.mark_unhealthy("c")
    assert r.pick(lambda name: name != "b") is None
    r.mark_healthy("a")
    assert r.pick() == "a"


def test_round_robin_cycles_over_takers_and_advances_on_dispatch() -> None:
    r = Router(["a", "b", "c"], "round_robin")
    seen = []
    for k in range(6):
        name = r.pick(lambda n: n != "b")
        seen.append(name)
        r.on_dispatched(str(k), name, 1, 1)
    assert seen == ["a", "c", "a", "c", "a", "c"]
    assert r.pick() == r.pick()  # pick alone has no side effect


def test_least_requests() -> None:
    r = Router(["a", "b"], "least_requests")
    r.on_dispatched("1", "a", 1, 1)
    assert r.pick() == "b"


def test_validation() -> None:
    with pytest.raises(ValueError):
        Router([])
    with pytest.raises(ValueError):
        Router(["a", "a"])
    with pytest.raises(ValueError):
        Router(["a"], "random")  # type: ignore[arg-type]
    r = Router(["a"])
    r.on_dispatched("1", "a", 1, 1)
    with pytest.raises(ValueError):
        r.on_dispatched("1", "a", 1, 1)
