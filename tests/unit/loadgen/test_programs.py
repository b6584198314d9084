"""Agent programs (weighbridge.loadgen.programs): calls that resend a growing context after
tool runs, subagents that fork from it and join back, failures, and the ids the requests
carry; played against a model server whose service times and answers hypothesis draws."""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.loadgen.bodies import build_body
from weighbridge.loadgen.conversations import conversations_of
from weighbridge.loadgen.plan import Answer, RequestPlan
from weighbridge.loadgen.programs import ProgramRun, programs_of
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import TenantsError, TenantSpec, parse_tenants

PHASES = (PhaseSpan("programs", 0.0, 20.0), PhaseSpan("drain", 20.0, 60.0))


def _tenant(**fields: Any) -> TenantSpec:
    spec = {"name": "agent", "endpoint": "completions",
            "system_prompt": {"length": 64},
            "lengths": {"prompt": {"kind": "uniform", "low": 1, "high": 60},
                        "output": {"kind": "uniform", "low": 1, "high": 30}},
            "arrival": {"kind": "poisson", "rate": 0.5}, "phases": {"drain": None},
            "programs": {"calls": {"kind": "uniform", "low": 1, "high": 6},
                         "tool_ms": {"kind": "uniform", "low": 1, "high": 3000},
                         "tool_output": {"kind": "uniform", "low": 1, "high": 80},
                         "subagents": {"probability": 0.5,
                                       "count": {"kind": "uniform", "low": 1, "high": 3},
                                       "calls": {"kind": "uniform", "low": 1, "high": 3},
                                       "depth": 2}},
            **fields}
    return parse_tenants({"tenants": [spec]}, base_dir=Path("."), source="test").tenants[0]


def _prompt_ids(plan: RequestPlan, tenant: TenantSpec) -> list[int]:
    ids: list[int] = orjson.loads(build_body(plan, tenant))["prompt"]
    return ids


@dataclass
class Played:
    """What a server saw of one program family: every call, its answer and its end."""

    run: ProgramRun
    calls: list[RequestPlan] = field(default_factory=list)
    answers: dict[str, Answer | None] = field(default_factory=dict)
    ends: dict[str, float] = field(default_factory=dict)


def _answer(plan: RequestPlan) -> Answer:
    """``max_tokens`` tokens, their ids a function of the call alone."""
    ids = random.Random(plan.request_id)
    return Answer(plan.max_tokens, None,
                  tuple(ids.randrange(6, 506) for _ in range(plan.max_tokens)))


def _play(run: ProgramRun, rng: random.Random, fail: float = 0.0) -> Played:
    """Serve the family's calls in time order: each ends a drawn service time after it is
    due, ok (:func:`_answer`) unless drawn to fail with chance ``fail``."""
    played = Played(run)
    pending: list[tuple[float, int, RequestPlan]] = []
    order = 0

    def send(plan: RequestPlan) -> None:
        nonlocal order
        order += 1
        heapq.heappush(pending, (plan.scheduled_s + rng.uniform(0.01, 4.0), order, plan))

    send(run.first())
    while pending:
        end_s, _, plan = heapq.heappop(pending)
        played.calls.append(plan)
        answer = _answer(plan) if rng.random() >= fail else None
        played.answers[plan.request_id], played.ends[plan.request_id] = answer, end_s
        for follow in run.ended(plan, answer, end_s):
            send(follow)
    return played


