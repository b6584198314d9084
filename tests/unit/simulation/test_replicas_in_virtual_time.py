"""Several sidecar replicas in virtual time (``Simulation(replicas=...)``): each its own
core, the requests sent to them in turn, their load and service exchanged as through Redis
(weighbridge.app.simulation.exchange). Issue 42's two-picker share
(tests/integration/epp/test_replicas_share.py) in the setup of the one-core test,
tests/unit/simulation/test_scenarios_in_virtual_time.py's
``test_a_weighted_share_holds_for_closed_loops_in_virtual_time``."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.scenarios import key
from tests.unit.sidecar.test_core import arrive
from tests.unit.simulation.test_scenarios_in_virtual_time import ENGINE, _lengths
from weighbridge.app.simulation.clients import WorkloadClients
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.exchange import ReplicaExchange
from weighbridge.app.simulation.loop import Simulation
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.loadgen.arrivals import Closed
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import TenantSpec
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.replica import Replica
from weighbridge.statistics import jain_index

WEIGHTS = {"heavy": 4, "light": 1}
END_S, WARMUP_S = 40.0, 4.0


def share_run(replicas: int, slots: int = 8, admission: dict[str, Any] | None = None,
              outputs: tuple[int, ...] = (24,), seed: int = 0,
              pinned: dict[str, int] | None = None) -> tuple[dict[str, int], Simulation]:
    """Output tokens per tenant answered in the window: weights 4:1, 24 closed-loop users
    each of 16-token prompts and answers of one of ``outputs`` tokens, one engine of
    ``slots`` sequences."""
    tenants = tuple(TenantSpec(name=name, api_key=key(name), tier="standard", weight=weight,
                               lengths=_lengths(*((16, n) for n in outputs)),
                               arrival=Closed(users=24))
                    for name, weight in WEIGHTS.items())
    config: dict[str, Any] = {
        "tiers": {"standard": {"rank": 1}},
        "tenants": {name: {"tier": "standard", "weight": weight,
                           "api_keys": [f"plain:{key(name)}"], "limits": {"max_queued": 500}}
                    for name, weight in WEIGHTS.items()},
        "backends": [{"name": ENGINE, "url": "http://127.0.0.1:9"}]}
    if admission:
        config["admission"] = admission
    engine = {"max_num_seqs": slots, "max_num_batched_tokens": 512, "num_kv_blocks": 1024,
              "block_size": 16, "t_fixed": 0.02}
    workload = Workload(scenario="share", phases=(PhaseSpan("load", 0.0, END_S),),
                        tenants=tenants)
    sim = Simulation(parse_config(config), [SimEngine(ENGINE, EmulatorOptions(**engine))],
                     WorkloadClients(workload, seed=seed, until_s=END_S), run_id="share",
                     scenario="share", until_s=END_S, replicas=replicas, pinned=pinned)
    result = sim.run()
    output = dict.fromkeys(WEIGHTS, 0)
    for r in result.records:
        if r.status == "ok" and WARMUP_S <= r.end_s < END_S:
            output[r.tenant] += r.output_tokens or 0
    return output, sim


def test_two_replicas_serve_what_one_serves() -> None:
    """Two replicas keep the engine as busy as one (the closed loops saturate it either
    way), each takes half the requests and judges the other's load."""
    one, _ = share_run(1)
    two, sim = share_run(2)
    print(f"\n[replicas, virtual time] one {one} {one['heavy'] / one['light']:.3f}:1; "
          f"two {two} {two['heavy'] / two['light']:.3f}:1")
    assert sum(two.values()) == sum(one.values())
    arrived = [core.ledger.total().arrivals for core in sim.cores]
    assert abs(arrived[0] - arrived[1]) <= 1, arrived
    assert all(pool.foreign for core in sim.cores for pool in core.pools())


@pytest.mark.parametrize("pinned", [None, {"heavy": 0, "light": 1}],
                         ids=["round-robin", "a-replica-per-tenant"])
