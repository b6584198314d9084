"""Every registered fairness policy and ordering (sidecar.plugins), as the scheduler and the
configuration use them: coherent traits, loaded by name, a positive service per request,
and, through the Scheduler, the choice its traits promise. The flow-level bounds are
tests/unit/sidecar/test_drr_properties.py's, over the same policies; the Scheduler's state
machine (test_scheduler_machine.py) runs every one too."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.sidecar.builders import make_request
from weighbridge.sidecar.config import Backend, Config
from weighbridge.sidecar.plugins import registered
from weighbridge.sidecar.queues import QueueLimits
from weighbridge.sidecar.scheduler import EndpointSpec, Scheduler, TenantSpec

POLICIES = sorted(registered("fairness"))
ORDERINGS = sorted(registered("ordering"))
TIERS = {"gold": 1, "silver": 2}
TENANTS = {"a": TenantSpec("gold", 1.0, QueueLimits(1000)),
           "b": TenantSpec("gold", 3.0, QueueLimits(1000)),
           "c": TenantSpec("silver", 1.0, QueueLimits(1000))}
ENDPOINTS = {"/v1/completions": EndpointSpec("tokens", 256)}


def scheduler(policy: str, ordering: str = "fifo") -> Scheduler:
    return Scheduler(TIERS, TENANTS, ENDPOINTS, policy=policy, ordering=ordering)


@pytest.mark.parametrize("policy", POLICIES)
def test_its_traits_are_coherent_and_documented(policy: str) -> None:
    part = registered("fairness")[policy]
    assert part.name == policy and (part.__doc__ or "").strip()
    # One that forwards at once cannot choose a tenant; one that does not choose a tenant
    # neither weighs tenants nor settles token charges.
    assert part.holds_requests or not part.per_tenant
    assert part.per_tenant or not (part.weighted or part.costs_tokens)


@pytest.mark.parametrize("policy", POLICIES)
def test_the_configuration_names_it(policy: str) -> None:
    config = Config.model_validate({"backends": [Backend(url="http://h:1")],
                                    "scheduler": {"policy": policy}})
    assert config.scheduler.policy == policy
    assert Scheduler.from_config(config).policy == policy


@pytest.mark.parametrize("policy", POLICIES)
@given(cost=st.integers(1, 100_000), quantum=st.integers(1, 65_536))
def test_a_request_costs_a_positive_finite_service(policy: str, cost: int,
                                                   quantum: int) -> None:
    service = registered("fairness")[policy].service(cost, quantum)
    assert service > 0 and math.isfinite(service)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=60, deadline=None)
@given(arrivals=st.lists(st.tuples(st.sampled_from(sorted(TENANTS)), st.integers(1, 2000)),
                         min_size=1, max_size=40),
       blocked=st.sampled_from(sorted(TENANTS)))
def test_the_choice_keeps_its_promises(policy: str, arrivals: list[tuple[str, int]],
                                       blocked: str) -> None:
    """Every request queued leaves exactly once; a tenant-choosing policy serves the better
    tier first, never a tenant ``eligible`` refuses while another has work, and each
    tenant's requests in its own order; the others serve in arrival order."""
    s = scheduler(policy)
    for k, (tenant, prompt) in enumerate(arrivals):
        request = make_request(tenant, TENANTS[tenant].tier, endpoint="/v1/completions",
                               prompt=prompt, arrival=k * 0.01)
        assert s.enqueue(request, k * 0.01) is None
    queued = {r.id: r for t in TENANTS for r in s.queued_of(t)}
    served = []
    while queued:
        eligible = (lambda t: t != blocked) if s.uses_headroom else None
        request = s.next(1.0, eligible)
        if request is None:
            assert s.uses_headroom and all(r.tenant == blocked for r in queued.values())
            request = s.next(1.0)
            assert request is not None and request.tenant == blocked
        elif s.uses_headroom:
            better = [r for r in queued.values() if TIERS[r.tier] < TIERS[request.tier]
                      and r.tenant != blocked]
            assert not better, "a better tier's eligible request waited"
            mine = [r for r in queued.values() if r.tenant == request.tenant
                    and r.tier == request.tier]
            assert request.order_key() == min(r.order_key() for r in mine)
        else:
            assert request.seq == min(r.seq for r in queued.values())
        del queued[request.id]
        served.append(request)
        s.on_finished(request, request.prompt_tokens, 10)
    assert len({r.id for r in served}) == len(arrivals)
    assert s.queued_requests == s.inflight_requests == 0


@pytest.mark.parametrize("policy", [p for p in POLICIES if registered("fairness")[p].weighted])
def test_a_weighted_policy_serves_backlogged_tenants_by_weight(policy: str) -> None:
    """Two tenants backlogged with equal requests: over many decisions each is served in
    proportion to its weight (b weighs 3, a 1), within one request either way."""
    s = scheduler(policy)
    for k in range(400):
        for tenant in ("a", "b"):
            s.enqueue(make_request(tenant, "gold", endpoint="/v1/completions", prompt=256,
                                   output=0, arrival=k), k)
    counts = {"a": 0, "b": 0}
    for _ in range(200):
        request = s.next(500.0)
        assert request is not None
        counts[request.tenant] += 1
        s.on_finished(request, 256, 0)
    assert abs(counts["b"] - 3 * counts["a"]) <= 4


@pytest.mark.parametrize("ordering", ORDERINGS)
@given(prompts=st.lists(st.integers(1, 4000), min_size=1, max_size=20),
       priorities=st.lists(st.integers(-1, 1), min_size=20, max_size=20))
def test_an_ordering_ranks_after_priority(ordering: str, prompts: list[int],
                                          priorities: list[int]) -> None:
    """Whatever the ordering, a tenant's more urgent requests (lower priority) leave first."""
    part = registered("ordering")[ordering]
    assert part.name == ordering and (part.__doc__ or "").strip()
    s = scheduler("drr", ordering)
    for k, prompt in enumerate(prompts):
        s.enqueue(make_request("a", "gold", endpoint="/v1/completions", prompt=prompt,
                               priority=priorities[k], arrival=0.0), 0.0)
    order = []
    while (request := s.next(1.0)) is not None:
        order.append(request.priority)
    assert order == sorted(order)
