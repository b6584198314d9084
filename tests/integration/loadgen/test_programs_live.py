"""Agent programs sent by the load generator's driver on loopback: against the emulator (its
prefix cache on, reporting cached tokens), every call, subagent and join is the one the pure
model makes of the answers the server gave, at the time it makes it; against a recording
server, each request names its program on the wire as each harness does.

The emulator's KV pool (4,096 blocks of 16 tokens) is larger than every token the run sends
(asserted), so a subagent's hit on its parent's context follows from the prefix cache's rule
alone, not from timing.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.support import locust
from weighbridge.analysis.frame import load_run
from weighbridge.analysis.summary import analyse, summary
from weighbridge.launch import ServerProcess, emulator_process, free_port
from weighbridge.loadgen.client import HttpTarget
from weighbridge.loadgen.driver import TrafficDriver
from weighbridge.loadgen.plan import Answer, RequestPlan
from weighbridge.loadgen.programs import ProgramRun, programs_of
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import parse_tenants
from weighbridge.records import RequestRecord, read_parquet

REPO = Path(__file__).resolve().parents[3]

BLOCK, BLOCKS = 16, 4096
SEED = 11
PROGRAMS = {"calls": {"kind": "uniform", "low": 2, "high": 4},
            "tool_ms": {"kind": "uniform", "low": 50, "high": 400},
            "tool_output": {"kind": "uniform", "low": 10, "high": 60},
            "subagents": {"probability": 0.5, "count": 2,
                          "calls": {"kind": "uniform", "low": 1, "high": 2}}}


def _workload(**fields: Any) -> Workload:
    specs = [{"name": "researcher", "endpoint": "completions", "api_key": "sk-r",
              "system_prompt": {"length": 200}, "programs": PROGRAMS,
              "lengths": {"prompt": {"kind": "uniform", "low": 20, "high": 60},
                          "output": {"kind": "uniform", "low": 8, "high": 24}},
              "arrival": {"kind": "poisson", "rate": 2}, "phases": {"drain": None},
              **fields},
             {"name": "coder", "endpoint": "chat", "api_key": "sk-c",
              "system_prompt": {"length": 150}, "programs": PROGRAMS,
              "lengths": {"prompt": {"kind": "uniform", "low": 20, "high": 60},
                          "output": {"kind": "uniform", "low": 8, "high": 24}},
              "arrival": {"kind": "poisson", "rate": 2}, "phases": {"drain": None},
              **fields}]
    tenants = parse_tenants({"tenants": specs}, base_dir=Path("."), source="test").tenants
    return Workload("programs", (PhaseSpan("programs", 0.0, 3.0),
                                 PhaseSpan("drain", 3.0, 30.0)), tuple(tenants))


def _drive(url: str, workload: Workload) -> tuple[list[RequestRecord], TrafficDriver]:
    records: list[RequestRecord] = []
    target = HttpTarget(url)
    driver = TrafficDriver(workload, target, run_id="programs", t0=time.monotonic() + 0.1,
                           seed=SEED, on_record=records.append)
    driver.start()
    assert driver.join(timeout=60)  # every program ends long before the drain phase does
    driver.stop()
    target.close()
    return records, driver


@pytest.fixture(scope="module")
def emulator() -> Iterator[ServerProcess]:
    with emulator_process(max_num_seqs=128, num_kv_blocks=BLOCKS, block_size=BLOCK,
                          enable_prompt_tokens_details=True) as server:
        yield server


def test_calls_subagents_and_joins_follow_the_server_s_answers(emulator: ServerProcess) -> None:
    workload = _workload()
    records, driver = _drive(emulator.url, workload)
    assert records and all(r.status == "ok" for r in records)
    assert sum((r.prompt_tokens or 0) + (r.output_tokens or 0) for r in records) < \
        BLOCK * BLOCKS
    assert dict(driver.stats.answers_without_ids) == {}  # the emulator returns their ids
    by_id = {r.request_id: r for r in records}
    played = forks = 0
    for tenant in workload.tenants:
        for program in programs_of(tenant, workload, SEED):
            run = ProgramRun(program, workload, SEED)
            queue: deque[RequestPlan] = deque([run.first()])
            fork_prompt: dict[str, int] = {}
            while queue:
                plan = queue.popleft()
                r = by_id[plan.request_id]
                assert plan.program is not None
                assert (r.program_id, r.parent_program_id, r.program_calls, r.turn,
                        r.session_id) == (plan.program.program_id, plan.program.parent_id,
                                          plan.program.calls, plan.turn, r.program_id)
                # Due when the pure model says: after a tool run, at a parent's answer, at
                # the last subagent's end, each from the end the driver measured.
                assert r.scheduled_s == plan.scheduled_s and r.max_tokens == plan.max_tokens
                assert r.output_tokens == plan.max_tokens and r.prompt_tokens is not None
                if tenant.endpoint == "completions":  # exact: token ids, no chat template
                    assert r.prompt_tokens == plan.prompt_tokens
                    if plan.program.parent_id is not None and plan.turn == 0:
                        # A subagent starts from its parent's context: the parent's prompt at
                        # the fork, in whole blocks, comes from the prefix cache.
                        parent = fork_prompt[plan.program.program_id]
                        assert r.cached_tokens is not None
                        assert r.cached_tokens >= parent // BLOCK * BLOCK
                follow = run.ended(plan, Answer(r.output_tokens, None,
                                                (0,) * r.output_tokens), r.end_s)
                for child in follow:
                    if child.turn == 0:
                        fork_prompt[child.request_id.removesuffix("-t0")] = r.prompt_tokens
                        forks += 1
                queue.extend(follow)
                played += 1
            assert run.done
    assert played == len(records)  # nothing sent that the model does not make
    assert forks >= 2


def test_each_harness_names_the_program_on_the_wire(delay_server: ServerProcess) -> None:
    workload = _workload(identity=["claude_code", "opencode", "codex", "agentic_context"],
                         headers={"x-test": orjson.dumps({"ttft_ms": 5, "itl_ms": 1}).decode()},
                         endpoint="completions")
    records, _ = _drive(delay_server.url, workload)
    target = HttpTarget(delay_server.url)
    seen = orjson.loads(target.client.get("/seen").read())
    target.close()
    assert len(seen) == len(records) and all(r.status == "ok" for r in records)
    wire = {(s["headers"]["thread-id"], orjson.loads(s["vllm_xargs"]["agentic_context"])[
        "step_id"]): s for s in seen}
    assert len(wire) == len(records)
    for r in records:
        assert r.program_id is not None and r.turn is not None
        s = wire[(r.program_id, r.turn)]
        root = r.program_id.split("-c")[0]
        context = orjson.loads(s["vllm_xargs"]["agentic_context"])
        assert context["program_id"] == r.program_id and context["root_program_id"] == root
        assert context.get("parent_program_id") == r.parent_program_id
        headers = s["headers"]
        assert headers["x-claude-code-session-id"] == headers["session-id"] == root
        assert headers["x-session-id"] == headers["x-session-affinity"] == r.program_id
        assert headers.get("x-claude-code-agent-id") == (
            r.program_id if r.parent_program_id else None)


@pytest.fixture(scope="module")
def long_context_emulator() -> Iterator[ServerProcess]:
    """The agent_programs scenario's contexts grow to about 10,000 tokens."""
    with emulator_process(max_num_seqs=128, num_kv_blocks=BLOCKS, block_size=BLOCK,
                          max_model_len=16384, enable_prompt_tokens_details=True) as server:
        yield server


