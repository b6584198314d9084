"""The isolation matrix's claims at its KV-tight fcfs point
(benchmarks/isolation_sim.py, benchmarks/isolation_matrix.py): with a config
naming only tiers, tenants and the backend, a victim in the flood's tier with its weight gets
a TTFT p50 and p90 within 1.3x of the ideal bound's, at an engine output the live acceptance
would accept (>= 85% of the ideal's).

The shape is issue 14's (benchmarks/isolation.py: KV for fewer of the flood's sequences than
the engine has slots, fcfs, 512 + 192-token flood) at 64 slots and the default step budget.
Everything runs in virtual time with fixed seeds, so the figures are exact, not sampled.
"""

from __future__ import annotations

import math

import pytest

from benchmarks.isolation_sim import (
    VICTIM_ROOM_SEQS,
    IsolationPoint,
    PointResult,
    ideal_cap,
    run_point,
)

POINT = IsolationPoint(slots=64, budget=2048, kv="tight", policy="fcfs", victim_tier="same",
                       flood="long")


@pytest.fixture(scope="module")
def result() -> PointResult:
    return run_point(POINT)


def test_the_ideal_flood_fills_the_kv_but_the_victims_room() -> None:
    # KV-tight: the cache holds 0.8 x 64 = 51 of the flood's sequences at full length.
    assert POINT.kv_blocks // POINT.flood_blocks == 51
    assert ideal_cap(POINT) == 51 - VICTIM_ROOM_SEQS


def test_the_defaults_keep_the_victim_within_1_3x_of_the_ideal(result: PointResult) -> None:
    assert result.defaults.unanswered == 0
    # Over 30 virtual seconds at 4 requests/s: ~120 requests on either side.
    assert result.defaults.victim_requests >= 100
    assert result.ideal.victim_requests >= 100
    assert result.ratio(50) <= 1.3
    assert result.ratio(90) <= 1.3
    assert math.isfinite(result.ratio(99))


def test_the_defaults_keep_the_engines_output(result: PointResult) -> None:
    assert result.output_fraction >= 0.85


def test_the_kv_gate_is_what_holds_the_flood(result: PointResult) -> None:
    """KV, not slots, binds on this engine: the derived KV watermark holds the flood."""
    holds = {key.split("/", 1)[1]: n for key, n in result.holds.items()}
    assert holds.get("kv_headroom", 0) > 0
    assert result.preemptions == 0
