"""Trace replay's pure part (weighbridge.loadgen.trace): Mooncake rows and our records made
into plans, each hash id one fixed block of tokens, tenants by rule, times by speed; AIPerf's
sessions (``session_id``, ``delay``), each turn after the previous answer; the sample trace
script; and the simulator sending the very plans the load generator sends."""

from __future__ import annotations

import itertools
import json
import runpy
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.app.simulation.run import Inputs, run_policy
from weighbridge.app.simulation.trace import trace_clients
from weighbridge.app.stack import load_stack
from weighbridge.loadgen.bodies import TRACE_BLOCK, build_body
from weighbridge.loadgen.plan import Answer, ProgramRef, RequestPlan
from weighbridge.loadgen.tenants import TenantSpec, parse_tenants
from weighbridge.loadgen.trace import (
    TenantRule,
    TraceError,
    TraceRow,
    TraceRows,
    read_trace_rows,
    trace_plans,
    trace_replay,
)
from weighbridge.records import RecordAppender, RequestRecord, read_parquet, write_parquet

REPO = Path(__file__).resolve().parents[3]
SAMPLE = REPO / "scripts" / "sample_mooncake_trace.py"


def write_sample(out: Path, *args: str) -> None:
    """The sample script's main, run in process (unit tests start no child process)."""
    script = runpy.run_path(str(SAMPLE))
    assert script["main"](["--out", str(out), *args]) == 0


def _tenants(*names: str, endpoint: str = "completions") -> list[TenantSpec]:
    specs = [{"name": n, "endpoint": endpoint, "api_key": f"sk-{n}",
              "lengths": {"prompt": 1, "output": 1}} for n in names]
    return parse_tenants({"tenants": specs}, base_dir=Path("."), source="test").tenants


def _write_mooncake(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _ids(plan: RequestPlan, tenant: TenantSpec) -> list[int]:
    prompt: list[int] = orjson.loads(build_body(plan, tenant))["prompt"]
    return prompt


# A Mooncake row: up to 4 blocks from a small id space, so rows share blocks often.
_ROW = st.builds(
    lambda ids, extra, t, out: {"timestamp": t, "hash_ids": ids,
                                "input_length": (len(ids) - 1) * TRACE_BLOCK + extra,
                                "output_length": out},
    st.lists(st.integers(0, 6), min_size=1, max_size=4), st.integers(1, TRACE_BLOCK),
    st.integers(0, 60_000), st.integers(1, 300))


@settings(max_examples=40, deadline=None)
@given(st.lists(_ROW, min_size=1, max_size=12), st.integers(0, 2**16),
       st.sampled_from([0.5, 1.0, 4.0]))
def test_each_hash_id_is_one_fixed_block_of_tokens(rows: list[dict[str, Any]], seed: int,
                                                    speed: float) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trace = read_trace_rows(_write_mooncake(Path(tmp) / "t.jsonl", rows))
    assert trace.format == "mooncake"
    (tenant,) = _tenants("only")
    plans = trace_plans(trace, [tenant], TenantRule("round_robin"), speed=speed, seed=seed)
    by_id = {p.request_id: p for p in plans}
    blocks: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        plan = by_id[f"trace-{i}"]
        ids = _ids(plan, tenant)
        assert len(ids) == plan.prompt_tokens == row["input_length"]
        assert plan.max_tokens == row["output_length"]
        assert plan.scheduled_s == pytest.approx(row["timestamp"] / 1000 / speed)
        for j, h in enumerate(row["hash_ids"]):
            block = ids[j * TRACE_BLOCK:(j + 1) * TRACE_BLOCK]
            known = blocks.setdefault(h, block)
            # The same id is the same tokens; a partial last block is the first of them.
            n = min(len(known), len(block))
            assert block[:n] == known[:n]
            if len(block) > len(known):
                blocks[h] = block
    assert [p.scheduled_s for p in plans] == sorted(p.scheduled_s for p in plans)


def test_different_ids_are_different_tokens_and_seeds_change_them(tmp_path: Path) -> None:
    trace = read_trace_rows(_write_mooncake(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]},
        {"timestamp": 5, "input_length": 1024, "output_length": 4, "hash_ids": [1, 3]}]))
    (tenant,) = _tenants("only")
    a, b = trace_plans(trace, [tenant], TenantRule("hash"), seed=0)
    ids_a, ids_b = _ids(a, tenant), _ids(b, tenant)
    assert ids_a[:512] == ids_b[:512] and ids_a[512:520] != ids_b[512:520]
    (other, _) = trace_plans(trace, [tenant], TenantRule("hash"), seed=1)
    assert _ids(other, tenant)[:8] != ids_a[:8]  # another run's blocks are other tokens


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), min_size=1,
                max_size=30))
