from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register

if TYPE_CHECKING:
    from weighbridge.sidecar.fleet import Backend, Fleet
    from weighbridge.sidecar.routing import Candidate


def least_loaded(candidates: Sequence[Backend], cost: Callable[[Backend], float]) -> Backend:
    """The backend of least ``cost``, then of least KV-cache usage (unknown counts as
    full), then with fewest requests in flight, then first in the fleet's order."""
    if len(candidates) == 1:
        return candidates[0]
    return min(candidates, key=lambda b: (
        cost(b), 1.0 if b.kv_cache_usage is None else b.kv_cache_usage, b.inflight, b.index))


@register("picker", "least_loaded")
class LeastLoaded:
    """The backend whose summed scorers cost least (``least_tokens``: the least token work
    outstanding), ties broken by KV-cache usage, then requests in flight. It weighs no
    affinity: a route with an affinity scorer takes ``bounded_load``."""

    @staticmethod
    def pick(candidates: Sequence[Backend], cost: Callable[[Backend], float],
             fleet: Fleet) -> Backend:
        del fleet
        return least_loaded(candidates, cost)

    @staticmethod
    def weigh(chosen: str, candidates: Mapping[str, Candidate],
              prompt_tokens: int) -> tuple[str, str]:
        del candidates, prompt_tokens
        return chosen, "load"

    @staticmethod
    def dispatched(backend: Backend, fleet: Fleet) -> None:
        del backend, fleet
