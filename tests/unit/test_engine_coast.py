"""``StepModel.coast``: plain decode steps taken at once leave the engine exactly as
``complete()`` + ``schedule()`` step by step do (hypothesis, over random loads and states)."""

from __future__ import annotations

import copy
import dataclasses
import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weighbridge.emulator.engine import Batch, Coast, EngineConfig, Sequence, StepModel
from weighbridge.emulator.profiles import get_profile

requests = st.lists(
    st.tuples(
        st.floats(min_value=0.0, max_value=0.5),  # arrival
        st.integers(min_value=1, max_value=200),  # prompt tokens
        st.integers(min_value=1, max_value=80),  # output tokens
        st.integers(min_value=0, max_value=3),  # priority
    ),
    min_size=1,
    max_size=24,
)


@st.composite
def configs(draw: st.DrawFn) -> EngineConfig:
    block_size = draw(st.sampled_from([1, 4, 16]))
    kv_tokens = draw(st.integers(min_value=384, max_value=1600))  # down to heavy preemption
    chunked = draw(st.booleans())
    return EngineConfig(
        max_num_seqs=draw(st.integers(min_value=1, max_value=12)),
        max_num_batched_tokens=draw(st.integers(min_value=2, max_value=512)) if chunked else 512,
        num_kv_blocks=math.ceil(kv_tokens / block_size),
        block_size=block_size,
        max_model_len=384,
        scheduling_policy=draw(st.sampled_from(["fcfs", "priority"])),
        chunked_prefill=chunked,
        long_prefill_token_threshold=draw(st.sampled_from([0, 32])),
    )


def _plain(model: StepModel, batch: Batch) -> bool:
    """Every running sequence decodes one token, none finishes, nothing waits."""
    return (not len(model.waiting) and not batch.preempted and batch.prefill_tokens == 0
            and bool(model.running)
            and list(batch.scheduled) == model.running
            and all(n == 1 for n in batch.scheduled.values())
            and all(s.output_tokens + 1 < s.target_output_tokens for s in model.running))


def _stepwise(model: StepModel, batch: Batch, end: float, until: float
              ) -> tuple[list[float], Batch] | None:
    if not _plain(model, batch):
        return None
    ends = []
    while True:
        running = list(model.running)
        result = model.complete(batch, end)
        assert result.emitted == running and not result.finished
        ends.append(end)
        following = model.schedule(end)
        assert following is not None
        batch = following
        if not _plain(model, batch) or end + batch.duration_s >= until:
            return ends, batch
        end += batch.duration_s


def _state(model: StepModel, batch: Batch | None) -> dict[str, Any]:
    seqs = {s.request_id: dataclasses.astuple(s) for s in
            [*model.running, *model.waiting, *model._by_id.values()]}
    in_flight = None if batch is None else (
        [(s.request_id, n) for s, n in batch.scheduled.items()], batch.prefill_tokens,
        batch.decode_seqs, batch.kv_tokens, [s.request_id for s in batch.preempted],
        batch.duration_s)
    return {"seqs": seqs, "running": [s.request_id for s in model.running],
            "waiting": [s.request_id for s in model.waiting], "free": model.free_blocks,
            "counters": dataclasses.astuple(model.counters), "batch": in_flight,
            "in_flight": model._in_flight is batch}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs(), reqs=requests, at=st.integers(min_value=0, max_value=400),
       horizon=st.floats(min_value=0.0, max_value=2.0), cut=st.integers(min_value=1, max_value=50))
def test_coasting_equals_complete_and_schedule_step_by_step(
        config: EngineConfig, reqs: list[tuple[float, int, int, int]], at: int, horizon: float,
        cut: int) -> None:
    _check(config, reqs, at, horizon, cut)


def test_coasting_stops_where_a_step_preempts_and_schedule_decides() -> None:
    # Three sequences that outgrow a 384-token cache with nothing waiting.
    config = EngineConfig(max_num_seqs=4, num_kv_blocks=96, block_size=4, max_model_len=384)
    plan = _check(config, [(0.0, 120, 120, 0)] * 3, 0, math.inf, 5)
    assert plan is not None and plan.preempts and plan.next_end(len(plan.ends)) is None


def _check(config: EngineConfig, reqs: list[tuple[float, int, int, int]], at: int,
           horizon: float, cut: int) -> Coast | None:
    model = StepModel(config, get_profile("cpu-tiny"))
    pending = sorted((Sequence(f"r{i}", p, o, o, a, prio) for i, (a, p, o, prio)
                      in enumerate(reqs)), key=lambda s: (s.arrival_s, s.seq_no))
    now, k, steps = 0.0, 0, 0
    batch: Batch | None = None
    # Run to the first plain step in flight at or after step `at` (or the end of the load).
    while True:
        while k < len(pending) and pending[k].arrival_s <= now:
            model.add(pending[k])
            k += 1
        batch = model.schedule(now)
        if batch is None:
            if k == len(pending):
                return None
            now = pending[k].arrival_s
            continue
        if steps >= at and _plain(model, batch):
            break
        model.complete(batch, now + batch.duration_s)
        now += batch.duration_s
        steps += 1
    end = now + batch.duration_s
    until = end + horizon
    original = copy.deepcopy((model, batch))
    expected = _stepwise(*copy.deepcopy(original), end, until)
    plan = model.coast_plan(batch, end, until)
    assert _state(model, batch) == _state(*original)  # a plan changes nothing
    assert (plan is None) == (expected is None)
    assert expected is not None and plan is not None
    # All of the plan, as coast() takes it.
    whole = copy.deepcopy(original)
    coasted = whole[0].coast(whole[1], end, until)
    assert coasted is not None
    stepwise_model = copy.deepcopy(original)
    expected = _stepwise(*stepwise_model, end, until)
    assert expected is not None
    assert coasted[0] == expected[0] == plan.ends
    assert _state(whole[0], coasted[1]) == _state(stepwise_model[0], expected[1])
    if (following_end := plan.next_end(len(plan.ends))) is not None:
        assert following_end == expected[0][-1] + expected[1].duration_s
    # Part of it: as far as a step-by-step run stopped by an earlier horizon goes.
    j = min(cut, len(plan.ends))
    if j < len(plan.ends):
        ends, following = model.coast_apply(batch, plan, j)
        reference_model = copy.deepcopy(original)
        reference = _stepwise(*reference_model, end, plan.ends[j])
        assert reference is not None and ends == reference[0] == plan.ends[:j]
        assert _state(model, following) == _state(reference_model[0], reference[1])
        assert plan.next_end(j) == plan.ends[j]
    return plan
