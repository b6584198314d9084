from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register

if TYPE_CHECKING:
    from weighbridge.sidecar.fleet import Backend
    from weighbridge.sidecar.request import QueuedRequest

# What a prompt token a backend's cache holds weighs against a token of its load in the
# prefix_aware preset (its weight there): elsewhere the request waits for that token's
# prefill, and the fleet computes it once more (work that delays the requests after it).
CACHE_WEIGHT = 2.0


@register("scorer", "prefix_affinity")
class PrefixAffinity:
    """Less the prompt tokens the backend's prefix cache is predicted to hold of the
    request (sidecar.prefix), for requests whose prompt the sidecar can read. Routing reads
    the index from the first dispatch on, before an answer has shown the engine reports
    cached tokens (the charges wait for that), so at a run's start the first second's
    requests spread a prefix over every backend; a backend whose answers do not report them
    has its index off and is predicted to hold nothing. In ``prefix_aware`` a cached token
    weighs twice a token of load (``CACHE_WEIGHT``): sent elsewhere, the request waits for
    that token's prefill and the fleet computes it once more, so a conversation's turns go
    back to the engine holding its history unless another has less load by more than twice
    the history."""

    affinity = True

    @staticmethod
    def applies(request: QueuedRequest) -> bool:
        return request.prefix is not None

    @staticmethod
    def cost(request: QueuedRequest, backend: Backend) -> float:
        assert request.prefix is not None
        return -backend.prefix.predict(request.prefix, request.prompt_tokens)

    @staticmethod
    def dispatched(request: QueuedRequest, backend: Backend) -> None:
        del request, backend  # the core records what it sent in the index itself
