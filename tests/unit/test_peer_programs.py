"""The live program benchmarks' pure parts: program completion from records, with programs
a live run's end cut off counted as lower bounds (benchmarks/program_ordering.py), and the
peer's flags and the tenants both routers read programs from (benchmarks/peer_programs.py)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchmarks._peer_figures import fleet_counters
from benchmarks.peer_programs import PEER, Rates, peer_flags, tenants
from benchmarks.program_ordering import measure
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.loadgen.tenants import parse_tenants
from weighbridge.records import RequestRecord


def call(program: str, turn: int, calls: int, scheduled: float, end: float,
         status: str = "ok", tenant: str = "alpha") -> RequestRecord:
    return RequestRecord(
        run_id="r", scenario="agent_programs", phase="programs",
        request_id=f"{program}-{turn}", tenant=tenant, tier="standard", endpoint="chat",
        stream=True, scheduled_s=scheduled, end_s=end, status=status,  # type: ignore[arg-type]
        prompt_tokens=100, output_tokens=10, cached_tokens=50, program_id=program,
        turn=turn, program_calls=calls,
        reason="run_ended" if status == "cancelled" else None)


def test_a_program_the_run_cut_off_counts_its_wait_so_far() -> None:
    records = [call("a", 0, 2, 0.0, 1.0), call("a", 1, 2, 2.0, 3.0),
               call("b", 0, 3, 1.0, 2.0), call("b", 1, 3, 4.0, 10.0, status="cancelled")]
    arm = measure("x", records)
    assert arm.programs == {"alpha": [3.0]}
    assert arm.unfinished == {"alpha": [9.0]}  # the run's last end (10) less b's start (1)
    assert (arm.started, arm.completed, arm.open_programs("alpha")) == (2, 1, 1)
    assert arm.completion("alpha") == [3.0, 9.0]


def test_a_failed_program_is_in_no_percentile() -> None:
    records = [call("a", 0, 2, 0.0, 1.0), call("a", 1, 2, 2.0, 3.0),
               call("c", 0, 2, 0.0, 1.0, status="error")]
    arm = measure("x", records)
    assert (arm.failed, arm.open_programs(), arm.completion()) == (1, 0, [3.0])


def test_the_peer_is_told_each_engines_kv_capacity_in_tokens() -> None:
    flags = peer_flags(EmulatorOptions(num_kv_blocks=4096, block_size=16))
    assert flags[0] == "--enable-program-scheduling"
    assert json.loads(flags[flags.index("--program-scheduling-config-json") + 1]) == {
        "token_capacity_per_dp_rank": 65536}
    assert PEER == "vllm_router"


def test_every_tenant_names_its_programs_as_vllm_router_reads_them() -> None:
    for scenario in ("alone", "flood"):
        for tenant in tenants(scenario, Rates()):
            assert "agentic_context" in tenant["identity"]
    assert [t["name"] for t in tenants("flood", Rates(small=1, flood=10))] == ["alpha", "beta"]


def test_tenants_starting_programs_for_a_while_are_a_valid_tenants_file() -> None:
    shapes = tenants("flood", Rates(small=1, flood=10), starts_s=60)
    parsed = parse_tenants({"tenants": shapes}, base_dir=Path("."), source="test")
    rng = random.Random(0)
    for tenant in parsed.tenants:
        times = list(tenant.arrival.times(rng, 0.0, 500.0))
        assert times and max(times) < 60  # none start after the first 60 s


def test_the_fleets_preemptions_are_summed_and_a_window_is_their_delta() -> None:
    def engine(preemptions: float) -> str:
        return ("# TYPE vllm:num_preemptions counter\n"
                f'vllm:num_preemptions_total{{engine="0",model_name="m"}} {preemptions}\n')
    before = fleet_counters([engine(2), engine(3)])
    after = fleet_counters([engine(7), engine(3)])
    assert (before.preemptions, (after - before).preemptions) == (5, 5)
