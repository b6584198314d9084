"""Prefix-aware routing and the cost of a cached prompt, in the scheduling core: a
conversation's next turn goes back to the backend that holds its history, unless that
backend is over the bounded-load rule; the router's load counts the prompt the engine
computes; the engine's reported cached tokens correct the index and are counted beside the
prediction."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tests.unit.sidecar.builders import make_fleet, prefer, send
from tests.unit.sidecar.test_core import arrive, make_config
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.routing.bounded_load import LOAD_BOUND, REQUEST_COST_TOKENS
from weighbridge.sidecar.routing.prefix_affinity import CACHE_WEIGHT
from weighbridge.vllm_metrics import BackendSample

BLOCK = 16
OPEN = GateLimits(max_inflight=1000)


def cache_shape(at: float, blocks: int = 1000) -> BackendSample:
    """A scrape saying the engine's cache: ``blocks`` of ``BLOCK`` tokens, nothing waiting."""
    return BackendSample(at, 0, 0, 0.1, 0, 0, 0, kv_blocks=blocks, block_size=BLOCK)


def core_with(routing: str, **overrides: Any) -> SchedulingCore:
    core = SchedulingCore(make_config(routing=routing, **overrides), gate_limits=OPEN)
    for backend in core.fleet.names:
        core.on_backend_metrics(backend, cache_shape(0.0))
    return core


def turn(core: SchedulingCore, history: list[int], now: float, tenant: str = "a"):
    request = arrive(core, tenant, now, prompt_tokens=len(history), max_tokens=8,
                     prefix=PromptPrefix(token_ids=history))
    assert isinstance(request, QueuedRequest)
    (dispatch,) = core.dispatch_ready(now)
    return dispatch


def test_the_next_turn_goes_back_to_the_backend_holding_its_history() -> None:
    core = core_with("prefix_aware")
    history = list(range(200))
    first = turn(core, history, 0.0)
    core.on_completed(first.request, 200, 8, 0.1, cached_tokens=0)
    # Another conversation makes the first backend the busier one ...
    other = turn(core, [7] * 64, 0.2, tenant="b")
    assert other.backend != first.backend or core.fleet[first.backend].outstanding_tokens
    # ... and the next turn still goes where its 192 cached tokens are.
    second = turn(core, history + list(range(300, 340)), 0.3)
    assert second.backend == first.backend
    assert second.request.predicted_cached_tokens == 192
    assert core.routing_decisions[(first.backend, "affinity")] == 1


def test_least_tokens_ignores_the_cache_but_counts_it_free() -> None:
    core = core_with("least_tokens")
    history = list(range(200))
    first = turn(core, history, 0.0)
    core.on_completed(first.request, 200, 8, 0.1, cached_tokens=0)
    second = turn(core, history, 0.2)
    # Whichever backend it went to, the router's load is the prompt it must compute.
    cached = second.request.predicted_cached_tokens
    assert cached == (192 if second.backend == first.backend else 0)
    assert core.fleet[second.backend].outstanding_tokens == 200 - cached + 8
    assert not core.routing_decisions


def test_a_backend_over_the_load_bound_loses_its_affinity() -> None:
    core = core_with("prefix_aware")
    history = list(range(160))
    first = turn(core, history, 0.0)
    core.on_completed(first.request, 160, 8, 0.1, cached_tokens=0)
    hot = first.backend
    # A long prefix-free prompt in flight on the backend with the history (least tokens
    # sends it to the first of two idle backends, as it sent the first turn).
    big = arrive(core, "b", 0.2, prompt_tokens=4000, max_tokens=8)
    assert isinstance(big, QueuedRequest)
    (d,) = core.dispatch_ready(0.2)
    assert d.backend == hot
    loads = {b: core.fleet[b].outstanding_tokens for b in core.fleet.names}
    assert loads[hot] > LOAD_BOUND * sum(loads.values()) / len(loads) + len(history)
    again = turn(core, history, 1.0)
    assert again.backend != hot
    assert core.routing_decisions[(again.backend, "bounded")] == 1


def test_what_the_engine_reports_corrects_the_index_and_is_counted() -> None:
    core = core_with("prefix_aware")
    history = list(range(100))
    first = turn(core, history, 0.0)
    core.on_completed(first.request, 100, 8, 0.1, cached_tokens=0)
    second = turn(core, history, 0.2)
    assert second.request.predicted_cached_tokens == 96
    # The engine evicted all but the first block meanwhile.
    core.on_completed(second.request, 100, 8, 0.3, cached_tokens=16)
    key = ("a", second.backend)
    assert (core.cached_predicted[key], core.cached_reported[key]) == (96, 16)
    third = turn(core, history, 0.4)
    assert third.request.predicted_cached_tokens == 16


def test_an_unknown_cache_predicts_nothing() -> None:
    core = SchedulingCore(make_config(routing="prefix_aware"), gate_limits=OPEN)
    history = list(range(100))
    first = turn(core, history, 0.0)
    core.on_completed(first.request, 100, 8, 0.1)
    assert turn(core, history, 0.2).request.predicted_cached_tokens == 0


