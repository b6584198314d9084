"""vLLM's ``stream_interval`` on the emulator: the server's ``--stream-interval`` and a
request's field, the larger winning; the first token's chunk at once, then one chunk per
interval, the rest with the finish (vllm/v1/engine/output_processor.py). Real vLLM's side is
in tests/conformance (the field in test_conformance.py, the flag in
test_stream_interval_flag.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError
from typer.testing import CliRunner

from tests.conformance.backends import assert_interval_chunks, content_chunks
from weighbridge.app.cli import app
from weighbridge.emulator.api import ApiError, parse_generation_request
from weighbridge.emulator.engine import Sequence
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.emulator.profiles import get_profile
from weighbridge.emulator.server import Emulator, EmulatorSettings, TokenStream

MODEL = "weighbridge-emulator"


def handed_over(interval: int, tokens: int) -> list[int]:
    """The tokens of each hand-over to the handler, for a reader that keeps up."""
    stream = TokenStream(seq=Sequence(request_id="r", prompt_tokens=4,
                                      target_output_tokens=tokens, max_tokens=tokens,
                                      arrival_s=0.0), seed=1, interval=interval)
    chunks = []
    for i in range(tokens):
        stream.emitted()
        if i == tokens - 1:
            stream.finish()
        if stream.pending:
            chunks.append(stream.pending)
            stream.pending = 0
    return chunks


@pytest.mark.parametrize(("interval", "tokens", "chunks"), [
    (1, 5, [1, 1, 1, 1, 1]),
    (4, 16, [1, 4, 4, 4, 3]),  # measured on real vLLM
    (5, 17, [1, 5, 5, 5, 1]),  # measured on real vLLM
    (5, 16, [1, 5, 5, 5]),  # the finish comes with a full interval
    (8, 1, [1]),
    (8, 3, [1, 2]),
])
def test_the_first_token_at_once_then_one_chunk_per_interval(
        interval: int, tokens: int, chunks: list[int]) -> None:
    assert handed_over(interval, tokens) == chunks


def test_a_slow_reader_gets_what_was_handed_over_never_the_held_tokens() -> None:
    stream = TokenStream(seq=Sequence(request_id="r", prompt_tokens=4, target_output_tokens=16,
                                      max_tokens=16, arrival_s=0.0), seed=1, interval=4)
    for _ in range(10):
        stream.emitted()
    # Tokens 1, 2-5 and 6-9 were handed over while the reader was away: one chunk of 9.
    assert (stream.pending, stream.held) == (9, 1)
    stream.finish()
    assert (stream.pending, stream.held, stream.finished) == (10, 0, True)


def parse(**fields: Any) -> Any:
    return parse_generation_request("completions", {"prompt": [7, 8, 9], **fields},
                                    served_model=MODEL, max_model_len=64, vocab_size=100)


@pytest.mark.parametrize(("value", "interval"), [
    (None, None), (1, 1), (8, 8), ("8", 8), (4.0, 4), (True, 1),
])
def test_the_field_is_read_as_vllm_s_pydantic_reads_it(value: Any, interval: int | None) -> None:
    assert parse(stream_interval=value).stream_interval == interval
    assert parse().stream_interval is None


@pytest.mark.parametrize(("value", "error"), [
    (0, "{'type': 'greater_than_equal', 'loc': 'body.stream_interval', 'msg': 'Input should "
        "be greater than or equal to 1', 'input': '0', 'ctx': {'ge': 1}}"),
    (False, "{'type': 'greater_than_equal', 'loc': 'body.stream_interval', 'msg': 'Input "
            "should be greater than or equal to 1', 'input': 'False', 'ctx': {'ge': 1}}"),
    (4.5, "{'type': 'int_from_float', 'loc': 'body.stream_interval', 'msg': 'Input should be "
          "a valid integer, got a number with a fractional part', 'input': '4.5'}"),
    ([1], "{'type': 'int_type', 'loc': 'body.stream_interval', 'msg': 'Input should be a "
          "valid integer', 'input': '<list of 1 items>'}"),
    ("x" * 300, "{'type': 'int_parsing', 'loc': 'body.stream_interval', 'msg': 'Input should "
                "be a valid integer, unable to parse string as an integer', 'input': '"
                + "x" * 200 + "...[truncated]'}"),
])
def test_a_bad_value_is_vllm_s_validation_error(value: Any, error: str) -> None:
    """As measured on real vLLM 0.32 (all but the long string, which follows its code)."""
    with pytest.raises(ApiError) as e:
        parse(stream_interval=value, stream=False)
    assert (e.value.status, e.value.type, e.value.param) == (400, "Bad Request",
                                                             "body.stream_interval")
    assert e.value.message == "1 validation error:\n  " + error


def test_the_field_is_checked_before_the_model_as_vllm_does() -> None:
    with pytest.raises(ApiError) as e:
        parse(stream_interval=0, model="no-such-model")
    assert e.value.status == 400


def test_the_flag_is_at_least_1() -> None:
    assert EmulatorOptions().stream_interval == 1
    with pytest.raises(ValidationError):
        EmulatorOptions(stream_interval=0)
    with pytest.raises(ValueError, match="stream_interval"):
        EmulatorSettings(stream_interval=0)
    result = CliRunner().invoke(app, ["emulator", "--stream-interval", "0"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 2
    assert "--stream-interval: Input should be greater than or equal to 1" in result.output


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    """An emulator started as ``--stream-interval 4``."""
    emulator = Emulator(EmulatorSettings(stream_interval=4), get_profile("cpu-tiny"))
    async with TestClient(TestServer(emulator.app)) as c:
        yield c


@pytest.mark.parametrize(("asked", "chunks"), [
    (None, 5),  # the server's 4: 1, 4, 4, 4, 3
    (2, 5),  # clamped up to the server's 4
    (8, 3),  # raised: 1, 8, 7
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_the_server_s_interval_unless_the_request_asks_for_more(
        client: TestClient[Any, Any], path: str, asked: int | None, chunks: int) -> None:
    body: dict[str, Any] = {"max_tokens": 16, "ignore_eos": True, "stream": True,
                            "stream_options": {"include_usage": True,
                                               "continuous_usage_stats": True}}
    if path == "/v1/completions":
        body["prompt"] = [7, 8, 9]
    else:
        body["messages"] = [{"role": "user", "content": "hi"}]
    if asked is not None:
        body["stream_interval"] = asked
    response = await client.post(path, json=body)
    assert response.status == 200
    raw = await response.read()
    # Boundaries where the interval puts them; fewer chunks only if the handler fell behind
    # the engine (the steps run in real time), never more.
    assert_interval_chunks(raw, max(asked or 1, 4), 16, chunks)
    content = content_chunks(raw)
    # The text is the same tokens, only cut differently: one word per token.
    words = "".join(c["choices"][0].get("text") or c["choices"][0]["delta"]["content"]
                    for c in content).split()
    assert len(words) == 16


async def test_a_whole_response_ignores_the_interval(client: TestClient[Any, Any]) -> None:
    response = await client.post("/v1/completions", json={
        "prompt": [7, 8, 9], "max_tokens": 16, "ignore_eos": True, "stream_interval": 8})
    assert response.status == 200
    body = await response.json()
    assert body["usage"]["completion_tokens"] == 16
    assert len(body["choices"][0]["text"].split()) == 16
