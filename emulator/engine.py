"""The engine step model: vLLM's continuous-batching scheduler and KV cache, without a model.

Pure and clock-free: callers pass times in, nothing here sleeps or does I/O. One step is
``schedule(now)`` (pick the batch, allocate KV blocks, preempt if blocks run out) followed by
``complete(batch, end)`` (advance the sequences, sample a token for each that caught up,
finish the ones that reached their length). The HTTP face drives this with the wall clock;
tests and simulations drive it with a virtual one through :func:`simulate`.

Vocabulary follows vLLM's V1 scheduler: a sequence has ``num_tokens`` (prompt + output so far)
and ``num_computed_tokens`` (tokens whose KV is cached); each step computes
``num_tokens - num_computed_tokens`` of them for each scheduled sequence, capped by the
token budget. A decode is the case where that difference is 1.

LoRA adapters, as vLLM serves them: a sequence may name one (``Sequence.lora``); a step's
batch holds at most ``max_loras`` distinct adapters, so a waiting request of another adapter
is passed over (it keeps its place in the queue) while the batch is full of adapters. The
adapters cost no step time here. Invariant: the running sequences never hold more than
``max_loras`` distinct adapters.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Literal

from weighbridge.emulator.counters import EngineCounters
from weighbridge.emulator.prefix_cache import BlockHash, BlockPool, RequestBlocks, hash_block
from weighbridge.emulator.profiles import StepTimeProfile

SchedulingPolicy = Literal["fcfs", "priority"]
FinishReason = Literal["stop", "length", "abort"]


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    num_kv_blocks: int = 512
    block_size: int = 16
    max_model_len: int = 4096
    scheduling_policy: SchedulingPolicy = "fcfs"
    chunked_prefill: bool = True
    # vLLM's --long-prefill-token-threshold: the most prompt tokens one sequence may prefill
    # in a step (0: no cap), so one long prompt cannot take a whole step's budget.
    long_prefill_token_threshold: int = 0
    # vLLM's --max-loras: the most distinct LoRA adapters in one step's batch (default 1).
    max_loras: int = 1
    # vLLM's --enable-prefix-caching (on by default): full blocks are cached under their
    # prefix hash and reused by later requests (emulator/prefix_cache.py).
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
                     "max_model_len", "max_loras"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, "
                             f"got {self.scheduling_policy!r}")
        if not self.chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            # vLLM refuses this too: without chunking a maximal prompt could never be scheduled.
            raise ValueError(
                "without chunked prefill, max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})"
            )
        if self.kv_capacity_tokens < self.max_model_len:
            # vLLM's start-up check: one maximal sequence must fit in the KV cache.
            raise ValueError(
                f"KV cache ({self.num_kv_blocks} blocks x {self.block_size} tokens = "
                f"{self.kv_capacity_tokens}) is smaller than max_model_len ({self.max_model_len})"
            )

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size


def kv_blocks_for_bytes(memory_bytes: int, block_size: int, kv_bytes_per_token: int) -> int:
    """How many KV blocks a cache of ``memory_bytes`` holds, as vLLM sizes it from
    ``--kv-cache-memory-bytes``: whole blocks of ``block_size`` tokens of
    ``kv_bytes_per_token`` each (the remainder is unused)."""
    if memory_bytes < 1 or block_size < 1 or kv_bytes_per_token < 1:
        raise ValueError("memory_bytes, block_size and kv_bytes_per_token must be >= 1")
    return memory_bytes // (block_size * kv_bytes_per_token)


@dataclass(eq=False, slots=True)
class Sequence:
    """One request inside the engine. ``target_output_tokens`` is how many tokens it will
    generate before it stops (drawn by the caller: ``max_tokens`` under ``ignore_eos``)."""

    request_id: str
    prompt_tokens: int
    target_output_tokens: int
    max_tokens: int
    arrival_s: float
    priority: int = 0
    # A pooling request (/v1/embeddings): its one "output" is the pooled hidden state at the
    # end of its prefill, not a generated token (give it target_output_tokens = max_tokens
    # = 1). The step model runs it like any prefill; only what is counted differs.
    pooling: bool = False
    # The LoRA adapter that serves it (its name, or vLLM's int id), None for the base model.
    lora: str | int | None = None
    # Token ids of the prompt, which the prefix cache hashes; None: content of its own,
    # shared with no other request (it can only hit its own blocks after a preemption).
    prompt_ids: tuple[int, ...] | None = None
    # The id of output token i, for hashing decode blocks; None: ids of its own.
    output_ids: Callable[[int], int] | None = None
    output_tokens: int = 0
    num_computed_tokens: int = 0
    # Prompt tokens its first admission found in the prefix cache (usage's cached_tokens),
    # and the prompt tokens it put there (vLLM's created_cache_tokens), known at its first token.
    num_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0
    kv: RequestBlocks = field(default_factory=RequestBlocks)
    block_hashes: list[BlockHash] = field(default_factory=list)
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    # When the engine loop took it in: the first schedule() after add(), as vLLM's busy loop
    # records its QUEUED event when it drains the input queue between steps (so a request
    # that arrives mid-step is queued at that step's end, and the queue time excludes it).
    queued_s: float | None = None
    first_scheduled_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    finished_s: float | None = None
    finish_reason: FinishReason | None = None
    # Arrival order breaks ties between equal arrival times, so ordering is total.
    seq_no: int = field(default_factory=itertools.count().__next__)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    @property
    def num_blocks(self) -> int:
        return len(self.kv.blocks)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def priority_key(self) -> tuple[int, float, int]:
        return (self.priority, self.arrival_s, self.seq_no)


@dataclass(slots=True)
class Batch:
    """What one step computes: tokens per scheduled sequence, and the step's cost terms."""

    scheduled: dict[Sequence, int]
    prefill_tokens: int
    decode_seqs: int
    kv_tokens: int
    preempted: list[Sequence]
    duration_s: float
    # Prefill chunks' new tokens x the tokens cached before each chunk (the step's
    # attention to a cached prefix or to earlier chunks).
    prefill_context: int = 0
    # The prefix-cache lookups of the requests it admitted, in prompt tokens (counted when
    # the step completes, as vLLM counts them).
    prefix_queries: int = 0
    prefix_hits: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.scheduled.values())


