"""Little's Law window: hand-computed cases, an exact brute-force property, steady processes
that close (ratio ~1) and lossy ones that do not."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weighbridge.exporters.littles_law import LittlesLawWindow


@dataclass(frozen=True)
class Visit:
    start: float
    end: float
    tokens: int


def brute_force(visits: list[Visit], window_s: float, at: float) -> tuple[float, float,
                                                                          float, float]:
    """(L, λW) at request and token level straight from the definitions, for a clock whose
    origin is 0 (a window reaching before it averages over the time since)."""
    lo = at - window_s
    span = min(window_s, at)
    occ = occ_tok = tis = tis_tok = 0.0
    for v in visits:
        end = min(v.end, at) if v.start <= at else v.start
        overlap = max(0.0, min(end, at) - max(v.start, lo))
        occ += overlap
        occ_tok += overlap * v.tokens
        if lo < v.end <= at:
            tis += v.end - v.start
            tis_tok += (v.end - v.start) * v.tokens
    return occ / span, tis / span, occ_tok / span, tis_tok / span


def feed(window: LittlesLawWindow, visits: list[Visit], key: str = "t") -> None:
    """Report entries and ends in time order (an end is reported with its completion)."""
    events = [(v.start, 0, v) for v in visits] + [(v.end, 1, v) for v in visits]
    for at, kind, v in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 0:
            window.entered(key, v.tokens, at)
        else:
            window.left(key, v.tokens, at)
            window.completed(key, v.end - v.start, v.tokens, at)


def test_one_request_inside_the_window() -> None:
    w = LittlesLawWindow(10.0)
    w.entered("a", 100, 0.0)
    w.left("a", 100, 4.0)
    w.completed("a", 4.0, 100, 4.0)
    r = w.reading(["a"], 10.0)
    assert r["request"].l == pytest.approx(0.4)
    assert r["request"].lambda_w == pytest.approx(0.4)
    assert r["request"].ratio == pytest.approx(1.0)
    assert r["token"].l == pytest.approx(40.0)
    assert r["token"].lambda_w == pytest.approx(40.0)
    assert r["request"].completions == 1


def test_window_edges_hand_computed() -> None:
    w = LittlesLawWindow(10.0)
    # A: 0..14 straddles the window start (10, 20]; B: 16.. still in flight at 20.
    w.entered("a", 1, 0.0)
    w.left("a", 1, 14.0)
    w.completed("a", 14.0, 1, 14.0)
    w.entered("a", 1, 16.0)
    r = w.reading(["a"], 20.0)["request"]
    assert r.l == pytest.approx((4.0 + 4.0) / 10)  # A's 10..14 and B's 16..20
    assert r.lambda_w == pytest.approx(14.0 / 10)  # A's whole stay
    assert r.completions == 1
    # Later, A has left the window: only B remains, in flight, nothing completed.
    r = w.reading(["a"], 30.0)["request"]
    assert r.l == pytest.approx(1.0)
    assert r.lambda_w == 0.0
    assert r.ratio == math.inf


def test_idle_key_reads_nan_and_unknown_key_reads_zero() -> None:
    w = LittlesLawWindow(5.0)
    w.entered("a", 1, 0.0)
    w.left("a", 1, 1.0)
    w.completed("a", 1.0, 1, 1.0)
    assert math.isnan(w.reading(["a"], 100.0)["request"].ratio)
    assert w.reading(["nobody"], 100.0)["token"].l == 0.0


def test_late_entry_counts_from_its_own_time() -> None:
    """A request reported at its scheduled time, after other events, is exact."""
    w = LittlesLawWindow(10.0)
    w.entered("a", 1, 0.0)
    w.left("a", 1, 6.0)
    w.completed("a", 6.0, 1, 6.0)
    w.entered("a", 1, 2.0)  # reported late
    w.left("a", 1, 8.0)
    w.completed("a", 6.0, 1, 8.0)
    r = w.reading(["a"], 10.0)["request"]
    assert r.l == pytest.approx(12.0 / 10)
    assert r.ratio == pytest.approx(1.0)


def test_leave_reported_before_the_last_reading_keeps_totals_monotone() -> None:
    w = LittlesLawWindow(10.0)
    w.entered("a", 5, 0.0)
    before = w.totals("a", 4.0)
    w.left("a", 5, 2.0)  # says it left at 2, after a reading at 4 counted it until 4
    after = w.totals("a", 4.0)
    assert after.occupancy_request_seconds >= before.occupancy_request_seconds
    assert after.occupancy_token_seconds >= before.occupancy_token_seconds
    assert w.in_flight("a") == (0.0, 0.0)


def test_validation() -> None:
    with pytest.raises(ValueError, match="window_s"):
        LittlesLawWindow(0)
    w = LittlesLawWindow(1.0)
    with pytest.raises(ValueError, match="time_in_system_s"):
        w.completed("a", -1.0, 1, 0.0)
    w.reading(["a"], 5.0)
    with pytest.raises(ValueError, match="backwards"):
        w.reading(["a"], 4.0)


visit_lists = st.lists(
    st.tuples(st.floats(0, 100), st.floats(0, 30), st.integers(0, 5000)).map(
        lambda t: Visit(t[0], t[0] + t[1], t[2])),
    max_size=40)


@settings(max_examples=200, deadline=None)
@given(visits=visit_lists, window_s=st.floats(0.5, 60), at=st.floats(130, 300))
def test_matches_the_definition_exactly(visits: list[Visit], window_s: float,
                                        at: float) -> None:
    """Whatever the visits and window, read after them all, L and λW are the definitions."""
    w = LittlesLawWindow(window_s)
    w.entered("origin", 0, 0.0)  # pin the clock origin so early windows are full length
    w.left("origin", 0, 0.0)
    feed(w, visits)
    r = w.reading(["t"], at)
    l_req, lw_req, l_tok, lw_tok = brute_force(visits, window_s, at)
    assert r["request"].l == pytest.approx(l_req, rel=1e-9, abs=1e-9)
    assert r["request"].lambda_w == pytest.approx(lw_req, rel=1e-9, abs=1e-9)
    assert r["token"].l == pytest.approx(l_tok, rel=1e-9, abs=1e-6)
    assert r["token"].lambda_w == pytest.approx(lw_tok, rel=1e-9, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(visits=visit_lists, window_s=st.floats(0.5, 60),
       reads=st.lists(st.floats(0.01, 140), min_size=1, max_size=6))
def test_readings_interleaved_with_events_match_the_definition(
        visits: list[Visit], window_s: float, reads: list[float]) -> None:
    """Readings taken while events keep coming (the scrape pattern) are exact too."""
    w = LittlesLawWindow(window_s)
    w.entered("origin", 0, 0.0)
    w.left("origin", 0, 0.0)
    events = sorted([(v.start, 0, i) for i, v in enumerate(visits)]
                    + [(v.end, 1, i) for i, v in enumerate(visits)]
                    + [(r, 2, -1) for r in reads])
    seen: list[Visit] = []
    for at, kind, i in events:
        if kind == 0:
            w.entered("t", visits[i].tokens, at)
            seen.append(visits[i])
        elif kind == 1:
            v = visits[i]
            w.left("t", v.tokens, at)
            w.completed("t", v.end - v.start, v.tokens, at)
        else:
            r = w.reading(["t"], at)
            # Visits not yet ended are in flight up to ``at``; brute_force clips them.
            l_req, lw_req, _, _ = brute_force(seen, window_s, at)
            assert r["request"].l == pytest.approx(l_req, rel=1e-9, abs=1e-9)
            assert r["request"].lambda_w == pytest.approx(lw_req, rel=1e-9, abs=1e-9)


def totals_ratio(w: LittlesLawWindow, key: str, t0: float, t1: float) -> tuple[float, float]:
    """What the recording rule computes: increase of the raw counters between two readings."""
    a, b = w.totals(key, t0), w.totals(key, t1)
    return (b.occupancy_request_seconds - a.occupancy_request_seconds,
            b.time_in_system_seconds - a.time_in_system_seconds)


def steady_visits(rate: float, mean_s: float, horizon: float, seed: int,
                  max_tokens: int = 512) -> list[Visit]:
    """Poisson arrivals; time in system grows with the request's size (longer outputs)."""
    rng = random.Random(seed)
    visits, t = [], 0.0
    while True:
        t += rng.expovariate(rate)
        if t > horizon:
            return visits
        tokens = rng.randint(16, max_tokens)
        stay = rng.expovariate(1 / mean_s) * 0.5 + mean_s * tokens / max_tokens
        visits.append(Visit(t, t + stay, tokens))


