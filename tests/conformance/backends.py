"""The conformance suite's backend under test and the engine shape both backends get."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.conformance.adapter import ADAPTER, RANK
from weighbridge.emulator.real_vllm import RealVllmServer, tiny_model_dir
from weighbridge.launch import emulator_process

# The engine shape both backends get. The CPU attention backend wants blocks of 32 tokens;
# 64 blocks hold two maximal sequences.
MAX_NUM_SEQS = 4
MAX_NUM_BATCHED_TOKENS = 512
MAX_MODEL_LEN = 1024
BLOCK_SIZE = 32
NUM_KV_BLOCKS = 64

# The server-wide flags whose modules share one server of each backend: LoRA (test_lora.py),
# the prefix cache off (test_prefix_cache_off.py) and --stream-interval
# (test_stream_interval_flag.py). None of the three modules' answers depends on the other
# flags (no LoRA test streams, no stream-interval test reads the cache, a LoRA adapter is
# cached like its base), and a real vLLM start-up costs 30-60 s: one for the three.
SERVER_STREAM_INTERVAL = 4
# The tiny model on vLLM's pooling runner, as an embedding model and as a classifier.
EMBED_MODEL = ("--runner", "pooling", "--convert", "embed")
CLASSIFY_MODEL = ("--runner", "pooling", "--convert", "classify")
# vLLM's development endpoints (/server_info), which both backends of the default pair serve.
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


@dataclass(frozen=True)
class Backend:
    kind: str
    url: str
    model: str
    max_num_seqs: int = MAX_NUM_SEQS
    max_model_len: int = MAX_MODEL_LEN


def vocab_size() -> int:
    """The tiny model's vocabulary when it is built, so token-id prompts valid on one backend
    are valid on the other."""
    config = tiny_model_dir() / "config.json"
    if config.is_file():
        return int(json.loads(config.read_text())["vocab_size"])
    return 32000


@contextlib.contextmanager
def emulator_backend(**flags: Any) -> Iterator[Backend]:
    """The emulator in the suite's engine shape (``flags`` add to or override it)."""
    shape: dict[str, Any] = {
        "model_name": "conformance", "max_num_seqs": MAX_NUM_SEQS,
        "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS, "max_model_len": MAX_MODEL_LEN,
        "block_size": BLOCK_SIZE, "num_kv_blocks": NUM_KV_BLOCKS, "vocab_size": vocab_size(),
        **flags}
    proc = emulator_process(**shape)
    proc.env = DEV_MODE  # as the real server: /server_info served
    with proc:
        yield Backend("emulator", proc.url, "conformance")


def assert_error_body(r: httpx.Response, status: int) -> None:
    """vLLM's error answer: ``{"error": {message, type, param, code}}`` with the status."""
    assert r.status_code == status, (r.status_code, r.text)
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str)
    assert error["code"] == status


def stream_chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed body, which ends with ``[DONE]``."""
    payloads = [event.removeprefix("data: ") for event in raw.decode().strip().split("\n\n")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def content_chunks(raw: bytes) -> list[dict[str, Any]]:
    """The chunks of a streamed body that carry output: not chat's opening role chunk, nor
    the usage chunk (``choices: []``)."""
    return [c for c in stream_chunks(raw)
            if c["choices"] and "role" not in c["choices"][0].get("delta", {})]


def assert_interval_chunks(raw: bytes, interval: int, max_tokens: int, chunks: int) -> None:
    """A streamed body asked with ``stream_options.continuous_usage_stats`` came in chunks as
    vLLM's ``stream_interval`` sends them: the first token's chunk at once, then one per
    ``interval`` tokens, the rest with the finish (``chunks`` content chunks in all).

    Read from each chunk's running ``usage.completion_tokens``, so the text of a token (which
    differs between the backends) does not matter. A reader that falls behind gets the chunks
    it missed merged into one (vLLM's output collector; real vLLM on 2 cores now and then
    merges a stream's last two), which removes chunk boundaries but never adds or moves
    one: so every boundary before the last must fall after the 1st, (1 + interval)th,
    (1 + 2 interval)th... token, and there may be fewer than ``chunks`` chunks, never more.
    No timing is assumed."""
    content = content_chunks(raw)
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert 1 <= len(counts) <= chunks, (counts, chunks)
    assert counts == sorted(set(counts)), counts  # strictly increasing
    assert counts[-1] == max_tokens, counts
    assert all((n - 1) % interval == 0 for n in counts[:-1]), (counts, interval)
    finish = [c["choices"][0]["finish_reason"] for c in content]
    assert finish[-1] == "length" and all(f is None for f in finish[:-1]), finish
    assert stream_chunks(raw)[-1]["usage"]["completion_tokens"] == max_tokens


def flagged_emulator(adapter: Path) -> contextlib.AbstractContextManager[Backend]:
    """The emulator in the suite's shape with the shared server-wide flags (above)."""
    return emulator_backend(
        enable_lora=True, lora_modules=[f"{ADAPTER}={adapter}"], max_lora_rank=RANK,
        enable_prefix_caching=False, enable_prompt_tokens_details=True,
        stream_interval=SERVER_STREAM_INTERVAL)


def flagged_vllm(adapter: Path) -> RealVllmServer:
    """Real vLLM in the suite's shape with the shared server-wide flags (above)."""
    return real_vllm(
        enable_prefix_caching=False, enable_prompt_tokens_details=True, extra_args=[
            "--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}", "--max-loras", "1",
            "--max-lora-rank", str(RANK), "--stream-interval", str(SERVER_STREAM_INTERVAL)])


def real_vllm(**extra: Any) -> RealVllmServer:
    """A real vLLM CPU server of the suite's engine shape (``extra``: more of its options)."""
    return RealVllmServer(
        model_name="conformance", max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, **extra)