@dataclass(slots=True)
class StepResult:
    batch: Batch
    end_s: float
    emitted: list[Sequence]  # sequences that sampled one new token this step
    finished: list[Sequence]
    token_gaps: list[float]  # inter-token latency of each emitted token after a first one


@dataclass(slots=True)
class Coast:
    """Plain decode steps an engine can take at once (``StepModel.coast_plan``)."""

    running: list[Sequence]  # each emits one token at each end
    ends: list[float]  # when each step completes
    durations: list[float]  # of the step scheduled at each end
    kv_tokens: int  # of the step in flight when planned
    preempts: bool  # the step after the last needs more blocks than are free

    def next_end(self, steps: int) -> float | None:
        """When the step in flight after ``steps`` of them ends (None: not known here, as
        schedule() will preempt then)."""
        if steps == len(self.ends) and self.preempts:
            return None
        return self.ends[steps - 1] + self.durations[steps - 1]


class WaitingQueue:
    """vLLM's waiting queue: FCFS with preempted requests pushed back to the front, or a
    priority heap on (priority, arrival)."""

    def __init__(self, policy: SchedulingPolicy) -> None:
        self._policy = policy
        self._fifo: deque[Sequence] = deque()
        self._heap: list[tuple[tuple[int, float, int], Sequence]] = []
        self._removed: set[Sequence] = set()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Sequence]:
        if self._policy == "fcfs":
            return iter(list(self._fifo))
        return iter([s for _, s in sorted(self._heap, key=lambda e: e[0])
                     if s not in self._removed])

    def add(self, seq: Sequence) -> None:
        if self._policy == "fcfs":
            self._fifo.append(seq)
        else:
            heapq.heappush(self._heap, (seq.priority_key(), seq))
        self._len += 1

    def prepend(self, seq: Sequence) -> None:
        """A preempted sequence goes back to the front (under priority, its key places it)."""
        if self._policy == "fcfs":
            self._fifo.appendleft(seq)
            self._len += 1
        else:
            self.add(seq)

    def peek(self) -> Sequence | None:
        if self._policy == "fcfs":
            return self._fifo[0] if self._fifo else None
        self._drop_removed()
        return self._heap[0][1] if self._heap else None

    def pop(self) -> Sequence:
        self._len -= 1
        if self._policy == "fcfs":
            return self._fifo.popleft()
        self._drop_removed()
        return heapq.heappop(self._heap)[1]

    def remove(self, seq: Sequence) -> None:
        if self._policy == "fcfs":
            self._fifo.remove(seq)
        else:
            # Lazy deletion keeps abort O(1); the heap entry is dropped when it surfaces.
            self._removed.add(seq)
        self._len -= 1

    def _drop_removed(self) -> None:
        while self._heap and self._heap[0][1] in self._removed:
            self._removed.discard(heapq.heappop(self._heap)[1])


