"""prefix_aware's trade of cache affinity against load, in tokens
(sidecar.routing.bounded_load.affine), and the prefill limits a prefix's holder may pass when
its cache pays for it (sidecar.eligibility.cache_pays_prefill): properties over 2-16
backends.

* Bounded load: the chosen backend never carries more than ``LOAD_BOUND`` times the mean
  load plus the request's prompt, whatever its cache holds.
* Within the bound the choice is the least token work with the request, a cached token
  weighing ``CACHE_WEIGHT`` tokens of load: a backend holding the prompt keeps it unless
  another has less load by more than that.
* The reason says which case it was.
* A prefill limit is passed only by what the cache saves: the overshoot is bounded.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tests.unit.sidecar.builders import make_fleet, prefer, send
from weighbridge.sidecar.eligibility import cache_pays_prefill
from weighbridge.sidecar.routing import Candidate
from weighbridge.sidecar.routing.bounded_load import (
    LOAD_BOUND,
    REQUEST_COST_TOKENS,
    affine,
    work,
)
from weighbridge.sidecar.routing.prefix_affinity import CACHE_WEIGHT


def held(load: int, inflight: int, cached: int, index: int) -> Candidate:
    """A backend of ``load`` outstanding tokens whose cache holds ``cached`` of the prompt,
    as prefix_aware weighs it (least_tokens, prefix_affinity at CACHE_WEIGHT)."""
    return Candidate(load, inflight, float(load), -CACHE_WEIGHT * cached, index)


def cached(c: Candidate) -> float:
    return -c.affinity / CACHE_WEIGHT


candidates = st.lists(
    st.tuples(st.integers(0, 50_000), st.integers(0, 64), st.integers(0, 8_000)),
    min_size=2, max_size=16,
).map(lambda rows: {f"b{i}": held(load, inflight, cached, i)
                    for i, (load, inflight, cached) in enumerate(rows)})
prompts = st.integers(1, 8_192)


def bound(fleet: dict[str, Candidate], prompt_tokens: int) -> float:
    return LOAD_BOUND * sum(c.load for c in fleet.values()) / len(fleet) + prompt_tokens


@given(candidates, prompts)
def test_the_choice_is_never_over_the_load_bound(fleet: dict[str, Candidate],
                                                 prompt_tokens: int) -> None:
    chosen, _ = affine(fleet, prompt_tokens)
    assert fleet[chosen].load <= bound(fleet, prompt_tokens)


@given(candidates, prompts)
def test_within_the_bound_the_least_work_with_the_cache_weighed_is_chosen(
        fleet: dict[str, Candidate], prompt_tokens: int) -> None:
    chosen, _ = affine(fleet, prompt_tokens)
    limit = bound(fleet, prompt_tokens)
    assert all(work(fleet[chosen]) <= work(c) for c in fleet.values() if c.load <= limit)


@given(candidates, prompts)
def test_the_reason_says_whether_it_holds_the_most_or_the_holders_were_over_the_bound(
        fleet: dict[str, Candidate], prompt_tokens: int) -> None:
    chosen, reason = affine(fleet, prompt_tokens)
    most = max(cached(c) for c in fleet.values())
    limit = bound(fleet, prompt_tokens)
    holder_within = any(cached(c) == most and c.load <= limit for c in fleet.values())
    if most == 0:
        assert reason == "load"
    elif cached(fleet[chosen]) == most:
        assert reason == "affinity"
    else:
        assert reason == ("load" if holder_within else "bounded")


@given(candidates, prompts, st.data())
def test_a_holder_within_the_bound_keeps_the_request_while_its_cache_outweighs_the_gap(
        fleet: dict[str, Candidate], prompt_tokens: int, data: st.DataObject) -> None:
    name = data.draw(st.sampled_from(sorted(fleet)))
    others = [c for n, c in fleet.items() if n != name]
    # The holder's load: at most what the least loaded other backend's work, plus what the
    # cache outweighs, allows (and within the bound).
    holder = fleet[name]
    holders = int(max(cached(c) for c in others)) + data.draw(st.integers(1, 4_000))
    cheapest = min(work(c) for c in others)
    room = cheapest + CACHE_WEIGHT * holders - REQUEST_COST_TOKENS * holder.inflight
    fleet = {**fleet, name: held(int(max(0, min(room, holder.load))), holder.inflight,
                                 holders, holder.index)}
    if fleet[name].load > bound(fleet, prompt_tokens) or work(fleet[name]) > cheapest:
        return  # the load it was drawn with cannot be met at this inflight
    chosen, reason = affine(fleet, prompt_tokens)
    assert cached(fleet[chosen]) == holders and reason == "affinity"


@given(candidates, prompts, st.integers(1, 4_000), st.data())
def test_more_of_the_prompt_cached_never_moves_the_request_away(
        fleet: dict[str, Candidate], prompt_tokens: int, more: int,
        data: st.DataObject) -> None:
    chosen, _ = affine(fleet, prompt_tokens)
    c = fleet[chosen]
    grown = {**fleet, chosen: held(c.load, c.inflight, int(cached(c)) + more, c.index)}
    assert affine(grown, prompt_tokens)[0] == chosen


def test_nothing_cached_anywhere_is_a_choice_by_load() -> None:
    fleet = {"a": held(100, 1, 0, 0), "b": held(0, 0, 0, 1)}
    assert affine(fleet, 50) == ("b", "load")


def test_a_prefix_s_holder_prefilling_another_prompt_keeps_the_request() -> None:
    """vllm bench's prefix_repetition: the holder of a 1,536-token prefix prefills a 1,792-token
    prompt of another prefix; the next request of its prefix computes 256 tokens there, all
    1,792 on the idle backend: it stays (a cached token weighed as one token of load sent it
    to the idle one, which recomputed the prefix)."""
    holder = held(1792 + 64, 1, 1536, 0)
    fleet = {"holder": holder, "idle": held(0, 0, 0, 1), "other": held(320, 1, 0, 2)}
    assert affine(fleet, 1792) == ("holder", "affinity")
    assert holder.load + REQUEST_COST_TOKENS * holder.inflight - cached(holder) > 0


@given(st.integers(0, 100_000), st.integers(0, 100_000), st.integers(0, 100_000),
       st.integers(0, 100_000))
def test_a_prefill_limit_is_passed_only_by_what_the_cache_saves(
        backlog: int, limit: int, computed: int, saved: int) -> None:
    passed = cache_pays_prefill(backlog, limit, computed, saved)
    assert passed == (backlog + computed - limit <= saved)
    # More saved never turns a pass into a hold; more backlog never turns a hold into a pass.
    if passed:
        assert cache_pays_prefill(backlog, limit, computed, saved + 1)
    else:
        assert not cache_pays_prefill(backlog + 1, limit, computed, saved)
    assert cache_pays_prefill(backlog, None, computed, saved)


def test_prefer_reads_the_router_s_load_and_requests_in_flight() -> None:
    fleet = make_fleet("x", "y", "z")
    send(fleet, "r", "x", 50, 0)
    busy = 50 + REQUEST_COST_TOKENS  # x's load and its one request in flight
    assert prefer(fleet, {"x": busy // CACHE_WEIGHT, "y": 0, "z": 0}, "y", 120) \
        == ("x", "affinity")
    assert prefer(fleet, {"x": busy // CACHE_WEIGHT - 1, "y": 0, "z": 0}, "y", 120) \
        == ("y", "load")
    # Nothing cached: ``pick``'s choice stands.
    assert prefer(fleet, {"x": 0, "y": 0, "z": 0}, "z", 120) == ("z", "load")