def test_two_replicas_hold_a_4_to_1_weighted_share(pinned: dict[str, int] | None) -> None:
    """Issue 42's acceptance in virtual time: two replicas give the 4:1 weighted share
    within 5%, whether the front spreads each tenant's requests over both or sends each
    tenant to one. Answers of 20-28 tokens (a fixed length makes every request of a wave
    end in the same step, which the live engine's timing does not), seeds 1-3, each run
    held to the 5%. Before the replicas held an engine's cap together (sidecar.admission,
    "Replicas"), round robin gave 3.01-3.10:1 and one replica per tenant 2.96-3.16:1 (live,
    two pickers: 3.07-3.13:1). On an engine of 16 slots this holds at 3.49-3.52:1 (3.46-3.51
    before): not yet (benchmarks/RESULTS.md, "epp_replicas")."""
    ratios = []
    for seed in (1, 2, 3):
        output, _ = share_run(2, outputs=(20, 22, 24, 26, 28), seed=seed, pinned=pinned)
        ratios.append(output["heavy"] / output["light"])
    print(f"\n[two replicas, virtual time] {pinned or 'round robin'}: "
          f"{', '.join(f'{r:.3f}' for r in ratios)}:1")
    for ratio in ratios:
        assert ratio == pytest.approx(4.0, rel=0.05), ratios


def test_a_tenant_behind_one_replica_of_three_gets_half_in_virtual_time() -> None:
    """Issue 15's acceptance (tests/integration/sidecar/test_replicas_fairness.py) in
    virtual time: two tenants of one weight on one engine of 8 slots, one sending through
    the first of three replicas, the other through all three; Jain's index over their
    output at least 0.98 (each within 0.43-0.57). Measured: 0.47 for the first, Jain
    0.996-0.997; with the replicas holding the cap together but a tenant backlogged
    elsewhere taken for light where its queue was short, 0.43 (Jain 0.979-0.981)."""
    weights = {"one": 1, "spread": 1}
    tenants = tuple(TenantSpec(name=name, api_key=key(name), tier="standard", weight=weight,
                               lengths=_lengths(*((16, n) for n in (20, 22, 24, 26, 28))),
                               arrival=Closed(users=24))
                    for name, weight in weights.items())
    config = parse_config({
        "tiers": {"standard": {"rank": 1}},
        "tenants": {name: {"tier": "standard", "weight": weight,
                           "api_keys": [f"plain:{key(name)}"], "limits": {"max_queued": 500}}
                    for name, weight in weights.items()},
        "backends": [{"name": ENGINE, "url": "http://127.0.0.1:9"}]})
    engine = EmulatorOptions(max_num_seqs=8, max_num_batched_tokens=512, num_kv_blocks=1024,
                             block_size=16, t_fixed=0.02)
    workload = Workload(scenario="fair", phases=(PhaseSpan("load", 0.0, END_S),),
                        tenants=tenants)
    for seed in (1, 2, 3):
        result = Simulation(config, [SimEngine(ENGINE, engine)],
                            WorkloadClients(workload, seed=seed, until_s=END_S), run_id="fair",
                            scenario="fair", until_s=END_S, replicas=3,
                            pinned={"one": 0}).run()
        output = dict.fromkeys(weights, 0)
        for r in result.records:
            if r.status == "ok" and WARMUP_S <= r.end_s < END_S:
                output[r.tenant] += r.output_tokens or 0
        index = jain_index(list(output.values()))
        print(f"\n[three replicas, virtual time] seed {seed}: {output}, Jain {index:.4f}")
        assert index is not None and index >= 0.98, output


def test_the_exchange_sums_the_others_load_and_charges_their_service() -> None:
    config = parse_config({
        "tenants": {"a": {"tier": "standard", "api_keys": ["plain:sk-a"]},
                    "b": {"tier": "standard", "api_keys": ["plain:sk-b"]}},
        "backends": [{"name": ENGINE, "url": "http://127.0.0.1:9"}]})
    cores = [SchedulingCore(config) for _ in range(3)]
    replicas = [Replica(core) for core in cores]
    exchange = ReplicaExchange(replicas, 0.01)
    for core in cores:
        arrive(core, "a")
        arrive(core, "b")
    list(cores[1].dispatch_ready(0.0))  # 2 in flight on replica 1
    exchange.tick()
    exchange.tick()  # replica 0 went first, before the others published: now it reads them
    pool = cores[0].pools()[0]
    # Replica 0 sees replica 1's two and replica 2's queue, not its own.
    assert pool.foreign == {"a": (1, True), "b": (1, True)}
    before = cores[0].scheduler.deficit("standard", "a")
    exchange.tick()  # the first service sync: totals read, nothing charged yet
    assert cores[0].scheduler.deficit("standard", "a") == before
    list(cores[2].dispatch_ready(0.1))
    for _ in range(3):
        exchange.tick()  # the second: replica 2's service charged to replica 0's queues
    assert cores[0].scheduler.deficit("standard", "a") < before
