from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register
from weighbridge.sidecar.routing import WeighsNoAffinity

if TYPE_CHECKING:
    from weighbridge.sidecar.fleet import Backend, Fleet


@register("picker", "least_loaded")
class LeastLoaded(WeighsNoAffinity):
    """The backend whose summed scorers cost least (``least_tokens``: the least token work
    outstanding), ties broken by KV-cache usage (unknown counts as full), then requests in
    flight, then the fleet's order. It weighs no affinity: a route with an affinity scorer
    takes ``bounded_load``."""

    @staticmethod
    def pick(candidates: Sequence[Backend], cost: Callable[[Backend], float],
             fleet: Fleet) -> Backend:
        del fleet
        if len(candidates) == 1:
            return candidates[0]
        return min(candidates, key=lambda b: (
            cost(b), 1.0 if b.kv_cache_usage is None else b.kv_cache_usage, b.inflight,
            b.index))
