from __future__ import annotations

import math
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.loadgen.plan import closed_users, open_loop_schedule, plan_request, share
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import TenantSpec, parse_tenants


def _tenant(**fields: object) -> TenantSpec:
    spec = {"name": "t", "lengths": {"prompt": {"kind": "uniform", "low": 1, "high": 900},
                                     "output": {"kind": "uniform", "low": 1, "high": 50}},
            "users": 5, **fields}
    return parse_tenants({"tenants": [spec]}, base_dir=Path("."), source="test").tenants[0]


PHASES = (PhaseSpan("quiet", 0.0, 10.0), PhaseSpan("flood", 10.0, 20.0),
          PhaseSpan("recovery", 20.0, math.inf))


def test_phases_switch_rates_and_silence() -> None:
    tenant = _tenant(arrival={"kind": "poisson", "rate": 2},
                     phases={"flood": {"kind": "burst", "count": 300, "over_s": 5},
                             "recovery": None})
    workload = Workload("s", PHASES, (tenant,))
    dues = list(open_loop_schedule(tenant, workload, seed=1))
    by_phase = {p.name: [d for d in dues if d.phase == p.name] for p in PHASES}
    assert all(0 <= d.t < 10 for d in by_phase["quiet"])
    assert 5 < len(by_phase["quiet"]) < 40
    assert len(by_phase["flood"]) == 300
    assert all(10 <= d.t < 15 for d in by_phase["flood"])
    assert by_phase["recovery"] == []  # silenced (and the open-ended phase ends)
    assert [d.seq for d in dues] == list(range(len(dues)))
    assert [d.t for d in dues] == sorted(d.t for d in dues)


def test_until_cuts_an_open_ended_phase() -> None:
    tenant = _tenant(arrival={"kind": "poisson", "rate": 50})
    workload = Workload("s", (PhaseSpan("steady", 0.0, math.inf),), (tenant,))
    dues = list(open_loop_schedule(tenant, workload, seed=0, until_s=3.0))
    assert dues and all(d.t < 3.0 for d in dues)


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 6), st.integers(0, 2**32))
def test_shares_partition_the_schedule_exactly(count: int, seed: int) -> None:
    tenant = _tenant(arrival={"kind": "gamma", "rate": 30, "burstiness": 3})
    workload = Workload("s", PHASES[:2], (tenant,))
    full = list(open_loop_schedule(tenant, workload, seed))
    parts = [list(share(open_loop_schedule(tenant, workload, seed), i, count))
             for i in range(count)]
    assert sorted((d for part in parts for d in part), key=lambda d: d.seq) == full


@given(st.integers(1, 40), st.integers(1, 5))
def test_closed_users_are_split_across_processes(users: int, count: int) -> None:
    tenant = _tenant(phases={"flood": {"kind": "closed", "users": users}})
    workload = Workload("s", PHASES, (tenant,))
    got = [u for i in range(count) for (_, _, _, u, _) in closed_users(tenant, workload, i,
                                                                          count)]
    assert sorted(got) == list(range(users))


@settings(max_examples=50, deadline=None)
@given(st.integers(0, 10**6), st.integers(0, 2**32))
def test_a_requests_sizes_depend_only_on_seed_and_id(seq: int, seed: int) -> None:
    tenant = _tenant()
    a = plan_request(tenant, f"t-{seq}", "quiet", 1.5, seed)
    b = plan_request(tenant, f"t-{seq}", "quiet", 1.5, seed)
    assert a == b
    assert 1 <= a.prompt_tokens <= 900 and 1 <= a.max_tokens <= 50
    assert a.user in {f"t-u{i}" for i in range(5)}
    assert a.endpoint == "/v1/completions" and a.stream
