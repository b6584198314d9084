"""cached_prompt_token_weight: what a prompt token the engine found cached counts in the
token rate limits, settled with the reported cached tokens; the tier's weight replaces the
endpoint's; nothing reported, nothing discounted; the DRR charge counts cached tokens free
whatever the weight."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.unit.sidecar.test_core import CHAT, arrive, make_config
from weighbridge.sidecar.admission import GateLimits
from weighbridge.sidecar.config import ConfigError, parse_config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.ratelimit import limited_tokens
from weighbridge.sidecar.request import QueuedRequest

LIMIT = 100_000  # tenant a's tokens_per_minute in make_config


def level(core: SchedulingCore) -> float:
    return core.rate_limiter.snapshot(0.0)["tenants"]["a"]["tokens_per_minute"]["level"]


def served(core: SchedulingCore, prompt: int, output: int, cached: int | None) -> None:
    """One request of tenant a at t=0, dispatched and completed with ``cached`` reported."""
    request = arrive(core, "a", 0.0, prompt_tokens=prompt, max_tokens=output)
    assert isinstance(request, QueuedRequest)
    (dispatch,) = core.dispatch_ready(0.0)
    core.on_completed(dispatch.request, prompt, output, 0.0, cached_tokens=cached)


def core_with(**overrides: Any) -> SchedulingCore:
    return SchedulingCore(make_config(**overrides), gate_limits=GateLimits(max_inflight=10))


@given(prompt=st.integers(0, 10_000), output=st.integers(0, 10_000),
       cached=st.integers(-5, 12_000), weight=st.floats(0, 1))
def test_limited_tokens_lies_between_the_computed_and_every_token(
        prompt: int, output: int, cached: int, weight: float) -> None:
    counted = limited_tokens(prompt, output, cached, weight)
    computed = prompt + output - max(0, min(cached, prompt))
    assert computed <= counted <= prompt + output
    assert limited_tokens(prompt, output, cached, 1.0) == prompt + output
    assert limited_tokens(prompt, output, cached, 0.0) == computed


def test_by_default_rate_limits_count_every_prompt_token() -> None:
    core = core_with()
    served(core, 1000, 50, cached=800)
    assert level(core) == LIMIT - 1050


def test_an_endpoint_s_weight_discounts_the_reported_cached_tokens() -> None:
    core = core_with(endpoints={CHAT: {"initial_output_estimate": 100,
                                       "cached_prompt_token_weight": 0.25}})
    served(core, 1000, 50, cached=800)
    # 200 computed + a quarter of the 800 cached + 50 output.
    assert level(core) == LIMIT - (200 + 200 + 50)


def test_the_tier_s_weight_replaces_the_endpoint_s() -> None:
    core = core_with(
        endpoints={CHAT: {"initial_output_estimate": 100, "cached_prompt_token_weight": 0.25}},
        tiers={"standard": {"rank": 2, "cached_prompt_token_weight": 0.0},
               "interactive": {"rank": 1}})
    served(core, 1000, 50, cached=800)
    assert level(core) == LIMIT - (200 + 50)


def test_nothing_reported_nothing_discounted() -> None:
    core = core_with(endpoints={CHAT: {"initial_output_estimate": 100,
                                       "cached_prompt_token_weight": 0.0}})
    served(core, 1000, 50, cached=None)
    assert level(core) == LIMIT - 1050


def test_a_failed_request_is_not_discounted() -> None:
    core = core_with(endpoints={CHAT: {"initial_output_estimate": 100,
                                       "cached_prompt_token_weight": 0.0}})
    request = arrive(core, "a", 0.0, prompt_tokens=1000, max_tokens=50)
    assert isinstance(request, QueuedRequest)
    (dispatch,) = core.dispatch_ready(0.0)
    core.on_failed(dispatch.request, 1000, 10, 0.0)
    assert level(core) == LIMIT - 1010


def test_the_drr_charge_counts_cached_tokens_free_whatever_the_weight() -> None:
    core = core_with(endpoints={CHAT: {"initial_output_estimate": 100,
                                       "cached_prompt_token_weight": 1.0}})
    request = arrive(core, "a", 0.0, prompt_tokens=1000, max_tokens=50)
    assert isinstance(request, QueuedRequest)
    (dispatch,) = core.dispatch_ready(0.0)
    core.on_completed(dispatch.request, 1000, 50, 0.0, cached_tokens=800)
    assert dispatch.request.charged == 200 + 50
    assert level(core) == LIMIT - 1050


@pytest.mark.parametrize("weight", [-0.1, 1.5])
def test_a_weight_outside_0_1_is_refused(weight: float) -> None:
    base = {"tenants": {"a": {"tier": "standard", "api_keys": ["plain:ka"]}},
            "backends": [{"url": "http://127.0.0.1:8001"}]}
    with pytest.raises(ConfigError, match="cached_prompt_token_weight"):
        parse_config({**base, "endpoints": {CHAT: {"cached_prompt_token_weight": weight}}})
    with pytest.raises(ConfigError, match="cached_prompt_token_weight"):
        parse_config({**base, "tiers": {"standard": {"rank": 1,
                                                     "cached_prompt_token_weight": weight}}})
