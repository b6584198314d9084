"""Multi-turn sessions and system prompts: the turn structure, think times and history growth
(weighbridge.loadgen.sessions), and how their bodies render (weighbridge.loadgen.bodies)."""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.loadgen.bodies import build_body, message_token_ids
from weighbridge.loadgen.plan import RequestPlan, plan_request
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.sessions import Answer, first_turn, next_turn, phase_at, sessions_of
from weighbridge.loadgen.tenants import TenantsError, TenantSpec, parse_tenants

PHASES = (PhaseSpan("quiet", 0.0, 10.0), PhaseSpan("flood", 10.0, 30.0))


def _tenants(*specs: dict[str, Any]) -> list[TenantSpec]:
    return parse_tenants({"tenants": list(specs)}, base_dir=Path("."), source="test").tenants


def _spec(name: str = "chat", **fields: Any) -> dict[str, Any]:
    return {"name": name, "endpoint": "completions",
            "lengths": {"prompt": {"kind": "uniform", "low": 1, "high": 80},
                        "output": {"kind": "uniform", "low": 1, "high": 40}},
            "arrival": {"kind": "poisson", "rate": 2},
            "sessions": {"turns": {"kind": "uniform", "low": 1, "high": 6},
                         "think_ms": {"kind": "uniform", "low": 1, "high": 5000}},
            **fields}


def _prompt_ids(plan: RequestPlan, tenant: TenantSpec) -> list[int]:
    body = orjson.loads(build_body(plan, tenant))
    ids: list[int] = body["prompt"]
    return ids


def _run(tenant: TenantSpec, seed: int, answer_ids: bool, fail_at: int | None = None,
         service_s: float = 0.25) -> list[list[RequestPlan]]:
    """Every session of ``tenant`` played against a server that answers each turn after
    ``service_s`` with exactly max_tokens tokens (with their ids when ``answer_ids``)."""
    workload = Workload("s", PHASES, (tenant,))
    played = []
    for session in sessions_of(tenant, workload, seed):
        plans: list[RequestPlan] = []
        plan: RequestPlan | None = first_turn(session, workload, seed)
        while plan is not None:
            plans.append(plan)
            ok = fail_at is None or plan.turn != fail_at
            ids = tuple(range(1000 + plan.max_tokens, 1000 + 2 * plan.max_tokens)) \
                if answer_ids else None
            answer = Answer(plan.max_tokens, "x" * plan.max_tokens, ids) if ok else None
            plan = next_turn(session, plan, answer, plan.scheduled_s + service_s, workload,
                             seed)
        played.append(plans)
    return played


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32), st.booleans(), st.sampled_from([None, 64, 200]))
def test_each_turn_resends_the_last_prompt_its_answer_and_a_new_message(
        seed: int, answer_ids: bool, system: int | None) -> None:
    extra = {"system_prompt": {"length": system}} if system else {}
    (tenant,) = _tenants(_spec(**extra))
    for plans in _run(tenant, seed, answer_ids):
        first = plans[0]
        assert first.turn == 0 and first.scheduled_s < PHASES[-1].end_s
        assert [p.turn for p in plans] == list(range(len(plans)))
        assert len({p.session_id for p in plans}) == 1
        for before, after in itertools.pairwise(plans):
            assert before.messages is not None and after.messages is not None
            # History growth: everything sent before, the answer, one new message.
            assert after.messages[:len(before.messages)] == before.messages
            answer, message = after.messages[len(before.messages):]
            assert answer.role == "assistant" and answer.tokens == before.max_tokens
            assert message.role == "user"
            assert after.prompt_tokens == before.prompt_tokens + before.max_tokens \
                + message.tokens
            ids_before, ids_after = _prompt_ids(before, tenant), _prompt_ids(after, tenant)
            assert len(ids_after) == after.prompt_tokens
            assert ids_after[:len(ids_before)] == ids_before  # a prefix, token for token
            if answer_ids:  # the answer goes back as the ids the server returned
                start = len(ids_before)
                assert ids_after[start:start + before.max_tokens] == list(answer.token_ids or ())


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 2**32))
def test_the_next_turn_is_due_a_think_time_after_the_answer_ended(seed: int) -> None:
    (tenant,) = _tenants(_spec())
    for service_s in (0.25, 3.0):
        for plans in _run(tenant, seed, True, service_s=service_s):
            for before, after in itertools.pairwise(plans):
                think = after.scheduled_s - (before.scheduled_s + service_s)
                # think_ms is uniform over 1..5000 ms: the gap is one draw of it.
                assert 0.001 - 1e-9 <= think <= 5.0 + 1e-9
    # The think times are the session's own: the same whatever the service time.
    fast, slow = _run(tenant, seed, True, service_s=0.25), _run(tenant, seed, True,
                                                                service_s=3.0)
    for a, b in zip(fast, slow, strict=True):
        gaps_fast = [y.scheduled_s - x.scheduled_s - 0.25 for x, y in itertools.pairwise(a)]
        gaps_slow = [y.scheduled_s - x.scheduled_s - 3.0 for x, y in itertools.pairwise(b)]
        assert gaps_fast == pytest.approx(gaps_slow)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32), st.integers(0, 4))
