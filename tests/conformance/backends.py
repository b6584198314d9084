"""The conformance suite's backend under test and the engine shape both backends get."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx

from weighbridge.emulator.real_vllm import RealVllmServer

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


def assert_error_body(r: httpx.Response, status: int) -> None:
    """vLLM's error answer: ``{"error": {message, type, param, code}}`` with the status."""
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["code"] == status


def real_vllm(**extra: Any) -> RealVllmServer:
    """A real vLLM CPU server of the suite's engine shape (``extra``: more of its options)."""
    return RealVllmServer(
        model_name="conformance", max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, **extra)