def _families(tenant: TenantSpec, seed: int) -> list[ProgramRun]:
    workload = Workload("p", PHASES, (tenant,))
    return [ProgramRun(p, workload, seed) for p in programs_of(tenant, workload, seed)]


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), server=st.integers(0, 2**16))
def test_every_call_resends_its_program_s_context_and_subagents_start_from_it(
        seed: int, server: int) -> None:
    """Call k + 1's prompt is call k's, its answer's ids and a tool output; a subagent's first
    prompt is its parent's at the fork and its answer, then its own task; a parent resumes
    with everything it had, once the last of its subagents has ended, and at that end."""
    tenant = _tenant()
    rng = random.Random(server)
    forks = 0
    for run in _families(tenant, seed):
        played = _play(run, rng)
        assert run.done
        by_program: dict[str, list[RequestPlan]] = {}
        for plan in played.calls:
            assert plan.program is not None and plan.session_id == plan.program.program_id
            by_program.setdefault(plan.program.program_id, []).append(plan)
        for calls in by_program.values():
            calls.sort(key=lambda p: p.turn or 0)
            ref = calls[0].program
            assert ref is not None
            # Every planned call is made when every call ends ok.
            assert [p.turn for p in calls] == list(range(ref.calls))
            assert {p.program for p in calls} == {ref}
            assert ref.root_id == run.root.program_id
            for before, after in itertools.pairwise(calls):
                answer = played.answers[before.request_id]
                assert answer is not None and answer.token_ids is not None
                grown = _prompt_ids(before, tenant) + list(answer.token_ids)
                assert _prompt_ids(after, tenant)[:len(grown)] == grown
                assert len(_prompt_ids(after, tenant)) > len(grown)  # a tool's output
                assert after.scheduled_s >= played.ends[before.request_id]
            if ref.parent_id is None:
                continue
            parent = [p for p in by_program[ref.parent_id]
                      if played.ends[p.request_id] <= calls[0].scheduled_s]
            fork = max(parent, key=lambda p: p.turn or 0)
            answer = played.answers[fork.request_id]
            assert answer is not None and answer.token_ids is not None
            shared = _prompt_ids(fork, tenant) + list(answer.token_ids)
            assert _prompt_ids(calls[0], tenant)[:len(shared)] == shared
            assert calls[0].scheduled_s == played.ends[fork.request_id]
            # The parent's next call waits for every sibling and starts with the last end.
            siblings = [c for c in by_program
                        if c.startswith(f"{ref.parent_id}-c{fork.turn}.")]
            last = max(played.ends[by_program[c][-1].request_id] for c in siblings)
            resume = next(p for p in by_program[ref.parent_id] if p.turn == (fork.turn or 0) + 1)
            assert resume.scheduled_s == last
            assert _prompt_ids(resume, tenant)[:len(shared)] == shared
            forks += 1
    assert forks or not _families(tenant, seed)


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 2**16), fast=st.integers(0, 2**16), slow=st.integers(0, 2**16))
def test_what_is_planned_follows_the_answers_not_when_they_come(seed: int, fast: int,
                                                                 slow: int) -> None:
    """Two plays with the same answers at other times make the same calls (ids, sizes,
    prompts, programs), in any order of the subagents' ends; only their due times differ."""
    tenant = _tenant()

    def calls(server: int) -> list[list[tuple[Any, ...]]]:
        return [sorted((c.request_id, c.max_tokens, c.prompt_tokens, c.program, c.messages)
                       for c in _play(run, random.Random(server)).calls)
                for run in _families(tenant, seed)]

    assert calls(fast) == calls(slow)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**16), server=st.integers(0, 2**16))
def test_a_failed_call_ends_its_program_and_a_parent_goes_on_without_it(
        seed: int, server: int) -> None:
    tenant = _tenant()
    for run in _families(tenant, seed):
        played = _play(run, random.Random(server), fail=0.3)
        assert run.done  # every family ends: nothing waits for a call that never comes
        by_program: dict[str, list[RequestPlan]] = {}
        for plan in played.calls:
            assert plan.program is not None
            by_program.setdefault(plan.program.program_id, []).append(plan)
        for calls in by_program.values():
            failed = [p for p in calls if played.answers[p.request_id] is None]
            # Nothing follows a failure in its own program.
            assert len(failed) <= 1
            if failed:
                assert max(p.turn or 0 for p in calls) == failed[0].turn


def test_subagents_fork_only_down_to_their_depth() -> None:
    for depth in (1, 2):
        tenant = _tenant(programs={
            "calls": 4, "tool_ms": 10, "tool_output": 5,
            "subagents": {"probability": 1, "count": 2, "calls": 3, "depth": depth}})
        run = _families(tenant, 0)[0]
        played = _play(run, random.Random(0))
        levels = {p.program.program_id.count("-c") for p in played.calls if p.program}
        assert levels == set(range(depth + 1))


def test_programs_start_at_the_tenant_s_arrivals_and_only_in_its_phases() -> None:
    tenant = _tenant()
    workload = Workload("p", PHASES, (tenant,))
    programs = list(programs_of(tenant, workload, 3))
    assert programs and all(p.start_s < 20.0 for p in programs)
    assert [p.program_id for p in programs] == [f"agent-p{i}" for i in range(len(programs))]
    assert all(p.parent_id is None and p.root_id == p.program_id for p in programs)
    conversations = conversations_of(tenant, workload, 3)
    assert conversations is not None
    assert [c.first() for c in conversations] == [
        ProgramRun(p, workload, 3).first() for p in programs]


@pytest.mark.parametrize(("fields", "problem"), [
    ({"arrival": {"kind": "closed", "users": 2}, "phases": {}}, "programs arrive open loop"),
    ({"endpoint": "embeddings", "stream": False}, "embeddings tenant"),
    ({"sessions": {"turns": 2, "think_ms": 10}}, "sessions and programs"),
    ({"identity": ["opencode", "opencode"]}, "named twice"),
    ({"identity": ["aider"]}, "identity"),
])
def test_programs_that_cannot_work_are_refused(fields: dict[str, Any], problem: str) -> None:
    with pytest.raises(TenantsError, match=problem):
        _tenant(**fields)
