"""Which backend takes the next request.

``least_tokens`` picks the backend with the least outstanding token work: prompt
tokens not yet prefilled plus the expected remaining output of every request the sidecar has
in flight there, tie-broken by KV-cache usage. Request counts hide the difference between a
backend running 30 short chats and one running 30 long generations; tokens do not.
``prefix_aware`` (the default) picks as ``least_tokens`` does, then lets the prefix cache move the
request (``prefer``, whose pure core is ``affine``): among the backends that may take it, the
one with the least token work once it has the request, its load and ``REQUEST_COST_TOKENS``
per request in flight, less ``CACHE_WEIGHT`` times the prompt tokens its cache is predicted
to hold (sidecar.prefix). A cached token weighs twice a token of load: sent elsewhere, the
request waits for that token's prefill, and the fleet computes it once more, work that
delays whoever comes next there. So among the backends offered, a prefix's holder keeps
its requests while it prefills another prompt (vllm bench's prefix_repetition: weighed
token for token, a holder busy with one 1,792-token prompt lost the next request of its
1,536-token prefix to an idle engine, which recomputed it), and a conversation's turns go
back to the engine holding its history unless another has less load by more than twice the
history. A bounded-load rule (consistent hashing with
bounded loads', in tokens) keeps a hot prefix, conversation or tenant from piling onto one
engine: no backend whose load passes ``LOAD_BOUND`` times the mean load, plus the request's
own prompt, is chosen while another can take it, whatever its cache holds.
``cache_pays_prefill`` states the same trade for admission control's prefill limits: a
backend they hold back may take a request whose prompt it holds more of than any open
backend when the prefill its cache saves pays for the overshoot. ``least_requests`` and
``round_robin`` are the baselines. Unhealthy backends and those the
caller says cannot take work (closed admission gate) are skipped; ``pick`` returns None when
no backend can take work.

Backends come and go with a reload (sidecar.reload): ``add`` joins one that takes no work
until it is marked healthy; ``retire`` stops routing to one while its requests finish, and
``remove`` forgets it once none is left.

``pick`` has no side effects (the caller may not end up dispatching); ``on_dispatched``
records the choice, and moves the round-robin pointer past it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import get_args

from weighbridge.sidecar.config import Routing
from weighbridge.sidecar.fleet import Backend, Fleet

# (1 + epsilon) of consistent hashing with bounded loads: the most a backend may carry,
# over the mean of those that may take a request, for prefix affinity to pick it.
LOAD_BOUND = 1.25
# What one request in flight adds to a backend's cost for prefix_aware, in prompt tokens: a
# busy engine makes the next request wait for the step it is taking, about half a step's fixed
# part (an H100's 5.5 ms, h100-llama3-8b) in the ~25k tokens/s it prefills, so a shared
# system prompt alone does not pull every request onto the engines that hold it while
# others idle (chat_sessions at low load: two of four engines used without it).
REQUEST_COST_TOKENS = 64
# What a prompt token a backend's cache holds weighs against a token of its load for
# prefix_aware: elsewhere the request waits for that token's prefill, and the fleet computes
# it once more (work that delays the requests after it there).
CACHE_WEIGHT = 2


@dataclass(frozen=True, slots=True)
class Candidate:
    """One backend as prefix affinity weighs it for a request."""

    load: int  # outstanding tokens: prompts not yet prefilled and expected output
    inflight: int  # requests in flight there
    cached: int  # prompt tokens of the request its cache is predicted to hold
    index: int = 0  # its place among the backends: the last tie-break


def work(candidate: Candidate) -> int:
    """The token work a backend would have with the request, less the prompt (the same
    everywhere): its load and ``REQUEST_COST_TOKENS`` a request in flight, less
    ``CACHE_WEIGHT`` times the prompt tokens its cache saves."""
    return (candidate.load + REQUEST_COST_TOKENS * candidate.inflight
            - CACHE_WEIGHT * candidate.cached)


def affine(candidates: Mapping[str, Candidate], prompt_tokens: int) -> tuple[str, str]:
    """``prefix_aware``'s choice among the backends that may take a request of
    ``prompt_tokens`` (module doc), and why: ``affinity`` (it holds the most of the
    prompt), ``load`` (none holds any, or one holding less had less work), ``bounded``
    (every backend holding the most is over the bound). Pure."""
    mean = sum(c.load for c in candidates.values()) / len(candidates)
    bound = LOAD_BOUND * mean + prompt_tokens
    within = [name for name, c in candidates.items() if c.load <= bound]

    def key(name: str) -> tuple[float, int, int]:
        c = candidates[name]
        return work(c), -c.cached, c.index

    best = min(within, key=key)  # the least loaded is never over the mean: never empty
    most = max(c.cached for c in candidates.values())
    if most > 0 and candidates[best].cached == most:
        return best, "affinity"
    if most <= 0 or any(candidates[name].cached == most for name in within):
        return best, "load"
    return best, "bounded"


def cache_pays_prefill(backlog: int, limit: int | None, computed: int, saved: int) -> bool:
    """Whether a prefill limit that holds a backend back (``limit`` prompt tokens still in
    prefill there, ``backlog`` now; None: no limit) lets a request through anyway, the
    backend holding more of its prompt than any open one: when the prefill its cache saves
    (``saved``: the tokens the request would compute on the best open backend, less the
    ``computed`` ones it computes here) pays for what it takes past the limit. So a prefix's
    holder is not passed over while it prefills another prompt, and the limit is overshot by
    less than the one prompt's cached part."""
    return limit is None or backlog + computed <= limit + saved


class Router:
    """The routing policy over the fleet's records; it keeps only round robin's pointer."""

    def __init__(self, fleet: Fleet, policy: Routing = "prefix_aware") -> None:
        if policy not in get_args(Routing):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy: Routing = policy
        self._fleet = fleet
        self._next_rr = 0

    # ------------------------------------------------------------------ choice

    def pick(self, can_take: Callable[[str], bool] | None = None) -> str | None:
        candidates = [
            b for b in self._fleet
            if b.healthy and not b.draining and (can_take is None or can_take(b.name))
        ]
        if not candidates:
            return None
        if self.policy in ("least_tokens", "prefix_aware"):
            best = min(
                candidates,
                key=lambda b: (
                    b.outstanding_tokens,
                    1.0 if b.kv_cache_usage is None else b.kv_cache_usage,
                    b.inflight,
                    b.index,
                ),
            )
        elif self.policy == "least_requests":
            best = min(candidates, key=lambda b: (b.inflight, b.index))
        else:
            count = len(self._fleet)
            best = min(candidates, key=lambda b: (b.index - self._next_rr) % count)
        return best.name

    def prefer(self, cached: Mapping[str, int], chosen: str,
               prompt_tokens: int) -> tuple[str, str]:
        """``prefix_aware``: the backend for a request ``pick`` gave ``chosen``, among the
        backends that may take it, each with the prompt tokens its prefix cache is predicted
        to hold (``cached``, ``chosen`` included). Returns it and why (module doc)."""
        if len(cached) < 2 or max(cached.values()) <= 0:
            return chosen, "load"
        fleet = self._fleet
        return affine({name: Candidate(fleet[name].outstanding_tokens, fleet[name].inflight,
                                       held, fleet[name].index)
                       for name, held in cached.items()}, prompt_tokens)

    def on_dispatched(self, backend: Backend) -> None:
        """A request went to ``backend``: round robin moves past it."""
        self._next_rr = (backend.index + 1) % len(self._fleet)
