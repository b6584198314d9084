from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register
from weighbridge.sidecar.routing import WeighsNoAffinity

if TYPE_CHECKING:
    from weighbridge.sidecar.fleet import Backend, Fleet


@register("picker", "round_robin")
class RoundRobin(WeighsNoAffinity):
    """The backends in turn, in the fleet's order, from the one after the last dispatched
    to; scorers are not read (a baseline)."""

    def __init__(self) -> None:
        self._next = 0  # the index after the backend last dispatched to

    def pick(self, candidates: Sequence[Backend], cost: Callable[[Backend], float],
             fleet: Fleet) -> Backend:
        del cost
        count, after = len(fleet), self._next
        return min(candidates, key=lambda b: (b.index - after) % count)

    def dispatched(self, backend: Backend, fleet: Fleet) -> None:
        self._next = (backend.index + 1) % len(fleet)