def test_locust_runs_agent_programs_and_its_exporter_counts_them(
        long_context_emulator: ServerProcess, tmp_path: Path) -> None:
    """``locust -f scenarios/ --scenario agent_programs``: the records carry the programs,
    and the exporter's program series count them while the run goes on."""
    run_dir = tmp_path / "run"
    port = free_port()
    argv = locust.argv(long_context_emulator.url, run_dir, "60s", "--stretch", "0.3",
                       "--scale", "0.3", "--seed", "2", scenario="agent_programs",
                       exporter_port=port)
    result, text = locust.run_scraped(argv, port, lambda t: _completed(t) > 0, wait_s=45)
    assert result.returncode == 0, result.stderr[-4000:]
    assert _completed(text) > 0, "no program completed while the exporter was scraped"
    records = read_parquet(run_dir / "requests.parquet")
    assert {r.status for r in records} <= {"ok", "cancelled"}
    assert {r.tenant for r in records if r.program_id} == {"coder", "researcher"}
    assert any(r.parent_program_id for r in records)
    s = summary(analyse(load_run(run_dir)))
    assert sum(t["programs_completed"] for t in s["programs"]["tenants"].values()) > 0


def _completed(metrics: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("weighbridge_client_programs_total{")
               and 'outcome="completed"' in line)


def test_locust_replays_aiperf_sessions_after_each_answer(emulator: ServerProcess,
                                                          tmp_path: Path) -> None:
    """``--trace`` with AIPerf's session rows: each turn is sent its delay (over the speed)
    after the previous answer ended, by one tenant, naming its session as its program."""
    rows = []
    for turn in range(3):
        for session in range(3):
            row: dict[str, Any] = {"session_id": f"s{session}", "input_length": 30 + turn,
                                   "output_length": 6, "hash_ids": [10 * session + turn]}
            row.update({"timestamp": 200 * session} if turn == 0 else {"delay": 300})
            rows.append(row)
    trace = tmp_path / "sessions.jsonl"
    trace.write_text("".join(orjson.dumps(r).decode() + "\n" for r in rows))
    run_dir = tmp_path / "replay"
    result = locust.run(emulator.url, run_dir, "60s", "--trace", str(trace), "--trace-speed",
                        "2", "--trace-tenants", "round_robin", scenario="chat_sessions")
    assert result.returncode == 0, result.stderr[-4000:]
    records = sorted(read_parquet(run_dir / "requests.parquet"),
                     key=lambda r: (r.session_id or "", r.turn or 0))
    assert len(records) == 9 and all(r.status == "ok" for r in records)
    for before, after in itertools.pairwise(records):
        if before.session_id != after.session_id:
            continue
        assert (after.program_id, after.program_calls, after.tenant) == (
            after.session_id, 3, before.tenant)
        assert after.scheduled_s == pytest.approx(before.end_s + 0.15, abs=1e-9)
