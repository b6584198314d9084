"""Work conservation at any fleet size (issue 38): if a backend's gate is open and has room,
and some queued request's tenant is eligible there under the tenant rules, a dispatch
happens. A tenant rule may hold a tenant back only for what that tenant has on that backend,
or for a fleet-wide share stated as such.

Two properties over 1-16 backends and random arrivals, first tokens and ends, each checked
once ``dispatch_ready`` has nothing more to give:

* against a model of the rules written here from their documentation (prefill pacing per
  backend, the prefill backlog, the in-flight cap), with no help from the core's internals;
* against the core's own verdicts with every rule live (headroom, light tenants, KV
  watermark): no backend the backend rules leave open or in headroom lets in a tenant with
  work queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.config import Config, parse_config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.eligibility import HEADROOM_RULES, OPEN_RULES
from weighbridge.sidecar.request import QueuedRequest

CHAT = "/v1/chat/completions"
TENANTS = ("t0", "t1", "t2", "t3", "t4")


def fleet_config(backends: int, policy: str = "drr") -> Config:
    return parse_config({
        "tiers": {"standard": {"rank": 1}},
        "tenants": {name: {"tier": "standard", "weight": 1 + i % 3,
                           "api_keys": [f"plain:k-{name}"],
                           "limits": {"max_queued": 10_000}}
                    for i, name in enumerate(TENANTS)},
        "endpoints": {CHAT: {"cost": "tokens", "quantum": 1024,
                             "initial_output_estimate": 50}},
        "backends": [{"url": f"http://127.0.0.1:{9000 + i}", "name": f"b{i}"}
                     for i in range(backends)],
        "scheduler": {"policy": policy},
    })


# One event of the fleet: a tenant's arrival with its prompt, a first token or an end of
# the k-th request in flight (modulo how many there are), or a step of the clock.
EVENTS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from(TENANTS), st.integers(1, 3000)),
        st.tuples(st.sampled_from(["first_token", "end"]), st.just(""),
                  st.integers(0, 10**6)),
        st.tuples(st.just("tick"), st.just(""), st.integers(1, 20_000)),
    ),
    min_size=1, max_size=120,
)


@dataclass
class Fleet:
    """What the test itself knows of the requests: where each went and whether its first
    token came back."""

    core: SchedulingCore
    now: float = 0.0
    queued: dict[str, QueuedRequest] = field(default_factory=dict)
    inflight: list[QueuedRequest] = field(default_factory=list)
    prefilled: set[str] = field(default_factory=set)
    sent: int = 0

    def apply(self, kind: str, tenant: str, value: int) -> list[Any]:
        """Apply one event, then dispatch all the core will; returns the dispatches."""
        self.event(kind, tenant, value)
        return self.dispatch()

    def event(self, kind: str, tenant: str, value: int) -> None:
        core = self.core
        if kind == "arrive":
            result = core.arrive(request_id=f"r{self.sent}", tenant=tenant, tier="standard",
                                 endpoint=CHAT, prompt_tokens=value, max_tokens=100,
                                 now=self.now)
            self.sent += 1
            if isinstance(result, QueuedRequest):
                self.queued[result.id] = result
        elif kind == "first_token" and self.inflight:
            request = self.inflight[value % len(self.inflight)]
            core.on_first_token(request, self.now)
            self.prefilled.add(request.id)
        elif kind == "end" and self.inflight:
            request = self.inflight.pop(value % len(self.inflight))
            core.on_completed(request, request.prompt_tokens, 10, self.now)
        elif kind == "tick":
            self.now += value / 1000

    def dispatch(self) -> list[Any]:
        dispatches = list(self.core.dispatch_ready(self.now))
        for d in dispatches:
            self.queued.pop(d.request.id)
            self.inflight.append(d.request)
        return dispatches

    def prefilling(self, backend: str, tenant: str | None = None) -> int:
        return sum(r.prompt_tokens for r in self.inflight
                   if r.backend == backend and r.id not in self.prefilled
                   and (tenant is None or r.tenant == tenant))

    def on(self, backend: str) -> int:
        return sum(1 for r in self.inflight if r.backend == backend)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(backends=st.integers(1, 16), cap=st.integers(1, 8), pacing=st.integers(1, 4000),
       backlog=st.one_of(st.none(), st.integers(1, 8000)), events=EVENTS)
def test_no_open_backend_idles_while_a_tenant_it_would_take_waits(
        backends: int, cap: int, pacing: int, backlog: int | None,
        events: list[tuple[str, str, int]]) -> None:
    """The model: a backend with fewer than ``cap`` in flight, and (with a backlog limit and
    something in flight) fewer than ``backlog`` prompt tokens prefilling, takes the next
    request of any tenant with fewer than ``pacing`` prompt tokens prefilling *on it*. After
    every event, no such backend and queued tenant remain; and no dispatch ever found its
    tenant at the pacing cap on its backend, or its backend full, or at the backlog with a
    prompt of the tenant's own in it (there a tenant under its share with none may add one:
    which is the core's share arithmetic, checked by the next property)."""
    limits = GateLimits(max_inflight=cap, max_prefill_tokens_inflight=pacing,
                        max_backend_prefill_tokens=backlog)
    fleet = Fleet(SchedulingCore(fleet_config(backends), gate_limits=limits))
    names = [f"b{i}" for i in range(backends)]
    for kind, tenant, value in events:
        fleet.event(kind, tenant, value)
        # Replay the dispatches one at a time against the model's state before each.
        before = Fleet(fleet.core, fleet.now, dict(fleet.queued), list(fleet.inflight),
                       set(fleet.prefilled), fleet.sent)
        for d in fleet.dispatch():
            own = before.prefilling(d.backend, d.request.tenant)
            assert takes(before, d.backend, cap, backlog) or (
                before.on(d.backend) < cap and own == 0)
            assert own < pacing
            before.queued.pop(d.request.id)
            before.inflight.append(d.request)
        waiting = {r.tenant for r in fleet.queued.values()}
        for backend in names:
            if takes(fleet, backend, cap, backlog):
                assert all(fleet.prefilling(backend, t) >= pacing for t in waiting), (
                    backend, {t: fleet.prefilling(backend, t) for t in waiting})