@settings(max_examples=25, deadline=None)
@given(rate=st.floats(2, 20), mean_s=st.floats(0.1, 2.0), seed=st.integers(0, 2**32))
def test_steady_process_closes(rate: float, mean_s: float, seed: int) -> None:
    # Long enough that the edges (a few W) are small against the window and ~1000 complete.
    window_s = max(100 * mean_s, 1000 / rate)
    horizon = 2 * window_s
    visits = steady_visits(rate, mean_s, horizon, seed)
    w = LittlesLawWindow(window_s)
    feed(w, [v for v in visits if v.end <= horizon])
    for v in visits:  # still in flight at the horizon
        if v.end > horizon:
            w.entered("t", v.tokens, v.start)
    r = w.reading(["t"], horizon)
    assert 0.9 <= r["request"].ratio <= 1.1, r
    assert 0.9 <= r["token"].ratio <= 1.1, r


def test_dropping_a_fifth_of_the_ends_departs_from_one() -> None:
    """The generator loses 20% of requests: they enter, never end."""
    window_s, horizon = 60.0, 240.0
    visits = steady_visits(10, 0.5, horizon, seed=7)
    honest, lossy = LittlesLawWindow(window_s), LittlesLawWindow(window_s)
    rng = random.Random(1)
    done = [v for v in visits if v.end <= horizon]
    feed(honest, done)
    for v in done:
        if rng.random() < 0.2:
            lossy.entered("t", v.tokens, v.start)  # never ends
        else:
            feed(lossy, [v])
    ok = honest.reading(["t"], horizon)
    bad = lossy.reading(["t"], horizon)
    assert 0.95 <= ok["request"].ratio <= 1.05
    # 20% of a minute's arrivals pile up for ever: L grows by ~ 0.2 x rate x age.
    assert bad["request"].ratio > 2.0, bad
    assert bad["token"].ratio > 2.0, bad


