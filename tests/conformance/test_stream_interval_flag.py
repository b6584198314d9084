"""vLLM's ``--stream-interval``, server-wide: a real vLLM started with the flag, its chunks
compared with an emulator's started with the same flag: the suite's flagged pair
(tests/conformance/conftest.py), whose other flags change no chunk.

The per-request field on the default servers (interval 1) is in test_conformance.py.
"""

from __future__ import annotations

import pytest

from tests.conformance.backends import SERVER_STREAM_INTERVAL as SERVER_INTERVAL
from tests.conformance.backends import Backend, assert_interval_chunks
from tests.support import loopback

MAX_TOKENS = 16

# Content chunks of a 16-token stream on a server started with --stream-interval 4, by the
# request's own stream_interval: the larger of the two wins.
EXPECTED = {
    None: 5,  # the server's 4: 1, 4, 4, 4, 3
    2: 5,  # clamped up to the server's 4
    8: 3,  # raised: 1, 8, 7
}


@pytest.fixture
def emulator_url(emulator_flagged_backend: Backend) -> str:
    return emulator_flagged_backend.url


@pytest.fixture
def vllm_url(vllm_flagged_backend: Backend) -> str:
    return vllm_flagged_backend.url


def check_chunks(url: str) -> None:
    """Every case of ``EXPECTED`` on both endpoints: a streamed ``MAX_TOKENS``-token answer
    in that many content chunks, the last with the finish, then the usage of all tokens."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        for asked, chunks in EXPECTED.items():
            body: dict[str, object] = {
                "model": "conformance", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
            if path == "/v1/completions":
                body["prompt"] = [(7 * i + 3) % 97 + 6 for i in range(20)]
            else:
                body["messages"] = [{"role": "user", "content": "Say something short."}]
            if asked is not None:
                body["stream_interval"] = asked
            r = loopback.post(url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
            assert_interval_chunks(r.content, max(asked or 1, SERVER_INTERVAL), MAX_TOKENS,
                                   chunks)


def test_the_emulator_batches_by_the_flag_unless_a_request_asks_for_more(
        emulator_url: str) -> None:
    check_chunks(emulator_url)


@pytest.mark.vllm
def test_real_vllm_batches_by_the_flag_as_the_emulator_does(vllm_url: str,
                                                           emulator_url: str) -> None:
    """The same cases, on real vLLM and on the emulator started with the same flag."""
    check_chunks(vllm_url)
    check_chunks(emulator_url)