def test_hash_rule_keeps_requests_with_one_first_block_on_one_tenant(
        blocks: list[list[int]]) -> None:
    rows = [TraceRow(float(i), len(b) * TRACE_BLOCK, 1, tuple(b)) for i, b in enumerate(blocks)]
    names = ["a", "b", "c"]
    assigned = TenantRule.parse("hash").assign(rows, names)
    assert assigned == TenantRule.parse("hash").assign(rows, names)  # stable
    first: dict[int, str] = {}
    for row, name in zip(rows, assigned, strict=True):
        assert row.hash_ids is not None
        assert first.setdefault(row.hash_ids[0], name) == name


def test_round_robin_and_column_rules() -> None:
    rows = [TraceRow(float(i), 10, 1, columns=(("app", "b" if i % 2 else "a"),))
            for i in range(5)]
    assert TenantRule.parse("round_robin").assign(rows, ["a", "b"]) == ["a", "b", "a", "b", "a"]
    assert TenantRule.parse("column:app").assign(rows, ["a", "b"]) == ["a", "b", "a", "b", "a"]
    with pytest.raises(TraceError, match="is not a tenant"):
        TenantRule.parse("column:app").assign(rows, ["a"])
    with pytest.raises(TraceError, match="one of auto, hash, round_robin, column:NAME"):
        TenantRule.parse("random")


def test_the_auto_rule_keeps_the_tenants_a_trace_names_else_hashes() -> None:
    named = [TraceRow(float(i), 10, 1, tenant="b" if i % 2 else "a") for i in range(4)]
    auto = TenantRule.parse("auto")
    assert auto.assign(named, ["a", "b"]) == ["a", "b", "a", "b"]
    blocks = [TraceRow(float(i), 600, 1, (i % 2, 9)) for i in range(6)]
    assert auto.assign(blocks, ["a", "b", "c"]) == TenantRule("hash").assign(blocks,
                                                                             ["a", "b", "c"])


def test_our_records_replay_by_their_tenant_column(tmp_path: Path) -> None:
    def record(request_id: str, tenant: str, t: float, prompt: int | None) -> RequestRecord:
        return RequestRecord(run_id="r", scenario="s", phase="p", request_id=request_id,
                             tenant=tenant, tier="standard", endpoint="/v1/completions",
                             stream=True, max_tokens=16, scheduled_s=t, end_s=t + 1,
                             prompt_tokens=prompt, status="ok" if prompt else "rejected")

    path = tmp_path / "requests.parquet"
    write_parquet([record("r-1", "acme", 1.0, 100), record("r-2", "zeta", 3.0, 40),
                   record("r-3", "acme", 4.0, None)], path)
    trace = read_trace_rows(path)
    assert trace.format == "records" and trace.filled == 1  # the rejected one's prompt
    tenants = _tenants(*sorted({r.tenant for r in trace.rows if r.tenant}))
    plans = trace_plans(trace, tenants, TenantRule.parse("column:tenant"), speed=2.0)
    assert {p.tenant for p in plans} == {r.tenant for r in trace.rows}
    assert all(p.messages is None for p in plans)  # records hold no content: prefix-free
    assert sorted(p.scheduled_s for p in plans) == sorted((r.t_s or 0.0) / 2 for r in trace.rows)
    # A run's records-*.jsonl (one still going, or a worker's) reads the same.
    jsonl = tmp_path / "records-local.jsonl"
    with RecordAppender(jsonl) as sink:
        for r in read_parquet(path):
            sink.append(r)
    assert read_trace_rows(jsonl) == trace


def test_a_trace_cannot_be_sent_by_embeddings_tenants() -> None:
    rows = TraceRows([TraceRow(0.0, 10, 1)], "table")
    tenant = parse_tenants({"tenants": [{"name": "e", "endpoint": "embeddings",
                                         "lengths": {"prompt": 1, "output": 1}}]},
                           base_dir=Path("."), source="test").tenants[0]
    with pytest.raises(TraceError, match="not embeddings"):
        trace_plans(rows, [tenant], TenantRule("round_robin"))


