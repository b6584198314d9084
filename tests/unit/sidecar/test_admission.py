"""AdmissionGate: metrics-driven holds, the in-flight caps, headroom, and liveness."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.sidecar.admission import AdmissionGate, GateLimits, vllm_priority
from weighbridge.vllm_metrics import BackendSample

LIMITS = GateLimits(
    max_backend_waiting=2,
    min_decode_tokens_per_s=7.0,
    metrics_stale_s=1.0,
    max_inflight=8,
    max_running=12,
    headroom_slots=2,
)


def sample(at, waiting=0, running=0, gen=None, kv=0.1) -> BackendSample:
    return BackendSample(at, waiting, running, kv, gen)


def fill(gate: AdmissionGate, n: int, now: float = 0.0) -> None:
    for _ in range(n):
        gate.on_dispatched(now)


def test_missing_metrics_fall_back_to_the_inflight_cap_with_headroom() -> None:
    gate = AdmissionGate(LIMITS)
    assert gate.verdict(0.0).mode == "open"
    fill(gate, 6)
    assert gate.verdict(0.0).mode == "headroom"
    fill(gate, 2)
    assert gate.verdict(0.0) .reason == "fallback_cap"
    gate.on_finished(0.0)
    assert gate.verdict(0.0).mode == "headroom"


def test_fresh_metrics_use_the_running_target() -> None:
    gate = AdmissionGate(LIMITS)
    gate.observe(sample(0.0, running=0))
    fill(gate, 9)
    assert gate.cap(0.5) == 12
    assert gate.verdict(0.5).mode == "open"
    assert gate.verdict(5.0).reason == "fallback_cap"  # stale again: back to 8


def test_backend_waiting_counts_our_dispatches_since_the_scrape() -> None:
    gate = AdmissionGate(GateLimits(max_inflight=64, max_running=64))
    fill(gate, 3)
    gate.observe(sample(0.0, waiting=1, running=64))
    assert gate.estimated_waiting(0.1) == 1
    assert gate.verdict(0.1).mode == "open"
    fill(gate, 2, 0.1)
    assert gate.estimated_waiting(0.1) == 3
    assert gate.verdict(0.1).reason == "backend_waiting"
    gate.on_finished(0.2)  # a slot turned over: one waiting request runs
    assert gate.verdict(0.2).mode == "open"


def test_our_first_tokens_drain_a_queue_of_ours_before_the_next_scrape() -> None:
    gate = AdmissionGate(GateLimits(max_inflight=64, max_running=64))
    fill(gate, 5)
    gate.observe(sample(0.0, waiting=4, running=60))  # a momentary queue, all of it ours
    assert gate.verdict(0.01).reason == "backend_waiting"
    for _ in range(3):  # three of ours were prefilled: at most 2 of ours can still wait
        gate.on_first_token(0.01)
    assert gate.estimated_waiting(0.01) == 2
    assert gate.verdict(0.01).mode == "open"
    gate.on_finished(0.02, awaiting_first_token=True)  # one ended before its first token
    assert gate.estimated_waiting(0.02) == 1


def test_another_clients_queue_still_holds_the_gate() -> None:
    gate = AdmissionGate(GateLimits(max_inflight=64, max_running=64))
    fill(gate, 2)
    gate.observe(sample(0.0, waiting=6, running=64))  # 2 of it ours at most: 4 foreign
    gate.on_first_token(0.01)
    gate.on_first_token(0.01)
    assert gate.estimated_waiting(0.01) == 4
    assert gate.verdict(0.01).reason == "backend_waiting"


def test_first_token_and_finish_bookkeeping_is_checked() -> None:
    gate = AdmissionGate(LIMITS)
    with pytest.raises(ValueError):
        gate.on_first_token(0.0)
    gate.on_dispatched(0.0)
    gate.on_first_token(0.0)
    with pytest.raises(ValueError):
        gate.on_finished(0.0, awaiting_first_token=True)


def test_free_slots_at_the_scrape_absorb_dispatches_first() -> None:
    gate = AdmissionGate(GateLimits(max_inflight=64, max_running=16))
    gate.observe(sample(0.0, waiting=0, running=10))
    fill(gate, 8, 0.1)
    assert gate.estimated_waiting(0.1) == 2  # 6 free slots, 2 queue
    assert gate.verdict(0.1).mode == "open"
    gate.on_dispatched(0.1)
    assert gate.verdict(0.1).reason == "backend_waiting"


def test_slow_decode_holds_and_the_first_scrape_does_not() -> None:
    gate = AdmissionGate(LIMITS)
    gate.observe(sample(0.0, running=4, gen=0))
    gate.on_dispatched(0.0)
    assert gate.decode_tokens_per_s_per_seq is None
    gate.observe(sample(1.0, running=4, gen=20))  # 20 tok/s over 4 sequences: 5 < 7
    assert gate.decode_tokens_per_s_per_seq == pytest.approx(5.0)
    assert gate.verdict(1.1).reason == "decode_slow"
    gate.observe(sample(2.0, running=4, gen=60))  # 40 tok/s / 4 = 10
    assert gate.verdict(2.1).mode == "open"
    gate.observe(sample(3.0, running=4, gen=5))  # counter reset (engine restart): unknown
    assert gate.decode_tokens_per_s_per_seq is None


def test_an_interval_from_an_idle_engine_says_nothing_about_decode_speed() -> None:
    """A request that arrived at an idle engine just before a scrape ran for part of the
    interval, in prefill: its ~0 tokens are not a slow decode."""
    gate = AdmissionGate(LIMITS)
    gate.observe(sample(0.0, running=0, gen=100))
    gate.on_dispatched(0.04)
    gate.observe(sample(0.05, running=1, gen=100))
    assert gate.decode_tokens_per_s_per_seq is None
    assert gate.verdict(0.06).mode == "open"
    gate.observe(sample(0.10, running=1, gen=102))  # running at both ends: 40 tok/s
    assert gate.decode_tokens_per_s_per_seq == pytest.approx(40.0)
    gate.observe(sample(0.15, running=0, gen=103))  # ended in between: unknown again
    assert gate.decode_tokens_per_s_per_seq is None


def test_nothing_of_ours_in_flight_is_never_held_by_metrics() -> None:
    gate = AdmissionGate(LIMITS)
    gate.observe(sample(0.0, waiting=50, running=12, gen=0))
    gate.observe(sample(0.5, waiting=50, running=12, gen=1))
    assert gate.verdict(0.6).mode == "open"
    gate.on_dispatched(0.6)
    assert gate.verdict(0.6).mode == "closed"


def test_old_scrapes_arriving_late_are_ignored() -> None:
    gate = AdmissionGate(LIMITS)
    gate.observe(sample(2.0, waiting=0))
    gate.observe(sample(1.0, waiting=40))
    gate.on_dispatched(2.0)
    assert gate.estimated_waiting(2.0) == 0


def test_limits_validation() -> None:
    with pytest.raises(ValueError):
        GateLimits(max_inflight=4, headroom_slots=4)
    with pytest.raises(ValueError):
        GateLimits(max_inflight=8, max_running=2, headroom_slots=2)


def test_vllm_priority_demotes_over_share() -> None:
    assert vllm_priority(5, over_share=False) == 5
    assert vllm_priority(5, over_share=True) == 6
    assert vllm_priority(0, over_share=True, demotion=3) == 3


EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("dispatch"), st.floats(0, 0.5)),
        st.tuples(st.just("dispatch"), st.floats(0, 0.5)),
        st.tuples(st.just("finish"), st.floats(0, 0.5)),
        st.tuples(st.just("scrape"), st.floats(0, 3)),
        st.tuples(st.just("wait"), st.floats(0, 5)),
    ),
    max_size=120,
)


@settings(max_examples=300, deadline=None)
@given(
    events=EVENTS,
    waiting=st.integers(0, 20),
    running=st.integers(0, 20),
    gen_rate=st.floats(0, 500),
    max_inflight=st.integers(1, 16),
    max_running=st.one_of(st.none(), st.integers(1, 32)),
    headroom=st.integers(0, 3),
)
def test_caps_hold_and_the_gate_never_blocks_forever(
    events, waiting, running, gen_rate, max_inflight, max_running, headroom
) -> None:
    cap_fresh = max_running or max_inflight
    headroom = min(headroom, min(max_inflight, cap_fresh) - 1)
    gate = AdmissionGate(
        GateLimits(
            max_inflight=max_inflight,
            max_running=max_running,
            headroom_slots=headroom,
            metrics_stale_s=1.0,
        )
    )
    now = 0.0
    gen = 0.0
    for kind, value in events:
        now += value
        verdict = gate.verdict(now)
        if kind == "dispatch" and verdict.mode != "closed":
            gate.on_dispatched(now)
            cap = max_inflight if not gate.fresh(now) else cap_fresh
            assert gate.inflight <= cap  # never over the cap in force
            if not gate.fresh(now):
                assert gate.inflight <= max_inflight  # stale: the fallback cap
        elif kind == "finish" and gate.inflight:
            gate.on_finished(now)
        elif kind == "scrape":
            gen += gen_rate * value
            gate.observe(sample(now - value / 2, waiting, running, gen))
        # liveness: with nothing of ours in flight the gate is open (or headroom), and
        # with stale metrics it is closed only at the fallback cap
        verdict = gate.verdict(now)
        if gate.inflight == 0:
            assert verdict.mode != "closed"
        if not gate.fresh(now) and gate.inflight < max_inflight:
            assert verdict.mode != "closed"
