"""SchedulingCore beside other replicas, through its replica wrapper (sidecar.replica; the
shared state feeds it): their load held against a tenant's global share, their service
charged to its credit, and the exchange's outboxes."""

from __future__ import annotations

from tests.unit.sidecar.test_core import arrive, make_config
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.replica import Replica
from weighbridge.sidecar.request import QueuedRequest

POOL = "b1,b2"


def core_with(max_inflight: int = 4) -> tuple[SchedulingCore, Replica]:
    core = SchedulingCore(make_config(), gate_limits=GateLimits(max_inflight=max_inflight))
    return core, Replica(core)


def test_a_tenant_at_its_global_share_waits_for_one_starved_elsewhere() -> None:
    core, replica = core_with(max_inflight=4)  # 8 slots over two backends
    for _ in range(10):
        arrive(core, "a")
    # b (weight 2) is backlogged on another replica with 1 in flight: its share of 8 slots
    # is 2/3, so it is starved, and a may hold only its own third.
    replica.set_foreign_load({(POOL, "b"): (1, True)})
    sent = list(core.dispatch_ready(0.0))
    assert len(sent) == 3  # a reaches 8 * 1/3 = 2.67 slots: the third one, then waits
    assert core.holds[("", "global_share")] >= 1
    # b holds 10 elsewhere: shares are of what the tier holds (13, more than the 8 slots),
    # so a may go on while b keeps at least its two thirds: to 6 of 16.
    replica.set_foreign_load({(POOL, "b"): (10, True)})
    assert len(list(core.dispatch_ready(0.1))) == 3
    # b no longer waits anywhere: a takes what is free.
    replica.set_foreign_load({(POOL, "b"): (10, False)})
    assert len(list(core.dispatch_ready(0.2))) == 2


def test_without_foreign_load_nothing_changes() -> None:
    core, replica = core_with(max_inflight=4)
    for _ in range(10):
        arrive(core, "a")
    assert len(list(core.dispatch_ready(0.0))) == 8
    replica.set_foreign_load({(POOL, "b"): (3, False)})  # b elsewhere, but not waiting
    assert core.holds[("", "global_share")] == 0


def test_local_load_and_booked_turns_are_what_others_need() -> None:
    core, replica = core_with()
    req = arrive(core, "a", prompt_tokens=400)
    arrive(core, "a", prompt_tokens=400)
    assert isinstance(req, QueuedRequest)
    (first, _) = core.dispatch_ready(0.0)
    assert replica.local_load() == {(POOL, "a"): (2, False)}
    booked = replica.take_booked()
    assert booked == {(POOL, "standard", "a"): 1.0}  # 2 x (400 + 100 estimated) / 1000
    core.on_completed(first.request, 400, 300, 0.0)  # 200 more than estimated
    assert replica.take_booked() == {(POOL, "standard", "a"): 0.2}
    assert replica.take_booked() == {}
    assert core.estimator.take_observations() == [("a", "/v1/chat/completions", "", 300)]


def test_service_elsewhere_is_charged_to_the_tenant_s_credit_here() -> None:
    core, replica = core_with(max_inflight=1)
    for _ in range(4):
        arrive(core, "a", prompt_tokens=400)
        arrive(core, "b", prompt_tokens=400)
    before = core.scheduler.deficit("standard", "b")
    replica.charge_foreign(POOL, "standard", "b", 3.0)
    assert core.scheduler.deficit("standard", "b") == before - 3.0
    replica.charge_foreign(POOL, "standard", "nobody", 1.0)  # never queued here: nothing
    replica.charge_foreign("other-pool", "standard", "b", 1.0)  # not a pool here: nothing
    assert core.scheduler.deficit("standard", "b") == before - 3.0


def test_the_global_share_binds_in_headroom_as_well() -> None:
    """Work-conserving headroom with no light tenant is ordinary capacity; a tenant over its
    share across replicas must not take it (3 replicas, 8 slots: the tenant sending through
    one replica got 0.60-0.66 of the engine that way)."""
    limits = GateLimits(max_inflight=4, headroom_slots=2, headroom_always=False)
    core = SchedulingCore(make_config(), gate_limits=limits)
    replica = Replica(core)
    for _ in range(10):
        arrive(core, "a")
    # b (weight 2) holds 10 elsewhere and waits there. It is starved once it holds less than
    # two thirds of what the tier holds, 10 < (a + 10) * 2/3, i.e. from a = 6; a then holds
    # at least its third and waits. The gates' open slots (2 + 2) are not the limit, and
    # without the rule in headroom a went on to the cap of 8.
    replica.set_foreign_load({(POOL, "b"): (10, True)})
    sent = list(core.dispatch_ready(0.0))
    assert len(sent) == 6
    # b no longer waits anywhere: a takes the rest of the headroom, up to the cap of 8.
    replica.set_foreign_load({(POOL, "b"): (10, False)})
    assert len(list(core.dispatch_ready(0.1))) == 2