def test_a_turn_that_fails_ends_its_session(seed: int, fail_at: int) -> None:
    (tenant,) = _tenants(_spec())
    workload = Workload("s", PHASES, (tenant,))
    sessions = list(sessions_of(tenant, workload, seed))
    for session, plans in zip(sessions, _run(tenant, seed, True, fail_at=fail_at),
                              strict=True):
        assert len(plans) == min(session.turns, fail_at + 1)
        assert 1 <= session.turns <= 6


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**32))
def test_sessions_arrive_open_loop_and_turns_are_reproducible(seed: int) -> None:
    (tenant,) = _tenants(_spec())
    workload = Workload("s", PHASES, (tenant,))
    starts = [s.start_s for s in sessions_of(tenant, workload, seed)]
    assert starts == sorted(starts) and all(0 <= t < 30 for t in starts)
    assert _run(tenant, seed, False) == _run(tenant, seed, False)
    for plans in _run(tenant, seed, False):
        for plan in plans:
            assert plan.phase == phase_at(workload, plan.scheduled_s)
            assert plan.request_id == f"{plan.session_id}-t{plan.turn}"


def test_phase_at_takes_the_phase_running_then() -> None:
    workload = Workload("s", PHASES, ())
    assert [phase_at(workload, t) for t in (0.0, 9.99, 10.0, 29.0, 45.0)] == \
        ["quiet", "quiet", "flood", "flood", "flood"]


def test_a_system_prompt_is_the_same_text_for_every_request_and_shared_by_name() -> None:
    a, b, c = _tenants(
        {**_spec("a", system_prompt={"length": 300, "shared": "common"}), "sessions": None},
        {**_spec("b", system_prompt={"length": 200, "shared": "common"}), "sessions": None},
        {**_spec("c", system_prompt={"length": 300}), "sessions": None})
    plans = {t.name: [plan_request(t, f"{t.name}-{i}", "p", 0.0, seed=3) for i in range(3)]
             for t in (a, b, c)}
    ids = {name: [_prompt_ids(p, t) for p in plans[name]]
           for name, t in (("a", a), ("b", b), ("c", c))}
    for name, system in (("a", 300), ("b", 200), ("c", 300)):
        heads = {tuple(x[:system]) for x in ids[name]}
        assert len(heads) == 1  # one system prompt for the tenant ...
        tails = {tuple(x[system:system + 8]) for x in ids[name]}
        assert len(tails) == 3  # ... and then each request's own message
    assert ids["a"][0][:200] == ids["b"][0][:200]  # one shared text, two lengths of it
    assert ids["a"][0][:8] != ids["c"][0][:8]  # another tenant's own text differs
    assert all(p.prompt_tokens == 300 + p.messages[1].tokens for p in plans["a"]
               if p.messages is not None)


def test_prefix_free_tenants_render_as_before() -> None:
    (tenant,) = _tenants({**_spec(), "sessions": None})
    plan = plan_request(tenant, "chat-0", "p", 0.0, seed=1)
    assert tenant.prefix_free and plan.messages is None and plan.session_id is None
    body = orjson.loads(build_body(plan, tenant))
    assert len(body["prompt"]) == plan.prompt_tokens and "return_token_ids" not in body


def test_chat_sessions_send_the_history_as_alternating_messages() -> None:
    (tenant,) = _tenants(_spec(endpoint="chat", system_prompt={"length": 40},
                               sessions={"turns": 3, "think_ms": 10}))
    workload = Workload("s", PHASES, (tenant,))
    session = next(sessions_of(tenant, workload, 0))
    plan = first_turn(session, workload, 0)
    plan = next_turn(session, plan, Answer(2, " fair cue"), 1.0, workload, 0)
    assert plan is not None
    body = orjson.loads(build_body(plan, tenant))
    assert [m["role"] for m in body["messages"]] == ["system", "user", "assistant", "user"]
    assert body["messages"][2]["content"] == " fair cue"
    assert len(body["messages"][0]["content"].split()) == 40
    assert "return_token_ids" not in body  # the answer goes back as text
    assert plan.scheduled_s == pytest.approx(1.01)


def test_completions_turns_ask_for_the_answer_token_ids() -> None:
    (tenant,) = _tenants(_spec())
    workload = Workload("s", PHASES, (tenant,))
    plan = first_turn(next(sessions_of(tenant, workload, 0)), workload, 0)
    assert orjson.loads(build_body(plan, tenant))["return_token_ids"] is True


def test_an_answer_without_ids_goes_back_as_ids_of_its_length() -> None:
    (tenant,) = _tenants(_spec(sessions={"turns": 2, "think_ms": 1}))
    (plans,) = _run(tenant, 0, answer_ids=False)[:1]
    assert plans[1].messages is not None
    assert len(message_token_ids(plans[1].messages[-2])) == plans[0].max_tokens


@pytest.mark.parametrize(("fields", "problem"), [
    ({"arrival": {"kind": "closed", "users": 2}}, "sessions arrive open loop"),
    ({"endpoint": "embeddings", "stream": False}, "embeddings tenant"),
])
def test_sessions_that_cannot_work_are_refused(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(TenantsError, match=problem):
        _tenants(_spec(**fields))


def test_sessions_stop_at_the_run_end() -> None:
    (tenant,) = _tenants(_spec())
    workload = Workload("s", PHASES, (tenant,))
    assert all(s.start_s < 5.0 for s in sessions_of(tenant, workload, 0, until_s=5.0))
    assert math.isfinite(workload.end_s)
