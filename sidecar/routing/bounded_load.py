from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from weighbridge.sidecar.plugins import register
from weighbridge.sidecar.routing.least_loaded import LeastLoaded

if TYPE_CHECKING:
    from weighbridge.sidecar.routing import Candidate

# (1 + epsilon) of consistent hashing with bounded loads: the most a backend may carry,
# over the mean of those that may take a request, for affinity to pick it.
LOAD_BOUND = 1.25
# What one request in flight adds to a backend's cost when affinity is weighed, in prompt
# tokens: a busy engine makes the next request wait for the step it is taking, about half a
# step's fixed part (an H100's 5.5 ms, h100-llama3-8b) in the ~25k tokens/s it prefills, so
# a shared system prompt alone does not pull every request onto the engines that hold it
# while others idle (chat_sessions at low load: two of four engines used without it).
REQUEST_COST_TOKENS = 64


def work(candidate: Candidate) -> float:
    """The cost a backend would have with the request, less the prompt (the same
    everywhere): its summed load, ``REQUEST_COST_TOKENS`` a request in flight, and its
    (negative) affinity."""
    return candidate.cost + REQUEST_COST_TOKENS * candidate.inflight + candidate.affinity


def affine(candidates: Mapping[str, Candidate], prompt_tokens: int) -> tuple[str, str]:
    """The choice among the backends that may take (or hold) a request of
    ``prompt_tokens``, and why: ``affinity`` (it has the strongest affinity), ``load``
    (none has any, or one with less had less work), ``bounded`` (every backend of the
    strongest affinity is over the bound). Pure."""
    mean = sum(c.load for c in candidates.values()) / len(candidates)
    bound = LOAD_BOUND * mean + prompt_tokens
    within = [name for name, c in candidates.items() if c.load <= bound]

    def key(name: str) -> tuple[float, float, int]:
        c = candidates[name]
        return work(c), c.affinity, c.index

    best = min(within, key=key)  # the least loaded is never over the mean: never empty
    most = min(c.affinity for c in candidates.values())
    if most < 0 and candidates[best].affinity == most:
        return best, "affinity"
    if most >= 0 or any(candidates[name].affinity == most for name in within):
        return best, "load"
    return best, "bounded"


@register("picker", "bounded_load")
class BoundedLoad(LeastLoaded):
    """Affinity within a load bound (consistent hashing with bounded loads, in tokens).
    Without affinity, as ``least_loaded``. With it, among the backends that may take the
    request (and those held back for prefill alone whose cache pays for it,
    sidecar.cycle), the least work once it has the request: its summed load,
    ``REQUEST_COST_TOKENS`` per request in flight, and its weighted affinity; but no
    backend whose outstanding tokens pass ``LOAD_BOUND`` times the mean, plus the
    request's prompt, while another can take it, whatever it holds, so a hot prefix,
    conversation or tenant cannot pile onto one engine."""

    def weigh(self, chosen: str, candidates: Mapping[str, Candidate],
              prompt_tokens: int) -> tuple[str, str]:
        del chosen
        return affine(candidates, prompt_tokens)
