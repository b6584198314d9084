"""Scheduler: the selector chain (tier -> DRR -> tenant order), policies, accounting."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.sidecar.builders import make_request
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.queues import QueueLimits
from weighbridge.sidecar.rejection import QUEUE_FULL
from weighbridge.sidecar.request import RequestState
from weighbridge.sidecar.scheduler import EndpointSpec, Scheduler, TenantSpec

TIERS = {"interactive": 1, "standard": 2, "batch": 3}
CHAT = "/v1/chat/completions"


def scheduler(policy="drr", tenants=None, **kwargs) -> Scheduler:
    tenants = tenants or {
        "a": TenantSpec("standard"),
        "b": TenantSpec("standard"),
        "i": TenantSpec("interactive"),
        "z": TenantSpec("batch"),
    }
    endpoints = {CHAT: EndpointSpec("tokens", 1000), "/v1/embeddings": EndpointSpec("requests", 1)}
    return Scheduler(TIERS, tenants, endpoints, policy=policy, **kwargs)


def drain(s: Scheduler, now: float = 0.0) -> list[str]:
    out = []
    while (r := s.next(now)) is not None:
        out.append(r.id)
    return out


def test_tiers_are_strict_by_rank() -> None:
    s = scheduler()
    s.enqueue(make_request("z", "batch", id="batch1"), 0)
    s.enqueue(make_request("a", "standard", id="std1"), 0)
    s.enqueue(make_request("i", "interactive", id="int1"), 0)
    assert drain(s) == ["int1", "std1", "batch1"]


def test_a_tenant_may_send_in_a_lower_tier_and_is_scheduled_there() -> None:
    s = scheduler()
    s.enqueue(make_request("i", "batch", id="low"), 0)
    s.enqueue(make_request("a", "standard", id="std"), 0)
    assert drain(s) == ["std", "low"]


def test_anti_starvation_weight_gives_lower_tiers_a_share() -> None:
    s = scheduler(anti_starvation_weight=0.25)
    for k in range(40):
        s.enqueue(make_request("i", "interactive", id=f"i{k}"), 0)
        s.enqueue(make_request("a", "standard", id=f"s{k}"), 0)
    first = [s.next(0).tier for _ in range(40)]
    assert first.count("standard") == 10  # exactly a quarter, deterministically
    assert first[:4] == ["interactive"] * 3 + ["standard"]


def test_tenant_order_is_priority_then_deadline_then_arrival() -> None:
    s = scheduler()
    s.enqueue(make_request("a", arrival=1, id="late-arrival"), 1)
    s.enqueue(make_request("a", arrival=2, id="deadline-far", deadline_s=50), 2)
    s.enqueue(make_request("a", arrival=3, id="deadline-near", deadline_s=10), 3)
    s.enqueue(make_request("a", arrival=4, id="urgent", priority=-1), 4)
    s.enqueue(make_request("a", arrival=0.5, id="low", priority=3), 5)
    s.enqueue(make_request("a", arrival=0.0, id="early-arrival"), 6)
    assert drain(s) == [
        "urgent",
        "deadline-near",
        "deadline-far",
        "early-arrival",
        "late-arrival",
        "low",
    ]


def test_shortest_prompt_first_orders_a_tenants_requests_by_prompt_after_priority() -> None:
    # Arrivals 10 ms apart: well within the aging bound (spf_delay_s), so prompt size rules.
    def order(**kwargs: bool) -> list[str]:
        s = scheduler(**kwargs)
        s.enqueue(make_request("a", arrival=0, prompt=900, id="long"), 0)
        s.enqueue(make_request("a", arrival=0.01, prompt=50, id="short"), 0.01)
        s.enqueue(make_request("a", arrival=0.02, prompt=300, id="medium"), 0.02)
        s.enqueue(make_request("a", arrival=0.03, prompt=2000, id="urgent", priority=-1), 0.03)
        s.enqueue(make_request("a", arrival=0.04, prompt=50, id="short-later"), 0.04)
        return drain(s)

    assert order() == ["urgent", "long", "short", "medium", "short-later"]
    assert order(shortest_prompt_first=True) == ["urgent", "short", "short-later", "medium",
                                                 "long"]


@settings(max_examples=100, deadline=None)
@given(prompts=st.lists(st.integers(1, 4000), min_size=1, max_size=30))
def test_shortest_prompt_first_drains_a_backlog_in_prompt_order(prompts: list[int]) -> None:
    # Queued at one instant: aging (tests/unit/sidecar/test_spf_aging.py) changes nothing.
    s = scheduler(shortest_prompt_first=True)
    for k, prompt in enumerate(prompts):
        s.enqueue(make_request("a", arrival=0, prompt=prompt, id=f"r{k}"), 0)
    drained = drain(s, 100.0)
    assert drained == [f"r{k}" for k in sorted(range(len(prompts)),
                                                key=lambda k: (prompts[k], k))]


def test_repeat_demotion_orders_a_users_second_and_third_requests_later() -> None:
    s = scheduler(repeat_demotion=True)
    for k in range(3):
        s.enqueue(make_request("a", arrival=k, id=f"u{k}", user="alice"), k)
    s.enqueue(make_request("a", arrival=5, id="bob", user="bob"), 5)
    assert [s.queued(f"u{k}").demotion for k in range(3)] == [0, 1, 2]
    assert drain(s) == ["u0", "bob", "u1", "u2"]


def test_repeat_demotion_counts_in_flight_requests_and_forgets_ended_ones() -> None:
    s = scheduler(repeat_demotion=True)
    s.enqueue(make_request("a", id="first", user="u"), 0)
    first = s.next(0)
    s.enqueue(make_request("a", id="second", user="u"), 0)
    assert s.queued("second").demotion == 1
    s.on_finished(first, 100, 20)
    s.next(0)
    s.enqueue(make_request("a", id="third", user="u"), 0)
    assert s.queued("third").demotion == 1  # only "second" is still active


def test_queue_bounds_reject_with_queue_full() -> None:
    tenants = {"a": TenantSpec("standard", limits=QueueLimits(2, 500))}
    s = scheduler(tenants=tenants)
    assert s.enqueue(make_request("a", prompt=1000, output=0), 0) is None  # empty queue: ok
    rejected = s.enqueue(make_request("a", prompt=10, output=0), 0)
    assert rejected is not None and rejected.reason == QUEUE_FULL  # tokens
    s.next(0)
    assert s.enqueue(make_request("a", prompt=100), 0) is None
    assert s.enqueue(make_request("a", prompt=100), 0) is None
    rejected = s.enqueue(make_request("a", prompt=1), 0)
    assert rejected is not None and rejected.reason == QUEUE_FULL  # count
    assert s.tenant_queued("a") == (2, 240)


def test_cancel_leaves_at_once_and_exactly() -> None:
    s = scheduler()
    reqs = [make_request("a", id=f"c{k}") for k in range(3)]
    for r in reqs:
        s.enqueue(r, 0)
    assert s.cancel("c1") is reqs[1]
    assert reqs[1].state is RequestState.ENDED
    assert s.cancel("c1") is None  # not twice
    assert s.queued_requests == 2 and s.queued_tokens == 240
    assert drain(s) == ["c0", "c2"]
    assert s.cancel("c0") is None  # dispatched: not the queue's business any more


def test_cancelling_the_last_request_takes_the_tenant_out_of_the_ring() -> None:
    s = scheduler()
    s.enqueue(make_request("a", id="a1"), 0)
    s.enqueue(make_request("b", id="b1"), 0)
    s.cancel("a1")
    assert s.snapshot()["tiers"]["standard"]["backlogged_tenants"] == 1
    assert drain(s) == ["b1"]


def test_fcfs_is_one_fifo_ignoring_tiers_tenants_and_priority() -> None:
    s = scheduler("fcfs")
    s.enqueue(make_request("z", "batch", id="1"), 0)
    s.enqueue(make_request("i", "interactive", id="2", priority=-5), 0)
    s.enqueue(make_request("a", id="3"), 0)
    s.cancel("2")
    s.enqueue(make_request("a", id="4"), 0)
    assert drain(s) == ["1", "3", "4"]
    assert s.holds_requests and not s.uses_headroom


def test_passthrough_is_fifo_and_does_not_hold() -> None:
    s = scheduler("passthrough")
    s.enqueue(make_request("a", id="1"), 0)
    s.enqueue(make_request("b", id="2"), 0)
    assert drain(s) == ["1", "2"]
    assert not s.holds_requests


def test_drr_weights_share_tokens_and_rr_ignores_them() -> None:
    tenants = {"a": TenantSpec("standard", 1.0), "b": TenantSpec("standard", 3.0)}
    for policy, expected_b in (("drr", 30), ("rr", 20)):
        s = scheduler(policy, tenants)
        for k in range(100):
            s.enqueue(make_request("a", prompt=480, output=20), k)
            s.enqueue(make_request("b", prompt=480, output=20), k)
        served = [s.next(0).tenant for _ in range(40)]
        assert served.count("b") == expected_b, policy


def test_token_cost_counts_prompt_plus_estimate_and_requests_cost_one() -> None:
    s = scheduler()
    s.enqueue(make_request("a", prompt=700, output=300, id="t"), 0)
    s.enqueue(make_request("a", endpoint="/v1/embeddings", prompt=5000, output=0, id="e"), 0)
    assert s.queued("t").cost == 1000
    assert s.queued("e").cost == 1
    s.enqueue(make_request("a", prompt=0, output=0, id="zero"), 0)
    assert s.queued("zero").cost == 1  # never free


def test_settlement_corrects_the_deficit_with_real_counts() -> None:
    s = scheduler()
    s.enqueue(make_request("a", prompt=100, output=400, id="x"), 0)
    s.enqueue(make_request("a", prompt=100, output=400, id="y"), 0)
    r = s.next(0)
    credit = s.deficit("standard", "a")
    assert credit == pytest.approx(1 - 0.5)  # quantum 1000 tokens = 1 turn
    s.on_finished(r, 100, 1400)  # 1000 tokens more than charged: one turn of debt
    assert s.deficit("standard", "a") == pytest.approx(credit - 1.0)
    assert r.charged == 1500 and r.state is RequestState.ENDED


def test_streamed_tokens_beyond_the_estimate_are_charged_live_and_not_twice() -> None:
    s = scheduler()
    s.enqueue(make_request("a", prompt=100, output=100, id="x"), 0)
    s.enqueue(make_request("a", id="keep-backlogged"), 0)
    r = s.next(0)
    base = s.deficit("standard", "a")
    s.on_tokens_streamed(r, 50)  # within the estimate: nothing more
    assert s.deficit("standard", "a") == pytest.approx(base)
    s.on_tokens_streamed(r, 250)  # 200 beyond the estimate
    assert s.deficit("standard", "a") == pytest.approx(base - 0.2)
    assert r.charged == 400
    s.on_finished(r, 100, 300)  # exactly what was streamed: no further change
    assert s.deficit("standard", "a") == pytest.approx(base - 0.2)


def test_streamed_tokens_are_not_charged_when_disabled() -> None:
    s = scheduler(charge_streamed_tokens=False)
    s.enqueue(make_request("a", prompt=100, output=100), 0)
    s.enqueue(make_request("a"), 0)
    r = s.next(0)
    base = s.deficit("standard", "a")
    s.on_tokens_streamed(r, 500)
    assert s.deficit("standard", "a") == base
    s.on_finished(r, 100, 500)
    assert s.deficit("standard", "a") == pytest.approx(base - 0.4)


def test_requeue_restores_the_place_and_refunds_the_charge() -> None:
    s = scheduler()
    for k in range(3):
        s.enqueue(make_request("a", arrival=k, id=f"q{k}"), 0)
    before = s.deficit("standard", "a")
    r = s.next(0)
    assert r.id == "q0"
    s.requeue(r)
    assert r.state is RequestState.QUEUED and s.inflight_requests == 0
    assert s.deficit("standard", "a") == pytest.approx(before)
    assert drain(s) == ["q0", "q1", "q2"]


def test_finishing_twice_or_out_of_order_raises() -> None:
    s = scheduler()
    s.enqueue(make_request("a"), 0)
    r = s.next(0)
    s.on_finished(r, 1, 1)
    with pytest.raises(ValueError):
        s.on_finished(r, 1, 1)
    with pytest.raises(ValueError):
        s.requeue(r)
    with pytest.raises(ValueError):
        s.enqueue(r, 0)


def test_unknown_tenant_or_tier_is_a_programming_error() -> None:
    s = scheduler()
    with pytest.raises(ValueError):
        s.enqueue(make_request("nobody"), 0)
    with pytest.raises(ValueError):
        s.enqueue(make_request("a", "gold"), 0)


def test_eligibility_skips_over_share_tenants_and_lower_tiers_can_take_the_slot() -> None:
    s = scheduler()
    s.enqueue(make_request("i", "interactive", id="int"), 0)
    s.enqueue(make_request("a", id="std"), 0)
    assert s.next(0, lambda t: t != "i").id == "std"
    assert s.next(0, lambda t: t != "i") is None
    assert s.next(0).id == "int"


def test_a_request_that_passes_goes_before_its_held_tenants_head() -> None:
    s = scheduler()
    s.enqueue(make_request("a", id="essay", prompt=40), 0)
    s.enqueue(make_request("a", id="short", prompt=200), 0)
    s.enqueue(make_request("a", id="also short", prompt=300), 0)
    nobody = lambda tenant: False  # noqa: E731
    fits = lambda request: request.id != "essay"  # noqa: E731
    assert s.next(0, nobody, fits).id == "short"
    assert s.next(0, nobody, fits).id == "also short"
    assert s.next(0, nobody, fits) is None  # the head itself never passes
    assert s.tenant_queued("a") == (1, s.queued_tokens) and s.inflight_requests == 2
    assert s.next(0).id == "essay"


def test_held_tenants_pass_only_in_the_policys_order() -> None:
    """Once the tenant whose turn it is has nothing that passes, no later tenant's request
    passes: passing jumps a tenant's own queue, not another tenant's turn."""
    s = scheduler()
    s.enqueue(make_request("a", id="a-essay"), 0)
    s.enqueue(make_request("b", id="b-short"), 0)
    nobody = lambda tenant: False  # noqa: E731
    fits = lambda request: request.id == "b-short"  # noqa: E731
    assert s.next(0, nobody, fits) is None  # a's turn, and none of a's passes
    assert s.next(0, lambda tenant: tenant == "a", fits).id == "a-essay"
    assert s.next(0, nobody, fits).id == "b-short"  # b's turn now


def test_shares_count_in_flight_against_weighted_share_of_active_tenants() -> None:
    tenants = {"a": TenantSpec("standard", 1.0), "b": TenantSpec("standard", 3.0)}
    s = scheduler(tenants=tenants)
    for _ in range(10):
        s.enqueue(make_request("a"), 0)
    for _ in range(3):
        s.next(0)
    # a alone: its share is all 8 slots
    assert s.under_share("a", 8) and not s.over_share("a", 8)
    s.enqueue(make_request("b"), 0)
    # b active (weight 3 of 4): a's share is 2 slots, it holds 3
    assert not s.under_share("a", 8) and s.over_share("a", 8)
    assert s.under_share("b", 8)


def test_backlog_view_aggregates() -> None:
    tenants = {
        "a": TenantSpec("standard", 1.0),
        "b": TenantSpec("standard", 2.0),
        "i": TenantSpec("interactive"),
    }
    s = scheduler(tenants=tenants)
    s.enqueue(make_request("i", "interactive", prompt=50, output=50), 0)
    s.enqueue(make_request("a", prompt=100, output=100), 0)
    s.enqueue(make_request("b", prompt=300, output=100), 0)
    view = s.backlog_view("standard", "a")
    assert view.higher_tiers_tokens == 100
    assert view.tier_tokens == 600
    assert view.tier_weight == 3.0
    assert view.tenant_tokens == 200 and view.tenant_backlogged
    assert s.backlog_tokens("standard") == 600
    assert s.backlog_tokens("standard", "b") == 400


def test_snapshot_is_json_serialisable() -> None:
    s = scheduler()
    s.enqueue(make_request("a", deadline_s=3.0), 0)
    s.enqueue(make_request("i", "interactive"), 0)
    s.next(0)
    snap = json.loads(json.dumps(s.snapshot()))
    assert snap["queued"] == 1
    assert snap["tenants"]["a"]["queues"]["standard"][0]["deadline_s"] == 3.0


def test_from_config_maps_the_schema() -> None:
    from weighbridge.keys import hash_api_key
    from weighbridge.sidecar.config import parse_config

    config = parse_config(
        {
            "tenants": {
                "acme": {
                    "tier": "interactive",
                    "weight": 2.0,
                    "api_keys": [hash_api_key("k")],
                    "limits": {"max_queued": 1},
                }
            },
            "backends": [{"url": "http://127.0.0.1:8001"}],
            "scheduler": {"policy": "rr", "repeat_demotion": True},
        }
    )
    s = Scheduler.from_config(config)
    assert s.policy == "rr"
    assert s.enqueue(make_request("acme", "interactive"), 0) is None
    assert s.enqueue(make_request("acme", "interactive"), 0).reason == QUEUE_FULL


def _visits(endpoint: str, endpoints: dict[str, object] | None = None,
            weights: dict[str, float] | None = None) -> list[int]:
    """Runs of one tenant in the dispatch order of two backlogged tenants sending 120-token
    requests to ``endpoint``, through the configuration's defaults."""
    config = parse_config({
        "tenants": {t: {"tier": "standard", "api_keys": [f"plain:k{t}"],
                        "weight": (weights or {}).get(t, 1)} for t in "ab"},
        "backends": [{"url": "http://127.0.0.1:1"}],
        **({"endpoints": endpoints} if endpoints else {})})
    s = Scheduler.from_config(config)
    for k in range(40):
        for t in "ab":
            s.enqueue(make_request(t, endpoint=endpoint, prompt=100, output=20,
                                   id=f"{t}{k}"), 0.0)
    order = [r.tenant for r in iter(lambda: s.next(0.0), None)]  # type: ignore[union-attr]
    return [len(list(run)) for _, run in itertools.groupby(order)]


def test_the_turn_follows_the_endpoints_batching_and_leaves_the_share() -> None:
    """Point 5 of issue 41: by default a visit is one request on a generating endpoint (two
    backlogged tenants alternate), a quantum on a pooling one (~17 requests of 120 tokens);
    a configured turn sets it; each tenant gets the same service whatever the turn."""
    chat = _visits("/v1/chat/completions")
    assert chat == [1] * 80
    embeddings = _visits("/v1/embeddings")
    assert max(embeddings) == -(-2048 // 120) and sum(embeddings) == 80
    assert max(_visits("/v1/chat/completions",
                       {"/v1/chat/completions": {"turn": 2048}})) == -(-2048 // 120)


def test_a_visit_is_the_tenants_weight_in_turns() -> None:
    """Within a round tenants interleave in the ratio of their weights (decision 0025): a
    tenant of weight 4 makes four dispatches a visit to another's one, so a backlog of a few
    requests (a closed loop's) is served 4:1 before it can empty, not 1:1 until the lighter
    tenant's credit runs out."""
    visits = _visits("/v1/chat/completions", weights={"a": 4, "b": 1})
    assert visits[:16] == [4, 1] * 8
