from __future__ import annotations

import pytest

from tests.unit.sidecar.builders import make_request
from tests.unit.sidecar.test_core import arrive
from tests.unit.sidecar.test_prefix_routing import core_with, turn
from weighbridge.sidecar.predictor import ThroughputMeter, WaitPredictor, tokens_ahead
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.rejection import DEADLINE_UNMEETABLE, Reject
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.scheduler import BacklogView, EndpointSpec, Scheduler, TenantSpec


def view(**kw) -> BacklogView:
    base = dict(
        fifo=False,
        total_tokens=0,
        higher_tiers_tokens=0,
        tier_tokens=0,
        tier_weight=0.0,
        tenant_tokens=0,
        tenant_weight=1.0,
        tenant_backlogged=False,
    )
    base.update(kw)
    return BacklogView(**base)


def test_tokens_ahead_uses_the_tenants_weighted_share_of_its_tier() -> None:
    # tier: 10,000 tokens, tenants of weight 3 backlogged; ours (weight 1) has 1,000 queued
    v = view(tier_tokens=10_000, tier_weight=4.0, tenant_tokens=1_000, tenant_backlogged=True,
             higher_tiers_tokens=500)
    assert tokens_ahead(v, 200) == 500 + 1_200 * 4
    # a newcomer's weight is added to the tier's
    v = view(tier_tokens=10_000, tier_weight=3.0)
    assert tokens_ahead(v, 100) == 100 * 4
    # never more than the whole tier backlog
    v = view(tier_tokens=1_000, tier_weight=99.0, tenant_tokens=900, tenant_backlogged=True)
    assert tokens_ahead(v, 100) == 1_100
    # fifo: everything queued
    assert tokens_ahead(view(fifo=True, total_tokens=7_000), 10) == 7_010


def test_meter_only_measures_while_requests_wait() -> None:
    m = ThroughputMeter(window_s=1.0, alpha=0.5)
    m.observe(5_000, 0.0, saturated=False)
    assert m.tokens_per_s is None
    m.observe(999, 1.0, saturated=True)  # starts the window; these tokens predate it
    m.observe(1_000, 1.5, saturated=True)
    m.observe(1_000, 2.0, saturated=True)
    assert m.tokens_per_s == pytest.approx(2_000)
    m.observe(10, 2.5, saturated=False)  # an idle spell is not a measurement
    m.observe(0, 9.0, saturated=True)
    m.observe(1_000, 10.0, saturated=True)
    assert m.tokens_per_s == pytest.approx(1_500)


def test_deadline_unmeetable() -> None:
    s = Scheduler({"t": 1}, {"a": TenantSpec("t"), "b": TenantSpec("t")},
                  {"/c": EndpointSpec("tokens", 1000)})
    meter = ThroughputMeter(window_s=1.0)
    p = WaitPredictor(s, meter)
    late = make_request("b", "t", endpoint="/c", prompt=100, deadline_s=0.5)
    assert not p.deadline_unmeetable(late, 0.0)  # throughput unknown: never reject
    for _ in range(10):
        s.enqueue(make_request("a", "t", endpoint="/c", prompt=900, output=100), 0)
    meter.observe(0, 0.0, True)
    meter.observe(1_000, 1.0, True)  # 1,000 tokens/s
    # b is alone in its share: (0 + 100) * (1 + 1) / 1 = 200 tokens ahead -> 0.2 s
    assert p.predicted_wait_s(late) == pytest.approx(0.2)
    assert not p.deadline_unmeetable(late, 0.0)
    assert p.deadline_unmeetable(late, 0.4)
    assert p.deadline_unmeetable(make_request("b", "t", deadline_s=1.0), 1.0)
    assert not p.deadline_unmeetable(make_request("b", "t", endpoint="/c"), 0.0)


