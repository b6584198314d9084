"""The fleet's records (sidecar.fleet): a backend's load is the sum over its tickets, its
index is its place, and a retired backend is forgotten exactly when its last request ends."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.unit.sidecar.builders import make_fleet, send
from weighbridge.sidecar.admission import AdmissionGate, GateLimits
from weighbridge.sidecar.config import Backend as BackendConfig

# (op, request index, backend index, tokens): dispatch, stream tokens, or finish.
ops = st.lists(st.tuples(st.sampled_from(["send", "stream", "finish"]), st.integers(0, 7),
                         st.integers(0, 2), st.integers(0, 300)), max_size=60)


@given(ops)
def test_load_is_the_sum_over_tickets(steps: list[tuple[str, int, int, int]]) -> None:
    fleet = make_fleet("a", "b", "c")
    live: dict[str, tuple[str, int, int]] = {}  # id -> (backend, prompt left, output left)
    for op, k, b, tokens in steps:
        rid = f"r{k}"
        if op == "send" and rid not in live:
            name = "abc"[b]
            send(fleet, rid, name, tokens, tokens // 2)
            live[rid] = (name, tokens, tokens // 2)
        elif op == "stream" and rid in live:
            name, _, output = live[rid]
            fleet.streamed(rid, tokens)
            live[rid] = (name, 0, output - min(tokens, output))
        elif op == "finish" and rid in live:
            name, _, _ = live.pop(rid)
            fleet.finished(rid)
        for record in fleet:
            mine = [v for v in live.values() if v[0] == record.name]
            assert record.outstanding_tokens == sum(p + o for _, p, o in mine)
            assert record.prefill_tokens == sum(p for _, p, _ in mine)
            assert record.inflight >= len(mine)  # the gate's count: ended by the core


def test_a_retired_backend_is_forgotten_when_its_last_request_ends() -> None:
    fleet = make_fleet("a", "b", "c")
    send(fleet, "r1", "b", 10, 10)
    fleet.retire("b")
    assert not fleet["b"].takes_work and fleet.draining == {"b"}
    assert not fleet.forget_if_drained("b")  # one request still there
    fleet["b"].gate.on_finished(0.0, awaiting_first_token=True)
    fleet.finished("r1")
    assert fleet.forget_if_drained("b")
    assert fleet.names == ["a", "c"] and [r.index for r in fleet] == [0, 1]


def test_a_reload_adds_unhealthy_backends_and_drains_the_removed() -> None:
    fleet = make_fleet("a", "b")
    send(fleet, "r1", "a", 10, 10)
    added, gone = fleet.reconfigure(
        [BackendConfig(name="b", url="http://b"), BackendConfig(name="c", url="http://c",
                                                                priority_scheduling=True)],
        lambda: AdmissionGate(GateLimits()))
    assert added == {"c"} and gone == {"a"}
    assert fleet["a"].draining and "a" in fleet  # still finishing r1
    assert not fleet["c"].takes_work and fleet["c"].priority_scheduling
    assert fleet["c"].index == 2
