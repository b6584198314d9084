"""Token buckets and the per-tenant limiter: exact Retry-After, atomic admission, debt,
refunds, and the capacity + rate x elapsed bound."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.sidecar.config import RateLimits
from weighbridge.sidecar.ratelimit import MONTH_S, Admit, LimitTable, TenantRateLimiter, TokenBucket
from weighbridge.sidecar.rejection import RATE_LIMITED, Reject


def limiter_of(*args: Any, **kwargs: Any) -> TenantRateLimiter:
    """A limiter over ``LimitTable(*args, **kwargs)``."""
    return TenantRateLimiter(LimitTable(*args, **kwargs))


def test_bucket_refills_continuously_and_caps_at_capacity() -> None:
    b = TokenBucket.full(60, 60.0, now=0.0)
    b.take(60, 0.0)
    assert b.wait_s(30, 0.0) == pytest.approx(30.0)
    b.refill(15.0)
    assert b.level == pytest.approx(15.0)
    b.refill(1000.0)
    assert b.level == 60.0
    b.refill(500.0)  # time going backwards changes nothing
    assert b.level == 60.0


def test_bucket_debt_and_capped_refund() -> None:
    b = TokenBucket.full(100, 100.0, now=0.0)
    b.take(250, 0.0)
    assert b.level == -150
    assert b.wait_s(10, 0.0) == pytest.approx(160.0)
    b.give(1000, 0.0)
    assert b.level == 100


def test_admit_charges_every_bucket_atomically() -> None:
    limiter = limiter_of({"a": RateLimits(requests_per_minute=10, tokens_per_minute=1000)})
    assert limiter.admit("a", "/x", 600, 0.0) == Admit(600)
    rejected = limiter.admit("a", "/x", 600, 0.0)
    assert isinstance(rejected, Reject) and rejected.reason == RATE_LIMITED
    # the rejected attempt charged nothing: the request bucket still has 9
    snap = limiter.snapshot(0.0)["tenants"]["a"]
    assert snap["requests_per_minute"]["level"] == 9
    assert snap["tokens_per_minute"]["level"] == 400


def test_retry_after_is_exact_for_the_binding_bucket() -> None:
    limiter = limiter_of({"a": RateLimits(requests_per_minute=60, tokens_per_minute=6000)})
    assert isinstance(limiter.admit("a", "/x", 6000, 0.0), Admit)
    rejected = limiter.admit("a", "/x", 3000, 0.0)
    assert isinstance(rejected, Reject)
    assert rejected.retry_after_s == pytest.approx(30.0)  # tokens bind, not requests (1s)
    assert "tokens_per_minute" in rejected.detail
    assert isinstance(limiter.admit("a", "/x", 3000, 29.99), Reject)
    assert isinstance(limiter.admit("a", "/x", 3000, 30.0), Admit)


def test_a_request_bigger_than_the_bucket_can_never_fit() -> None:
    limiter = limiter_of({"a": RateLimits(tokens_per_minute=1000)})
    rejected = limiter.admit("a", "/x", 1001, 0.0)
    assert isinstance(rejected, Reject)
    assert rejected.retry_after_s is None and "never" in rejected.detail


def test_settle_charges_underestimates_into_debt_and_refunds_overestimates() -> None:
    limiter = limiter_of({"a": RateLimits(tokens_per_minute=600)})
    limiter.admit("a", "/x", 100, 0.0)
    limiter.settle("a", "/x", estimated=100, actual=1000, now=0.0)
    level = limiter.snapshot(0.0)["tenants"]["a"]["tokens_per_minute"]["level"]
    assert level == pytest.approx(-400)
    rejected = limiter.admit("a", "/x", 100, 0.0)
    assert rejected.retry_after_s == pytest.approx(50.0)  # (100 + 400) / 10 per s
    limiter.settle("a", "/x", estimated=900, actual=0, now=0.0)
    assert isinstance(limiter.admit("a", "/x", 100, 0.0), Admit)


def test_refund_returns_tokens_but_not_the_request() -> None:
    limiter = limiter_of({"a": RateLimits(requests_per_minute=1, tokens_per_minute=100)})
    limiter.admit("a", "/x", 100, 0.0)
    limiter.refund("a", "/x", 100, 0.0)
    snap = limiter.snapshot(0.0)["tenants"]["a"]
    assert snap["tokens_per_minute"]["level"] == 100
    assert snap["requests_per_minute"]["level"] == 0


def test_long_windows_are_buckets_over_the_window() -> None:
    limiter = limiter_of({"a": RateLimits(tokens_per_month=3000)})
    assert isinstance(limiter.admit("a", "/x", 3000, 0.0), Admit)
    rejected = limiter.admit("a", "/x", 100, 0.0)
    assert rejected.retry_after_s == pytest.approx(100 * MONTH_S / 3000)


def test_endpoint_limits_apply_on_top_of_tenant_limits() -> None:
    limiter = limiter_of(
        {"a": RateLimits(requests_per_minute=100)},
        {("a", "/embed"): RateLimits(requests_per_minute=1)},
    )
    assert isinstance(limiter.admit("a", "/embed", 1, 0.0), Admit)
    assert isinstance(limiter.admit("a", "/embed", 1, 0.0), Reject)
    assert isinstance(limiter.admit("a", "/chat", 1, 0.0), Admit)
    snap = limiter.snapshot(0.0)
    assert snap["tenants"]["a"]["requests_per_minute"]["level"] == 98
    assert snap["endpoints"]["a"]["/embed"]["requests_per_minute"]["level"] == 0


def test_model_defaults_give_each_tenant_its_own_buckets_and_own_entries_replace_them() -> None:
    limiter = limiter_of(
        {"a": RateLimits(), "b": RateLimits(), "c": RateLimits()},
        model_limits={("c", "big"): RateLimits(requests_per_minute=3)},
        model_defaults={"big": RateLimits(requests_per_minute=1)},
    )
    for tenant in ("a", "b"):  # one bucket of 1 each, not one shared by both
        assert isinstance(limiter.admit(tenant, "/v1/completions", 1, 0.0, model="big"), Admit)
        assert isinstance(limiter.admit(tenant, "/v1/completions", 1, 0.0, model="big"), Reject)
        # Another model, and a request naming none, meet no model limit.
        assert isinstance(limiter.admit(tenant, "/v1/completions", 1, 0.0, model="small"), Admit)
        assert isinstance(limiter.admit(tenant, "/v1/completions", 1, 0.0), Admit)
    admitted = [limiter.admit("c", "/v1/completions", 1, 0.0, model="big") for _ in range(4)]
    assert [isinstance(a, Admit) for a in admitted] == [True, True, True, False]
    snap = limiter.snapshot(0.0)
    assert set(snap["models"]) == {"a", "b", "c"}
    assert snap["models"]["c"]["big"]["requests_per_minute"]["capacity"] == 3


def test_endpoint_defaults_apply_per_tenant_unless_it_has_its_own() -> None:
    limiter = limiter_of(
        {"a": RateLimits(), "b": RateLimits()},
        {("b", "/v1/embeddings"): RateLimits()},  # b's own entry: unlimited there
        endpoint_defaults={"/v1/embeddings": RateLimits(tokens_per_minute=100)},
    )
    assert isinstance(limiter.admit("a", "/v1/embeddings", 100, 0.0), Admit)
    assert isinstance(limiter.admit("a", "/v1/embeddings", 1, 0.0), Reject)
    assert isinstance(limiter.admit("a", "/v1/completions", 1000, 0.0), Admit)
    assert isinstance(limiter.admit("b", "/v1/embeddings", 10_000, 0.0), Admit)


def test_a_model_limit_refunds_and_settles_like_the_others() -> None:
    limiter = limiter_of({"a": RateLimits()},
                                model_defaults={"m": RateLimits(tokens_per_minute=1000)})
    admitted = limiter.admit("a", "/v1/completions", 600, 0.0, model="m")
    assert isinstance(admitted, Admit)
    limiter.refund("a", "/v1/completions", 600, 0.0, model="m")
    assert isinstance(limiter.admit("a", "/v1/completions", 1000, 0.0, model="m"), Admit)
    limiter.settle("a", "/v1/completions", 1000, 400, 0.0, model="m")  # used less: refunded
    level = limiter.snapshot(0.0)["models"]["a"]["m"]["tokens_per_minute"]["level"]
    assert level == 600


def test_unlimited_tenants_always_pass() -> None:
    limiter = limiter_of({"a": RateLimits()})
    for _ in range(1000):
        assert isinstance(limiter.admit("a", "/x", 10**9, 0.0), Admit)
    assert isinstance(limiter.admit("stranger", "/x", 1, 0.0), Admit)


EVENTS = st.lists(
    st.tuples(
        st.floats(0, 5, allow_nan=False),  # time advance
        st.sampled_from(["admit", "admit", "admit", "settle", "refund"]),
        st.integers(1, 400),
        st.integers(0, 600),
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(events=EVENTS, tpm=st.integers(100, 2000), rpm=st.integers(1, 120))
def test_never_admits_more_than_capacity_plus_rate_times_elapsed(events, tpm, rpm) -> None:
    """Over any window [t_a, t_b]: admitted <= capacity + rate * (t_b - t_a) + credits given
    back inside the window (refunds, over-estimates settled); debts only make it tighter."""
    limiter = limiter_of({"a": RateLimits(requests_per_minute=rpm, tokens_per_minute=tpm)})
    now = 0.0
    admitted: list[tuple[float, int]] = []
    credits: list[tuple[float, int]] = []
    outstanding: list[int] = []
    for dt, kind, tokens, actual in events:
        now += dt
        if kind == "admit":
            result = limiter.admit("a", "/x", tokens, now)
            if isinstance(result, Admit):
                admitted.append((now, tokens))
                outstanding.append(tokens)
            elif result.retry_after_s is not None:
                assert result.retry_after_s > 0
                # exact: the same request fits once retry_after has passed (no other event)
                probe = limiter_of(
                    {"a": RateLimits(requests_per_minute=rpm, tokens_per_minute=tpm)}
                )
                probe._scopes_by_key = _copy_scopes(limiter)
                later = now + result.retry_after_s
                assert isinstance(probe.admit("a", "/x", tokens, later), Admit)
        elif outstanding:
            estimated = outstanding.pop(0)
            if kind == "settle":
                limiter.settle("a", "/x", estimated, actual, now)
                if actual < estimated:
                    credits.append((now, estimated - actual))
            else:
                limiter.refund("a", "/x", estimated, now)
                credits.append((now, estimated))
    for i, (t_a, _) in enumerate(admitted):
        total = 0
        for count, (t_b, tokens) in enumerate(admitted[i:], start=1):
            total += tokens
            given_back = sum(c for t, c in credits if t_a <= t <= t_b)
            elapsed = t_b - t_a
            assert total <= tpm + tpm / 60 * elapsed + given_back + 1e-6
            assert count <= rpm + rpm / 60 * elapsed + 1e-6


def _copy_scopes(limiter: TenantRateLimiter):
    import copy

    return copy.deepcopy(limiter._scopes_by_key)


def test_a_monthly_request_budget_beside_the_per_minute_one() -> None:
    limiter = limiter_of({"a": RateLimits(requests_per_minute=100,
                                                 requests_per_month=3)})
    for _ in range(3):
        assert isinstance(limiter.admit("a", "/v1/completions", 10, 0.0), Admit)
    rejected = limiter.admit("a", "/v1/completions", 10, 0.0)
    assert isinstance(rejected, Reject) and rejected.reason == RATE_LIMITED
    assert "requests_per_month" in rejected.detail
    # The month refills at 3 per 30 days: one request after 10 days, exactly.
    assert rejected.retry_after_s == pytest.approx(MONTH_S / 3)
    assert isinstance(limiter.admit("a", "/v1/completions", 10, MONTH_S / 3), Admit)


def test_a_tiers_limit_binds_every_tenant_in_the_tier_together() -> None:
    limiter = limiter_of(
        {"a": RateLimits(), "b": RateLimits()},
        tier_limits={"interactive": RateLimits(tokens_per_minute=1000),
                     "standard": RateLimits()})
    assert isinstance(limiter.admit("a", "/e", 600, 0.0, "interactive"), Admit)
    # b has no limit of its own, but the tier it asks for is nearly spent...
    refused = limiter.admit("b", "/e", 600, 0.0, "interactive")
    assert isinstance(refused, Reject) and refused.retry_after_s == pytest.approx(12.0)
    # ...while the tier below takes it at once.
    assert isinstance(limiter.admit("b", "/e", 600, 0.0, "standard"), Admit)
    # Settling and refunds reach the tier's bucket too.
    limiter.refund("a", "/e", 600, 0.0, "interactive")
    assert isinstance(limiter.admit("b", "/e", 600, 0.0, "interactive"), Admit)
    assert limiter.snapshot(0.0)["tiers"]["interactive"]["tokens_per_minute"]["level"] \
        == pytest.approx(400)