def test_the_sample_script_writes_a_reproducible_trace_with_shared_prefixes(
        tmp_path: Path) -> None:
    out_a, out_b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for out in (out_a, out_b):
        write_sample(out, "--requests", "80")
    assert out_a.read_bytes() == out_b.read_bytes()
    trace = read_trace_rows(out_a)
    assert trace.format == "mooncake" and len(trace.rows) == 80
    firsts = [r.hash_ids[0] for r in trace.rows if r.hash_ids]
    assert len(set(firsts)) < len(firsts) / 2  # system prompts: many share a first block
    for row in trace.rows:
        assert row.hash_ids is not None
        assert (len(row.hash_ids) - 1) * TRACE_BLOCK < row.prompt_tokens \
            <= len(row.hash_ids) * TRACE_BLOCK
    times = [r.t_s or 0.0 for r in trace.rows]
    assert times == sorted(times)
    # Later turns repeat an earlier request's blocks and add to them.
    grows = sum(1 for a, b in itertools.combinations(trace.rows, 2)
                if a.hash_ids and b.hash_ids and len(b.hash_ids) > len(a.hash_ids)
                and b.hash_ids[:len(a.hash_ids)] == a.hash_ids)
    assert grows > 5


def test_the_simulator_sends_the_plans_the_load_generator_sends(tmp_path: Path) -> None:
    trace_file = tmp_path / "sample.jsonl"
    write_sample(trace_file, "--requests", "40", "--rate", "20")
    stack = load_stack(REPO / "deploy" / "stacks" / "chat-sessions.yaml")
    inputs = Inputs(stack=stack, trace=trace_file, trace_speed=2.0, seed=5)
    outcome = run_policy(inputs, None, tmp_path / "run")
    records = {r.request_id: r for r in outcome.result.records}
    from weighbridge.app.simulation.run import find_scenario

    tenants = find_scenario("chat_sessions").workload().tenants
    plans = trace_plans(read_trace_rows(trace_file), tenants, TenantRule("hash"), speed=2.0,
                        seed=5)
    assert sorted(records) == sorted(p.request_id for p in plans)
    for plan in plans:
        r = records[plan.request_id]
        assert (r.tenant, r.scheduled_s, r.max_tokens) == (plan.tenant, plan.scheduled_s,
                                                            plan.max_tokens)
        assert r.status == "ok" and r.prompt_tokens == plan.prompt_tokens
        assert r.cached_tokens is not None  # the stack's engines report them
    # The trace's shared system prompts and growing conversations hit the cache.
    assert sum(r.cached_tokens or 0 for r in records.values()) > 0
    sim = trace_clients(read_trace_rows(trace_file), tenants, TenantRule("hash"), speed=2.0,
                        seed=5)
    assert [c.plan for c in sim.requests] == plans


# ---------------------------------------------------------------- AIPerf sessions


def _session_rows(sessions: int, turns: int, delay_ms: int, blocks: bool) -> list[dict[str, Any]]:
    """AIPerf's multi-turn Mooncake form: each session's first row at a timestamp, the rest
    ``delay`` ms after the previous answer; each row's input is the turn's new message."""
    rows = []
    for k in range(turns):
        for s in range(sessions):
            row: dict[str, Any] = {"session_id": f"sess-{s}", "input_length": 40 + 10 * k,
                                   "output_length": 8 + k}
            if k == 0:
                row["timestamp"] = 1000 * s
            else:
                row["delay"] = delay_ms
            if blocks:
                row["hash_ids"] = [100 * s + k]
            rows.append(row)
    return rows


def test_aiperf_session_rows_are_read_and_checked(tmp_path: Path) -> None:
    rows = _session_rows(2, 3, 500, blocks=True)
    trace = read_trace_rows(_write_mooncake(tmp_path / "s.jsonl", rows))
    assert trace.format == "mooncake"
    sessions = trace.sessions()
    assert list(sessions) == ["sess-0", "sess-1"]
    assert [r.delay_s for r in sessions["sess-1"]] == [None, 0.5, 0.5]
    assert [r.t_s for r in sessions["sess-1"]] == [1.0, None, None]
    assert trace.end_s == 2.0 and trace.longest_session == 3  # 1 s + two 0.5 s delays
    bad_rows: list[tuple[dict[str, Any], str]] = [
        ({"input_length": 3, "output_length": 1, "delay": 5, "timestamp": 0}, "no session_id"),
        ({"input_length": 3, "output_length": 1}, "needs a timestamp"),
        ({"session_id": "a b", "input_length": 3, "output_length": 1}, "session_id"),
        ({"session_id": "a", "input_length": 3, "output_length": 1, "delay": -1}, "delay"),
        ({"session_id": "a", "input_length": True, "output_length": 1}, "input_length"),
    ]
    for bad, problem in bad_rows:
        with pytest.raises(TraceError, match=problem):
            read_trace_rows(_write_mooncake(tmp_path / "bad.jsonl", [bad]))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 5), st.integers(0, 3000), st.booleans(),
       st.sampled_from([0.5, 1.0, 2.0]), st.sampled_from(["hash", "round_robin"]),
       st.integers(0, 2**16))
