"""Each rule of sidecar.eligibility alone: what it does to a backend's standing, or whom it
lets dispatch, given the state it reads. (How the core composes them is what the core's
property tests and the virtual-time fairness and saturation simulations check.)"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from weighbridge.sidecar.admission import AdmissionGate, GateLimits, GateVerdict
from weighbridge.sidecar.eligibility import (
    BACKEND_RULES,
    HEADROOM_RULES,
    OPEN_RULES,
    BackendState,
    DecodeFloor,
    DecodeFloorShare,
    GlobalShare,
    KvReserve,
    KvWatermark,
    Pacing,
    Pass,
    PrefillBacklog,
    PrefillBacklogShare,
    SlotHeadroom,
    Standing,
    eligible,
    refine,
)
from weighbridge.sidecar.kv import KvFootprint
from weighbridge.sidecar.plugins import registered

OPEN = GateVerdict("open", "", 8)
OPEN_STANDING = Standing("b", OPEN)


@dataclass
class Shares:
    """The scheduler's answers the tenant rules read: a share fraction, whether a tenant is
    under its share of the slots, and its queued requests."""

    fraction: dict[str, float] = field(default_factory=dict)
    under: set[str] = field(default_factory=set)
    queued: dict[str, int] = field(default_factory=dict)
    uses_headroom: bool = True

    def share_fraction(self, tenant: str) -> float:
        return self.fraction.get(tenant, 1.0)

    def under_share(self, tenant: str, slots: float) -> bool:
        return tenant in self.under

    def tenant_queued(self, tenant: str) -> tuple[int, int]:
        return self.queued.get(tenant, 0), 0


def gate(inflight: int = 0, **limits: Any) -> AdmissionGate:
    g = AdmissionGate(GateLimits(**limits))
    for _ in range(inflight):
        g.on_dispatched(0.0)
    return g


def state(g: AdmissionGate, prefill_tokens: int = 0, kv: KvFootprint | None = None,
          tenant_aware: bool = True) -> BackendState:
    return BackendState(g, prefill_tokens, kv or KvFootprint(), tenant_aware)


def a_pass(standing: Standing = OPEN_STANDING, shares: Shares | None = None,
           **fields: Any) -> Pass:
    p = Pass(standing, shares or Shares(), 8, KvFootprint(), None, {}, frozenset(), True, 0,
             None)
    return replace(p, **fields)  # type: ignore[arg-type]


# -- backend rules -----------------------------------------------------------------------------

def test_prefill_backlog_makes_a_gate_with_enough_prompts_waiting_headroom() -> None:
    rule = PrefillBacklog()
    g = gate(inflight=1, max_backend_prefill_tokens=100)
    assert rule(Standing("b", OPEN), state(g, 100)).verdict == GateVerdict(
        "headroom", "prefill_backlog", 8)
    assert rule(Standing("b", OPEN), state(g, 99)).verdict == OPEN
    # The FIFO baselines cannot choose a tenant: for them the gate closes.
    assert rule(Standing("b", OPEN), state(g, 100, tenant_aware=False)).verdict == \
        GateVerdict("closed", "prefill_backlog", 8)
    # Nothing in flight there: the backlog is what the sidecar alone would send.
    assert rule(Standing("b", OPEN), state(gate(max_backend_prefill_tokens=100), 500)
                ).verdict == OPEN


def test_decode_floor_turns_a_slow_engine_into_headroom_for_tenant_aware_policies() -> None:
    slow = Standing("b", GateVerdict("closed", "decode_slow", 4))
    assert DecodeFloor()(slow, state(gate())).verdict == GateVerdict("headroom", "decode_slow", 4)
    assert DecodeFloor()(slow, state(gate(), tenant_aware=False)) == slow


def test_the_kv_watermark_makes_an_open_gate_headroom_and_marks_it_tight() -> None:
    kv = KvFootprint(block_size=16)
    kv.add("r", "t", 16 * 9, 0)  # 9 blocks
    g = gate(kv_blocks=10, kv_reserve_blocks=1)  # watermark 9
    standing = KvWatermark()(Standing("b", OPEN), state(g, kv=kv))
    assert standing == Standing("b", GateVerdict("headroom", "kv_headroom", 8), kv_tight=True)
    kv.remove("r")
    assert KvWatermark()(Standing("b", OPEN), state(g, kv=kv)) == Standing("b", OPEN)


def test_backend_rules_run_in_order() -> None:
    assert [type(r) for r in BACKEND_RULES] == [PrefillBacklog, DecodeFloor, KvWatermark]
    g = gate(inflight=1, max_backend_prefill_tokens=10)
    assert refine(OPEN, "b", state(g, 10)).verdict.reason == "prefill_backlog"


# -- tenant rules ------------------------------------------------------------------------------

def test_at_the_prefill_backlog_only_a_light_tenant_with_none_in_it_may_add_one() -> None:
    backlog = Standing("b", GateVerdict("headroom", "prefill_backlog", 8))
    shares = Shares(under={"victim", "flood", "crowd"}, queued={"victim": 1, "crowd": 5})
    allowed = PrefillBacklogShare()(a_pass(backlog, shares, prefilling={"flood": 3000}))
    assert allowed is not None and allowed("victim")
    assert not allowed("flood")  # it built the backlog
    assert not allowed("crowd")  # backlogged upstream: it would pile on
    assert not allowed("over")  # over its share of the slots
    lit = PrefillBacklogShare()(a_pass(backlog, shares, light=frozenset({"crowd"})))
    assert lit is not None and lit("crowd")  # light lately, however many just arrived
    assert PrefillBacklogShare()(a_pass()) is None  # no backlog: no restriction


def test_pacing_holds_a_tenant_with_its_prefill_budget_in_flight() -> None:
    allowed = Pacing()(a_pass(prefill_cap=100, prefilling={"flood": 100, "light": 99}))
    assert allowed is not None and not allowed("flood") and allowed("light")
    assert allowed("new")
    assert Pacing()(a_pass()) is None  # no cap configured
    assert Pacing()(a_pass(prefill_cap=100, shares=Shares(uses_headroom=False))) is None


def test_the_global_share_is_the_replicas_predicate() -> None:
    def fair(tenant: str) -> bool:
        return tenant == "starved"

    assert GlobalShare()(a_pass(globally_fair=fair)) is fair
    assert GlobalShare()(a_pass()) is None


def test_below_the_decode_floor_only_under_share_tenants_beside_others_start() -> None:
    slow = Standing("b", GateVerdict("headroom", "decode_slow", 8))
    shares = Shares(fraction={"alone": 1.0, "victim": 0.5, "flood": 0.5}, under={"victim",
                                                                                   "alone"})
    allowed = DecodeFloorShare()(a_pass(slow, shares))
    assert allowed is not None
    assert allowed("victim") and not allowed("flood") and not allowed("alone")
    assert DecodeFloorShare()(a_pass(shares=shares)) is None


@pytest.mark.parametrize(("always", "light", "expected"), [
    (True, frozenset(), {"under": True, "over": False}),
    # Work-conserving: with a light tenant about, it keeps the headroom from over-share ones
    (False, frozenset({"light"}), {"under": True, "over": False, "light": True}),
    # ... and with none, the headroom is ordinary capacity.
    (False, frozenset(), None),
])
def test_slot_headroom_is_for_under_share_tenants(always: bool, light: frozenset[str],
                                                  expected: dict[str, bool] | None) -> None:
    standing = Standing("b", GateVerdict("headroom", "headroom", 8))
    shares = Shares(under={"under"})
    allowed = SlotHeadroom()(a_pass(standing, shares, headroom_always=always, light=light))
    if expected is None:
        assert allowed is None
    else:
        assert allowed is not None
        assert {t: allowed(t) for t in expected} == expected


def test_the_kv_reserve_is_for_light_tenants_under_their_share_of_the_watermark() -> None:
    kv = KvFootprint(block_size=1)
    kv.add("a", "big", 50, 0)
    kv.add("b", "small", 10, 0)
    tight = Standing("b", GateVerdict("headroom", "kv_headroom", 8), kv_tight=True)
    shares = Shares(fraction={"big": 0.5, "small": 0.5, "backlogged": 0.5},
                    queued={"big": 1, "small": 1, "backlogged": 5})
    allowed = KvReserve()(a_pass(tight, shares, kv=kv, kv_watermark=100))
    assert allowed is not None
    assert allowed("small")  # under its 50 blocks, one request queued
    assert not allowed("big")  # at its share of the watermark
    assert not allowed("backlogged")  # backlogged upstream and not light
    lit = KvReserve()(a_pass(tight, shares, kv=kv, kv_watermark=100,
                             light=frozenset({"backlogged"})))
    assert lit is not None and lit("backlogged")
    assert KvReserve()(a_pass(shares=shares)) is None  # not at the watermark


def test_rules_compose_as_all_of_them() -> None:
    assert [type(r) for r in OPEN_RULES] == [Pacing, GlobalShare]
    assert [type(r) for r in HEADROOM_RULES] == [PrefillBacklogShare, DecodeFloorShare,
                                                 SlotHeadroom, KvReserve, Pacing, GlobalShare]
    assert eligible(OPEN_RULES, a_pass()) is None
    allowed = eligible(OPEN_RULES, a_pass(prefill_cap=10, prefilling={"x": 10},
                                          globally_fair=lambda t: t != "y"))
    assert allowed is not None
    assert [allowed(t) for t in ("x", "y", "z")] == [False, False, True]


def test_every_registered_rule_is_composed_and_every_composed_rule_registered() -> None:
    """A rule is one class and one registration (sidecar.plugins), placed in the list that
    orders it: none registered and left out, none composed unregistered."""
    assert {type(r) for r in BACKEND_RULES} == set(registered("backend_rule").values())
    assert {type(r) for r in (*OPEN_RULES, *HEADROOM_RULES)} == \
        set(registered("tenant_rule").values())
    for part in (*registered("backend_rule").values(), *registered("tenant_rule").values()):
        assert (part.__doc__ or "").strip(), part  # its docstring is its reason
