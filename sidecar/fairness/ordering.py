"""The orderings of a tenant's own queue (after priority and deadline, before arrival)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register

if TYPE_CHECKING:
    from weighbridge.sidecar.request import QueuedRequest


@register("ordering", "fifo")
class FirstInFirstOut:
    """Priority, then deadline (none last), then arrival."""

    @staticmethod
    def rank(request: QueuedRequest) -> int:
        del request
        return 0


@register("ordering", "shortest_prompt_first")
class ShortestPromptFirst:
    """Priority, then deadline, then the shorter prompt, then arrival: an approximate
    shortest-job-first within a tenant. A tenant's long prompts wait while its short ones
    keep coming; other tenants are unaffected, since fairness is between tenants."""

    @staticmethod
    def rank(request: QueuedRequest) -> int:
        return request.prompt_tokens