def takes(fleet: Fleet, backend: str, cap: int, backlog: int | None) -> bool:
    """The model's gate: room for one more in flight, and prefill backlog below its limit
    (an idle backend always takes one)."""
    return fleet.on(backend) < cap and (
        backlog is None or fleet.on(backend) == 0 or fleet.prefilling(backend) < backlog)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(backends=st.integers(1, 16), policy=st.sampled_from(["drr", "rr"]),
       cap=st.integers(2, 8), headroom=st.integers(0, 1), always=st.booleans(),
       kv_blocks=st.one_of(st.none(), st.integers(40, 400)), pacing=st.integers(1, 4000),
       backlog=st.one_of(st.none(), st.integers(1, 8000)), events=EVENTS)
def test_every_rule_live_no_backend_admitting_a_waiting_tenant_is_left(
        backends: int, policy: str, cap: int, headroom: int, always: bool,
        kv_blocks: int | None, pacing: int, backlog: int | None,
        events: list[tuple[str, str, int]]) -> None:
    """With headroom (kept always, or only for light tenants), the KV watermark, pacing and
    the prefill backlog live: once ``dispatch_ready`` stops, every backend the backend rules
    leave open lets in none of the tenants with work queued, and neither does any backend
    in headroom."""
    limits = GateLimits(max_inflight=cap, headroom_slots=headroom, headroom_always=always,
                        kv_blocks=kv_blocks, kv_reserve_blocks=0 if kv_blocks is None else 8,
                        max_prefill_tokens_inflight=pacing, max_backend_prefill_tokens=backlog)
    core = SchedulingCore(fleet_config(backends, policy), gate_limits=limits)
    fleet = Fleet(core)
    for kind, tenant, value in events:
        fleet.apply(kind, tenant, value)
        waiting = {r.tenant for r in fleet.queued.values()}
        if not waiting:
            continue
        core.fold_streamed()
        for pool in core.pools():
            standings = core._cycle._standings(pool, fleet.now)
            slots = sum(s.verdict.share_slots for s in standings.values())
            fair = core._cycle._globally_fair(pool, slots)
            for mode, rules in (("open", OPEN_RULES), ("headroom", HEADROOM_RULES)):
                names = [n for n, s in standings.items() if s.verdict.mode == mode]
                verdicts = core._cycle._verdicts(pool, names, rules, standings, slots, fair,
                                          fleet.now)
                for backend, allowed in verdicts.items():
                    let_in = {t for t in waiting if allowed is None or allowed(t)}
                    assert not let_in, (mode, backend, let_in)


def test_a_lone_flood_fills_every_backend_of_a_fleet() -> None:
    """Issue 38's flood: one tenant's long prompts on 8 backends, paced at one step budget
    each, keep all 8 prefilling a budget, where a fleet-wide count gave the fleet one."""
    limits = GateLimits(max_inflight=16, max_prefill_tokens_inflight=2048)
    fleet = Fleet(SchedulingCore(fleet_config(8), gate_limits=limits))
    for _ in range(100):
        fleet.apply("arrive", "t0", 1000)
    assert sorted({r.backend for r in fleet.inflight}) == [f"b{i}" for i in range(8)]
    assert all(fleet.prefilling(f"b{i}", "t0") == 3000 for i in range(8))
    assert len(fleet.queued) == 100 - 3 * 8
