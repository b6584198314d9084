"""The emulator with ``--tokenizer`` set to the tiny model's directory numbers text exactly
as real vLLM serving that model does: ``/tokenize`` and ``usage.prompt_tokens`` for text
completions and chat, and the cached tokens of a chat turn after its history."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conformance.backends import BLOCK_SIZE, Backend, emulator_backend
from tests.support import loopback
from weighbridge.emulator.real_vllm import tiny_model_dir

pytestmark = pytest.mark.vllm

SYSTEM = " ".join(f"Rule {i}: answer {'briefly' if i % 2 else 'politely'}, cite section {i}."
                  for i in range(12))
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "Where is the station?"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Tell me, 42 times!"}],
    [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "Go  north,\nthen east."},
     {"role": "user", "content": [{"type": "text", "text": "And "},
                                  {"type": "text", "text": "then? café ☕"}]}],
]
PROMPTS = ["Hello world, plain prompt.", "  two leading spaces\tand a tab", "ünïcödé 😀 text"]


@pytest.fixture(scope="module")
def emulator() -> Iterator[Backend]:
    with emulator_backend(tokenizer=str(tiny_model_dir()),
                          enable_prompt_tokens_details=True) as backend:
        yield backend


def _post(backend: Backend, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = loopback.post(backend.url + path, json={"model": backend.model, **body}, timeout=60)
    assert r.status_code == 200, r.text
    answer: dict[str, Any] = r.json()
    return answer


@pytest.mark.parametrize("messages", CHATS)
def test_chat_ids_and_prompt_tokens_are_vllm_s(emulator: Backend, vllm_backend: Backend,
                                               messages: list[dict[str, Any]]) -> None:
    ids = [_post(b, "/tokenize", {"messages": messages})["tokens"]
           for b in (emulator, vllm_backend)]
    assert ids[0] == ids[1]
    usage = [_post(b, "/v1/chat/completions", {"messages": messages, "max_tokens": 2,
                                               "ignore_eos": True})["usage"]
             for b in (emulator, vllm_backend)]
    assert usage[0]["prompt_tokens"] == usage[1]["prompt_tokens"] == len(ids[0])


@pytest.mark.parametrize("prompt", PROMPTS)
def test_text_prompt_ids_are_vllm_s(emulator: Backend, vllm_backend: Backend,
                                    prompt: str) -> None:
    for special in (True, False):
        ids = [_post(b, "/tokenize", {"prompt": prompt, "add_special_tokens": special})
               ["tokens"] for b in (emulator, vllm_backend)]
        assert ids[0] == ids[1]
    usage = [_post(b, "/v1/completions", {"prompt": prompt, "max_tokens": 2,
                                          "ignore_eos": True})["usage"]
             for b in (emulator, vllm_backend)]
    assert usage[0]["prompt_tokens"] == usage[1]["prompt_tokens"]


def test_a_turn_after_its_history_hits_the_same_blocks(emulator: Backend,
                                                       vllm_backend: Backend) -> None:
    """The history alone, then the history and a next turn: the same cached tokens on both
    (whole blocks of the shared ids; other tests' requests share no 32-token block)."""
    history = [{"role": "system", "content": SYSTEM + " Unique to this test."},
               {"role": "user", "content": "first question"}]
    turn = [*history, {"role": "assistant", "content": "first answer"},
            {"role": "user", "content": "second question"}]
    cached = []
    for b in (emulator, vllm_backend):
        _post(b, "/v1/chat/completions", {"messages": history, "max_tokens": 1})
        usage = _post(b, "/v1/chat/completions", {"messages": turn, "max_tokens": 1})["usage"]
        cached.append(usage["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == cached[1] and cached[0] > 0 and cached[0] % BLOCK_SIZE == 0
