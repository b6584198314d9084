"""The orderings of a tenant's own queue (after priority and deadline, before arrival)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register

if TYPE_CHECKING:
    from weighbridge.sidecar.request import QueuedRequest


@register("ordering", "fifo")
class FirstInFirstOut:
    """Priority, then deadline (none last), then arrival: a tenant's requests in the order
    they came."""

    @staticmethod
    def rank(request: QueuedRequest) -> int:
        del request
        return 0


@register("ordering", "shortest_prompt_first")
class ShortestPromptFirst:
    """Priority, then deadline, then arrival delayed by the prompt's size
    (``sidecar.request.spf_delay_s``: under 2 s, more for a longer prompt), then arrival:
    an approximate shortest-job-first within a tenant that ages. A short prompt passes a
    long one that arrived less than the difference of their delays before it, never one
    that arrived 2 s or more before it, so a long prompt's wait behind later arrivals is
    bounded; other tenants are unaffected, since fairness is between tenants. The default
    ordering (decision 0019 (c))."""

    @staticmethod
    def rank(request: QueuedRequest) -> int:
        return request.prompt_tokens
