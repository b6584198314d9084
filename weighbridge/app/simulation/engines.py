"""One emulated engine in virtual time: the emulator's StepModel, its API front end, and the
counters its ``/metrics`` would show.

The step model is the live emulator's own class (``weighbridge.emulator.engine.StepModel``); only
the clock differs. What a scrape returns is built from the model's state and the counters the
emulator's ``EngineMetrics`` keeps, as ``weighbridge.vllm_metrics.BackendSample``: rendering
and parsing the Prometheus text on every poll (as live) costs ~1 ms per scrape and would dominate an
hour-long run, so the equality of both paths is a test instead
(tests/unit/simulation/test_engines.py renders the live exposition and parses it with the
sidecar's parser).
"""

from __future__ import annotations

from weighbridge.emulator.engine import Batch, Coast, Sequence, StepModel, StepResult
from weighbridge.emulator.eos import EosModel
from weighbridge.emulator.frontend import ApiFrontEnd
from weighbridge.emulator.intake import ApiRequest, engine_sequences
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.vllm_metrics import BackendSample

__all__ = ["SimEngine", "output_token_id"]


def output_token_id(index: int) -> int:
    """The id of a simulated answer's token ``index``: the same in every answer, which the
    prefix cache's chained hashes keep apart (an answer is cached after its own prompt)."""
    return 6 + (index * 7919 + 13) % 500


class SimEngine:
    def __init__(self, name: str, options: EmulatorOptions, seed_offset: int = 0) -> None:
        self.name = name
        self.served_model = options.model_name  # what an answer names without a model of its own
        self.model = StepModel(options.engine(), options.step_profile())
        self.front_end = ApiFrontEnd(self.model.profile)
        # As `weighbridge up`: engine i draws its output lengths from seed + i.
        self.eos = EosModel(options.mean_output_tokens, options.seed + seed_offset)
        # --enable-prompt-tokens-details: usage carries the prompt's prefix-cache hits.
        self.reports_cached_tokens = options.enable_prompt_tokens_details
        self.batch: Batch | None = None  # the step in flight
        self.steps = 0
        # vLLM's counters, as emulator.metrics.EngineMetrics.on_step counts them.
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.preemptions_total = 0
        # vllm:prefix_cache_queries and _hits: the model's, as the last step's end counted them
        # (with the admissions of the step scheduled there).
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        # vllm:request_queue_time_seconds, observed when a request finishes (metrics.on_finish).
        self.queue_time_sum = 0.0
        self.queue_time_count = 0

    @property
    def busy(self) -> bool:
        return self.batch is not None

    def sequences(self, request: ApiRequest, request_id: str, now: float) -> list[Sequence]:
        """The sequences the emulator's handler makes of ``request`` (``engine_sequences``:
        one for a generation, its length drawn; one pooling sequence per embeddings input).
        A sequence with prompt ids (none: content of its own) outputs ``output_token_id``'s
        tokens, the ids a next turn sends back."""
        sequences = engine_sequences(request, request_id, now, self.eos,
                                     self.model.config.scheduling_policy)
        for seq in sequences:
            if seq.prompt_ids is not None:
                seq.output_ids = output_token_id
        return sequences

    def start_step(self, now: float) -> float | None:
        """Schedule a step at ``now`` if there is work; returns when it ends."""
        batch = self.model.schedule(now)
        if batch is None:
            return None
        self.batch = batch
        return now + batch.duration_s

    def advance(self, end_s: float) -> tuple[StepResult, float | None]:
        """Complete the step in flight at ``end_s`` and, as the emulator's loop does before
        any handler runs, schedule the next one there. Returns the step's result and when
        the next step ends (None: the engine is idle)."""
        batch = self.batch
        assert batch is not None
        model = self.model
        result = model.complete(batch, end_s)
        self.steps += 1
        if batch.preempted:
            self.preemptions_total += len(batch.preempted)
        emitted = result.emitted
        self.generation_tokens_total += len(emitted)
        if emitted:  # the front end streams them before its next admission, as live
            self.front_end.streamed(end_s, len(emitted))
        for seq in emitted:
            if seq.output_tokens == 1:
                self.prompt_tokens_total += seq.prompt_tokens
                if seq.pooling:  # its one output is the pooled state, not a generated token
                    self.generation_tokens_total -= 1
        for seq in result.finished:
            if seq.finish_reason not in (None, "abort") and seq.first_scheduled_s is not None:
                queued = seq.queued_s if seq.queued_s is not None else seq.arrival_s
                self.queue_time_sum += seq.first_scheduled_s - queued
                self.queue_time_count += 1
        if model.running or len(model.waiting):
            following = model.schedule(end_s)
            self.batch = following
            self._count_lookups()
            return result, None if following is None else end_s + following.duration_s
        self.batch = None
        self._count_lookups()
        return result, None

    def _count_lookups(self) -> None:
        self.prefix_cache_queries_total = self.model.prefix_cache_queries
        self.prefix_cache_hits_total = self.model.prefix_cache_hits

    def coast_plan(self, end_s: float, until_s: float) -> Coast | None:
        """The plain decode steps this engine can take at once from the step ending at
        ``end_s`` (``StepModel.coast_plan``; changes nothing)."""
        assert self.batch is not None
        return self.model.coast_plan(self.batch, end_s, until_s)

    def coast(self, plan: Coast, steps: int) -> tuple[list[float], float]:
        """``advance()`` the first ``steps`` steps of ``plan`` at once. Returns their end
        times (every sequence of ``plan.running`` emitted a token at each) and when the step
        left in flight ends. The counters move as ``advance`` moves them step by step: no
        prompt is counted (every sequence had its first token), no preemption, nothing
        finishes."""
        assert self.batch is not None
        ends, following = self.model.coast_apply(self.batch, plan, steps)
        n = len(plan.running)
        self.steps += steps
        self.generation_tokens_total += n * steps
        front_end = self.front_end
        if front_end.token_s:
            for end in ends:
                front_end.streamed(end, n)
        self.batch = following
        self._count_lookups()
        return ends, ends[-1] + following.duration_s

    def sample(self, at_s: float) -> BackendSample:
        """What a scrape sent at ``at_s`` reads (the sidecar stamps the send time)."""
        model = self.model
        return BackendSample(
            at_s=at_s, waiting=float(model.num_waiting), running=float(model.num_running),
            kv_cache_usage=model.kv_cache_usage,
            generation_tokens_total=float(self.generation_tokens_total),
            prompt_tokens_total=float(self.prompt_tokens_total),
            preemptions_total=float(self.preemptions_total),
            queue_time_sum=self.queue_time_sum, queue_time_count=float(self.queue_time_count),
            kv_blocks=model.config.num_kv_blocks, block_size=model.config.block_size,
            prefix_caching=model.config.enable_prefix_caching,
            prefix_cache_queries_total=float(self.prefix_cache_queries_total),
            prefix_cache_hits_total=float(self.prefix_cache_hits_total))
