"""Service-normalised cost (sidecar/service_cost.py, decision 0026): engine seconds per
computed token per (endpoint, model, prompt-length band), and the DRR charge it scales."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.sidecar.test_core import CHAT, arrive, make_config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.replica import Replica
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.service_cost import BANDS, MAX_FACTOR, ServiceCost, band

OBSERVATIONS = st.lists(st.tuples(st.sampled_from(["/a", "/b"]), st.integers(0, 40_000),
                                  st.integers(1, 10_000),
                                  st.floats(1e-6, 100, allow_nan=False)), max_size=60)


def test_bands_split_prompts_by_length() -> None:
    assert [band(p) for p in (0, BANDS[0] - 1, BANDS[0], BANDS[-1], 10**6)] == [
        0, 0, 1, len(BANDS), len(BANDS)]


@settings(max_examples=200, deadline=None)
@given(OBSERVATIONS, st.sampled_from(["/a", "/b", "/c"]), st.integers(0, 40_000))
def test_a_factor_is_one_until_seen_and_always_bounded(observations, endpoint,
                                                       prompt) -> None:
    cost = ServiceCost()
    assert cost.factor(endpoint, None, prompt) == 1.0
    for path, p, tokens, seconds in observations:
        cost.observe(path, None, p, tokens, seconds)
    assert 1 / MAX_FACTOR <= cost.factor(endpoint, None, prompt) <= MAX_FACTOR
    if endpoint == "/c":
        assert cost.factor(endpoint, None, prompt) == 1.0


def test_the_dearer_key_has_the_larger_factor() -> None:
    cost = ServiceCost(alpha=0.5)  # the reference: 0.625 ms a token
    cost.observe(CHAT, "m", 100, 500, 0.5)  # 1 ms a token: decode-heavy
    cost.observe(CHAT, "m", 6000, 6000, 1.5)  # 0.25 ms a token: one long prefill
    assert cost.factor(CHAT, "m", 100) > 1 > cost.factor(CHAT, "m", 6000)
    assert cost.factor(CHAT, "other-model", 100) == 1.0  # a key of its own


def test_the_charge_follows_the_factor_fixed_at_arrival() -> None:
    """On: a request is charged its tokens times its key's factor, the same factor at
    dispatch and at settlement; a completed request teaches its key."""
    core = SchedulingCore(make_config(scheduler={"policy": "drr", "service_cost": True}))
    assert core.service_cost is not None
    first = arrive(core, prompt_tokens=100)
    assert isinstance(first, QueuedRequest) and first.cost_factor == 1.0
    list(core.dispatch_ready(0.0))
    core.on_first_token(first, 0.1)
    core.on_completed(first, 100, 100, 2.0)
    core.service_cost.observe(CHAT, None, 8000, 8000, 0.4)  # a cheap long prompt, seen
    second = arrive(core, prompt_tokens=100, now=2.0)
    assert isinstance(second, QueuedRequest) and second.cost_factor > 1.0
    replica = Replica(core)
    replica.take_booked()
    list(core.dispatch_ready(2.0))
    # Booked in turns of the endpoint's quantum (1,000 tokens), at its factor.
    assert sum(replica.take_booked().values()) == second.cost * second.cost_factor / 1000
    core.on_first_token(second, 2.1)
    core.on_completed(second, 100, 300, 3.0)  # 200 more than estimated: settled at it too
    assert sum(replica.take_booked().values()) == 200 * second.cost_factor / 1000
    factors = core.snapshot(3.0)["service_cost"]  # /admin/state shows each key's factor
    assert factors[f"{CHAT} - 0"] > 1 > factors[f"{CHAT} - 2"]
    assert SchedulingCore(make_config()).service_cost is None  # off by default
