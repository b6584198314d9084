from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register

if TYPE_CHECKING:
    from weighbridge.sidecar.fleet import Backend, Fleet
    from weighbridge.sidecar.routing import Candidate


@register("picker", "least_requests")
class LeastRequests:
    """The backend with fewest of the sidecar's requests in flight, then first in the
    fleet's order; scorers are not read (a baseline)."""

    @staticmethod
    def pick(candidates: Sequence[Backend], cost: Callable[[Backend], float],
             fleet: Fleet) -> Backend:
        del cost, fleet
        return min(candidates, key=lambda b: (b.inflight, b.index))

    @staticmethod
    def weigh(chosen: str, candidates: Mapping[str, Candidate],
              prompt_tokens: int) -> tuple[str, str]:
        del candidates, prompt_tokens
        return chosen, "load"

    @staticmethod
    def dispatched(backend: Backend, fleet: Fleet) -> None:
        del backend, fleet
