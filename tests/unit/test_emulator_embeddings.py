"""/v1/embeddings on the emulator: vLLM's request forms and answers, each input a
prefill-only request to the step model (counted as prompt tokens, never as generation)."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.support.metrics import parse as parse_metrics
from weighbridge.emulator import text
from weighbridge.emulator.api import EMBEDDING_SIZE, ApiError, parse_embedding_request
from weighbridge.emulator.profiles import get_profile
from weighbridge.emulator.server import Emulator, EmulatorSettings

MODEL = "weighbridge-emulator"


def tokens(words: str) -> int:
    """A text input's prompt tokens: the emulator's tokenizer, and BOS."""
    return text.count_tokens(words) + 1


def parse(body: Any) -> Any:
    return parse_embedding_request(body, served_model=MODEL, max_model_len=64,
                                   vocab_size=100)


@pytest.mark.parametrize(("body", "counts"), [
    ({"input": "hello world"}, (tokens("hello world"),)),
    ({"input": ["a", "b c"]}, (tokens("a"), tokens("b c"))),
    ({"input": [1, 2, 3]}, (3,)),
    ({"input": [[1], [2, 3]], "model": MODEL}, (1, 2)),
])
def test_the_input_forms_of_openai_and_vllm(body: dict[str, Any],
                                            counts: tuple[int, ...]) -> None:
    assert parse(body).prompt_tokens == counts


@pytest.mark.parametrize(("body", "status"), [
    ({}, 400), ({"input": ""}, 400), ({"input": []}, 400), ({"input": [[]]}, 400),
    ({"input": ["a", ""]}, 400), ({"input": [1, "a"]}, 400), ({"input": [100]}, 400),
    ({"input": [1] * 65}, 400), ({"input": "a", "dimensions": 8}, 400),
    ({"input": "a", "encoding_format": "int8"}, 400), ({"input": "a", "model": "x"}, 404),
    ([1], 400),
])
def test_bad_requests_get_vllm_s_answers(body: Any, status: int) -> None:
    with pytest.raises(ApiError) as e:
        parse(body)
    assert e.value.status == status


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(Emulator(EmulatorSettings(),
                                              get_profile("cpu-tiny")).app)) as c:
        yield c


async def test_one_unit_vector_per_input_and_the_same_one_for_the_same_input(
        client: TestClient[Any, Any]) -> None:
    response = await client.post("/v1/embeddings", json={"input": ["x y", "z", "x y"]})
    assert response.status == 200
    body = await response.json()
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["id"].startswith("embd-")
    vectors = [d["embedding"] for d in body["data"]]
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(len(v) == EMBEDDING_SIZE for v in vectors)
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0) for v in vectors)
    assert vectors[0] == vectors[2] != vectors[1]
    prompt = 2 * tokens("x y") + tokens("z")
    assert body["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt,
                             "completion_tokens": 0, "prompt_tokens_details": None,
                             "completion_tokens_details": None}

    encoded = await (await client.post("/v1/embeddings", json={
        "input": "x y", "encoding_format": "base64"})).json()
    raw = base64.b64decode(encoded["data"][0]["embedding"])
    decoded = struct.unpack(f"<{EMBEDDING_SIZE}f", raw)
    assert decoded == pytest.approx(vectors[0], abs=1e-6)  # float32


async def test_inputs_are_prompt_tokens_of_the_engine_not_generation(
        client: TestClient[Any, Any]) -> None:
    assert (await client.post("/v1/embeddings", json={"input": [[1] * 10, [2] * 5]})).status \
        == 200
    samples = parse_metrics(await (await client.get("/metrics")).text())
    assert samples.total("vllm:prompt_tokens_total") == 15
    assert samples.total("vllm:generation_tokens_total") == 0
    assert samples.total("vllm:num_requests_running") == 0
