"""SchedulingCore: the ingress chain, dispatch with gates and routing, every way a request
ends, and the ledger identity under random event sequences."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.config import Config, parse_config
from weighbridge.sidecar.core import Dispatch, SchedulingCore
from weighbridge.sidecar.ledger import LedgerError
from weighbridge.sidecar.rejection import DEADLINE_UNMEETABLE, QUEUE_FULL, RATE_LIMITED, Reject
from weighbridge.sidecar.request import QueuedRequest, RequestState
from weighbridge.vllm_metrics import BackendSample

CHAT = "/v1/chat/completions"
_ids = itertools.count()


def make_config(policy: str = "drr", **overrides: Any) -> Config:
    data: dict[str, Any] = {
        "tenants": {
            "a": {"tier": "standard", "api_keys": ["plain:ka"],
                  "limits": {"max_queued": 50, "tokens_per_minute": 100_000}},
            "b": {"tier": "standard", "api_keys": ["plain:kb"], "weight": 2.0},
            "i": {"tier": "interactive", "api_keys": ["plain:ki"]},
            "tiny": {"tier": "standard", "api_keys": ["plain:kt"],
                     "limits": {"requests_per_minute": 2, "max_queued": 1}},
        },
        "endpoints": {CHAT: {"cost": "tokens", "quantum": 1000, "initial_output_estimate": 100}},
        "backends": [
            {"url": "http://127.0.0.1:8001", "name": "b1"},
            {"url": "http://127.0.0.1:8002", "name": "b2", "priority_scheduling": True},
        ],
        "scheduler": {"policy": policy},
        "admission": {"max_inflight_per_backend": 4, "max_backend_waiting": 2},
    }
    data.update(overrides)
    return parse_config(data)


def arrive(core: SchedulingCore, tenant: str = "a", now: float = 0.0, **kw: Any):
    tier = kw.pop("tier", None) or core.config.tenants[tenant].tier
    return core.arrive(
        request_id=kw.pop("request_id", f"q{next(_ids)}"),
        tenant=tenant,
        tier=tier,
        endpoint=kw.pop("endpoint", CHAT),
        prompt_tokens=kw.pop("prompt_tokens", 100),
        max_tokens=kw.pop("max_tokens", 500),
        now=now,
        **kw,
    )


def balanced(core: SchedulingCore) -> None:
    total = core.ledger.total()
    assert total.balanced
    assert total.queued == core.scheduler.queued_requests
    assert total.dispatched == core.scheduler.inflight_requests
    assert total.dispatched == sum(b.inflight for b in core.fleet)


def test_a_request_from_arrival_to_completion() -> None:
    core = SchedulingCore(make_config())
    req = arrive(core, prompt_tokens=300)
    assert isinstance(req, QueuedRequest) and req.estimated_output_tokens == 100
    dispatches = list(core.dispatch_ready(0.0))
    assert [d.request for d in dispatches] == [req]
    assert dispatches[0].backend in ("b1", "b2")
    core.on_first_token(req, 0.0)
    core.on_tokens_streamed(req, 50, 0.0)
    core.on_completed(req, 280, 60, 0.0)
    assert req.state is RequestState.ENDED
    assert core.estimator.estimate("a", CHAT, None) == 60  # learned
    level = core.rate_limiter.snapshot(0.0)["tenants"]["a"]["tokens_per_minute"]["level"]
    assert level == 100_000 - 340  # charged the 400 estimated, settled to the 340 used
    assert core.ledger.total().completed == 1
    assert core.fleet[req.backend].outstanding_tokens == 0
    balanced(core)
    json.dumps(core.snapshot(0.5))
    with pytest.raises(LedgerError):
        core.on_completed(req, 280, 60, 0.6)


def test_rate_limit_rejects_with_retry_after() -> None:
    core = SchedulingCore(make_config())
    assert isinstance(arrive(core, "tiny"), QueuedRequest)
    list(core.dispatch_ready(0))
    assert isinstance(arrive(core, "tiny"), QueuedRequest)
    rejected = arrive(core, "tiny")
    assert isinstance(rejected, Reject) and rejected.reason == RATE_LIMITED
    assert rejected.retry_after_s == pytest.approx(30.0)
    assert core.ledger.total().rejected[RATE_LIMITED] == 1
    balanced(core)


def test_per_model_limits_charge_the_default_model_for_a_request_without_one() -> None:
    core = SchedulingCore(make_config(
        models={"big": {"tenant_limits": {"requests_per_minute": 1}}}, default_model="big"))
    first = arrive(core)  # no model: the default's limit
    assert isinstance(first, QueuedRequest) and first.model == "big"
    rejected = arrive(core, model="big")
    assert isinstance(rejected, Reject) and rejected.reason == RATE_LIMITED
    assert isinstance(arrive(core, model="small"), QueuedRequest)
    assert isinstance(arrive(core, "b", model="big"), QueuedRequest)  # b's own bucket
    for dispatch in core.dispatch_ready(0.0):
        core.on_completed(dispatch.request, 100, 10, 0.0)
    balanced(core)


def test_queue_full_refunds_tokens_but_keeps_the_request_charge() -> None:
    core = SchedulingCore(make_config())
    config = make_config(tenants={
        "a": {"tier": "standard", "api_keys": ["plain:ka"],
              "limits": {"max_queued": 1, "tokens_per_minute": 10_000,
                         "requests_per_minute": 100}},
    })
    core = SchedulingCore(config)
    arrive(core)
    rejected = arrive(core)
    assert isinstance(rejected, Reject) and rejected.reason == QUEUE_FULL
    buckets = core.rate_limiter.snapshot(0.0)["tenants"]["a"]
    assert buckets["tokens_per_minute"]["level"] == 10_000 - 200
    assert buckets["requests_per_minute"]["level"] == 98
    balanced(core)


def test_deadline_unmeetable_is_decided_at_arrival() -> None:
    core = SchedulingCore(make_config())
    for _ in range(20):
        arrive(core, "a", prompt_tokens=900)
    # prime the throughput meter: 1,000 tokens/s while requests wait
    core.meter.observe(0, 0.0, True)
    core.meter.observe(1_000, 1.0, True)
    rejected = arrive(core, "b", now=1.0, deadline_s=1.05, prompt_tokens=200)
    assert isinstance(rejected, Reject) and rejected.reason == DEADLINE_UNMEETABLE
    assert rejected.retry_after_s is not None and rejected.retry_after_s > 0.05
    ok = arrive(core, "b", now=1.0, deadline_s=1.0 + 10, prompt_tokens=200)
    assert isinstance(ok, QueuedRequest)
    balanced(core)


def test_an_end_to_end_deadline_counts_the_time_to_decode_the_answer() -> None:
    core = SchedulingCore(make_config())
    tiers = core.config.tiers
    assert tiers["standard"].deadline_covers_output()  # e2e_slo_ms, no TTFT SLO
    assert not tiers["interactive"].deadline_covers_output()  # its TTFT SLO
    assert not tiers["standard"].deadline_covers_output(requested_ms=500)  # the client's
    for _ in range(5):
        arrive(core, "a", prompt_tokens=100)
    core.meter.observe(0, 0.0, True)
    core.meter.observe(10_000, 1.0, True)  # a wait of ~0.1 s before any new request
    # Both engines decode 20 tokens/s per sequence (4 running, 80 tokens in a second).
    for name in ("b1", "b2"):
        core.on_backend_metrics(name, BackendSample(0.0, 0, 4, 0.1, 0))
        core.on_backend_metrics(name, BackendSample(1.0, 0, 4, 0.1, 80))
    # The expected output (the endpoint's initial estimate, 100 tokens) at 20 tokens/s: 5 s,
    # past a deadline 4 s away however short the wait.
    long = arrive(core, "b", now=1.0, deadline_s=5.0, deadline_covers_output=True,
                  prompt_tokens=100, max_tokens=300)
    assert isinstance(long, Reject) and long.reason == DEADLINE_UNMEETABLE
    # 50 tokens (its max_tokens): 2.5 s, in time; and 100 against a first-token deadline.
    assert isinstance(arrive(core, "b", now=1.0, deadline_s=5.0, deadline_covers_output=True,
                             prompt_tokens=100, max_tokens=50), QueuedRequest)
    assert isinstance(arrive(core, "b", now=1.0, deadline_s=5.0, prompt_tokens=100,
                             max_tokens=300), QueuedRequest)
    balanced(core)


def test_cancel_while_queued_and_client_gone_while_streaming() -> None:
    core = SchedulingCore(make_config())
    queued = arrive(core)
    assert core.cancel(queued.id, 0.1)
    assert not core.cancel(queued.id, 0.1)
    streaming = arrive(core)
    (d,) = core.dispatch_ready(0.2)
    assert not core.cancel(streaming.id, 0.3)  # in flight: abort upstream instead
    core.on_tokens_streamed(streaming, 10, 0.3)
    core.on_client_gone(streaming, 100, 10, 0.4)
    tally = core.ledger.total()
    assert tally.cancelled == 2 and tally.in_flight == 0
    assert core.fleet[d.backend].gate.inflight == 0
    balanced(core)


def test_failure_refunds_the_drr_charge_and_frees_the_slot() -> None:
    core = SchedulingCore(make_config())
    arrive(core, prompt_tokens=900)
    arrive(core, prompt_tokens=900)
    (first, second) = core.dispatch_ready(0.0)
    credit = core.scheduler.deficit("standard", "a")
    core.on_failed(first.request, 0, 0, 0.1)
    assert core.scheduler.deficit("standard", "a") == pytest.approx(credit)  # idle: clamp
    assert core.ledger.total().failed == 1
    core.on_completed(second.request, 900, 100, 0.2)
    balanced(core)


def test_dispatch_failed_requeues_onto_another_backend() -> None:
    core = SchedulingCore(make_config())
    req = arrive(core)
    (d,) = core.dispatch_ready(0.0)
    core.mark_backend_unhealthy(d.backend)
    core.dispatch_failed(req, 0.1)
    assert req.state is RequestState.QUEUED
    (again,) = core.dispatch_ready(0.2)
    assert again.request is req and again.backend != d.backend
    assert core.ledger.total().in_flight == 1
    balanced(core)


def test_gates_cap_dispatch_and_holds_are_counted() -> None:
    core = SchedulingCore(make_config())
    for _ in range(12):
        arrive(core)
    assert len(list(core.dispatch_ready(0.0))) == 8  # 4 per backend, no metrics: fallback
    assert core.holds[("b1", "fallback_cap")] == 1
    core.mark_backend_unhealthy("b1")
    core.mark_backend_unhealthy("b2")
    assert core.next_dispatch(0.0) is None
    assert core.holds[("", "no_healthy_backend")] == 1


def test_metrics_hold_a_backend_with_a_queue() -> None:
    core = SchedulingCore(make_config())
    for _ in range(6):
        arrive(core)
    core.on_backend_metrics("b1", BackendSample(0.0, waiting=5, running=4, kv_cache_usage=0.9))
    core.on_backend_metrics("b2", BackendSample(0.0, waiting=0, running=0, kv_cache_usage=0.1))
    backends = [d.backend for d in core.dispatch_ready(0.1)]
    assert backends.count("b1") == 1  # nothing of ours there yet: one goes, then held
    assert backends.count("b2") == 4


def test_headroom_is_for_under_share_tenants_only() -> None:
    limits = GateLimits(max_inflight=4, headroom_slots=1)
    core = SchedulingCore(make_config(backends=[{"url": "http://127.0.0.1:8001"}]),
                          gate_limits=limits)
    for _ in range(10):
        arrive(core, "a")
    flood = list(core.dispatch_ready(0.0))
    assert len(flood) == 3  # the flood stops short of the headroom
    arrive(core, "b")
    (d,) = core.dispatch_ready(0.1)
    assert d.request.tenant == "b"  # no slot turnover needed
    assert core.next_dispatch(0.1) is None
    assert core.holds[("127.0.0.1:8001", "headroom")] == 1  # the flood, held at 3
    assert core.holds[("127.0.0.1:8001", "fallback_cap")] == 2


SLOW_BACKEND = "127.0.0.1:8001"


def slowed_by_a(policy: str) -> SchedulingCore:
    """A core whose one backend runs 4 of tenant a's requests and decodes them at 5 tokens/s
    each, below the 7 tokens/s floor (two scrapes 1 s apart, 20 tokens over 4 sequences)."""
    limits = GateLimits(max_inflight=8, max_running=8, min_decode_tokens_per_s=7.0)
    core = SchedulingCore(make_config(policy, backends=[{"url": f"http://{SLOW_BACKEND}"}]),
                          gate_limits=limits)
    for _ in range(4):
        arrive(core, "a")
    assert len(list(core.dispatch_ready(0.0))) == 4
    core.on_backend_metrics(SLOW_BACKEND, BackendSample(0.5, 0, 4, 0.1, 0))
    core.on_backend_metrics(SLOW_BACKEND, BackendSample(1.5, 0, 4, 0.1, 20))
    return core


def test_a_slow_decode_holds_the_tenants_that_slowed_it_not_one_under_its_share() -> None:
    core = slowed_by_a("drr")
    # The lone tenant keeps the floor: nothing more of its own goes in.
    for _ in range(4):
        arrive(core, "a", now=1.6)
    assert core.next_dispatch(1.6) is None
    assert core.holds[(SLOW_BACKEND, "decode_slow")] == 1
    # A tenant under its share beside it still starts; the one over its share still waits.
    arrive(core, "b", now=1.7)
    (d,) = core.dispatch_ready(1.7)
    assert d.request.tenant == "b"
    assert core.next_dispatch(1.7) is None
    # Held again at the end of the pass that dispatched b, and once more just now.
    assert core.holds[(SLOW_BACKEND, "decode_slow")] == 3


def test_fcfs_holds_everyone_while_decode_is_slow() -> None:
    core = slowed_by_a("fcfs")
    arrive(core, "b", now=1.7)
    assert core.next_dispatch(1.7) is None  # the baseline cannot pick a tenant


def test_over_share_requests_get_a_demoted_vllm_priority() -> None:
    core = SchedulingCore(make_config(backends=[
        {"url": "http://127.0.0.1:8002", "name": "p", "priority_scheduling": True}]))
    arrive(core, "i")
    for _ in range(3):
        arrive(core, "a")
    arrive(core, "b")
    got = [(d.request.tenant, d.vllm_priority, d.over_share) for d in core.dispatch_ready(0)]
    # interactive first at its tier priority; a holds more than its share (4 slots over
    # weights i:1, a:1, b:2 -> 1 slot) from its second request on
    assert got[0] == ("i", 0, False)
    assert ("a", 5, False) in got and ("a", 6, True) in got


def test_a_flood_is_demoted_below_a_light_tenant_that_is_idle_between_requests() -> None:
    """The victim sends one request at a time: between them it is idle, and a share judged
    among the active tenants only would give the flood every slot and the victim's own
    engine priority, so the flood's prompts already in the engine go first when the victim
    next arrives. It counts as active for 10 s after its last request (a light tenant)."""
    core = SchedulingCore(make_config(backends=[
        {"url": "http://127.0.0.1:8002", "name": "p", "priority_scheduling": True}]))
    victim = arrive(core, "a", now=0.0)
    (d,) = core.dispatch_ready(0.0)
    assert d.request is victim and (d.vllm_priority, d.over_share) == (5, False)
    core.on_first_token(victim, 0.1)
    core.on_completed(victim, 100, 10, 0.2)
    for _ in range(4):
        arrive(core, "b", now=1.0)
    flood = [(d.vllm_priority, d.over_share) for d in core.dispatch_ready(1.0)]
    # b (weight 2) beside a lately active a (weight 1): its share is 4 * 2/3 of the slots
    assert flood[:2] == [(5, False), (5, False)]
    assert flood[2:] == [(6, True)] * (len(flood) - 2) and len(flood) > 2
    # Once a has been idle longer than the light memory, b alone may hold every slot.
    core2 = SchedulingCore(make_config(backends=[
        {"url": "http://127.0.0.1:8002", "name": "p", "priority_scheduling": True}]))
    v2 = arrive(core2, "a", now=0.0)
    list(core2.dispatch_ready(0.0))
    core2.on_first_token(v2, 0.1)
    core2.on_completed(v2, 100, 10, 0.2)
    for _ in range(4):
        arrive(core2, "b", now=20.0)
    assert {d.over_share for d in core2.dispatch_ready(20.0)} == {False}


def test_no_priority_field_for_backends_without_priority_scheduling() -> None:
    core = SchedulingCore(make_config(backends=[{"url": "http://127.0.0.1:8001"}]))
    arrive(core)
    (d,) = core.dispatch_ready(0)
    assert d.vllm_priority is None


def test_passthrough_ignores_the_gate_and_fcfs_uses_headroom_as_capacity() -> None:
    core = SchedulingCore(make_config("passthrough"))
    for _ in range(20):
        arrive(core)
    assert len(list(core.dispatch_ready(0))) == 20
    limits = GateLimits(max_inflight=4, headroom_slots=2)
    core = SchedulingCore(make_config("fcfs", backends=[{"url": "http://127.0.0.1:8001"}]),
                          gate_limits=limits)
    for _ in range(20):
        arrive(core)
    assert len(list(core.dispatch_ready(0))) == 4


def test_deadline_for_prefers_the_clients_then_the_tiers_slo() -> None:
    core = SchedulingCore(make_config())
    assert core.config.tiers["interactive"].deadline(10.0) == pytest.approx(10.5)
    assert core.config.tiers["standard"].deadline(10.0) == pytest.approx(20.0)
    assert core.config.tiers["batch"].deadline(10.0) is None
    assert core.config.tiers["batch"].deadline(10.0, requested_ms=250) == pytest.approx(10.25)


def test_unknown_tenant_is_refused_before_counting() -> None:
    core = SchedulingCore(make_config())
    with pytest.raises(ValueError):
        arrive(core, "nobody", tier="standard")
    core.ledger.rejected_on_arrival("", "", "unauthorized")
    assert core.ledger.total().rejected["unauthorized"] == 1
    balanced(core)


def arrive_or_dispatch(core: SchedulingCore, kind: str, tenant: str, prompt_tokens: int,
                       now: float, queued: list[QueuedRequest], inflight: list[QueuedRequest],
                       request_id: str | None = None) -> list[Dispatch]:
    """The random event sequences' "arrive" (queued if accepted) and "dispatch" (every
    dispatch possible, moved from ``queued`` to ``inflight``, and returned)."""
    if kind == "arrive":
        ids = {} if request_id is None else {"request_id": request_id}
        result = arrive(core, tenant, now, prompt_tokens=prompt_tokens, user="u", **ids)
        if isinstance(result, QueuedRequest):
            queued.append(result)
        return []
    dispatches = list(core.dispatch_ready(now))
    for d in dispatches:
        queued.remove(d.request)
        inflight.append(d.request)
    return dispatches


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("arrive"), st.sampled_from(["a", "b", "i", "tiny"]), st.integers(0, 3000)
        ),
        st.tuples(st.just("dispatch"), st.just(""), st.just(0)),
        st.tuples(st.just("stream"), st.just(""), st.integers(0, 300)),
        st.tuples(st.sampled_from(["complete", "fail", "gone", "refused"]), st.just(""),
                  st.integers(0, 10**6)),
        st.tuples(st.just("cancel"), st.just(""), st.integers(0, 10**6)),
        st.tuples(st.just("scrape"), st.sampled_from(["b1", "b2"]), st.integers(0, 6)),
        st.tuples(st.just("health"), st.sampled_from(["b1", "b2"]), st.integers(0, 1)),
        st.tuples(st.just("tick"), st.just(""), st.integers(0, 3000)),
    ),
    max_size=100,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["drr", "rr", "fcfs", "passthrough"]), ops=OPS)
def test_every_request_ends_exactly_once_under_any_event_sequence(policy, ops) -> None:
    core = SchedulingCore(make_config(policy), gate_limits=GateLimits(max_inflight=3,
                                                                      headroom_slots=1))
    now = 0.0
    queued: list[QueuedRequest] = []
    inflight: list[QueuedRequest] = []
    for kind, who, value in ops:
        now += 0.01
        if kind in ("arrive", "dispatch"):
            for d in arrive_or_dispatch(core, kind, who, value, now, queued, inflight):
                if policy not in ("passthrough",):
                    assert core.fleet[d.backend].gate.inflight <= 3
        elif kind == "stream" and inflight:
            core.on_tokens_streamed(inflight[0], value, now)
        elif kind in ("complete", "fail", "gone", "refused") and inflight:
            req = inflight.pop(value % len(inflight))
            if kind == "complete":
                core.on_completed(req, req.prompt_tokens, value % 700, now)
            elif kind == "fail":
                core.on_failed(req, req.prompt_tokens, value % 50, now)
            elif kind == "gone":
                core.on_client_gone(req, req.prompt_tokens, value % 50, now)
            else:
                core.dispatch_failed(req, now)
                queued.append(req)
        elif kind == "cancel" and queued:
            req = queued.pop(value % len(queued))
            assert core.cancel(req.id, now)
        elif kind == "scrape":
            core.on_backend_metrics(who, BackendSample(now, value % 3, value, 0.5, now * 100))
        elif kind == "health":
            (core.mark_backend_healthy if value else core.mark_backend_unhealthy)(who)
        elif kind == "tick":
            now += value / 1000
        balanced(core)
        assert core.ledger.total().queued == len(queued)
        assert core.ledger.total().dispatched == len(inflight)
    # drain: everything still in flight ends, and the books close
    for req in inflight:
        core.on_completed(req, 1, 1, now)
    for req in queued:
        core.on_client_gone(req, 0, 0, now)
    total = core.ledger.total()
    assert total.in_flight == 0 and total.balanced
    assert core.scheduler.queued_tokens == 0
    assert all(core.fleet[b].outstanding_tokens == 0 for b in ("b1", "b2"))


def _admission(**fields: Any) -> dict[str, Any]:
    return {"max_inflight_per_backend": 64, **fields}


def test_prefill_pacing_holds_a_tenant_with_prompts_still_prefilling() -> None:
    config = make_config(backends=[{"url": "http://127.0.0.1:8001", "name": "b1"}],
                         admission=_admission(max_prefill_tokens_inflight=1500))
    core = SchedulingCore(config)
    for _ in range(5):
        arrive(core, "a", prompt_tokens=1000)
    arrive(core, "b", prompt_tokens=100)
    sent = list(core.dispatch_ready(0.0))
    # a: the first 1,000 tokens fit under 1,500, the second would start at 1,000 < 1,500,
    # the third is held; b is not affected by a's prompts.
    assert sorted(d.request.tenant for d in sent) == ["a", "a", "b"]
    first = next(d.request for d in sent if d.request.tenant == "a")
    core.on_tokens_streamed(first, 1, 0.1)  # its prefill is done
    assert [d.request.tenant for d in core.dispatch_ready(0.1)] == ["a"]


def test_prefill_pacing_is_per_backend_so_a_fleet_takes_a_budget_each() -> None:
    # The cap is each backend's (its step budget): on two backends a tenant has two
    # budgets in prefill, one on each; counted over the fleet it had one (issue 38).
    core = SchedulingCore(make_config(admission=_admission(max_prefill_tokens_inflight=1500)))
    for _ in range(6):
        arrive(core, "a", prompt_tokens=1000)
    sent = list(core.dispatch_ready(0.0))
    assert sorted(d.backend for d in sent) == ["b1", "b1", "b2", "b2"]
    done = next(d.request for d in sent if d.backend == "b2")
    core.on_tokens_streamed(done, 1, 0.1)  # b2's first prompt is prefilled
    assert [d.backend for d in core.dispatch_ready(0.1)] == ["b2"]


def test_backend_prefill_backlog_holds_its_builders_until_a_first_token() -> None:
    config = make_config(backends=[{"url": "http://127.0.0.1:8001", "name": "b1"}],
                         admission=_admission(max_backend_prefill_tokens=2000))
    core = SchedulingCore(config)
    for _ in range(6):
        arrive(core, "a", prompt_tokens=1000)
    sent = [d.request for d in core.dispatch_ready(0.0)]
    assert len(sent) == 2  # 2,000 prompt tokens prefilling: the backend takes no more of a's
    assert core.holds[("b1", "prefill_backlog")] >= 1
    # A light tenant, with nothing in the backlog, adds one prompt; then, with one there,
    # no second.
    arrive(core, "b", prompt_tokens=1000)
    assert [d.request.tenant for d in core.dispatch_ready(0.0)] == ["b"]
    arrive(core, "b", prompt_tokens=1000)
    assert list(core.dispatch_ready(0.0)) == []
    core.on_tokens_streamed(sent[0], 1, 0.1)
    core.on_tokens_streamed(sent[1], 1, 0.1)
    assert len(list(core.dispatch_ready(0.1))) == 1


def test_stats_are_values_of_what_the_parts_counted() -> None:
    core = SchedulingCore(make_config())
    req = arrive(core, prompt_tokens=300)
    assert core.estimated_tokens("a", CHAT, 300, None) == 400  # prompt + the initial estimate
    dispatched = next(core.dispatch_ready(0.0))
    queued = arrive(core, "b", prompt_tokens=50)
    stats = core.stats(0.0)
    by_tenant = {t.tenant: t for t in stats.tenants}
    assert set(by_tenant) == set(core.config.tenants)
    assert by_tenant["b"].weight == 2.0 and by_tenant["b"].tier == "standard"
    assert by_tenant["b"].queued_tokens == core.scheduler.tenant_queued("b")[1] > 0
    backends = {b.backend: b for b in stats.backends}
    assert backends[dispatched.backend].inflight == 1
    assert backends[dispatched.backend].prefill_tokens == 300
    assert stats.healthy_backends == ["b1", "b2"]
    assert stats.tallies[("a", "standard")].dispatched == 1
    # Values, not the parts: a later event does not change a taken snapshot.
    core.on_first_token(req, 0.1)
    core.on_completed(req, 300, 10, 0.2)
    assert stats.tallies[("a", "standard")].dispatched == 1
    assert core.stats(0.2).tallies[("a", "standard")].completed == 1
    assert isinstance(queued, QueuedRequest)


def test_a_tier_limit_refuses_a_tenant_that_moves_up_to_it() -> None:
    # Priority inflation: a batch tenant may not flood the interactive tier when that tier's
    # own limit (all tenants together) is spent; its own tier still takes it.
    config = make_config(tiers={
        "interactive": {"rank": 1, "limits": {"requests_per_minute": 1}},
        "standard": {"rank": 2},
    })
    core = SchedulingCore(config)
    assert isinstance(arrive(core, "i", tier="interactive"), QueuedRequest)
    refused = arrive(core, "i", tier="interactive")
    assert isinstance(refused, Reject) and refused.reason == RATE_LIMITED
    assert refused.retry_after_s == pytest.approx(60.0)
    assert isinstance(arrive(core, "i", tier="standard"), QueuedRequest)
    assert core.rate_limiter.snapshot(0.0)["tiers"]["interactive"]["requests_per_minute"][
        "level"] == pytest.approx(0.0)
    balanced(core)


# Streams between decisions, the case the fold is for: OPS's lists are short and mixed.
FOLD_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from(["a", "b", "i"]), st.integers(0, 3000)),
        st.tuples(st.just("dispatch"), st.just(""), st.just(0)),
        *[st.tuples(st.just("stream"), st.just(""), st.integers(0, 300))] * 3,
        st.tuples(st.sampled_from(["complete", "gone"]), st.just(""), st.integers(0, 10**6)),
        st.tuples(st.just("tick"), st.just(""), st.integers(0, 3000)),
    ),
    min_size=10, max_size=80,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["drr", "rr", "fcfs", "passthrough"]), ops=FOLD_OPS)
def test_streamed_tokens_folded_late_give_the_decisions_of_folding_each_chunk(policy,
                                                                              ops) -> None:
    """The core folds a stream's tokens into its charges, router, KV footprint and meter at
    the next entry (module doc, "Streamed tokens"). A core folded and read after every event
    and one left alone between decisions make the same dispatches, and their state agrees at
    each decision and at the end."""
    # A quantum of 1,024 tokens keeps every charge in turns an exact binary fraction, so
    # charging 29 then 32 tokens equals charging 61 at once, as in exact arithmetic; with
    # 1,000 the two groupings round apart in the last bit (0.6629999999999999 against 0.663),
    # which is the floats', not the fold's.
    endpoints = {CHAT: {"cost": "tokens", "quantum": 1024, "initial_output_estimate": 100}}
    cores = [SchedulingCore(make_config(policy, endpoints=endpoints),
                            gate_limits=GateLimits(max_inflight=3, headroom_slots=1))
             for _ in range(2)]
    eager, lazy = cores
    now = 0.0
    flights: list[list[QueuedRequest]] = [[], []]
    queues: list[list[QueuedRequest]] = [[], []]

    first_token: set[str] = set()  # requests that streamed (their prefill is done)
    # Per request in flight, token by token: its expected output as the KV footprint counts
    # it, and its output left as the router does (decision 0018: from its expected final
    # length given what it generated, once its tenant's answers are seen; else the estimate).
    expected: dict[str, int] = {}
    left: dict[str, int] = {}

    def final(r: QueuedRequest, generated: int) -> int | None:
        return eager.estimator.final(r.tenant, r.endpoint, generated, r.max_tokens, r.model)

    def state(core: SchedulingCore, inflight: list[QueuedRequest]) -> tuple[Any, ...]:
        """The views, checked against what token-by-token accounting gives: a backend's
        outstanding tokens are its requests' prompts until their first token plus their
        output left; its KV footprint their prompts plus the larger of expected output and
        output, in blocks of 16; under drr a request has been charged its dispatch cost or
        its prompt and output so far, whichever is more (VTC)."""
        core.fold_streamed()  # the views are plain reads: folded by an entry first
        for backend in ("b1", "b2"):
            mine = [r for r in inflight if r.backend == backend]
            assert core.fleet[backend].outstanding_tokens == sum(
                (0 if r.id in first_token else r.prompt_tokens) + left[r.id] for r in mine)
            assert core.fleet[backend].kv.blocks() == sum(
                -(-(r.prompt_tokens + max(expected[r.id], r.streamed_output_tokens))
                  // 16) for r in mine)
        if policy == "drr":  # read after the fold above
            for r in inflight:
                assert r.charged == max(r.cost, r.prompt_tokens + r.streamed_output_tokens)
        return ({b.name: (b.healthy, b.inflight, b.outstanding_tokens, b.prefill_tokens,
                         b.kv_cache_usage, b.kv.blocks()) for b in core.fleet},
                core.scheduler.snapshot(None), core.ledger.snapshot())

    for k, (kind, who, value) in enumerate(ops):
        now += 0.01
        for core, inflight, queued in zip(cores, flights, queues, strict=True):
            if kind in ("arrive", "dispatch"):
                arrive_or_dispatch(core, kind, who, value, now, queued, inflight, f"r{k}")
            elif kind == "stream" and inflight:
                core.on_tokens_streamed(inflight[0], value, now)
                first_token.add(inflight[0].id)
                if core is eager and value > 0:
                    r = inflight[0]
                    g = r.streamed_output_tokens
                    f = final(r, g)
                    left[r.id] = max(0, left[r.id] - value if f is None else f - g)
                    expected[r.id] = expected[r.id] if f is None else max(expected[r.id], f)
            elif kind in ("complete", "gone") and inflight:
                req = inflight.pop(value % len(inflight))
                (core.on_completed if kind == "complete" else core.on_client_gone)(
                    req, req.prompt_tokens, req.streamed_output_tokens, now)
            elif kind == "tick":
                now += value / 1000 / 2  # both cores: half each, same total
            if core is eager and kind == "dispatch":
                for r in inflight:
                    if r.id not in expected:
                        f = final(r, 0)
                        expected[r.id] = left[r.id] = (r.estimated_output_tokens if f is None
                                                       else f)
        if kind != "tick":
            assert [r.id for r in flights[0]] == [r.id for r in flights[1]]
            assert [r.id for r in queues[0]] == [r.id for r in queues[1]]
            assert [r.streamed_output_tokens for r in flights[0]] == \
                [r.streamed_output_tokens for r in flights[1]]
        state(eager, flights[0])  # folds after every event: token by token
        if kind == "dispatch":
            assert state(lazy, flights[1]) == state(eager, flights[0])
    assert state(lazy, flights[1]) == state(eager, flights[0])
