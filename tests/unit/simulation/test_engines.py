"""A simulated scrape reads what the live path reads: the emulator's /metrics exposition,
parsed by the sidecar's parser, on the same engine state (embeddings inputs and a rerank's
query and documents among the requests: a pooling sequence counts its prompt, and no
generated token)."""

from __future__ import annotations

from prometheus_client import generate_latest

from weighbridge.app.simulation.engines import SimEngine
from weighbridge.emulator.api import EmbeddingRequest, GenerationRequest
from weighbridge.emulator.metrics import EngineMetrics
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.emulator.pooling import ScoringRequest
from weighbridge.endpoints import EndpointKind
from weighbridge.vllm_metrics import parse_vllm_metrics

# A small KV cache so the run preempts (the preemption counter must agree too).
OPTIONS = EmulatorOptions(profile="h100-llama3-8b", max_num_seqs=8, max_num_batched_tokens=256,
                          num_kv_blocks=64, block_size=16, max_model_len=1024,
                          scheduling_policy="priority")


def _live(metrics: EngineMetrics, at_s: float) -> object:
    return parse_vllm_metrics(generate_latest(metrics.registry).decode(), at_s)


def _generation(prompt_tokens: int, max_tokens: int, priority: int) -> GenerationRequest:
    return GenerationRequest(endpoint="completions", model="m", prompt_tokens=prompt_tokens,
                             max_tokens=max_tokens, ignore_eos=True, priority=priority,
                             stream=True, include_usage=True, continuous_usage=False,
                             user=None)


def _embeddings(*lengths: int) -> EmbeddingRequest:
    ids = tuple(tuple(range(7, 7 + n)) for n in lengths)
    return EmbeddingRequest(model="m", inputs=ids, input_ids=ids, prompt_tokens=lengths,
                            encoding_format="float", priority=1, user=None)


def _rerank(query: int, *documents: int) -> ScoringRequest:
    ids = tuple(tuple(range(9, 9 + n)) for n in (query, *documents))
    return ScoringRequest(kind=EndpointKind.RERANK, model="m", input_ids=ids, queries=1,
                          documents=tuple(map(str, documents)))


def test_sample_equals_the_parsed_exposition_at_every_step() -> None:
    engine = SimEngine("engine-0", OPTIONS)
    metrics = EngineMetrics(engine.model, "m")
    for i in range(24):
        request = _generation(40 + 17 * i, 30 + i, i % 3)
        for seq in engine.sequences(request, f"r{i}", 0.0):
            engine.model.add(seq)
        if i % 6 == 0:
            for seq in engine.sequences(_embeddings(20 + i, 90), f"e{i}", 0.0):
                engine.model.add(seq)
        if i % 8 == 0:
            for seq in engine.sequences(_rerank(12, 30, 40), f"s{i}", 0.0):
                engine.model.add(seq)
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
    # Every generation's tokens, and none for the 8 pooled inputs and the 3 reranks' 9.
    assert engine.sample(now).generation_tokens_total == sum(30 + i for i in range(24))
    assert engine.sample(now).prompt_tokens_total == sum(
        40 + 17 * i for i in range(24)) + sum(20 + i + 90 for i in range(0, 24, 6)) + 3 * 82
