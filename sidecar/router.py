"""Which backend takes the next request.

``least_tokens`` picks the backend with the least outstanding token work: prompt
tokens not yet prefilled plus the expected remaining output of every request the sidecar has
in flight there, tie-broken by KV-cache usage. Request counts hide the difference between a
backend running 30 short chats and one running 30 long generations; tokens do not.
``prefix_aware`` (the default) picks as ``least_tokens`` does, then lets the prefix cache move the
request (``prefer``): among the backends that may take it, the one with the least token work
once it has the request, its load plus the prompt it would compute (the part its cache is
not predicted to hold, sidecar.prefix), so a conversation's turns go back to the engine
that holds its history unless another is less loaded by more than the history; a
bounded-load rule (consistent hashing with bounded loads'
rule, in tokens) keeps a hot conversation or tenant from piling onto one engine: no backend
whose load passes ``LOAD_BOUND`` times the mean load, plus the request's own prompt, is
chosen while another can take it. ``least_requests`` and ``round_robin`` are the
baselines. Unhealthy backends and those the
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
        to hold (``cached``, ``chosen`` included). Each backend's cost is the token work it
        would have with the request: its load plus the prompt it would compute (the prompt
        less its cached part), so a held history weighs against load token for token, plus
        ``REQUEST_COST_TOKENS`` per request in flight there; the cheapest within the load
        bound takes it. Returns it and why: ``affinity`` (it holds
        the most of the prompt), ``load`` (a less loaded backend holding less was cheaper;
        also when none holds any: ``chosen``), ``bounded`` (the one holding the most was
        over the bound)."""
        if len(cached) < 2 or max(cached.values()) <= 0:
            return chosen, "load"
        loads = {name: self._by_name[name].outstanding_tokens for name in cached}
        # The request's own prompt is slack: at low load one request more is no pile-up.
        bound = LOAD_BOUND * sum(loads.values()) / len(loads) + prompt_tokens

        def cost(name: str) -> tuple[int, int, int]:
            b = self._by_name[name]
            return (loads[name] + REQUEST_COST_TOKENS * b.inflight - cached[name],
                    -cached[name], b.index)

        best = min((name for name in cached if loads[name] <= bound), key=cost)
        most = max(cached.values())
        if cached[best] == most:
            return best, "affinity"
        holder = min((name for name in cached if cached[name] == most), key=cost)
        return best, "bounded" if loads[holder] > bound else "load"

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
