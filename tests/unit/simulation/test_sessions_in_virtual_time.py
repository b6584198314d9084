"""chat_sessions in virtual time: the simulator sends each session's turns as the load
generator would (weighbridge.loadgen.sessions, with the answers its engines gave), and the
engine model's prefix cache sees the prompts' token ids."""

from __future__ import annotations

from pathlib import Path

import pytest

from weighbridge.app.simulation.run import Inputs, find_scenario, run_policy
from weighbridge.app.stack import load_stack
from weighbridge.loadgen.sessions import Answer, first_turn, next_turn, sessions_of

STACK = Path(__file__).resolve().parents[3] / "deploy" / "stacks" / "chat-sessions.yaml"
STRETCH, SEED = 0.25, 2


def test_turns_follow_the_answers_and_hit_the_cache(tmp_path: Path) -> None:
    outcome = run_policy(Inputs(stack=load_stack(STACK), stretch=STRETCH, seed=SEED), None,
                         tmp_path / "run")
    records = {r.request_id: r for r in outcome.result.records}
    workload = find_scenario("chat_sessions").workload(stretch=STRETCH)
    turns = 0
    for tenant in workload.tenants:
        for session in sessions_of(tenant, workload, SEED):
            plan = first_turn(session, workload, SEED)
            while plan is not None and plan.request_id in records:
                r = records[plan.request_id]
                assert (r.session_id, r.turn, r.max_tokens) == (session.session_id, plan.turn,
                                                                plan.max_tokens)
                assert r.scheduled_s == pytest.approx(plan.scheduled_s, abs=1e-12)
                if r.status != "ok":  # cut off by the run's end
                    assert r.status == "cancelled"
                    break
                assert r.prompt_tokens == plan.prompt_tokens  # no chat template in the model
                assert r.output_tokens is not None and r.cached_tokens is not None
                turns += plan.turn > 0
                plan = next_turn(session, plan, Answer(r.output_tokens), r.end_s, workload,
                                 SEED)
            # Every turn the simulator sent is one the pure model makes.
            sent = [r for r in records.values() if r.session_id == session.session_id]
            assert all(r.turn is not None and r.turn < session.turns for r in sent)
    assert turns > 5
    cached = sum(r.cached_tokens or 0 for r in records.values())
    prompt = sum(r.prompt_tokens or 0 for r in records.values() if r.cached_tokens is not None)
    # Histories and system prompts are resent: well over half the prompt tokens are hits
    # (each turn resends all before it; only a turn routed to the other engine misses).
    assert cached > prompt / 2
