from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register

if TYPE_CHECKING:
    from weighbridge.sidecar.fleet import Backend
    from weighbridge.sidecar.request import QueuedRequest


@register("scorer", "least_tokens")
class LeastTokens:
    """The token work outstanding on the backend: prompt tokens not yet prefilled (the
    cached part free) plus the expected remaining output of every request the sidecar has in
    flight there. Request counts hide the difference between a backend running 30 short
    chats and one running 30 long generations; tokens do not."""

    affinity = False

    @staticmethod
    def applies(request: QueuedRequest) -> bool:
        del request
        return True

    @staticmethod
    def cost(request: QueuedRequest, backend: Backend) -> float:
        del request
        return backend.outstanding_tokens

    @staticmethod
    def dispatched(request: QueuedRequest, backend: Backend) -> None:
        del request, backend
