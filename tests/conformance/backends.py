"""The conformance suite's backend under test and the engine shape both backends get."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

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
