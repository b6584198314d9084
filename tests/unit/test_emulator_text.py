"""The emulator's tokenizer rule, EOS model and request parsing."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.emulator import text
from weighbridge.emulator.api import ApiError, GenerationRequest, parse_generation_request
from weighbridge.emulator.eos import EosModel


def test_tokenizer_rule() -> None:
    assert text.tokenize("hello world") == ["hell", "o", " worl", "d"]
    assert text.count_tokens("a, b!") == 4  # "a" "," " b" "!"
    assert text.count_tokens("") == 0
    assert text.count_tokens("  ") == 2


@given(st.text())
def test_tokens_cover_the_text_exactly(s: str) -> None:
    assert "".join(text.tokenize(s)) == s


@given(st.integers(min_value=0, max_value=10**6), st.integers(min_value=0, max_value=500))
def test_generated_text_retokenizes_to_its_length(seed: int, n: int) -> None:
    assert text.count_tokens(text.generated_text(seed, 0, n)) == n


def test_eos_model_is_seeded_and_capped() -> None:
    model_a, model_b = EosModel(50, seed=3), EosModel(50, seed=3)
    draws_a = [model_a.output_tokens(100, False) for _ in range(400)]
    draws_b = [model_b.output_tokens(100, False) for _ in range(400)]
    assert draws_a == draws_b
    assert all(1 <= d <= 100 for d in draws_a)
    # Geometric with mean 50 capped at 100: mean ~ 50 * (1 - e^-2) ~ 43.
    assert 35 < sum(draws_a) / len(draws_a) < 52
    assert EosModel(50).output_tokens(7, True) == 7


def parse(body: object, endpoint: str = "completions") -> GenerationRequest:
    return parse_generation_request(endpoint, body, served_model="m",  # type: ignore[arg-type]
                                    max_model_len=100, vocab_size=1000)


def test_parse_counts_prompt_and_clamps_max_tokens() -> None:
    r = parse({"model": "m", "prompt": [1, 2, 3], "max_tokens": 99})
    assert r.prompt_tokens == 3 and r.max_tokens == 97
    assert parse({"prompt": "hi"}).prompt_tokens == 2  # BOS + "hi"
    chat = parse({"messages": [{"role": "user", "content": "hi"}]}, "chat")
    assert chat.prompt_tokens == text.count_chat_tokens(["hi"]) and chat.max_tokens == 100 - 4


@pytest.mark.parametrize(
    ("body", "status"),
    [
        ([], 400),
        ({"model": "other", "prompt": "x"}, 404),
        ({"prompt": "x", "max_tokens": 0}, 400),
        ({"prompt": "x", "max_tokens": True}, 400),
        ({"prompt": "x", "max_tokens": "ten"}, 400),
        ({"prompt": [1, 5000]}, 400),
        ({"prompt": []}, 400),
        ({}, 400),
        ({"prompt": list(range(100))}, 400),
        ({"prompt": list(range(101))}, 400),
        ({"prompt": "x", "max_tokens": 101}, 400),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, 400),
        ({"prompt": "x", "n": 2}, 400),
    ],
)
def test_bad_requests_are_api_errors(body: object, status: int) -> None:
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.status == status
    assert e.value.body()["error"]["code"] == status
