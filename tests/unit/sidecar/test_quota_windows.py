"""The long windows' core (sidecar.ratelimit): UTC calendar periods, calendar buckets, and
durable levels that a crash can only lower. Every clock here is virtual: ``now`` a number,
the wall clock ``now + wall_offset_s``."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.sidecar.config import RateLimits
from weighbridge.sidecar.ratelimit import (
    DAY_S,
    MONTH_S,
    Admit,
    BucketSettings,
    LimitTable,
    StoredLevel,
    TenantRateLimiter,
    calendar_period,
    restored_level,
)
from weighbridge.sidecar.rejection import Reject

CHAT = "/v1/chat/completions"
# 2026-01-31 12:00 UTC: a month's last day, so a few days cross into February.
JAN_31 = datetime(2026, 1, 31, 12, tzinfo=UTC).timestamp()
# 1970 to 2100, in whole microseconds (datetime's resolution, which rounds finer ones).
WALLS = st.integers(0, 4_102_444_800 * 10**6).map(lambda us: us / 10**6)


@given(wall=WALLS)
def test_a_calendar_period_is_the_utc_day_or_month_holding_the_instant(wall: float) -> None:
    at = datetime.fromtimestamp(wall, UTC)
    day, day_end = calendar_period(wall, "day")
    assert day_end == datetime(at.year, at.month, at.day, tzinfo=UTC).timestamp() + DAY_S
    month, month_end = calendar_period(wall, "month")
    assert month == (at.year - 1970) * 12 + at.month - 1
    start = datetime(at.year, at.month, 1, tzinfo=UTC)
    assert month_end == (start + timedelta(days=32)).replace(day=1).timestamp()
    assert wall < day_end <= month_end
    # The next period starts exactly at the end: its index is one more.
    assert calendar_period(day_end, "day")[0] == day + 1
    assert calendar_period(month_end, "month")[0] == month + 1


def limiter(windows: str = "rolling", offset: float = JAN_31, **limits: Any) -> TenantRateLimiter:
    table = LimitTable({"a": RateLimits(windows=windows, **limits)})
    return TenantRateLimiter(table, settings=BucketSettings(wall_offset_s=offset))


STEPS = st.lists(st.tuples(st.floats(0, 3 * DAY_S), st.integers(1, 400)), max_size=60)


@given(steps=STEPS)
def test_a_calendar_window_never_admits_more_than_its_limit_within_a_period(
        steps: list[tuple[float, int]]) -> None:
    """Whatever the arrivals, the tokens admitted inside one UTC day are at most the day's
    limit (no request settles above its estimate here, so no debt)."""
    rl = limiter("calendar", tokens_per_day=1_000)
    now, per_day = 0.0, {}
    for gap, tokens in steps:
        now += gap
        result = rl.admit("a", CHAT, tokens, now)
        if isinstance(result, Admit):
            day = calendar_period(now + JAN_31, "day")[0]
            per_day[day] = per_day.get(day, 0) + tokens
        else:
            assert result.retry_after_s is not None
            # Retry-After is the next UTC midnight, exactly.
            assert now + JAN_31 + result.retry_after_s == pytest.approx(
                calendar_period(now + JAN_31, "day")[1])
    assert all(total <= 1_000 for total in per_day.values())


def test_a_calendar_month_resets_on_the_first_and_carries_a_debt() -> None:
    rl = limiter("calendar", tokens_per_month=1_000)
    assert isinstance(rl.admit("a", CHAT, 900, 0.0), Admit)
    rl.settle("a", CHAT, 900, 1_200, 0.0)  # 200 over: a debt
    rejected = rl.admit("a", CHAT, 1, DAY_S / 4)  # still January: no refill at all
    assert isinstance(rejected, Reject)
    assert rejected.retry_after_s == pytest.approx(DAY_S / 4)  # 12:00 + 6 h = midnight
    february = rl.snapshot(DAY_S / 2 + 1)["tenants"]["a"]["tokens_per_month"]
    assert february["level"] == 800  # full less the debt
    assert february["resets_at"] == datetime(2026, 3, 1, tzinfo=UTC).timestamp()


def test_a_rolling_month_is_the_default_and_refills_continuously() -> None:
    rl = limiter(tokens_per_month=3_000)
    assert isinstance(rl.admit("a", CHAT, 3_000, 0.0), Admit)
    level = rl.snapshot(DAY_S)["tenants"]["a"]["tokens_per_month"]["level"]
    assert level == pytest.approx(3_000 * DAY_S / MONTH_S)


# --------------------------------------------------------------------------- durable levels


def durable(store: dict, now_offset: float, ahead: float, **limits: Any) -> TenantRateLimiter:
    """A limiter whose long windows start from ``store`` (a dict standing for the file)."""
    table = LimitTable({"a": RateLimits(**limits)})
    return TenantRateLimiter(table, settings=BucketSettings(
        wall_offset_s=now_offset, durable=True, restored=dict(store)), reserve_ahead=ahead)


def write(store: dict, levels: list[StoredLevel]) -> None:
    for level in levels:
        store[(level.scope, level.name)] = level


def admit(rl: TenantRateLimiter, store: dict, tokens: int, now: float) -> bool:
    """As the shell does: the reservation written first, then the admission."""
    levels = rl.reservations("a", CHAT, tokens, now)
    write(store, levels)
    rl.stored(levels, now)
    return isinstance(rl.admit("a", CHAT, tokens, now), Admit)


OPS = st.lists(st.tuples(st.sampled_from(["send", "settle", "refund", "flush", "crash",
                                          "wait"]),
                         st.integers(1, 300)), max_size=80)


@given(ops=OPS, ahead=st.sampled_from([0.0, 0.01, 0.1]),
       windows=st.sampled_from(["rolling", "calendar"]))
def test_a_crash_never_raises_a_level(ops: list[tuple[str, int]], ahead: float,
                                      windows: str) -> None:
    """Whatever happens between crashes, the level a restarted limiter starts from is at
    most the level the crashed one had (its store never held more than the truth), and
    at least that level less the reservation written ahead and the debts of the last
    flush interval."""
    store: dict = {}
    limits = {"requests_per_month": 50, "tokens_per_day": 5_000, "windows": windows}
    now, offset = 0.0, JAN_31
    rl = durable(store, offset, ahead, **limits)
    admitted: list[int] = []
    for op, n in ops:
        if op == "send":
            if admit(rl, store, n, now):
                admitted.append(n)
        elif op == "settle" and admitted:
            rl.settle("a", CHAT, admitted.pop(), n, now)
        elif op == "refund" and admitted:
            rl.refund("a", CHAT, admitted.pop(), now)
        elif op == "flush":
            levels = rl.unsaved(now)
            write(store, levels)
            rl.stored(levels, now)
        elif op == "wait":
            now += n * 600.0
        elif op == "crash":
            rl.reservations("a", CHAT, 1, now)  # the buckets exist, as after any request
            before = rl.snapshot(now)["tenants"]["a"]
            unsaved_debt = {level.name: level for level in rl.unsaved(now)
                            if level.level < before[level.name]["stored_level"]}
            # A new process, a new monotonic clock: the wall clock goes on.
            offset, now = offset + now - 7.0, 7.0
            rl = durable(store, offset, ahead, **limits)
            rl.reservations("a", CHAT, 1, now)
            after = rl.snapshot(now)["tenants"]["a"]
            for name, bucket in before.items():
                if name in unsaved_debt:
                    continue  # a debt not flushed yet: the one thing a crash can lose
                assert after[name]["level"] <= bucket["level"] + 1e-6
                assert after[name]["level"] >= bucket["level"] - ahead * bucket["capacity"] \
                    - 1e-6 or after[name]["level"] >= 0 or bucket["level"] < 0
            admitted.clear()  # those requests died with the process


def test_no_admission_goes_beyond_what_the_store_holds() -> None:
    """Exactly the limit across any number of crashes, the store written ahead of none."""
    store: dict = {}
    total = 0
    for _ in range(7):  # six crashes
        rl = durable(store, JAN_31, 0.0, requests_per_month=20)
        total += sum(admit(rl, store, 1, 0.0) for _ in range(4))
    assert total == 20


def test_an_admission_made_without_a_reservation_is_written_behind_it() -> None:
    rl = durable({}, JAN_31, 0.0, requests_per_month=20)
    assert isinstance(rl.admit("a", CHAT, 1, 0.0), Admit)  # a front that did not reserve
    (behind,) = rl.unsaved(0.0)
    assert (behind.name, behind.level) == ("requests_per_month", 19.0)


def test_a_stored_level_refills_by_the_wall_clock_time_since() -> None:
    stored = StoredLevel(("tenant", "a"), "requests_per_month", 0.0, JAN_31, 30.0,
                         30 / MONTH_S)
    assert restored_level(stored, 30.0, JAN_31 + DAY_S, None) == pytest.approx(1.0)
    assert restored_level(stored, 60.0, JAN_31 + DAY_S, None) == pytest.approx(31.0)  # raised
    calendar = StoredLevel(("tenant", "a"), "requests_per_month", -2.0, JAN_31, 30.0, 0.0,
                           calendar_period(JAN_31, "month")[0])
    assert restored_level(calendar, 30.0, JAN_31 + DAY_S, calendar.period) == -2.0
    assert restored_level(calendar, 30.0, JAN_31 + DAY_S,
                          calendar_period(JAN_31 + DAY_S, "month")[0]) == 28.0
