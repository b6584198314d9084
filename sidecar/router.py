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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from weighbridge.sidecar.config import Routing

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


@dataclass(slots=True)
class _Backend:
    name: str
    index: int
    healthy: bool = True
    retired: bool = False  # draining: takes no new work (``retire``)
    inflight: int = 0
    outstanding_tokens: int = 0
    prefill_tokens: int = 0  # prompt tokens in flight whose first token has not come back
    kv_cache_usage: float | None = None


@dataclass(slots=True)
class _Ticket:
    backend: _Backend
    prompt_left: int  # prompt tokens until the first token says prefill is done
    output_left: int  # expected output tokens not yet streamed


class Router:
    def __init__(self, backends: Sequence[str], policy: Routing = "prefix_aware") -> None:
        if not backends:
            raise ValueError("at least one backend is required")
        if len(set(backends)) != len(backends):
            raise ValueError("backend names must be unique")
        if policy not in get_args(Routing):
            raise ValueError(f"unknown routing policy {policy!r}")
        self.policy: Routing = policy
        self._backends = [_Backend(name, i) for i, name in enumerate(backends)]
        self._by_name = {b.name: b for b in self._backends}
        self._tickets: dict[str, _Ticket] = {}
        self._next_rr = 0

    @property
    def backends(self) -> list[str]:
        return [b.name for b in self._backends]

    # ------------------------------------------------------------------ health and load

    def add(self, backend: str) -> None:
        """A new backend, unhealthy (no work) until ``mark_healthy``."""
        if backend in self._by_name:
            raise ValueError(f"backend {backend!r} is already routed to")
        b = _Backend(backend, len(self._backends), healthy=False)
        self._backends.append(b)
        self._by_name[backend] = b

    def retire(self, backend: str) -> None:
        """Route nothing more to ``backend``; its requests in flight finish."""
        self._by_name[backend].retired = True

    def remove(self, backend: str) -> None:
        """Forget a retired backend with nothing in flight."""
        b = self._by_name[backend]
        if b.inflight:
            raise ValueError(f"backend {backend!r} has {b.inflight} requests in flight")
        del self._by_name[backend]
        self._backends.remove(b)
        for i, other in enumerate(self._backends):
            other.index = i

    def mark_unhealthy(self, backend: str) -> None:
        self._by_name[backend].healthy = False

    def mark_healthy(self, backend: str) -> None:
        self._by_name[backend].healthy = True

    def is_healthy(self, backend: str) -> bool:
        """Whether it may take work: healthy and not retired."""
        b = self._by_name[backend]
        return b.healthy and not b.retired

    def observe_kv(self, backend: str, usage: float | None) -> None:
        self._by_name[backend].kv_cache_usage = usage

    def outstanding_tokens(self, backend: str) -> int:
        return self._by_name[backend].outstanding_tokens

    def inflight(self, backend: str) -> int:
        return self._by_name[backend].inflight

    def prefill_tokens(self, backend: str) -> int:
        """Prompt tokens dispatched there whose prefill has not finished (no first token)."""
        return self._by_name[backend].prefill_tokens

    # ------------------------------------------------------------------ choice

    def pick(self, can_take: Callable[[str], bool] | None = None) -> str | None:
        candidates = [
            b for b in self._backends
            if b.healthy and not b.retired and (can_take is None or can_take(b.name))
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
            count = len(self._backends)
            best = min(candidates, key=lambda b: (b.index - self._next_rr) % count)
        return best.name

    def prefer(self, cached: Mapping[str, int], chosen: str,
               prompt_tokens: int) -> tuple[str, str]:
        """``prefix_aware``: the backend for a request ``pick`` gave ``chosen``, among the
        backends that may take it, each with the prompt tokens its prefix cache is predicted
        to hold (``cached``, ``chosen`` included). Returns it and why (module doc)."""
        if len(cached) < 2 or max(cached.values()) <= 0:
            return chosen, "load"
        backends = self._by_name
        return affine({name: Candidate(backends[name].outstanding_tokens,
                                       backends[name].inflight, held, backends[name].index)
                       for name, held in cached.items()}, prompt_tokens)

    # ------------------------------------------------------------------ requests

    def on_dispatched(
        self, request_id: str, backend: str, prompt_tokens: int, expected_output_tokens: int
    ) -> None:
        if request_id in self._tickets:
            raise ValueError(f"request {request_id!r} is already in flight")
        b = self._by_name[backend]
        ticket = _Ticket(b, max(0, prompt_tokens), max(0, expected_output_tokens))
        self._tickets[request_id] = ticket
        b.inflight += 1
        b.outstanding_tokens += ticket.prompt_left + ticket.output_left
        b.prefill_tokens += ticket.prompt_left
        self._next_rr = (b.index + 1) % len(self._backends)

    def on_tokens(self, request_id: str, tokens: int) -> None:
        """Output tokens streamed; the first one also says the prompt is prefilled."""
        ticket = self._tickets.get(request_id)
        if ticket is None:
            return
        produced = min(max(0, tokens), ticket.output_left)
        ticket.backend.outstanding_tokens -= ticket.prompt_left + produced
        ticket.backend.prefill_tokens -= ticket.prompt_left
        ticket.prompt_left = 0
        ticket.output_left -= produced

    def on_finished(self, request_id: str) -> None:
        ticket = self._tickets.pop(request_id, None)
        if ticket is None:
            return
        b = ticket.backend
        b.inflight -= 1
        b.outstanding_tokens -= ticket.prompt_left + ticket.output_left
        b.prefill_tokens -= ticket.prompt_left

    def snapshot(self) -> dict[str, Any]:
        return {
            b.name: {
                "healthy": b.healthy,
                "inflight": b.inflight,
                "outstanding_tokens": b.outstanding_tokens,
                "prefill_tokens": b.prefill_tokens,
                "kv_cache_usage": b.kv_cache_usage,
            }
            for b in self._backends
        }
