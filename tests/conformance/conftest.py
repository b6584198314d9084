"""One conformance suite, two backends: the emulator and the real vLLM CPU build.

Both are started once per session with the same small engine shape, so that queueing
happens with a handful of requests. The real-vLLM backend carries the ``vllm`` marker; when
vLLM cannot start, its tests fail (never skip).
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from tests.conformance.backends import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    MAX_NUM_BATCHED_TOKENS,
    MAX_NUM_SEQS,
    NUM_KV_BLOCKS,
    Backend,
    real_vllm,
)
from weighbridge.emulator.real_vllm import tiny_model_dir
from weighbridge.launch import emulator_process


@pytest.fixture(scope="session")
def emulator_backend() -> Iterator[Backend]:
    with emulator_process(
        model_name="conformance", max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, vocab_size=_vocab_size(),
    ) as proc:
        yield Backend("emulator", proc.url, "conformance")


@pytest.fixture(scope="session")
def vllm_backend() -> Iterator[Backend]:
    with real_vllm() as server:
        yield Backend("vllm", server.url, server.model_name)


@pytest.fixture(params=["emulator", pytest.param("vllm", marks=pytest.mark.vllm)])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")


def _vocab_size() -> int:
    """The tiny model's vocabulary when it is built, so token-id prompts valid on one backend
    are valid on the other."""
    config = tiny_model_dir() / "config.json"
    if config.is_file():
        return int(json.loads(config.read_text())["vocab_size"])
    return 32000
