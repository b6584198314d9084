from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register

if TYPE_CHECKING:
    from weighbridge.sidecar.fleet import Backend, Fleet
    from weighbridge.sidecar.routing import Candidate


@register("picker", "round_robin")
class RoundRobin:
    """The backends in turn, in the fleet's order, from the one after the last dispatched
    to; scorers are not read (a baseline)."""

    def __init__(self) -> None:
        self._next = 0  # the index after the backend last dispatched to

    def pick(self, candidates: Sequence[Backend], cost: Callable[[Backend], float],
             fleet: Fleet) -> Backend:
        del cost
        count, after = len(fleet), self._next
        return min(candidates, key=lambda b: (b.index - after) % count)

    @staticmethod
    def weigh(chosen: str, candidates: Mapping[str, Candidate],
              prompt_tokens: int) -> tuple[str, str]:
        del candidates, prompt_tokens
        return chosen, "load"

    def dispatched(self, backend: Backend, fleet: Fleet) -> None:
        self._next = (backend.index + 1) % len(fleet)
