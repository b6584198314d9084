"""∫ L dt for Little's Law at the sidecar, against a brute-force sum over requests."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.sidecar.metrics import TimeInSystem

stays = st.lists(st.tuples(st.sampled_from(["a", "b"]), st.floats(0, 1000),
                           st.floats(0, 100)), max_size=60)


@given(stays=stays, now=st.floats(0, 1200))
def test_request_seconds_are_the_sum_of_stays_up_to_now(
        stays: list[tuple[str, float, float]], now: float) -> None:
    clock = TimeInSystem()
    # Replay arrivals and departures in time order, up to `now`.
    events = sorted([(a, 0, i) for i, (_, a, _) in enumerate(stays)]
                    + [(a + d, 1, i) for i, (_, a, d) in enumerate(stays)])
    for t, kind, i in events:
        if t > now:
            break
        tenant, arrival, _ = stays[i]
        if kind == 0:
            clock.enter(tenant, "standard", arrival)
        else:
            clock.leave(tenant, "standard", arrival, t)
    totals = clock.totals(now)
    for tenant in ("a", "b"):
        expected = sum(max(0.0, min(a + d, now) - a) for who, a, d in stays if who == tenant)
        got = totals.get((tenant, "standard"), 0.0)
        assert got == pytest.approx(expected, rel=1e-9, abs=1e-6)
