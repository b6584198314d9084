"""Which backend takes the next request.

``least_tokens`` (default) picks the backend with the least outstanding token work: prompt
tokens not yet prefilled plus the expected remaining output of every request the sidecar has
in flight there, tie-broken by KV-cache usage. Request counts hide the difference between a
backend running 30 short chats and one running 30 long generations; tokens do not.
``least_requests`` and ``round_robin`` are the baselines. Unhealthy backends and those the
caller says cannot take work (closed admission gate) are skipped; ``pick`` returns None when
no backend can take work.

``pick`` has no side effects (the caller may not end up dispatching); ``on_dispatched``
records the choice, and moves the round-robin pointer past it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, get_args

from weighbridge.config import Routing


@dataclass(slots=True)
class _Backend:
    name: str
    index: int
    healthy: bool = True
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
    def __init__(self, backends: Sequence[str], policy: Routing = "least_tokens") -> None:
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

    def mark_unhealthy(self, backend: str) -> None:
        self._by_name[backend].healthy = False

    def mark_healthy(self, backend: str) -> None:
        self._by_name[backend].healthy = True

    def is_healthy(self, backend: str) -> bool:
        return self._by_name[backend].healthy

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
            b for b in self._backends if b.healthy and (can_take is None or can_take(b.name))
        ]
        if not candidates:
            return None
        if self.policy == "least_tokens":
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