class StepModel:
    """vLLM's scheduler loop over an emulated KV cache."""

    def __init__(self, config: EngineConfig, profile: StepTimeProfile) -> None:
        self.config = config
        self.profile = profile
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Sequence] = []
        self.kv = BlockPool(config.num_kv_blocks, config.block_size,
                            config.enable_prefix_caching)
        # What vLLM's /metrics counts of the engine's work (emulator/counters.py).
        self.counters = EngineCounters()
        self._lookups = [0, 0]  # the step being scheduled's prefix-cache queries and hits
        self._by_id: dict[str, Sequence] = {}
        self._in_flight: Batch | None = None
        self._arrived: list[Sequence] = []  # added since the last schedule(): not queued yet
        # Requests in the engine (waiting or running) per LoRA adapter, in the order the
        # adapters first appeared; an adapter leaves when its last request does (as vLLM's
        # per-adapter request states behind vllm:lora_requests_info).
        self.lora_requests: dict[str | int, int] = {}

    # -- requests ---------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self._by_id[seq.request_id] = seq
        self.waiting.add(seq)
        self._arrived.append(seq)
        if seq.lora is not None:
            self.lora_requests[seq.lora] = self.lora_requests.get(seq.lora, 0) + 1

    def check(self, seq: Sequence) -> None:
        """Raise ValueError if ``add(seq)`` would refuse it."""
        if seq.request_id in self._by_id:
            raise ValueError(f"duplicate request id {seq.request_id!r}")
        if seq.prompt_tokens < 1:
            raise ValueError("a sequence needs at least one prompt token")
        if seq.target_output_tokens < 1 or seq.target_output_tokens > seq.max_tokens:
            raise ValueError("target_output_tokens must be in [1, max_tokens]")
        # A pooling output is the prompt's pooled state, no token of the context.
        if seq.prompt_tokens + (0 if seq.pooling else seq.max_tokens) > \
                self.config.max_model_len:
            raise ValueError(
                f"prompt ({seq.prompt_tokens}) + max_tokens ({seq.max_tokens}) exceeds "
                f"max_model_len ({self.config.max_model_len})"
            )

    def abort(self, request_id: str, now: float) -> Sequence | None:
        """Abort a request wherever it is; its KV blocks are freed at once."""
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return None
        if seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        seq.finished_s = now
        self._left(seq)
        return seq

    def get(self, request_id: str) -> Sequence | None:
        return self._by_id.get(request_id)

    def _left(self, seq: Sequence) -> None:
        if seq.lora is None:
            return
        left = self.lora_requests[seq.lora] - 1
        if left:
            self.lora_requests[seq.lora] = left
        else:
            del self.lora_requests[seq.lora]

    # -- state ------------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    @property
    def free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones among them: they are evicted when needed)."""
        return self.kv.num_free_blocks

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.free_blocks / self.config.num_kv_blocks

    # -- the step ---------------------------------------------------------------------------

    def schedule(self, now: float) -> Batch | None:
        """Pick this step's batch. ``None`` when there is nothing to run. A step that only
        preempted (the first running sequence needing a block was itself the victim, under
        priority) is an empty batch of zero duration, as vLLM skips the model for a step
        with no tokens; the next step runs the rest."""
        if self._in_flight is not None:
            raise RuntimeError("schedule() called twice without complete()")
        if self._arrived:
            for seq in self._arrived:
                seq.queued_s = now
            self._arrived.clear()
        self._lookups = [0, 0]
        if self.config.chunked_prefill:
            scheduled, preempted = self._schedule_chunked()
        else:
            scheduled, preempted = self._schedule_split()
        if not scheduled and not preempted:
            return None
        if not scheduled:
            batch = Batch(scheduled={}, prefill_tokens=0, decode_seqs=0, kv_tokens=0,
                          preempted=preempted, duration_s=0.0,
                          prefix_queries=self._lookups[0], prefix_hits=self._lookups[1])
            self._in_flight = batch
            return batch
        prefill_tokens = decode_seqs = kv_tokens = prefill_context = 0
        for seq, n in scheduled.items():
            if seq.first_scheduled_s is None:
                seq.first_scheduled_s = now
            kv_tokens += seq.num_computed_tokens + n
            if n == 1 and seq.num_computed_tokens >= seq.prompt_tokens:
                decode_seqs += 1
            else:
                prefill_tokens += n
                prefill_context += n * seq.num_computed_tokens
        batch = Batch(
            scheduled=scheduled,
            prefill_tokens=prefill_tokens,
            decode_seqs=decode_seqs,
            kv_tokens=kv_tokens,
            preempted=preempted,
            duration_s=self.profile.step_time(prefill_tokens, decode_seqs, kv_tokens,
                                              prefill_context),
            prefill_context=prefill_context,
            prefix_queries=self._lookups[0],
            prefix_hits=self._lookups[1],
        )
        self._in_flight = batch
        return batch

    def complete(self, batch: Batch, end_s: float) -> StepResult:
        """Apply the step's computation at its end time."""
        if batch is not self._in_flight:
            raise RuntimeError("complete() of a batch that is not in flight")
        self._in_flight = None
        counters = self.counters
        counters.preemptions += len(batch.preempted)
        counters.prefix_cache_queries += batch.prefix_queries
        counters.prefix_cache_hits += batch.prefix_hits
        emitted: list[Sequence] = []
        finished: list[Sequence] = []
        gaps: list[float] = []
        for seq, n in batch.scheduled.items():
            if seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk, more to come
            seq.output_tokens += 1
            if not seq.pooling:
                counters.generation_tokens += 1
            if seq.first_token_s is None:
                counters.first_output(seq)
                seq.first_token_s = end_s
                # As vLLM's PrefillStats.finalize: the prompt's cached blocks less the hit.
                registered = seq.kv.num_cached * self.config.block_size
                seq.num_cache_creation_tokens = max(
                    min(registered, seq.prompt_tokens) - seq.num_cached_tokens, 0)
            else:
                # Why the ignore below: last_token_s is set together with first_token_s, so it is
                # not None here.
                gaps.append(end_s - seq.last_token_s)  # type: ignore[operator]
            seq.last_token_s = end_s
            emitted.append(seq)
            if seq.output_tokens >= seq.target_output_tokens:
                seq.status = SequenceStatus.FINISHED
                # A pooling request stops once pooled, as vLLM finishes it.
                seq.finish_reason = (
                    "length" if seq.output_tokens >= seq.max_tokens and not seq.pooling
                    else "stop"
                )
                seq.finished_s = end_s
                self.running.remove(seq)
                self._free(seq)
                del self._by_id[seq.request_id]
                self._left(seq)
                counters.finish(seq)
                finished.append(seq)
        return StepResult(batch=batch, end_s=end_s, emitted=emitted, finished=finished,
                          token_gaps=gaps)

    def coast_plan(self, batch: Batch, end_s: float, until_s: float) -> Coast | None:
        """How far the engine can coast from ``batch`` (in flight, ending at ``end_s``):
        ``None`` unless ``batch`` is a plain decode step, else the plain decode steps from it
        on, the last of them the first whose following step ends at or after ``until_s``,
        is not plain, or needs more blocks than are free. Changes nothing (see
        :meth:`coast`, which applies it).

        A plain decode step: nothing waits, every running sequence decodes one token and
        none of them finishes (so nothing joins, leaves or is preempted); the next step is
        then scheduled at its end, each running sequence decoding one more token.
        """
        if batch is not self._in_flight:
            raise RuntimeError("coast of a batch that is not in flight")
        running = self.running
        n = len(running)
        config = self.config
        if (not n or batch.prefill_tokens or batch.preempted or batch.decode_seqs != n
                or len(batch.scheduled) != n or len(self.waiting)
                or (config.chunked_prefill and n > config.max_num_batched_tokens)):
            # Not every running sequence decodes in it (the scheduled ones are the running
            # ones: only an abort removes one during a step, and a join would wait), or the
            # next step could admit or be cut by the token budget.
            return None
        # Completions that finish nothing: the one that brings a sequence to its target ends it.
        plain = running[0].target_output_tokens
        for seq in running:
            left = seq.target_output_tokens - seq.output_tokens
            if left < plain:
                plain = left
        plain -= 1
        if plain < 1:
            return None
        block_size = config.block_size
        free = self.free_blocks
        held = [(seq.num_computed_tokens, seq.num_blocks) for seq in running]
        step_time = self.profile.step_time
        kv_tokens = batch.kv_tokens
        ends: list[float] = []
        durations: list[float] = []
        end = end_s
        needed = 0  # blocks the next step takes beyond those held now, all sequences
        recount = 1  # the next step count after which that may grow
        while True:
            ends.append(end)  # the step in flight completes: one token each
            # The next is scheduled: each sequence's blocks for one more token
            # (_try_allocate), all of them from the free ones or a preemption.
            j = len(ends)
            if j >= recount:
                needed = 0
                recount = j + block_size
                for computed, blocks in held:
                    want = -(-(computed + j + 1) // block_size)
                    if want > blocks:
                        needed += want - blocks
                    else:
                        want = blocks
                    # It wants another block once computed + j' + 1 > want * block_size.
                    if want * block_size - computed < recount:
                        recount = want * block_size - computed
            if needed > free:
                return Coast(list(running), ends, durations, batch.kv_tokens, preempts=True)
            kv_tokens += n  # sum(num_computed_tokens + 1), each one token further
            duration = step_time(0, n, kv_tokens)
            durations.append(duration)
            following_end = end + duration
            if j >= plain or following_end >= until_s:
                return Coast(list(running), ends, durations, batch.kv_tokens, preempts=False)
            end = following_end

    def coast(self, batch: Batch, end_s: float, until_s: float) -> tuple[list[float], Batch] | None:
        """Complete ``batch`` (in flight, ending at ``end_s``) and the plain decode steps
        after it that end before ``until_s`` (:meth:`coast_plan`), all in one call: what a
        virtual-time caller does between two events of its own. ``None``, with nothing
        done, unless ``batch`` is a plain decode step.

        Returns the end times of the steps completed, and the batch left in flight: exactly
        what ``schedule()`` would have put there, as are the sequences and the KV cache
        (tests/unit/test_engine_coast.py holds it against ``complete()`` + ``schedule()``
        step by step). Every running sequence emitted one token at each of those end times;
        no :class:`StepResult` is made, so the token gaps are not recorded.
        """
        plan = self.coast_plan(batch, end_s, until_s)
        return None if plan is None else self.coast_apply(batch, plan)

    def coast_apply(self, batch: Batch, plan: Coast, steps: int | None = None
                    ) -> tuple[list[float], Batch]:
        """Take the first ``steps`` (all: None) of ``plan``, made for ``batch`` with
        nothing changed since, as :meth:`coast` takes them."""
        if batch is not self._in_flight:
            raise RuntimeError("coast of a batch that is not in flight")
        ends = plan.ends
        j = len(ends) if steps is None else steps
        if not 1 <= j <= len(ends):
            raise ValueError(f"steps must be in [1, {len(ends)}], got {steps}")
        if j < len(ends):
            ends = ends[:j]
        running = plan.running
        end = ends[-1]
        tokens_before = [seq.num_tokens for seq in running]
        for seq in running:
            seq.num_computed_tokens += j
            seq.output_tokens += j
            seq.last_token_s = end
        self.counters.generation_tokens += j * len(running)
        self._in_flight = None
        if j == len(plan.ends) and plan.preempts:
            # The steps before the last scheduled their decodes as schedule() would have.
            self._coast_blocks(running, tokens_before, j - 1)
            following = self.schedule(end)  # schedule() decides whom to preempt
            assert following is not None  # it holds the preempted sequences
            return ends, following
        self._coast_blocks(running, tokens_before, j)
        n = len(running)
        following = Batch(scheduled=dict.fromkeys(running, 1), prefill_tokens=0,
                          decode_seqs=n, kv_tokens=plan.kv_tokens + j * n, preempted=[],
                          duration_s=plan.durations[j - 1])
        self._in_flight = following
        return ends, following

    def _coast_blocks(self, running: list[Sequence], tokens_before: list[int],
                      steps: int) -> None:
        """The KV blocks of ``steps`` decode steps scheduled one after another: at the k-th,
        sequence i (of ``tokens_before[i]`` tokens before the first) decodes with
        ``tokens_before[i] + k`` tokens, taking a block when it needs one and caching the
        block it filled, in the order step by step scheduling does them (which blocks leave
        the free queue, and which is registered first, depend on it)."""
        block_size = self.config.block_size
        events: list[tuple[int, int, int]] = []  # (step, sequence, 0 allocate / 1 cache)
        for i, before in enumerate(tokens_before):
            # Step k allocates when before + k is one past a block boundary, and caches when
            # it lands on one.
            first = (-before) % block_size + 1
            for k in range(first, steps + 1, block_size):
                events.append((k, i, 0))
            if self.kv.enable_caching:
                first = (-before) % block_size or block_size
                for k in range(first, steps + 1, block_size):
                    events.append((k, i, 1))
        events.sort()
        for k, i, kind in events:
            seq = running[i]
            if kind == 0:
                self.kv.allocate(seq.kv, tokens_before[i] + k)
            else:
                tokens = tokens_before[i] + k
                self.kv.cache(seq.kv, self._hashes(seq, tokens), tokens)

    def step(self, now: float) -> StepResult | None:
        """Schedule and complete one step in virtual time."""
        batch = self.schedule(now)
        if batch is None:
            return None
        return self.complete(batch, now + batch.duration_s)

    # -- scheduling policies ----------------------------------------------------------------

    def _schedule_chunked(self) -> tuple[dict[Sequence, int], list[Sequence]]:
        """vLLM V1: running sequences first (decodes and unfinished prefill chunks), then
        waiting ones fill what is left of the token budget."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        preempted: list[Sequence] = []
        # As vLLM, the long-prefill cap is waived when a single request is in the engine.
        cap = self.config.long_prefill_token_threshold
        if len(self.running) + len(self.waiting) <= 1:
            cap = 0
        seq: Sequence | None  # a running sequence, then the head of the waiting queue
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(self._chunk(seq, cap), budget)
            while not self._try_allocate(seq, n):
                victim = self._pick_victim()
                budget += scheduled.pop(victim, 0)
                victim_index = self.running.index(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    n = 0
                    break
                if victim_index < i:
                    i -= 1
            if seq.status is not SequenceStatus.RUNNING:
                # It preempted itself: nothing lower to preempt is left. vLLM stops scheduling
                # running sequences here (under fcfs it was the last one anyway; under
                # priority the ones after it wait for the next step).
                break
            scheduled[seq] = n
            budget -= n
            i += 1
        # vLLM admits no new request in a step that had to preempt: memory is short.
        if not preempted:
            # The adapters of the running sequences scheduled above (all of them: the loop
            # ends early only when the budget is spent or it preempted).
            loras = {s.lora for s in scheduled if s.lora is not None}
            skipped: list[Sequence] = []
            while budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting.peek()
                if seq is None:
                    break
                if self._lora_blocked(seq, loras):
                    skipped.append(self.waiting.pop())
                    continue
                hit = self._lookup(seq)
                computed = len(hit) * self.config.block_size
                # vLLM 0.32 (scheduler_reserve_full_isl, on by default) admits a request only
                # when its whole prompt fits in the free blocks, not just the first chunk
                # (its hit blocks that are free count too: they leave the free queue).
                if self.kv.blocks_to_allocate(seq.kv, seq.num_tokens, hit) > self.free_blocks:
                    break
                n = min(self._chunk(seq, cap, computed), budget)
                if not self._try_allocate(seq, n, hit):
                    break
                self._admitted(seq, computed)
                self.waiting.pop()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                if seq.lora is not None:
                    loras.add(seq.lora)
                scheduled[seq] = n
                budget -= n
            self._requeue(skipped)
        return scheduled, preempted

    def _schedule_split(self) -> tuple[dict[Sequence, int], list[Sequence]]:
        """Without chunked prefill, as vLLM V0 did it: a step prefills whole prompts of waiting
        requests if any can be admitted, otherwise it decodes every running one. (vLLM V1
        with chunked prefill off still mixes decodes with whole prompts; this mode models the
        split behaviour the seed article compares against. See docs/emulator.md.)"""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Sequence, int] = {}
        # As vLLM V0: the adapters of every running sequence count.
        loras = {s.lora for s in self.running if s.lora is not None}
        skipped: list[Sequence] = []
        while len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            if seq is None:
                break
            if self._lora_blocked(seq, loras):
                skipped.append(self.waiting.pop())
                continue
            hit = self._lookup(seq)
            computed = len(hit) * self.config.block_size
            n = seq.num_tokens - computed
            if n > budget or not self._try_allocate(seq, n, hit):
                break
            self._admitted(seq, computed)
            self.waiting.pop()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.lora is not None:
                loras.add(seq.lora)
            scheduled[seq] = n
            budget -= n
        self._requeue(skipped)
        if scheduled:
            return scheduled, []
        preempted: list[Sequence] = []
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            while not self._try_allocate(seq, 1):
                victim = self._pick_victim()
                scheduled.pop(victim, None)
                victim_index = self.running.index(victim)
                self._preempt(victim)
                preempted.append(victim)
                if victim is seq:
                    break
                if victim_index < i:
                    i -= 1
            if seq.status is not SequenceStatus.RUNNING:
                continue
            scheduled[seq] = 1
            i += 1
        return scheduled, preempted

    def _lora_blocked(self, seq: Sequence, loras: set[str | int]) -> bool:
        """vLLM's max_loras rule: a request of an adapter that is not in the batch yet waits
        while the batch already holds ``max_loras`` distinct adapters."""
        return (seq.lora is not None and seq.lora not in loras
                and len(loras) >= self.config.max_loras)

    def _requeue(self, skipped: list[Sequence]) -> None:
        """Put the requests passed over back at the front of the queue, in their order (as
        vLLM's ``prepend_requests``; under priority their key places them)."""
        for seq in reversed(skipped):
            self.waiting.prepend(seq)

    @staticmethod
    def _chunk(seq: Sequence, cap: int, computed: int | None = None) -> int:
        """Tokens ``seq`` computes next, with ``computed`` of them done (default: its own)."""
        n = seq.num_tokens - (seq.num_computed_tokens if computed is None else computed)
        return min(n, cap) if 0 < cap < n else n

    # -- KV cache ---------------------------------------------------------------------------

    def _try_allocate(self, seq: Sequence, num_new_tokens: int,
                      hit: list[int] | None = None) -> bool:
        """Slots for ``num_new_tokens`` more tokens of ``seq`` (after its computed ones, or
        after ``hit``, the cached blocks a waiting sequence starts from), as vLLM's
        ``allocate_slots``; the blocks those tokens fill are cached at once."""
        block_size = self.config.block_size
        kv = self.kv
        if hit is None:  # a running sequence (most often a decode needing no new block)
            tokens = seq.num_computed_tokens + num_new_tokens
            needed = -(-tokens // block_size) - len(seq.kv.blocks)
            if needed > 0:
                if needed > kv.num_free_blocks:
                    return False
                kv.allocate(seq.kv, tokens)
        else:
            tokens = len(hit) * block_size + num_new_tokens
            if kv.blocks_to_allocate(seq.kv, tokens, hit) > kv.num_free_blocks:
                return False
            kv.allocate(seq.kv, tokens, hit)
        cached = min(tokens, seq.num_tokens)
        if kv.enable_caching and cached // block_size > seq.kv.num_cached:
            kv.cache(seq.kv, self._hashes(seq, cached), cached)
        return True

    def _lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting sequence starts from (none without prefix caching)."""
        if not self.kv.enable_caching:
            return []
        return self.kv.longest_hit(self._hashes(seq, seq.num_tokens), seq.num_tokens)

    def _admitted(self, seq: Sequence, computed: int) -> None:
        """A waiting sequence was admitted with ``computed`` tokens from the cache; vLLM
        counts the lookup (and reports the hit in usage) only at a first admission."""
        seq.num_computed_tokens = computed
        if not self.kv.enable_caching or seq.num_preemptions:
            return
        self._lookups[0] += seq.num_tokens
        self._lookups[1] += computed
        seq.num_cached_tokens = computed

    def _hashes(self, seq: Sequence, tokens: int) -> list[BlockHash]:
        """The hashes of ``seq``'s full blocks, at least those of its first ``tokens`` (vLLM's
        ``request.block_hashes``; computed when first needed, so that coasting and step by
        step scheduling leave the same list)."""
        hashes = seq.block_hashes
        block_size = self.config.block_size
        full = tokens // block_size
        while len(hashes) < full:
            start = len(hashes) * block_size
            hashes.append(hash_block(hashes[-1] if hashes else None,
                                     self._block_tokens(seq, start, start + block_size),
                                     self._extra_keys(seq, start)))
        return hashes

    @staticmethod
    def _block_tokens(seq: Sequence, start: int, end: int) -> list[int]:
        prompt = seq.prompt_tokens
        tokens: list[int] = []
        if start < prompt:
            stop = min(end, prompt)
            if seq.prompt_ids is not None:
                tokens.extend(seq.prompt_ids[start:stop])
            else:
                tokens.extend([0] * (stop - start))  # made its own by the salt of block 0
        output_ids = seq.output_ids
        for i in range(max(start, prompt) - prompt, end - prompt):
            # Negative ids are no real token's: output of its own, per sequence.
            tokens.append(output_ids(i) if output_ids is not None else -1 - seq.seq_no)
        return tokens

    @staticmethod
    def _extra_keys(seq: Sequence, start: int) -> tuple[object, ...] | None:
        """vLLM's extra keys: the LoRA adapter on every block; a prompt of unknown content
        gets a salt of its own on its first block, as vLLM's ``cache_salt``."""
        keys: list[object] = []
        if seq.lora is not None:
            keys.append(("lora", seq.lora))
        if start == 0 and seq.prompt_ids is None:
            keys.append(("cache_salt", seq.seq_no))
        return tuple(keys) or None

    def _free(self, seq: Sequence) -> None:
        self.kv.free(seq.kv)

    def _pick_victim(self) -> Sequence:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=Sequence.priority_key)
        return self.running[-1]

    def _preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop the KV cache and requeue at the front."""
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.prepend(seq)


def simulate(
    model: StepModel,
    arrivals: Iterable[Sequence],
    *,
    start_s: float = 0.0,
    until_s: float = math.inf,
) -> Iterator[StepResult]:
    """Drive ``model`` in virtual time: sequences join at their ``arrival_s``; each step starts
    when the previous one ends (or at the next arrival when the engine is idle)."""
    pending = sorted(arrivals, key=lambda s: (s.arrival_s, s.seq_no))
    k = 0
    now = start_s
    while now < until_s:
        while k < len(pending) and pending[k].arrival_s <= now:
            model.add(pending[k])
            k += 1
        result = model.step(now)
        if result is not None:
            yield result
            now = result.end_s
        elif k < len(pending):
            now = max(now, pending[k].arrival_s)
        else:
            return