def test_prefer_takes_the_cheapest_within_the_load_bound() -> None:
    fleet = make_fleet("x", "y", "z")
    send(fleet, "r", "x", 50, 0)
    # x's cost: its load of 50 and one request in flight, less CACHE_WEIGHT times what it
    # holds.
    busy = 50 + REQUEST_COST_TOKENS
    assert prefer(fleet, {"x": busy // CACHE_WEIGHT + 1, "y": 0, "z": 0}, "y", 120) \
        == ("x", "affinity")
    # A cache worth less than x's load: the idle one is cheaper.
    assert prefer(fleet, {"x": busy // CACHE_WEIGHT - 1, "y": 0, "z": 0}, "y", 120) \
        == ("y", "load")
    assert prefer(fleet, {"x": 0, "y": 0, "z": 0}, "y", 120) == ("y", "load")
    # Equal hits: the less loaded.
    assert prefer(fleet, {"x": 64, "y": 64, "z": 0}, "z", 120) == ("y", "affinity")
    send(fleet, "s", "x", 1000, 0)
    # x carries 1,050 against a mean of 350: over the bound (437.5 + the prompt's 120), so
    # however much it holds, the cheapest of the others takes it.
    assert prefer(fleet, {"x": 5000, "y": 32, "z": 0}, "z", 120) == ("y", "bounded")
    assert prefer(fleet, {"x": 5000, "y": 0, "z": 0}, "y", 120) == ("y", "bounded")


def test_the_drr_charge_and_pacing_count_the_prompt_the_engine_computes() -> None:
    core = core_with("least_tokens", backends=[{"url": "http://127.0.0.1:8001",
                                                "name": "b1"}])
    history = list(range(200))
    first = turn(core, history, 0.0)
    assert first.request.charged == 200 + 8  # nothing cached yet: the whole prompt
    core.on_completed(first.request, 200, 8, 0.1, cached_tokens=0)
    second = turn(core, history + [1] * 40, 0.2)
    # 192 of the 240 tokens are predicted cached: charged for the 48 computed, and pacing
    # counts those 48 in prefill.
    assert second.request.predicted_cached_tokens == 192
    assert second.request.charged == 48 + 8
    assert core.fleet["b1"].prefilling["a"] == 48
    # The engine reports 176 cached: the charge settles to the 64 it computed.
    core.on_completed(second.request, 240, 8, 0.3, cached_tokens=176)
    assert second.request.charged == 64 + 8
    assert not core.fleet["b1"].prefilling


def test_an_engine_without_prefix_caching_is_predicted_to_hold_nothing() -> None:
    core = SchedulingCore(make_config(routing="prefix_aware"), gate_limits=OPEN)
    for backend in core.fleet.names:
        core.on_backend_metrics(backend, replace(cache_shape(0.0), prefix_caching=False))
    history = list(range(100))
    first = turn(core, history, 0.0)
    core.on_completed(first.request, 100, 8, 0.1, cached_tokens=0)
    assert turn(core, history, 0.2).request.predicted_cached_tokens == 0


def test_answers_without_cached_tokens_turn_the_backend_s_index_off() -> None:
    core = core_with("prefix_aware", backends=[{"url": "http://127.0.0.1:8001",
                                                 "name": "b1"}])
    history = list(range(100))
    first = turn(core, history, 0.0)
    core.on_completed(first.request, 100, 8, 0.1)  # no prompt_tokens_details
    assert core.unreported == {"b1"}
    second = turn(core, history, 0.2)
    assert second.request.predicted_cached_tokens == 0
    assert second.request.charged == 100 + 8  # the full charge, as without a prefix cache
    core.on_backend_metrics("b1", cache_shape(0.3))  # a later scrape does not turn it back
    core.on_completed(second.request, 100, 8, 0.4)
    assert turn(core, history, 0.5).request.predicted_cached_tokens == 0
    assert core.snapshot(0.5)["backends"]["b1"]["prefix_index"]["reported"] is False


def test_nothing_is_predicted_before_an_answer_reports_cached_tokens() -> None:
    """Until the engine has shown it reports what it found cached, a prediction could not be
    settled and would undercount the prefill backlog (a flood of prompts sharing a prefix
    crowded an engine's queue in its first second): the index learns, predicts nothing."""
    core = core_with("prefix_aware", backends=[{"url": "http://127.0.0.1:8001",
                                                 "name": "b1"}])
    history = list(range(100))
    first = turn(core, history, 0.0)
    second = turn(core, history, 0.1)  # the first is still in flight: nothing reported yet
    assert second.request.predicted_cached_tokens == 0
    assert core.fleet["b1"].prefill_tokens == 200
    core.on_completed(first.request, 100, 8, 0.2, cached_tokens=0)
    assert turn(core, history, 0.3).request.predicted_cached_tokens == 96


def test_the_kv_footprint_counts_a_shared_prefix_once_per_backend() -> None:
    core = core_with("least_tokens", backends=[{"url": "http://127.0.0.1:8001",
                                                "name": "b1"}])
    history = list(range(200))  # 12 full blocks of 16, and 8 tokens over
    unreported = turn(core, history, 0.0)
    # Before the engine has reported cached tokens, nothing is known shared: counted whole.
    assert core.fleet["b1"].kv.blocks() == -(-(200 + 8) // BLOCK)
    core.on_completed(unreported.request, 200, 8, 0.1, cached_tokens=0)
    turn(core, history, 0.2)
    turn(core, history + [1] * 40, 0.2, tenant="b")
    # The 12 blocks once, and each request's own: 13 - 12 and ceil(248 / 16) - 12.
    assert core.fleet["b1"].kv.blocks() == 12 + 1 + 4
    assert core.fleet["b1"].kv.tenant_blocks("a") == 12 + 1
