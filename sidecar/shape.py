"""What one engine is, learned from its own ``/metrics``: slots, KV cache, step time.

Admission sized by hand only fits the engine it was sized for (the same fixed defaults were
too many slots for a KV-tight engine and too few for a large one: docs/sidecar.md,
"Admission defaults: learned from each engine"). ``ShapeLearner``
watches consecutive scrapes of one backend and keeps an ``EngineShape``; the admission gate
derives every knob a config leaves unset from it (``weighbridge.sidecar.admission.derive_limits``).

What is learned, and from what
------------------------------
``slots``       the sequences the engine runs at once when it cannot take more: the running
                count of a scrape taken while the engine was *saturated*, that is its waiting
                queue was non-empty at this scrape and the previous one, its running count
                did not grow in between (a ramp that admits more every step is bound by the
                prefill budget, not by slots), and the requests that finished in between
                had waited in the queue, on average, longer than ``saturated_wait_steps``
                engine steps (``vllm:request_queue_time_seconds``).
                An engine with free slots admits a waiting request at its next step, so a
                momentary queue (a few arrivals between two steps) is not saturation; a
                queue that holds requests for several steps is. The largest such count is
                kept, and any larger running count seen later raises it (the engine ran that
                many, so it can). It is the binding capacity — slots, or KV when KV binds
                first — which is what admission needs either way.
                Before any saturation is seen, the gate may report that the engine ran
                everything the sidecar's own in-flight cap let through, with nothing
                waiting (``runs_at_least``): the engine has at least that many slots.
                Without that, an engine larger than the fallback cap never queues, so its
                slots were never learned and no headroom was kept (the isolation matrix's
                64- and 256-slot engines with ample KV, docs/sidecar.md). Such a count is a
                lower bound (``slots_exact`` False): the derived limits let a lone tenant run a
                little past it, so that a larger engine shows a larger running count and the
                bound grows, step by step, until the engine queues (then the count is
                exact) or runs all the traffic there is. Without that probing the bound
                stayed at the fallback cap and a 256-slot engine ran 64-72 sequences (the
                matrix's output 0.50-0.77 of the ideal's).
``kv_blocks``   ``vllm:cache_config_info``'s ``num_gpu_blocks`` and ``block_size`` labels
``block_size``  (vLLM exports them; so does the emulator). None when absent: KV-aware
                admission is then off unless the config gives them.
``step_s``      one engine step: 1 / (generated tokens per second per running sequence),
                since every running sequence decodes one token a step. None until two
                scrapes with decoding between them.
``scrape_s``    how long one scrape of ``/metrics`` takes, request sent to body read: the
                median of the last ``SCRAPE_WINDOW`` timed scrapes (a median, so one scrape
                that met a long engine step does not move it). vLLM's API server renders
                the exposition (~48 KB, ~3 ms of CPU on real vLLM CPU 0.32) on the event loop
                that streams every token, so this is time the engine's server does not
                stream in; the admission gate keeps its polling to a small share of it.
                None until a timed scrape.

Invariants (tests/unit/sidecar/test_shape.py): ``slots`` never decreases and is never
below a running count observed in a saturated interval; ``step_s`` is positive or None;
the learner is pure (no clock: it reads the scrapes' own timestamps).
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, replace

from weighbridge.vllm_metrics import BackendSample


@dataclass(frozen=True, slots=True)
class EngineShape:
    slots: int | None = None
    # True once ``slots`` was seen binding (a saturated queue); False while it is only a
    # lower bound (the engine ran all the sidecar sent): the admission defaults then let a
    # lone tenant probe past it, so an engine larger than the first bound is learned whole.
    slots_exact: bool = False
    kv_blocks: int | None = None
    block_size: int | None = None
    step_s: float | None = None
    scrape_s: float | None = None


# Mean queue wait, in engine steps, that says the engine could not admit what waited. An
# engine with a free slot admits at its next step (a wait of at most one step, half on
# average); four steps leave room for a long prompt that needs two or three steps of budget.
SATURATED_WAIT_STEPS = 4.0
SCRAPE_WINDOW = 9  # scrape durations the median of ``scrape_s`` is taken over


class ShapeLearner:
    def __init__(self, saturated_wait_steps: float = SATURATED_WAIT_STEPS) -> None:
        self._wait_steps = saturated_wait_steps
        self._shape = EngineShape()
        self._previous: BackendSample | None = None
        self._scrape_durations: deque[float] = deque(maxlen=SCRAPE_WINDOW)

    @property
    def shape(self) -> EngineShape:
        return self._shape

    def observe(self, sample: BackendSample, fallback_step_s: float) -> EngineShape:
        """Learn from one more scrape (in scrape order; an older one is ignored).
        ``fallback_step_s`` stands for the step time until one is measured (the poll
        period is a safe choice: a wait longer than a poll is certainly not one step)."""
        previous = self._previous
        if previous is not None and sample.at_s <= previous.at_s:
            return self._shape
        self._previous = sample
        shape = self._shape
        kv_blocks, block_size = sample.kv_blocks, sample.block_size
        if kv_blocks and block_size:
            shape = replace(shape, kv_blocks=int(kv_blocks), block_size=int(block_size))
        scrape_s = sample.scrape_s
        if scrape_s is not None and scrape_s >= 0:
            self._scrape_durations.append(scrape_s)
            shape = replace(shape, scrape_s=statistics.median(self._scrape_durations))
        if previous is None:
            self._shape = shape
            return shape
        step = _step_s(previous, sample)
        if step is not None:
            shape = replace(shape, step_s=step)
        running = int(sample.running)
        if shape.slots is not None and running > shape.slots:
            shape = replace(shape, slots=running)  # it ran that many: it can
        elif (previous.waiting > 0 and sample.waiting > 0
              and 0 < running <= previous.running):
            # ... and the engine took no more sequences in between: an engine still ramping
            # up (running growing) makes requests wait for prefill budget, not for slots
            # (budget 512 and 512-token prompts: a 64-slot engine was learned as ~40).
            step_s = shape.step_s if shape.step_s is not None else fallback_step_s
            if _waited_long(previous, sample, self._wait_steps * step_s):
                shape = replace(shape, slots=max(shape.slots or 0, running), slots_exact=True)
        self._shape = shape
        return shape


    def runs_at_least(self, slots: int) -> EngineShape:
        """The engine ran ``slots`` sequences at once, all that was sent, nothing waiting:
        it has at least that many (slots never decrease)."""
        if slots > 0 and (self._shape.slots is None or slots > self._shape.slots):
            self._shape = replace(self._shape, slots=slots)
        return self._shape


def _step_s(previous: BackendSample, sample: BackendSample) -> float | None:
    before, after = previous.generation_tokens_total, sample.generation_tokens_total
    running = (previous.running + sample.running) / 2
    if before is None or after is None or after <= before or running <= 0:
        return None
    per_seq = (after - before) / (sample.at_s - previous.at_s) / running
    return 1.0 / per_seq


def _waited_long(previous: BackendSample, sample: BackendSample, threshold_s: float) -> bool:
    """Whether the requests that finished between two scrapes had waited in the engine's
    queue longer than ``threshold_s`` on average. vLLM observes a request's queue time when
    it finishes, so the evidence lags by a request's lifetime; saturation that lasts is seen
    all the same. False when unknown (not exported, counters reset, nothing finished)."""
    s0, c0 = previous.queue_time_sum, previous.queue_time_count
    s1, c1 = sample.queue_time_sum, sample.queue_time_count
    if s0 is None or c0 is None or s1 is None or c1 is None or c1 <= c0 or s1 < s0:
        return False
    return bool((s1 - s0) / (c1 - c0) >= threshold_s)
