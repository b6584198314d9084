"""Several sidecar replicas in virtual time (``Simulation(replicas=...)``): each its own
core, the requests sent to them in turn, their load and service exchanged as through Redis
(weighbridge.app.simulation.exchange). Issue 42's two-picker share
(tests/integration/epp/test_replicas_share.py) in the setup of the one-core test,
tests/unit/simulation/test_scenarios_in_virtual_time.py's
``test_a_weighted_share_holds_for_closed_loops_in_virtual_time``."""

from __future__ import annotations

from typing import Any

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

WEIGHTS = {"heavy": 4, "light": 1}
END_S, WARMUP_S = 40.0, 4.0


def share_run(replicas: int, slots: int = 8, admission: dict[str, Any] | None = None,
              ) -> tuple[dict[str, int], Simulation]:
    """Output tokens per tenant answered in the window: weights 4:1, 24 closed-loop users
    each of 16 + 24 tokens, one engine of ``slots`` sequences."""
    tenants = tuple(TenantSpec(name=name, api_key=key(name), tier="standard", weight=weight,
                               lengths=_lengths((16, 24)), arrival=Closed(users=24))
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
                     WorkloadClients(workload, seed=0, until_s=END_S), run_id="share",
                     scenario="share", until_s=END_S, replicas=replicas)
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
