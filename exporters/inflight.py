"""Requests in flight at the load generator, so an end can be matched to its start.

The generator reports a start as (tenant, tier, declared tokens, time) and an end as the
finished request's record: no shared id. The end is matched to the in-flight start of the
same tenant and tier whose time is nearest the record's own start (end time minus its time in
system). When the generator reports starts at the scheduled send time, as the records
measure, the match is exact; otherwise it picks a concurrent request with a near start,
which keeps the in-flight count and token sum exact and shifts only which declared count
leaves.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from dataclasses import dataclass

__all__ = ["InFlight", "InFlightSet"]


@dataclass(frozen=True, slots=True, order=True)
class InFlight:
    started_at: float
    tokens: int


class InFlightSet:
    def __init__(self) -> None:
        self._by_key: dict[Hashable, list[InFlight]] = {}  # sorted by start

    def add(self, key: Hashable, started_at: float, tokens: int) -> None:
        bisect.insort(self._by_key.setdefault(key, []), InFlight(started_at, tokens))

    def pop_nearest(self, key: Hashable, started_at: float) -> InFlight | None:
        """Remove and return the entry of ``key`` starting nearest ``started_at``; None when
        ``key`` has nothing in flight (an end whose start was never reported)."""
        entries = self._by_key.get(key)
        if not entries:
            return None
        i = bisect.bisect_left(entries, InFlight(started_at, -1))
        if i == len(entries) or (
            i > 0 and started_at - entries[i - 1].started_at <= entries[i].started_at - started_at
        ):
            i -= 1
        return entries.pop(i)

    def count(self, key: Hashable) -> int:
        return len(self._by_key.get(key, ()))
