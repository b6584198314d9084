"""Traffic with prefix structure through ``locust -f scenarios/`` against the emulator with
its prefix cache and ``--enable-prompt-tokens-details``: chat_sessions' sessions and system
prompts, and a Mooncake trace replayed at its times.

The emulator's KV pool (4,096 blocks of 16 tokens: 65,536 tokens) is larger than every
token either run sends (asserted), so nothing cached is ever evicted: each hit asserted
below follows from the prefix cache's rule alone, not from timing.
"""

from __future__ import annotations

import subprocess
import sys
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import locust
from weighbridge.launch import ServerProcess, emulator_process
from weighbridge.loadgen.scenario import discover_scenarios
from weighbridge.loadgen.sessions import Answer, first_turn, next_turn, sessions_of
from weighbridge.loadgen.trace import TenantRule, read_trace_rows, trace_plans
from weighbridge.records import RequestRecord, read_parquet
from weighbridge.rundir import read_run_info

REPO = Path(__file__).resolve().parents[3]
BLOCK, BLOCKS = 16, 4096
KV_TOKENS = BLOCK * BLOCKS


@pytest.fixture(scope="module")
def emulator() -> Iterator[ServerProcess]:
    with emulator_process(max_num_seqs=128, num_kv_blocks=BLOCKS, block_size=BLOCK,
                          enable_prompt_tokens_details=True) as server:
        yield server


def _ok(result: subprocess.CompletedProcess[str], run_dir: Path) -> list[RequestRecord]:
    assert result.returncode == 0, result.stderr[-4000:]
    records = read_parquet(run_dir / "requests.parquet")
    assert sum((r.prompt_tokens or 0) + (r.output_tokens or 0) for r in records) < KV_TOKENS
    return records


def test_chat_sessions_turns_follow_answers_and_hit_the_cache(emulator: ServerProcess,
                                                              tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    # 15 s of the scenario (phases at a quarter); -t a little longer, so it ends by itself.
    result = locust.run(emulator.url, run_dir, "60s", "--stretch", "0.25", "--seed", "3",
                        scenario="chat_sessions")
    records = _ok(result, run_dir)
    scenario = discover_scenarios(REPO / "scenarios",
                                  [REPO / "scenarios" / "locustfile.py"])["chat_sessions"]
    workload = scenario.workload(stretch=0.25)
    by_id = {r.request_id: r for r in records}
    turns = 0
    for tenant in workload.tenants:
        if tenant.sessions is None:
            continue
        for session in sessions_of(tenant, workload, 3):
            # Replay the session with the answers the server gave: every turn the
            # generator sent is the plan the pure model makes of them, at that time.
            plan = first_turn(session, workload, 3)
            while plan is not None and plan.request_id in by_id:
                r = by_id[plan.request_id]
                assert (r.session_id, r.turn) == (session.session_id, plan.turn)
                assert r.scheduled_s == pytest.approx(plan.scheduled_s, abs=1e-9)
                assert r.max_tokens == plan.max_tokens
                if r.status != "ok":
                    break
                assert r.output_tokens == plan.max_tokens and r.cached_tokens is not None
                if plan.turn:
                    turns += 1
                    previous = by_id[f"{session.session_id}-t{plan.turn - 1}"]
                    assert previous.prompt_tokens is not None
                    # The previous prompt's full blocks are cached (nothing is evicted).
                    assert r.cached_tokens >= previous.prompt_tokens // BLOCK * BLOCK
                plan = next_turn(session, plan, Answer(r.output_tokens), r.end_s, workload, 3)
    assert turns > 5  # 15 s at 1 session/s of 2-6 turns: dozens (a floor, not a figure)
    lookups = sorted((r for r in records if r.tenant == "lookup" and r.status == "ok"),
                     key=lambda r: r.scheduled_s)
    assert lookups[0].first_token_s is not None
    later = [r for r in lookups[1:] if r.scheduled_s > lookups[0].first_token_s]
    assert later  # 1.5 lookups/s for 15 s
    for r in later:
        # Its 384-token system prompt: 24 full blocks, cached by the first lookup.
        assert r.cached_tokens is not None and r.cached_tokens >= 384


def test_a_mooncake_trace_replays_at_its_times_and_hits_shared_blocks(
        emulator: ServerProcess, tmp_path: Path) -> None:
    trace_file = tmp_path / "sample.jsonl"
    subprocess.run([sys.executable, str(REPO / "scripts" / "sample_mooncake_trace.py"),
                    "--out", str(trace_file), "--requests", "40", "--rate", "4"],
                   check=True, capture_output=True)
    run_dir = tmp_path / "replay"
    result = locust.run(emulator.url, run_dir, "120s", "--trace", str(trace_file),
                        "--trace-speed", "2", "--trace-tenants", "round_robin", "--seed", "4",
                        scenario="chat_sessions")
    records = _ok(result, run_dir)
    info = read_run_info(run_dir)
    assert info.options["trace_speed"] == 2 and [p.name for p in info.phases] == ["trace"]
    scenario = discover_scenarios(REPO / "scenarios",
                                  [REPO / "scenarios" / "locustfile.py"])["chat_sessions"]
    rows = read_trace_rows(trace_file)
    plans = trace_plans(rows, scenario.workload().tenants, TenantRule("round_robin"), speed=2,
                        seed=4)
    by_id = {r.request_id: r for r in records}
    assert sorted(by_id) == sorted(p.request_id for p in plans)
    first_seen: dict[int, list[RequestRecord]] = defaultdict(list)
    shared = 0
    for plan, row in zip(sorted(plans, key=lambda p: int(p.request_id.split("-")[1])),
                         rows.rows, strict=True):
        r = by_id[plan.request_id]
        assert r.status == "ok", r
        assert (r.tenant, r.max_tokens) == (plan.tenant, plan.max_tokens)
        assert r.scheduled_s == pytest.approx(plan.scheduled_s, abs=1e-9)
        assert row.hash_ids is not None
        endpoint = r.endpoint
        earlier = [e for e in first_seen[row.hash_ids[0]]
                   if e.endpoint == endpoint and e.first_token_s is not None
                   and e.first_token_s < r.scheduled_s and (e.prompt_tokens or 0) > 520]
        if earlier and row.prompt_tokens > 520 and endpoint == "/v1/completions":
            # The first 512-token block is one an earlier request computed: 32 full blocks.
            assert r.cached_tokens is not None and r.cached_tokens >= 512
            shared += 1
        first_seen[row.hash_ids[0]].append(r)
    # The sample's system prompts: most rows share a first block with one sent seconds before
    # (4 requests/s at speed 2, every third a completions one), while a first token takes a
    # fraction of a second at this load.
    assert shared > 0
