"""One conformance suite, two backends: the emulator and the real vLLM CPU build.

Both are started once per session with the same small engine shape, so that queueing
happens with a handful of requests. The real-vLLM backend carries the ``vllm`` marker; when
vLLM cannot start, its tests fail (never skip).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from emulator.real_vllm import RealVllmServer, tiny_model_dir
from weighbridge.launch import emulator_process

# The engine shape both backends get. The CPU attention backend wants blocks of 32 tokens;
# 64 blocks hold two maximal sequences.
MAX_NUM_SEQS = 4
MAX_NUM_BATCHED_TOKENS = 512
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 32
NUM_KV_BLOCKS = 64


@dataclass(frozen=True)
class Backend:
    kind: str
    url: str
    model: str
    max_num_seqs: int = MAX_NUM_SEQS
    max_model_len: int = MAX_MODEL_LEN


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
    with RealVllmServer(
        model_name="conformance", max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS,
    ) as server:
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
