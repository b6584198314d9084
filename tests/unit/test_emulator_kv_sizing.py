"""The emulated KV cache is sized as vLLM's (in blocks, or in bytes at the model's KV bytes
per token) and described on /metrics as vLLM 0.32 describes it."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

from weighbridge.emulator.engine import EngineConfig, StepModel, kv_blocks_for_bytes
from weighbridge.emulator.metrics import EngineMetrics
from weighbridge.emulator.profiles import get_profile


def test_bytes_make_whole_blocks() -> None:
    # The fidelity benchmark's flood shape: vLLM reported 576 blocks for these bytes.
    assert kv_blocks_for_bytes(37_748_736, 32, 2048) == 576
    assert kv_blocks_for_bytes(37_748_736 + 65_535, 32, 2048) == 576
    with pytest.raises(ValueError):
        kv_blocks_for_bytes(0, 32, 2048)


def test_profiles_know_their_kv_bytes_per_token() -> None:
    assert get_profile("cpu-tiny").kv_bytes_per_token == 2 * 2 * 2 * 64 * 4
    assert get_profile("h100-llama3-8b").kv_bytes_per_token == 128 * 1024


def _cache_info(metrics: EngineMetrics) -> dict[str, str]:
    text = generate_latest(metrics.registry).decode()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("vllm:cache_config_info{")]
    labels = line[line.index("{") + 1:line.rindex("}")]
    return dict((k, v.strip('"')) for k, v in (p.split("=", 1) for p in labels.split('",')))


def test_cache_config_info_describes_the_cache_as_vllm() -> None:
    config = EngineConfig(num_kv_blocks=576, block_size=32, max_model_len=1024)
    model = StepModel(config, get_profile("cpu-tiny"))
    info = _cache_info(EngineMetrics(model, "m", num_gpu_blocks_override=576))
    # Values as real vLLM 0.32 exported them for the same shape (captured from its /metrics).
    assert info["num_gpu_blocks"] == "576" and info["block_size"] == "32"
    assert info["num_gpu_blocks_override"] == "576"
    assert info["kv_cache_memory_bytes"] == "37748736"
    assert info["kv_cache_size_tokens"] == "18432"
    assert info["kv_cache_max_concurrency"] == "18.0"
    sized_in_bytes = _cache_info(EngineMetrics(model, "m", kv_cache_memory_bytes=37_800_000))
    assert sized_in_bytes["num_gpu_blocks_override"] == "None"
    assert sized_in_bytes["kv_cache_memory_bytes"] == "37800000"
