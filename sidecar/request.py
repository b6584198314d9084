"""A request as the scheduling core sees it: who sent it, what it costs, where it is.

The shell builds one per accepted HTTP request (through ``SchedulingCore.arrive`` or directly)
and hands the same object back on every later event, so per-request accounting (what was
charged, what was streamed) lives on it rather than in side tables keyed by id.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from weighbridge.sidecar.config import CostModel
from weighbridge.sidecar.prefix import PromptPrefix

# Shortest-prompt-first ages (``spf_delay_s``): a prompt waits at most this long behind
# shorter prompts that arrive after it (benchmarks/RESULTS.md, scheduling_quality (c)).
SPF_MAX_DELAY_S = 2.0
# The prompt that is delayed half of SPF_MAX_DELAY_S: prompts around it are told apart most.
SPF_HALF_PROMPT_TOKENS = 512


def spf_delay_s(prompt_tokens: int, max_delay_s: float = SPF_MAX_DELAY_S) -> float:
    """Shortest-prompt-first with aging: a prompt of ``prompt_tokens`` is ordered as if it
    had arrived this much later, ``max_delay_s * p / (p + SPF_HALF_PROMPT_TOKENS)``, never
    ``max_delay_s`` or more. Of two requests alike in priority and deadline, the shorter
    prompt goes first when they arrive within the difference of their delays of each other,
    and a request is never passed by one that arrives ``max_delay_s`` or more after it: its
    wait behind later arrivals is bounded (strict shortest-first lets a stream of short
    prompts hold a long one forever). 0 tokens (the FIFO ordering's rank): no delay."""
    if prompt_tokens <= 0:
        return 0.0
    return max_delay_s * prompt_tokens / (prompt_tokens + SPF_HALF_PROMPT_TOKENS)


class RequestState(Enum):
    NEW = "new"  # built, not yet accepted by a scheduler
    QUEUED = "queued"
    DISPATCHED = "dispatched"  # handed to a backend; its tokens are being produced
    ENDED = "ended"  # completed, cancelled or failed after it was queued


def request_cost(model: CostModel, prompt_tokens: int, output_tokens: int) -> int:
    """Cost of a request in its endpoint's unit: one request, or its tokens.

    Never below 1: a zero-cost request would let its tenant be served forever inside one DRR
    turn without ever spending credit.
    """
    if model == "requests":
        return 1
    return max(1, prompt_tokens + output_tokens)


@dataclass(slots=True, eq=False)
class QueuedRequest:
    id: str
    tenant: str
    tier: str
    endpoint: str
    prompt_tokens: int  # the shell's count or estimate at ingress; `usage` settles it later
    max_tokens: int | None  # per sequence; None: unbounded by the client (so is the estimate)
    estimated_output_tokens: int  # every sequence's
    arrival_s: float
    user: str | None = None  # the caller's identity (its key): repeat demotion counts per caller
    # The program the call continues (sidecar.programs: its x-session-id header, or the
    # like): what session affinity routes by.
    session: str | None = None
    # The agent program family it is a call of (sidecar.programs): what program_las orders by.
    program: str | None = None
    model: str | None = None  # what per-model limits charge: the body's `model` or the default
    priority: int = 0  # the client's own ordering among its requests, lower first (as vLLM)
    deadline_s: float | None = None  # absolute, same clock as arrival_s
    sequences: int = 1  # the answers it generates (the body's `n`)
    prefix: PromptPrefix | None = None  # what the prefix index reads of the prompt

    # ---- set by the scheduler -----------------------------------------------------------
    seq: int = -1  # arrival order within the scheduler: the stable FIFO tie-break
    demotion: int = 0  # repeat demotion: the caller's other requests active at enqueue
    size_rank: int = 0  # shortest-prompt-first: the prompt's tokens (aged: spf_delay_s); else 0
    order_delay_s: float = 0.0  # a stateful ordering's delay (program_las: its program's service)
    cost: int = 0  # DRR charge at dispatch, in the endpoint's unit (tokens or 1)
    charged: int = 0  # charged so far: cost plus streamed tokens beyond the estimate
    streamed_output_tokens: int = 0
    # Streamed output not yet folded into the core's charges and estimates (SchedulingCore,
    # "Streamed tokens"), and when the last of it passed.
    unfolded_tokens: int = 0
    unfolded_s: float = 0.0
    state: RequestState = RequestState.NEW
    dispatched_s: float | None = None
    backend: str | None = None
    # ---- set by the rate limiter --------------------------------------------------------
    admitted_tokens: int = 0  # the token estimate charged at admission, settled at the end
    # ---- set at arrival, then at dispatch ---------------------------------------------
    # Prompt tokens its backend's prefix cache should hold: at arrival the most any backend
    # of its pool holds (the backlog and early rejection count the rest), at dispatch its own.
    predicted_cached_tokens: int = 0
    # Admitted by the limits every replica shares (sidecar.shared), which then get its
    # refund or settlement; False: by this process's own limiter.
    shared_limits: bool = False
    # What one of its tokens is charged in DRR (``scheduler.service_cost``: its key's engine
    # seconds per token over the mean's, fixed at arrival so every charge and refund agrees).
    cost_factor: float = 1.0
    inflight_at_dispatch: int = 0  # our requests on its backend once it was dispatched

    @property
    def estimated_tokens(self) -> int:
        """Prompt plus expected output: the unit of rate limits (contracts count every
        prompt token)."""
        return self.prompt_tokens + self.estimated_output_tokens

    @property
    def computed_tokens(self) -> int:
        """Computed prompt plus expected output, what DRR charges: the unit of the backlog
        (queued tokens) and of the throughput early rejection divides it by."""
        return self.computed_prompt_tokens + self.estimated_output_tokens

    @property
    def computed_prompt_tokens(self) -> int:
        """The prompt tokens its engine computes: the rest its prefix cache holds."""
        return self.prompt_tokens - self.predicted_cached_tokens

    @property
    def effective_priority(self) -> int:
        return self.priority + self.demotion

    def order_key(self) -> tuple[int, float, float, float, int]:
        """A tenant's own dispatch order: priority, then deadline (none last), then arrival
        delayed by the prompt's size (with ``shortest_prompt_first``: ``spf_delay_s``, the
        shorter prompt first among near arrivals; else no delay) or by its program's service
        (``program_las``: ``order_delay_s``), then arrival."""
        deadline = math.inf if self.deadline_s is None else self.deadline_s
        return (self.effective_priority, deadline,
                self.arrival_s + spf_delay_s(self.size_rank) + self.order_delay_s,
                self.arrival_s, self.seq)
