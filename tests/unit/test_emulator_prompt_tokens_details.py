"""The prefix cache as clients see it: the switches as vLLM spells them, usage's
``prompt_tokens_details`` in vLLM 0.32's shapes (captured from the real server with
``--enable-prompt-tokens-details``), the token ids text and chat prompts hash to, and
``/tokenize``."""

from __future__ import annotations

from typing import Any

from typer.testing import CliRunner

from weighbridge.app.cli import app
from weighbridge.emulator import text
from weighbridge.emulator.api import (
    Endpoint,
    ResponseShape,
    parse_generation_request,
    tokenize,
)
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.launch import emulator_process


def _request(endpoint: Endpoint, body: dict[str, Any]) -> Any:
    return parse_generation_request(endpoint, {"model": "m", **body}, served_model="m",
                                    max_model_len=1024, vocab_size=2048)


def _shape(endpoint: Endpoint, details: bool) -> ResponseShape:
    body = ({"prompt": [7] * 40} if endpoint == "completions"
            else {"messages": [{"role": "user", "content": "hi"}]})
    return ResponseShape.for_request(_request(endpoint, {**body, "max_tokens": 4}), "id",
                                     prompt_tokens_details=details)


def test_the_switches_are_vllm_s_two_spellings() -> None:
    assert EmulatorOptions().engine().enable_prefix_caching  # on by default, as vLLM
    off = EmulatorOptions(enable_prefix_caching=False)
    assert not off.engine().enable_prefix_caching
    assert off.flags() == {"enable_prefix_caching": False, "seed": 0}
    argv = emulator_process(**off.flags()).argv
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    result = CliRunner().invoke(app, ["emulator", "--help"], env={"COLUMNS": "400"})
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching",
                 "--enable-prompt-tokens-details"):
        assert flag in result.output


def test_usage_says_how_many_prompt_tokens_were_cached_only_with_the_flag() -> None:
    for endpoint in ("completions", "chat"):
        plain = _shape(endpoint, details=False)
        assert plain.full_response("x", "length", 4, 32, 0)["usage"][
            "prompt_tokens_details"] is None
        assert "prompt_tokens_details" not in plain.usage_chunk(4, 32, 0)["usage"]
    completions, chat = _shape("completions", True), _shape("chat", True)
    # Whole answers: chat fills created_cache_tokens, completions leaves it null.
    assert completions.full_response("x", "length", 4, 288, 0)["usage"][
        "prompt_tokens_details"] == {"cached_tokens": 288, "created_cache_tokens": None,
                                     "multimodal_tokens": None}
    assert chat.full_response("x", "length", 4, 0, 288)["usage"][
        "prompt_tokens_details"] == {"cached_tokens": 0, "created_cache_tokens": 288,
                                     "multimodal_tokens": None}
    # The streamed usage chunk drops the null fields.
    assert completions.usage_chunk(4, 288, 0)["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 288}
    assert chat.usage_chunk(4, 288, 0)["usage"]["prompt_tokens_details"] == {
        "cached_tokens": 288, "created_cache_tokens": 0}


def test_prompts_carry_the_token_ids_the_cache_hashes() -> None:
    ids = _request("completions", {"prompt": [9, 8, 7]}).prompt_ids
    assert ids == (9, 8, 7)
    textual = _request("completions", {"prompt": "hello world"})
    assert textual.prompt_ids == text.prompt_ids("hello world")
    assert textual.prompt_ids[0] == text.BOS_ID and textual.prompt_tokens == 5
    system = {"role": "system", "content": "You are terse."}
    first = _request("chat", {"messages": [system, {"role": "user", "content": "Hi"}]})
    assert len(first.prompt_ids) == first.prompt_tokens
    # A next turn resends the reply as an assistant message: the first turn's ids, with
    # the reply's opening, are a prefix of it, and so are the reply's words.
    reply = text.generated_text(3, 0, 5)
    turn = _request("chat", {"messages": [system, {"role": "user", "content": "Hi"},
                                          {"role": "assistant", "content": reply},
                                          {"role": "user", "content": "More"}]})
    answer = tuple(text.generated_token_id(3, i) for i in range(5))
    assert turn.prompt_ids[:first.prompt_tokens + 5] == first.prompt_ids + answer


def test_tokenize_answers_the_ids_as_vllm_s_endpoint() -> None:
    messages = [{"role": "user", "content": "Hi there"}]
    with_reply = tokenize({"messages": messages}, served_model="m", vocab_size=2048)
    assert with_reply == _request("chat", {"messages": messages}).prompt_ids
    assert tokenize({"messages": messages, "add_generation_prompt": False},
                    served_model="m", vocab_size=2048) == with_reply[:-1]
    assert tokenize({"prompt": "hello"}, served_model="m", vocab_size=2048) == \
        text.prompt_ids("hello")
    assert tokenize({"prompt": "hello", "add_special_tokens": False}, served_model="m",
                    vocab_size=2048) == text.prompt_ids("hello")[1:]


def test_return_token_ids_gives_the_ids_an_answer_is_hashed_under() -> None:
    """vLLM's return_token_ids: a completion's choice has the output's and the prompt's ids
    (streamed: the prompt's with the first chunk); they are the ids the decode blocks hash,
    inside the vocabulary, so a next turn can send them back."""
    shape = ResponseShape.for_request(_request("completions", {
        "prompt": [9, 8, 7], "max_tokens": 3, "return_token_ids": True}), "id")
    ids = text.generated_token_ids(5, 0, 3)
    assert all(6 <= i < 2048 for i in ids)
    assert ids == [text.token_id(t) for t in text.tokenize(text.generated_text(5, 0, 3))]
    choice = shape.full_response("x", "length", 3, token_ids=ids)["choices"][0]
    assert (choice["token_ids"], choice["prompt_token_ids"]) == (ids, [9, 8, 7])
    first = shape.delta_chunk("x", None, 1, ids[:1], first=True)["choices"][0]
    later = shape.delta_chunk("y", None, 2, ids[1:2])["choices"][0]
    assert (first["prompt_token_ids"], first["token_ids"]) == ([9, 8, 7], ids[:1])
    assert (later["prompt_token_ids"], later["token_ids"]) == (None, ids[1:2])
    plain = _shape("completions", details=False).full_response("x", "length", 3,
                                                               token_ids=ids)["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None
