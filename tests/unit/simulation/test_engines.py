"""A simulated scrape reads what the live path reads: the emulator's /metrics exposition,
parsed by the sidecar's parser, on the same engine state."""

from __future__ import annotations

from prometheus_client import generate_latest

from weighbridge.app.simulation.engines import SimEngine
from weighbridge.emulator.metrics import EngineMetrics
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.vllm_metrics import parse_vllm_metrics

# A small KV cache so the run preempts (the preemption counter must agree too).
OPTIONS = EmulatorOptions(profile="h100-llama3-8b", max_num_seqs=8, max_num_batched_tokens=256,
                          num_kv_blocks=64, block_size=16, max_model_len=1024,
                          scheduling_policy="priority")


def _live(metrics: EngineMetrics, at_s: float) -> object:
    return parse_vllm_metrics(generate_latest(metrics.registry).decode(), at_s)


def test_sample_equals_the_parsed_exposition_at_every_step() -> None:
    engine = SimEngine("engine-0", OPTIONS)
    metrics = EngineMetrics(engine.model, "m")
    for i in range(24):
        engine.model.add(engine.sequence(f"r{i}", 40 + 17 * i, 30 + i, True, i % 3, 0.0))
    now, compared, preempted = 0.0, 0, 0
    end = engine.start_step(now)
    while end is not None:
        # Mid-step (a scrape while the step runs) and after it.
        assert engine.sample(now) == _live(metrics, now)
        result, following = engine.advance(end)
        metrics.on_step(result, lag_s=0.0)
        for seq in result.finished:
            metrics.on_finish(seq)
        preempted += len(result.batch.preempted)
        assert engine.sample(end) == _live(metrics, end)
        compared += 2
        now, end = end, following
    assert compared > 50
    assert preempted > 0  # the counter was exercised
    assert engine.sample(now).generation_tokens_total == sum(30 + i for i in range(24))