def test_uncounted_completions_depart_from_one() -> None:
    """20% leave the system without being counted as completions, and the converse."""
    window_s, horizon = 60.0, 240.0
    done = [v for v in steady_visits(10, 0.5, horizon, seed=3) if v.end <= horizon]
    uncounted, unentered = LittlesLawWindow(window_s), LittlesLawWindow(window_s)
    for i, v in enumerate(done):
        if i % 5 == 0:
            uncounted.entered("t", v.tokens, v.start)
            uncounted.left("t", v.tokens, v.end)
            # its completion is never counted; the other's entry never was
            unentered.completed("t", v.end - v.start, v.tokens, v.end)
        else:
            feed(uncounted, [v])
            feed(unentered, [v])
    assert uncounted.reading(["t"], horizon)["request"].ratio > 1.15
    assert unentered.reading(["t"], horizon)["request"].ratio < 0.87


def test_recording_rule_form_equals_the_window_reading() -> None:
    """rate(occupancy)/rate(time in system) over the same window is the exporter's ratio."""
    window_s, horizon = 30.0, 120.0
    visits = [v for v in steady_visits(8, 0.4, horizon, seed=11) if v.end <= horizon]
    w = LittlesLawWindow(window_s)
    w.entered("t", 0, 0.0)
    w.left("t", 0, 0.0)
    # Readings of the raw counters at the window's start and end, as Prometheus scrapes.
    early = [v for v in visits if v.start <= horizon - window_s]
    late = [v for v in visits if v.start > horizon - window_s]
    pending_ends = sorted(early, key=lambda v: v.end)
    for v in sorted(early, key=lambda v: v.start):
        w.entered("t", v.tokens, v.start)
    for v in [v for v in pending_ends if v.end <= horizon - window_s]:
        w.left("t", v.tokens, v.end)
        w.completed("t", v.end - v.start, v.tokens, v.end)
    start_totals = w.totals("t", horizon - window_s)
    for v in sorted(late, key=lambda v: v.start):
        w.entered("t", v.tokens, v.start)
    for v in [v for v in pending_ends if v.end > horizon - window_s] + late:
        w.left("t", v.tokens, v.end)
        w.completed("t", v.end - v.start, v.tokens, v.end)
    end_totals = w.totals("t", horizon)
    reading = w.reading(["t"], horizon)["request"]
    occ = end_totals.occupancy_request_seconds - start_totals.occupancy_request_seconds
    tis = end_totals.time_in_system_seconds - start_totals.time_in_system_seconds
    assert occ / window_s == pytest.approx(reading.l, rel=1e-9)
    assert tis / window_s == pytest.approx(reading.lambda_w, rel=1e-9)


def test_keys_add_up() -> None:
    w = LittlesLawWindow(10.0)
    for key, stay in (("a", 2.0), ("b", 3.0)):
        w.entered(key, 10, 1.0)
        w.left(key, 10, 1.0 + stay)
        w.completed(key, stay, 10, 1.0 + stay)
    both = w.reading(["a", "b"], 10.0)
    a, b = w.reading(["a"], 10.0), w.reading(["b"], 10.0)
    summed = a["request"] + b["request"]
    assert both["request"].l == pytest.approx(summed.l)
    assert both["request"].lambda_w == pytest.approx(summed.lambda_w)
    assert both["request"].completions == 2
