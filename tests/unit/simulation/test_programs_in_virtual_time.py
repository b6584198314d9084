"""agent_programs in virtual time: the simulator sends each program's calls, subagents and
joins as the load generator would (weighbridge.loadgen.programs, with the answers its
engines gave), the records carry the programs, and ``weighbridge simulate``'s figures and
the report read program completion per tenant from them."""

from __future__ import annotations

from collections import deque
from pathlib import Path

import pytest
from rich.console import Console

from weighbridge.analysis.frame import load_run
from weighbridge.analysis.summary import analyse, summary
from weighbridge.app.simulation.engines import output_token_id
from weighbridge.app.simulation.figures import figures, figures_table
from weighbridge.app.simulation.run import Inputs, find_scenario, run_policy
from weighbridge.app.stack import load_stack
from weighbridge.loadgen.plan import Answer, RequestPlan
from weighbridge.loadgen.programs import ProgramRun, programs_of

STACK = Path(__file__).resolve().parents[3] / "deploy" / "stacks" / "agent-programs.yaml"
STRETCH, SEED = 0.4, 3


def test_programs_follow_their_answers_and_their_subagents(tmp_path: Path) -> None:
    outcome = run_policy(Inputs(stack=load_stack(STACK), stretch=STRETCH, seed=SEED), None,
                         tmp_path / "run")
    records = {r.request_id: r for r in outcome.result.records}
    workload = find_scenario("agent_programs").workload(stretch=STRETCH)
    checked = forked = cut = 0
    end = outcome.result.end_s
    for tenant in workload.tenants:
        for program in programs_of(tenant, workload, SEED):
            run = ProgramRun(program, workload, SEED)
            queue: deque[RequestPlan] = deque([run.first()])
            while queue:
                plan = queue.popleft()
                r = records.get(plan.request_id)
                if r is None:  # due after the run's end
                    assert plan.scheduled_s >= end
                    cut += 1
                    continue
                assert plan.program is not None
                assert (r.program_id, r.parent_program_id, r.program_calls, r.turn) == (
                    plan.program.program_id, plan.program.parent_id, plan.program.calls,
                    plan.turn)
                assert r.scheduled_s == pytest.approx(plan.scheduled_s, abs=1e-9)
                assert r.max_tokens == plan.max_tokens
                checked += 1
                if r.status != "ok":  # the stack's engines keep up: only the run's end cuts
                    assert (r.status, r.end_s) == ("cancelled", end)
                    cut += 1
                    continue
                assert r.prompt_tokens == plan.prompt_tokens and r.output_tokens is not None
                answer = Answer(r.output_tokens, "", tuple(
                    output_token_id(i) for i in range(r.output_tokens)))
                follow = run.ended(plan, answer, r.end_s)
                forked += sum(1 for f in follow if f.turn == 0)
                queue.extend(follow)
    # Every record is a call the pure model makes of the answers: none besides them.
    assert checked == len(records)
    assert forked > 5 and cut < checked / 4
    # Subagents start from their parent's context: their prompts hit the prefix cache.
    children = [r for r in records.values()
                if r.parent_program_id and r.turn == 0 and r.status == "ok"]
    assert children and all(r.cached_tokens and r.prompt_tokens
                            and r.cached_tokens > r.prompt_tokens / 2 for r in children)


def test_simulate_prints_program_completion_per_tenant(tmp_path: Path) -> None:
    outcome = run_policy(Inputs(stack=load_stack(STACK), stretch=STRETCH, seed=SEED), None,
                         tmp_path / "run")
    figs = figures(outcome.run_dir, 2.0)
    assert set(figs["programs"]) == {"coder", "researcher"}
    s = summary(analyse(load_run(outcome.run_dir), 2.0))
    for name, program in figs["programs"].items():
        report = s["programs"]["tenants"][name]
        assert program["programs_completed"] == report["programs_completed"] > 0
        assert 0 < program["completion_p50_s"] <= program["completion_p90_s"]
    assert figs["computed_tokens_jain_index"] == s["programs"]["computed_tokens_jain_index"]
    console = Console(width=160, record=True)
    console.print(figures_table("simulated", {"drr": figs}))
    text = console.export_text()
    for name in ("coder", "researcher"):
        assert f"{name} program p50 / p90 / p99" in text
        assert f"{name} programs completed" in text
    assert "Jain's index, computed tokens" in text