@pytest.mark.parametrize("policy_fifo", [False, True])
def test_an_arrival_with_nothing_queued_ahead_is_never_turned_away(policy_fifo: bool) -> None:
    """However slow the served rate, nothing queued ahead means dispatch at the next pass."""
    s = Scheduler({"t": 1}, {"a": TenantSpec("t"), "b": TenantSpec("t")},
                  {"/c": EndpointSpec("tokens", 1000)}, policy="fcfs" if policy_fifo else "drr")
    meter = ThroughputMeter(window_s=1.0)
    meter.observe(0, 0.0, True)
    meter.observe(1, 1.0, True)  # 1 token/s: any prompt would take minutes at this rate
    p = WaitPredictor(s, meter)
    lone = make_request("b", "t", endpoint="/c", prompt=4_000, deadline_s=1.0)
    assert p.predicted_wait_s(lone) == 0.0
    assert not p.deadline_unmeetable(lone, 0.0)
    s.enqueue(make_request("a", "t", endpoint="/c", prompt=1, output=1), 0)
    assert p.deadline_unmeetable(lone, 0.0)  # one token queued ahead: judged again


def test_the_backlog_and_the_newcomer_count_only_the_prompt_the_engine_computes() -> None:
    s = Scheduler({"t": 1}, {"a": TenantSpec("t"), "b": TenantSpec("t")},
                  {"/c": EndpointSpec("tokens", 1000)})
    meter = ThroughputMeter(window_s=1.0)
    p = WaitPredictor(s, meter)
    # a queued history of 1,000 tokens, 900 of them predicted cached: 100 + 20 queued
    s.enqueue(make_request("a", "t", endpoint="/c", prompt=1_000, output=20,
                           predicted_cached_tokens=900), 0)
    assert s.backlog_tokens("t", "a") == 120
    meter.observe(0, 0.0, True)
    meter.observe(1_000, 1.0, True)  # 1,000 tokens/s
    cached = make_request("b", "t", endpoint="/c", prompt=1_000, predicted_cached_tokens=990)
    fresh = make_request("b", "t", endpoint="/c", prompt=1_000)
    # b is a newcomer of equal weight: min(120 + own, own * 2) tokens ahead
    assert p.predicted_wait_s(cached) == pytest.approx(10 * 2 / 1_000)
    assert p.predicted_wait_s(fresh) == pytest.approx((120 + 1_000) / 1_000)


def test_a_cached_history_is_not_turned_away_where_a_prefix_free_prompt_is() -> None:
    """The same tenant, length and deadline: the history its backend holds costs the engine
    its new tokens only, so its predicted wait meets the deadline the full prompt misses."""
    core = core_with("least_tokens", backends=[{"url": "http://127.0.0.1:8001",
                                                "name": "b1"}])
    history = list(range(1_600))  # 100 blocks of 16
    first = turn(core, history, 0.0)
    core.on_completed(first.request, 1_600, 8, 0.0, cached_tokens=0)
    for _ in range(5):  # b (weight 2) backlogged: 5 x (900 + 100) tokens queued
        assert isinstance(arrive(core, "b", 0.0, prompt_tokens=900, max_tokens=100),
                          QueuedRequest)
    core.meter.observe(0, 0.0, True)
    core.meter.observe(1_000, 1.0, True)  # 1,000 tokens/s
    prompt = history + list(range(5_000, 5_040))

    def next_turn(ids: list[int]) -> QueuedRequest | Reject:
        return arrive(core, "a", 1.0, prompt_tokens=len(ids), max_tokens=8, deadline_s=2.0,
                      prefix=PromptPrefix(token_ids=ids))

    # 1,600 cached, 40 computed: min(5,000 + 40, 40 * 3 / 1) = 120 tokens, 0.12 s ahead.
    cached = next_turn(prompt)
    assert isinstance(cached, QueuedRequest)
    assert cached.predicted_cached_tokens == 1_600
    assert core.scheduler.tenant_queued("a") == (1, 40 + 8)
    core.cancel(cached.id, 1.0)
    assert core.scheduler.tenant_queued("a") == (0, 0)
    # The same length with no prefix cached: min(5,000 + 1,640, 1,640 * 3) tokens, 4.9 s.
    fresh = next_turn([7] * len(prompt))
    assert isinstance(fresh, Reject) and fresh.reason == DEADLINE_UNMEETABLE
