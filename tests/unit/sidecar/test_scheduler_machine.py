"""Stateful property test of the Scheduler under every registered fairness policy
(sidecar.plugins): accounting conserves
requests and tokens, cancel never loses or duplicates, and each tenant's requests leave in
(priority, deadline, arrival) order."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    precondition,
    rule,
)

from weighbridge.sidecar.plugins import registered
from weighbridge.sidecar.queues import QueueLimits
from weighbridge.sidecar.request import QueuedRequest, RequestState
from weighbridge.sidecar.scheduler import EndpointSpec, Scheduler, TenantSpec

TIERS = {"gold": 1, "silver": 2}
TENANTS = {
    "a": TenantSpec("gold", 1.0, QueueLimits(6, 4000)),
    "b": TenantSpec("gold", 2.0, QueueLimits(6)),
    "c": TenantSpec("silver", 0.5, QueueLimits(4)),
}
ENDPOINTS = {"/tok": EndpointSpec("tokens", 256), "/req": EndpointSpec("requests", 1)}


class SchedulerMachine(RuleBasedStateMachine):
    queued_ids = Bundle("queued_ids")

    def __init__(self) -> None:
        super().__init__()
        self.ids = itertools.count()
        self.clock = 0.0

    @initialize(
        policy=st.sampled_from(sorted(registered("fairness"))),
        demotion=st.booleans(),
        streamed=st.booleans(),
        shortest_first=st.booleans(),
    )
    def setup(self, policy: str, demotion: bool, streamed: bool, shortest_first: bool) -> None:
        self.s = Scheduler(
            TIERS,
            TENANTS,
            ENDPOINTS,
            policy=policy,
            repeat_demotion=demotion,
            charge_streamed_tokens=streamed,
            shortest_prompt_first=shortest_first,
        )
        self.queued: dict[str, QueuedRequest] = {}
        self.inflight: dict[str, QueuedRequest] = {}
        self.ended: set[str] = set()
        self.requeued: set[str] = set()
        self.arrived = 0
        self.rejected = 0

    @rule(
        target=queued_ids,
        tenant=st.sampled_from(sorted(TENANTS)),
        lower_tier=st.booleans(),
        endpoint=st.sampled_from(sorted(ENDPOINTS)),
        prompt=st.integers(0, 1500),
        output=st.integers(0, 600),
        priority=st.integers(-1, 2),
        deadline=st.one_of(st.none(), st.floats(0, 100)),
        user=st.one_of(st.none(), st.sampled_from(["u1", "u2"])),
    )
    def enqueue(self, tenant, lower_tier, endpoint, prompt, output, priority, deadline, user):
        self.clock += 0.25
        tier = "silver" if lower_tier else TENANTS[tenant].tier
        request = QueuedRequest(
            id=f"r{next(self.ids)}",
            tenant=tenant,
            tier=tier,
            endpoint=endpoint,
            prompt_tokens=prompt,
            max_tokens=output,
            estimated_output_tokens=output,
            arrival_s=self.clock,
            user=user,
            priority=priority,
            deadline_s=deadline,
        )
        self.arrived += 1
        if self.s.enqueue(request, self.clock) is None:
            self.queued[request.id] = request
        else:
            self.rejected += 1
            assert request.state is RequestState.NEW
        return request.id

    def _check_choice(self, request: QueuedRequest) -> None:
        assert request.id in self.queued, "dispatched something not queued (or twice)"
        if not self.s.uses_headroom:  # one FIFO: no choice among tenants
            assert request.seq == min(r.seq for r in self.queued.values())
        else:
            mine = [
                r for r in self.queued.values()
                if r.tenant == request.tenant and r.tier == request.tier
            ]
            assert request.order_key() == min(r.order_key() for r in mine)
            # strict tiers: nothing queued in a better tier
            rank = TIERS[request.tier]
            assert not any(TIERS[r.tier] < rank for r in self.queued.values())
        del self.queued[request.id]
        self.inflight[request.id] = request
        assert request.state is RequestState.DISPATCHED

    @rule()
    def next_any(self) -> None:
        request = self.s.next(self.clock)
        if request is None:
            assert not self.queued
        else:
            self._check_choice(request)

    @rule(blocked=st.sampled_from(sorted(TENANTS)))
    def next_with_eligibility(self, blocked: str) -> None:
        if not self.s.uses_headroom:
            return
        request = self.s.next(self.clock, lambda t: t != blocked)
        if request is None:
            assert all(r.tenant == blocked for r in self.queued.values())
        else:
            assert request.tenant != blocked
            mine = [
                r for r in self.queued.values()
                if r.tenant == request.tenant and r.tier == request.tier
            ]
            assert request.order_key() == min(r.order_key() for r in mine)
            del self.queued[request.id]
            self.inflight[request.id] = request

    @rule(request_id=consumes(queued_ids))
    def cancel(self, request_id: str) -> None:
        got = self.s.cancel(request_id)
        if request_id in self.queued:
            assert got is self.queued.pop(request_id)
            assert got.state is RequestState.ENDED
            self.ended.add(request_id)
        else:
            assert got is None

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), prompt=st.integers(0, 2000), output=st.integers(0, 2000))
    def finish(self, data, prompt: int, output: int) -> None:
        request_id = data.draw(st.sampled_from(sorted(self.inflight)))
        request = self.inflight.pop(request_id)
        self.s.on_finished(request, prompt, output)
        self.ended.add(request_id)
        with pytest.raises(ValueError):
            self.s.on_finished(request, prompt, output)

    @precondition(lambda self: self.inflight)
    @rule(data=st.data(), tokens=st.integers(0, 400))
    def stream(self, data, tokens: int) -> None:
        request = self.inflight[data.draw(st.sampled_from(sorted(self.inflight)))]
        charged = request.charged
        self.s.on_tokens_streamed(request, tokens)
        assert request.charged >= charged

    @precondition(lambda self: self.inflight)
    @rule(data=st.data())
    def requeue(self, data) -> None:
        request = self.inflight.pop(data.draw(st.sampled_from(sorted(self.inflight))))
        self.s.requeue(request)
        self.queued[request.id] = request
        self.requeued.add(request.id)

    @invariant()
    def conservation(self) -> None:
        if not hasattr(self, "s"):
            return
        s = self.s
        # requests: every arrival is rejected, queued, in flight or ended, exactly once
        assert self.arrived == self.rejected + len(self.queued) + len(self.inflight) + len(
            self.ended
        )
        assert not (set(self.queued) & set(self.inflight))
        assert s.queued_requests == len(self.queued)
        assert s.inflight_requests == len(self.inflight)
        # tokens: the aggregates equal the sums over what is actually queued
        assert s.queued_tokens == sum(r.estimated_tokens for r in self.queued.values())
        for tier in TIERS:
            mine = [r for r in self.queued.values() if r.tier == tier]
            assert s.tier_queued(tier) == (len(mine), sum(r.estimated_tokens for r in mine))
        for tenant in TENANTS:
            mine = [r for r in self.queued.values() if r.tenant == tenant]
            assert s.tenant_queued(tenant) == (
                len(mine),
                sum(r.estimated_tokens for r in mine),
            )
            # requeue bypasses the bound (the request was admitted already)
            fresh = [r for r in mine if r.id not in self.requeued]
            assert len(fresh) <= TENANTS[tenant].limits.max_queued
            assert s.tenant_inflight(tenant) == sum(
                1 for r in self.inflight.values() if r.tenant == tenant
            )
        snap = s.snapshot(max_tenants=None)
        active = {r.tenant for r in (*self.queued.values(), *self.inflight.values())}
        assert snap["active_tenants"] == len(active)
        weight = sum(
            TENANTS[t].weight if registered("fairness")[s.policy].weighted else 1.0
            for t in active
        )
        assert snap["active_weight"] == pytest.approx(weight)
        for tier, view in snap["tiers"].items():
            backlogged = {r.tenant for r in self.queued.values() if r.tier == tier}
            assert view["backlogged_tenants"] == len(backlogged)


SchedulerMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
