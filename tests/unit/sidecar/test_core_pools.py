"""SchedulingCore with several models: each request goes only to a backend serving its
model, and admission and fairness are judged per pool (sidecar.catalog)."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.unit.sidecar.test_core import arrive, make_config
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.rejection import MODEL_NOT_FOUND, Reject
from weighbridge.sidecar.request import QueuedRequest

# b1 serves llama and its adapter, b2 serves qwen.
SERVED = {"b1": ["llama", "llama-sql"], "b2": ["qwen"]}


def two_models(policy: str = "drr", *, max_inflight: int = 2, **overrides: Any
               ) -> SchedulingCore:
    core = SchedulingCore(make_config(policy, **overrides),
                          gate_limits=GateLimits(max_inflight=max_inflight, headroom_slots=0))
    for backend, models in SERVED.items():
        assert core.on_backend_models(backend, models)
    return core


def test_a_request_goes_only_to_a_backend_serving_its_model() -> None:
    core = two_models(max_inflight=8)
    requests = {model: [arrive(core, model=model) for _ in range(3)]
                for model in ("llama", "llama-sql", "qwen")}
    sent = {d.request.id: d.backend for d in core.dispatch_ready(0.0)}
    assert len(sent) == 9
    for model, reqs in requests.items():
        assert {sent[r.id] for r in reqs} == ({"b2"} if model == "qwen" else {"b1"})


def test_a_flooded_model_does_not_hold_another_model_s_request() -> None:
    core = two_models(max_inflight=2)
    for _ in range(30):
        arrive(core, "a", model="llama")
    assert len(list(core.dispatch_ready(0.0))) == 2  # b1 full, 28 llama requests wait
    victim = arrive(core, "b", model="qwen", now=0.1)
    assert [(d.request, d.backend) for d in core.dispatch_ready(0.1)] == [(victim, "b2")]
    assert sum(n for (backend, _), n in core.holds.items() if backend == "b1") >= 1
    assert not any(backend == "b2" for backend, _ in core.holds)


def test_fairness_is_per_pool_service_elsewhere_is_not_charged() -> None:
    # a is backlogged on both models, b (weight 2) on qwen only. On qwen's backend, b gets
    # two turns for a's one; a's service on llama, which b never asked for, is not held
    # against a there (one fleet-wide scheduler would leave a almost nothing on qwen).
    core = two_models(max_inflight=1)
    for _ in range(20):
        arrive(core, "a", model="llama", prompt_tokens=400)
        arrive(core, "a", model="qwen", prompt_tokens=400)
        arrive(core, "b", model="qwen", prompt_tokens=400)
    on_qwen, now = [], 0.0
    while len(on_qwen) < 12:
        dispatches = list(core.dispatch_ready(now))
        assert dispatches
        for d in dispatches:
            if d.backend == "b2":
                on_qwen.append(d.request.tenant)
            core.on_completed(d.request, 400, 100, now)
        now += 0.01
    assert on_qwen.count("b") == 2 * on_qwen.count("a")


def test_a_model_no_backend_serves_is_vllm_s_404_and_charges_nothing() -> None:
    core = two_models(tenants={"a": {"tier": "standard", "api_keys": ["plain:ka"],
                                     "limits": {"requests_per_minute": 1}}})
    rejected = arrive(core, model="mistral")
    assert isinstance(rejected, Reject) and rejected.reason == MODEL_NOT_FOUND
    assert rejected.http_status == 404 and "mistral" in rejected.detail
    assert isinstance(arrive(core, model="qwen"), QueuedRequest)  # the 404 took no request
    total = core.ledger.total()
    assert total.rejected[MODEL_NOT_FOUND] == 1 and total.balanced
    assert "mistral" not in core.ledger.by_model()  # a client's typo is no metric label


def test_without_model_a_request_goes_where_vllm_would_serve_it() -> None:
    core = two_models(max_inflight=8)
    req = arrive(core)  # b1 is first in the config: its first model, llama
    (dispatch,) = core.dispatch_ready(0.0)
    assert dispatch.request is req and dispatch.backend == "b1"
    assert set(core.ledger.by_model()) == {"llama"}
    pinned = two_models(max_inflight=8, default_model="qwen")
    arrive(pinned)
    assert [d.backend for d in pinned.dispatch_ready(0.0)] == ["b2"]


def test_a_queued_request_keeps_its_pool_when_what_backends_serve_changes() -> None:
    core = two_models(max_inflight=1)
    arrive(core, model="llama")
    list(core.dispatch_ready(0.0))
    waiting = arrive(core, model="llama")
    assert core.on_backend_models("b2", ["qwen", "llama"])  # b2 now serves llama too
    assert core.pool_for(waiting.id) == {"b1"}
    newer = arrive(core, "b", model="llama")
    assert core.pool_for(newer.id) == {"b1", "b2"}
    assert [(d.request, d.backend) for d in core.dispatch_ready(0.1)] == [(newer, "b2")]


def test_one_pool_is_the_single_model_fleet_of_before() -> None:
    core = SchedulingCore(make_config(), gate_limits=GateLimits(max_inflight=2))
    for backend in ("b1", "b2"):
        core.on_backend_models(backend, ["llama"])
    reqs = [arrive(core, model="llama") for _ in range(3)]
    assert len(list(core.dispatch_ready(0.0))) == 4 - 1  # both backends, one pool
    assert core.scheduler.inflight_requests == 3 and all(r.backend for r in reqs)
    assert len(core.snapshot(0.0)["pools"]) == 1


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.sampled_from(["a", "b", "i"]),
                  st.sampled_from(["llama", "llama-sql", "qwen", "mistral"])),
        st.tuples(st.just("dispatch"), st.just(""), st.just("")),
        st.tuples(st.sampled_from(["complete", "gone", "refused", "cancel"]), st.just(""),
                  st.integers(0, 10**6)),
        st.tuples(st.just("learn"), st.sampled_from(["b1", "b2"]),
                  st.lists(st.sampled_from(["llama", "llama-sql", "qwen"]), unique=True)),
    ),
    max_size=80,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["drr", "fcfs", "passthrough"]), ops=OPS)
def test_every_request_ends_once_and_only_reaches_its_pool(policy: str, ops: Any) -> None:
    core = two_models(policy, max_inflight=2)
    now = 0.0
    queued: list[QueuedRequest] = []
    inflight: list[QueuedRequest] = []
    for kind, who, value in ops:
        now += 0.01
        if kind == "arrive":
            result = arrive(core, who, now, model=value)
            if isinstance(result, QueuedRequest):
                queued.append(result)
        elif kind == "dispatch":
            for d in core.dispatch_ready(now):
                pool = core.pool_for(d.request.id)
                assert pool is not None and d.backend in pool
                queued.remove(d.request)
                inflight.append(d.request)
        elif kind in ("complete", "gone", "refused") and inflight:
            req = inflight.pop(int(value) % len(inflight))
            if kind == "complete":
                core.on_completed(req, req.prompt_tokens, 10, now)
            elif kind == "gone":
                core.on_client_gone(req, req.prompt_tokens, 1, now)
            else:
                core.dispatch_failed(req, now)
                queued.append(req)
        elif kind == "cancel" and queued:
            assert core.cancel(queued.pop(int(value) % len(queued)).id, now)
        elif kind == "learn":
            core.on_backend_models(who, value)
        total = core.ledger.total()
        assert total.balanced and total.queued == len(queued)
        assert total.dispatched == len(inflight)
        by_model = core.ledger.by_model().values()
        assert sum(t.queued for t in by_model) == len(queued)
        assert sum(t.dispatched for t in by_model) == len(inflight)
    for req in inflight:
        core.on_completed(req, 1, 1, now)
    for req in queued:
        core.on_client_gone(req, 0, 0, now)
    assert core.ledger.total().in_flight == 0
    assert all(pool["scheduler"]["queued"] == 0 for pool in core.snapshot(now)["pools"])


def test_an_empty_model_is_no_model_as_vllm_reads_it() -> None:
    core = two_models(max_inflight=8, default_model="qwen")
    req = arrive(core, model="")
    assert isinstance(req, QueuedRequest) and req.model == "qwen"
    assert [d.backend for d in core.dispatch_ready(0.0)] == ["b2"]


def test_an_arrival_restricted_to_some_backends_queues_in_their_pool() -> None:
    """An endpoint picker's subset (``allowed_backends``): the request goes only there, in
    the pool of those backends; a subset serving nothing is the model's 404."""
    core = SchedulingCore(make_config(), gate_limits=GateLimits(max_inflight=8))
    for _ in range(3):
        request = arrive(core, allowed_backends=frozenset({"b2"}))
        assert isinstance(request, QueuedRequest)
        assert core.pool_for(request.id) == {"b2"}
    assert {d.backend for d in core.dispatch_ready(0.0)} == {"b2"}
    refused = arrive(core, allowed_backends=frozenset({"elsewhere"}))
    assert isinstance(refused, Reject) and refused.reason == MODEL_NOT_FOUND
