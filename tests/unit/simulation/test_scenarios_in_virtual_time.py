"""Acceptance scenarios 2 (token fairness) and 3 (tiers) in virtual time: the sidecar's
scheduling core in front of the engine's step model (weighbridge.app.simulation), with the
engines, tenants and settings of the live scenarios (tests/support/scenarios.py).

Here the exact targets are asserted: nothing but the scheduler and the engine model decides
the outcome, and a run is deterministic. The live tests (tests/integration/sidecar/
test_scenarios.py) check that real processes on loopback deliver the same, with margins for
what a shared machine adds.

Service is counted as in the live test where the records allow it: booked (dispatched)
tokens of the requests dispatched in the window, every tenant backlogged throughout.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.scenarios import (
    FAIR_CLIENTS,
    FAIR_END_S,
    FAIR_ENGINE,
    FAIR_WARMUP_S,
    FAIR_WEIGHTS,
    LONG,
    SHORT,
    TIER_CHAT,
    TIER_CHAT_RATE,
    TIER_CHAT_START_S,
    TIER_ENGINE,
    TIER_FLOOD,
    TIER_FLOOD_CLIENTS,
    TIER_JOB_CLIENTS,
    TIER_JOBS,
    TIER_SLO_S,
    fair_config,
    key,
    tier_config,
)
from weighbridge.app.simulation.clients import WorkloadClients
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.loop import Simulation
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.loadgen.arrivals import Closed, Poisson
from weighbridge.loadgen.lengths import Lengths
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import TenantSpec
from weighbridge.records import RequestRecord
from weighbridge.sidecar.config import parse_config
from weighbridge.statistics import jain_index, percentile

ENGINE = "engine-0"


def _simulate(config: dict[str, Any], engine: dict[str, Any], backend: dict[str, Any],
              tenants: tuple[TenantSpec, ...], end_s: float) -> list[RequestRecord]:
    sidecar = parse_config({**config,
                            "backends": [{"name": ENGINE, "url": "http://127.0.0.1:9",
                                          **backend}]})
    workload = Workload(scenario="acceptance", phases=(PhaseSpan("load", 0.0, end_s),),
                        tenants=tenants)
    result = Simulation(sidecar, [SimEngine(ENGINE, EmulatorOptions(**engine))],
                        WorkloadClients(workload, seed=0, until_s=end_s),
                        run_id="acceptance", scenario="acceptance", until_s=end_s).run()
    return result.records


def _lengths(*shapes: tuple[int, int]) -> Lengths:
    return Lengths.model_validate(
        {"classes": [{"prompt": prompt, "output": output} for prompt, output in shapes]})


def _dispatched_at(record: RequestRecord) -> float | None:
    if record.http_status is None or record.queue_s is None:
        return None  # never dispatched (still queued at the end, or turned away)
    return record.scheduled_s + record.queue_s


# ============================================================================ 2. fairness

def _fair_shares(policy: str) -> tuple[dict[str, float], float]:
    """Booked tokens dispatched in the window per tenant, relative to its weighted share
    (1.0 = exact), and Jain's index on weight-normalised service."""
    # "mixed" alternates the two shapes per client in the live test; here it draws either
    # with equal odds, the same mix on average.
    shapes = {"short": (SHORT,), "long": (LONG,), "mixed": (SHORT, LONG)}
    tenants = tuple(TenantSpec(name=name, api_key=key(name), tier="standard", weight=weight,
                               lengths=_lengths(*shapes[name]),
                               arrival=Closed(users=FAIR_CLIENTS))
                    for name, weight in FAIR_WEIGHTS.items())
    records = _simulate(fair_config(policy), {"profile": "h100-llama3-8b", **FAIR_ENGINE},
                        {}, tenants, FAIR_END_S)
    booked = dict.fromkeys(FAIR_WEIGHTS, 0.0)
    for r in records:
        t = _dispatched_at(r)
        if t is not None and FAIR_WARMUP_S <= t < FAIR_END_S:
            assert r.max_tokens is not None
            booked[r.tenant] += r.max_tokens + (SHORT[0] if r.max_tokens == SHORT[1]
                                                else LONG[0])
    total, total_weight = sum(booked.values()), sum(FAIR_WEIGHTS.values())
    shares = {n: booked[n] / total / (FAIR_WEIGHTS[n] / total_weight) for n in FAIR_WEIGHTS}
    jain = jain_index([booked[n] / FAIR_WEIGHTS[n] for n in FAIR_WEIGHTS])
    assert jain is not None
    return shares, jain


def test_token_fairness_drr_vs_rr_in_virtual_time() -> None:
    """Acceptance 2: under drr every tenant's service is within +-5% of its weighted share
    and Jain's index on weight-normalised service is >= 0.99; rr diverges."""
    drr, drr_jain = _fair_shares("drr")
    rr, rr_jain = _fair_shares("rr")
    print(f"\n[fairness, virtual time] drr {drr} Jain {drr_jain:.4f}; rr {rr} Jain {rr_jain:.4f}")
    for name, share in drr.items():
        assert share == pytest.approx(1.0, abs=0.05), (name, drr)
    assert drr_jain >= 0.99
    # rr hands out requests, not tokens: the long tenant takes far more than its share.
    assert rr_jain < 0.8, rr
    assert rr["long"] > 1.5 and rr["short"] < 0.5, rr


