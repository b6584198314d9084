from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register
from weighbridge.sidecar.routing import WeighsNoAffinity

if TYPE_CHECKING:
    from weighbridge.sidecar.fleet import Backend, Fleet


@register("picker", "least_requests")
class LeastRequests(WeighsNoAffinity):
    """The backend with fewest of the sidecar's requests in flight, then first in the
    fleet's order; scorers are not read (a baseline)."""

    @staticmethod
    def pick(candidates: Sequence[Backend], cost: Callable[[Backend], float],
             fleet: Fleet) -> Backend:
        del cost, fleet
        return min(candidates, key=lambda b: (b.inflight, b.index))
