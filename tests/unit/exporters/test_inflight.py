"""Matching an end to its start without a shared id."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from weighbridge.exporters.inflight import InFlight, InFlightSet


def test_nearest_start_of_the_same_key() -> None:
    s = InFlightSet()
    s.add("a", 1.0, 10)
    s.add("a", 5.0, 50)
    s.add("b", 4.9, 99)
    assert s.pop_nearest("a", 4.0) == InFlight(5.0, 50)
    assert s.pop_nearest("a", 4.0) == InFlight(1.0, 10)
    assert s.pop_nearest("a", 4.0) is None
    assert s.count("b") == 1


@given(st.lists(st.tuples(st.floats(0, 1000), st.integers(0, 10**6)), max_size=40,
                unique_by=lambda e: e[0]))
def test_exact_start_times_pair_exactly(entries: list[tuple[float, int]]) -> None:
    """Ends reported with their own start time, in any order, get their own entry back."""
    s = InFlightSet()
    for at, tokens in entries:
        s.add("k", at, tokens)
    for at, tokens in reversed(entries):
        assert s.pop_nearest("k", at) == InFlight(at, tokens)
    assert s.count("k") == 0