@pytest.mark.parametrize("slots", [8, 16])
def test_a_weighted_share_holds_for_closed_loops_in_virtual_time(slots: int) -> None:
    """Issue 42's 4:1 share in the setup of tests/integration/epp/test_replicas_share.py, one
    sidecar's core: tenants weighted 4 and 1, each 24 closed-loop users of 16 + 24 tokens, on
    one engine of ``slots`` sequences; the engine's output splits 4:1 within 5% at the
    default config. Each tenant's backlog is a few requests, so this holds only if a DRR
    visit spends the tenant's weight (decision 0025): with one request a visit whatever
    the weight it was 3.41:1 on 8 slots and 3.69:1 on 16."""
    weights = {"heavy": 4, "light": 1}
    end_s, warmup_s = 40.0, 4.0
    tenants = tuple(TenantSpec(name=name, api_key=key(name), tier="standard", weight=weight,
                               lengths=_lengths((16, 24)), arrival=Closed(users=24))
                    for name, weight in weights.items())
    config = {"tiers": {"standard": {"rank": 1}},
              "tenants": {name: {"tier": "standard", "weight": weight,
                                 "api_keys": [f"plain:{key(name)}"],
                                 "limits": {"max_queued": 500}}
                          for name, weight in weights.items()}}
    engine = {"max_num_seqs": slots, "max_num_batched_tokens": 512, "num_kv_blocks": 1024,
              "block_size": 16, "t_fixed": 0.02}
    records = _simulate(config, engine, {}, tenants, end_s)
    output = dict.fromkeys(weights, 0)
    for r in records:
        if r.status == "ok" and warmup_s <= r.end_s < end_s:
            output[r.tenant] += r.output_tokens or 0
    ratio = output["heavy"] / output["light"]
    print(f"\n[weighted share, virtual time] {slots} slots: {output}, {ratio:.3f}:1")
    assert ratio == pytest.approx(4.0, rel=0.05)


# ============================================================================ 3. tiers

TIER_END_S = 12.0  # the live test's drr phase


def _tier_run(policy: str) -> list[RequestRecord]:
    tenants = (
        TenantSpec(name="bulk", api_key=key("bulk"), tier="batch", lengths=_lengths(TIER_FLOOD),
                   arrival=Closed(users=TIER_FLOOD_CLIENTS)),
        TenantSpec(name="app", api_key=key("app"), tier="interactive",
                   headers={"x-weighbridge-tier": "batch"}, lengths=_lengths(TIER_JOBS),
                   arrival=Closed(users=TIER_JOB_CLIENTS)),
        # The live chat stream runs from 2 s (once the flood fills the engine) to 1 s before
        # the end; here it runs throughout and only that window's requests are judged.
        TenantSpec(name="chat", api_key=key("chat"), tier="interactive",
                   lengths=_lengths(TIER_CHAT), arrival=Poisson(rate=TIER_CHAT_RATE)),
    )
    return _simulate(tier_config(policy), {"profile": "h100-llama3-8b", **TIER_ENGINE},
                     {"priority_scheduling": True}, tenants, TIER_END_S)


def _chat(records: list[RequestRecord]) -> list[RequestRecord]:
    """The chat requests of the live test's window."""
    return [r for r in records if r.tenant == "chat"
            and TIER_CHAT_START_S <= r.scheduled_s < TIER_END_S - 1]


def _in_flight_and_batch_queued(records: list[RequestRecord], t: float) -> tuple[int, int]:
    running = queued = 0
    for r in records:
        if r.scheduled_s > t:
            continue
        dispatched = _dispatched_at(r)
        if dispatched is not None and dispatched <= t < r.end_s:
            running += 1
        elif r.tenant != "chat" and (dispatched is None or t < dispatched) and t < r.end_s:
            queued += 1
    return running, queued


def test_interactive_ttft_while_batch_saturates_in_virtual_time() -> None:
    """Acceptance 3: interactive p99 TTFT under 500 ms while batch traffic saturates the
    backend (the sidecar keeps the engine's slots full and batch requests wait upstream all
    along); through fcfs most interactive requests miss the target."""
    drr = _tier_run("drr")
    samples = [_in_flight_and_batch_queued(drr, TIER_CHAT_START_S + 0.25 * i)
               for i in range(int((TIER_END_S - 1 - TIER_CHAT_START_S) / 0.25))]
    assert sum(running for running, _ in samples) / len(samples) >= 0.8 * 32, samples
    assert min(queued for _, queued in samples) > 0, samples
    chat = _chat(drr)
    assert len(chat) > 100
    assert all(r.status == "ok" for r in chat), [(r.status, r.reason) for r in chat][:5]
    ttft = sorted(r.ttft_s for r in chat if r.ttft_s is not None)
    fifo = _chat(_tier_run("fcfs"))
    in_slo = [r for r in fifo if r.ttft_s is not None and r.ttft_s < TIER_SLO_S]
    print(f"\n[tiers, virtual time] drr: {len(chat)} interactive, TTFT p50 "
          f"{percentile(ttft, 0.5):.3f} s, p99 {percentile(ttft, 0.99):.3f} s; engine slots in "
          f"use {sum(running for running, _ in samples) / len(samples):.1f} of 32, fewest batch "
          f"queued {min(queued for _, queued in samples)}; fcfs: {len(in_slo)} of {len(fifo)} "
          f"within {TIER_SLO_S} s")
    assert percentile(ttft, 0.99) < TIER_SLO_S, ttft[-10:]
    assert len(in_slo) < 0.5 * len(fifo)