def test_a_session_s_turns_follow_answers_as_aiperf_replays_them(
        sessions: int, turns: int, delay_ms: int, blocks: bool, speed: float, rule: str,
        seed: int) -> None:
    """Each turn resends the history with the answer as returned, adds its row's message,
    and is due its delay (over the speed) after the previous answer ended; one tenant sends
    a whole session, whose requests name it as their program."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        trace = read_trace_rows(_write_mooncake(
            Path(tmp) / "s.jsonl", _session_rows(sessions, turns, delay_ms, blocks)))
    tenants = _tenants("a", "b", "c")
    by_name = {t.name: t for t in tenants}
    replay = trace_replay(trace, tenants, TenantRule.parse(rule), speed=speed, seed=seed)
    assert replay.plans == []  # every row is a session's
    assert [s.session_id for s in replay.sessions] == [f"sess-{i}" for i in range(sessions)]
    for session in replay.sessions:
        plan: RequestPlan | None = session.first()
        assert plan is not None and plan.scheduled_s == (session.rows[0].t_s or 0) / speed
        seen = 0
        while plan is not None:
            assert plan.tenant == session.tenant.name and plan.turn == seen
            assert plan.program == ProgramRef(session.session_id, session.session_id, None,
                                              turns)
            assert plan.session_id == session.session_id
            assert plan.prompt_tokens == sum(40 + 10 * k + (8 + k) * (k < seen)
                                             for k in range(seen + 1))
            end = plan.scheduled_s + 0.25
            answer = Answer(plan.max_tokens, None, tuple(range(7, 7 + plan.max_tokens)))
            follow = session.ended(plan, answer, end)
            seen += 1
            if not follow:
                break
            (after,) = follow
            assert after.scheduled_s == pytest.approx(end + delay_ms / 1000 / speed)
            tenant = by_name[plan.tenant]
            grown = _ids(plan, tenant) + list(answer.token_ids or ())
            assert _ids(after, tenant)[:len(grown)] == grown
            plan = after
        assert seen == turns
        # A turn that does not end ok ends its session.
        assert session.ended(session.first(), None, 1.0) == []


def test_a_trace_mixes_single_requests_and_sessions(tmp_path: Path) -> None:
    rows = [{"timestamp": 500, "input_length": 30, "output_length": 4},
            *_session_rows(1, 2, 100, blocks=False)]
    trace = read_trace_rows(_write_mooncake(tmp_path / "m.jsonl", rows))
    replay = trace_replay(trace, _tenants("a"), TenantRule("round_robin"))
    assert [p.request_id for p in replay.plans] == ["trace-0"]
    assert replay.plans[0].program is None and replay.plans[0].messages is None
    assert [s.session_id for s in replay.sessions] == ["sess-0"]
    assert trace_plans(trace, _tenants("a"), TenantRule("round_robin")) == replay.plans


def test_the_simulator_replays_aiperf_sessions_after_each_answer(tmp_path: Path) -> None:
    trace_file = _write_mooncake(tmp_path / "s.jsonl", _session_rows(3, 4, 700, blocks=True))
    # Routed prefix-aware: a session's turns go back to the engine holding its history.
    stack = load_stack(REPO / "deploy" / "stacks" / "agent-programs.yaml")
    outcome = run_policy(Inputs(stack=stack, trace=trace_file, trace_speed=2.0, seed=5,
                                trace_tenants="round_robin"), None, tmp_path / "run")
    records = sorted(outcome.result.records, key=lambda r: (r.session_id or "", r.turn or 0))
    assert len(records) == 12 and all(r.status == "ok" for r in records)
    for before, after in itertools.pairwise(records):
        if before.session_id != after.session_id:
            continue
        assert (after.program_id, after.parent_program_id, after.program_calls) == (
            after.session_id, None, 4)
        assert after.tenant == before.tenant
        assert after.scheduled_s == pytest.approx(before.end_s + 0.35)
        # The history (whole blocks of it) comes back from the engine's prefix cache.
        assert after.cached_tokens is not None and before.prompt_tokens is not None
        assert after.cached_tokens >= before.prompt_tokens // 16 * 16
    assert {r.program_end for r in records if r.turn == 3} == {"completed"}
