"""vLLM's engine counters, kept by the step model itself (``StepModel.counters``).

What an engine's ``/metrics`` counts, counted once, where the steps happen: the emulator's
``/metrics`` (``emulator/metrics.py``) renders these values, and the virtual-time engines
(``weighbridge/app/simulation/engines.py``) read them for the scrapes they answer, so live
and virtual time cannot count a request differently. vLLM counts a step's work when the
step's outputs come back (``vllm/v1/metrics/stats.py``: ``IterationStats`` from the step's
``EngineCoreOutputs``, the scheduler's stats made with them), so these move in
``StepModel.complete``: a request's prompt at its first output, each sampled token (a
pooling request's one output is its pooled state, no token), the step's preemptions and
prefix-cache lookups, and each request the engine finished, with the time it waited to be
scheduled. A client's abort is not a finish (vLLM counts only what the engine ended).
Pure: no clock, no I/O.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from weighbridge.emulator.engine import Sequence

__all__ = ["REQUEST_LATENCY_BUCKETS", "EngineCounters", "Observations"]

# vLLM's request latency buckets (vllm/v1/metrics/loggers.py), the queue time's among them.
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(slots=True)
class Observations:
    """A histogram's state as Prometheus exports it: a count per bucket (the last one above
    every bound), their sum and their number."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    sum: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[int]:
        """The count at or below each bound, then the count of all (``+Inf``)."""
        out, total = [], 0
        for n in self.counts:
            total += n
            out.append(total)
        return out


@dataclass(slots=True)
class EngineCounters:
    prompt_tokens: int = 0  # vllm:prompt_tokens
    generation_tokens: int = 0  # vllm:generation_tokens
    preemptions: int = 0  # vllm:num_preemptions
    # vllm:prefix_cache_queries and _hits, in prompt tokens: a request's lookup at its first
    # admission (a preempted request's on its return goes to a series vLLM does not export).
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_cached: int = 0  # vllm:prompt_tokens_cached
    # vllm:request_success, by finish reason.
    finished: dict[str, int] = field(default_factory=lambda: {"stop": 0, "length": 0})
    # vllm:request_queue_time_seconds: from the engine taking a request in to its first
    # scheduling, observed when it finishes.
    queue_time: Observations = field(
        default_factory=lambda: Observations(REQUEST_LATENCY_BUCKETS))

    def first_output(self, seq: Sequence) -> None:
        """``seq`` had its first output (a first token, or its pooled state)."""
        self.prompt_tokens += seq.prompt_tokens
        self.prompt_tokens_cached += seq.num_cached_tokens

    def finish(self, seq: Sequence) -> None:
        """The engine finished ``seq`` (its length or a stop)."""
        assert seq.finish_reason in ("stop", "length") and seq.first_scheduled_s is not None
        self.finished[seq.finish_reason] += 1
        queued = seq.queued_s if seq.queued_s is not None else seq.arrival_s
        self.queue_time.observe(seq.first_scheduled_s - queued)
