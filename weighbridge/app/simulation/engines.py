"""One emulated engine in virtual time: the emulator's StepModel and its API front end.

The step model is the live emulator's own class (``weighbridge.emulator.engine.StepModel``); only
the clock differs. What a scrape returns is built from the model's state and its counters
(``StepModel.counters``, the ones the emulator's ``/metrics`` renders), as
``weighbridge.vllm_metrics.BackendSample``: rendering
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
        emitted = result.emitted
        if emitted:  # the front end streams them before its next admission, as live
            self.front_end.streamed(end_s, len(emitted))
        if model.running or len(model.waiting):
            following = model.schedule(end_s)
            self.batch = following
            return result, None if following is None else end_s + following.duration_s
        self.batch = None
        return result, None

    def coast_plan(self, end_s: float, until_s: float) -> Coast | None:
        """The plain decode steps this engine can take at once from the step ending at
        ``end_s`` (``StepModel.coast_plan``; changes nothing)."""
        assert self.batch is not None
        return self.model.coast_plan(self.batch, end_s, until_s)

    def coast(self, plan: Coast, steps: int) -> tuple[list[float], float]:
        """``advance()`` the first ``steps`` steps of ``plan`` at once. Returns their end
        times (every sequence of ``plan.running`` emitted a token at each) and when the step
        left in flight ends. The model's counters move as step by step."""
        assert self.batch is not None
        ends, following = self.model.coast_apply(self.batch, plan, steps)
        n = len(plan.running)
        self.steps += steps
        front_end = self.front_end
        if front_end.token_s:
            for end in ends:
                front_end.streamed(end, n)
        self.batch = following
        return ends, ends[-1] + following.duration_s

    def sample(self, at_s: float) -> BackendSample:
        """What a scrape sent at ``at_s`` reads (the sidecar stamps the send time)."""
        model = self.model
        counters = model.counters
        return BackendSample(
            at_s=at_s, waiting=float(model.num_waiting), running=float(model.num_running),
            kv_cache_usage=model.kv_cache_usage,
            generation_tokens_total=float(counters.generation_tokens),
            prompt_tokens_total=float(counters.prompt_tokens),
            preemptions_total=float(counters.preemptions),
            queue_time_sum=counters.queue_time.sum,
            queue_time_count=float(counters.queue_time.count),
            kv_blocks=model.config.num_kv_blocks, block_size=model.config.block_size,
            prefix_caching=model.config.enable_prefix_caching,
            prefix_cache_queries_total=float(counters.prefix_cache_queries),
            prefix_cache_hits_total=float(counters.prefix_cache_hits))
