"""/pooling, /classify, /score and /rerank on the emulator: vLLM's request forms, refusals and
answers, each input (a rerank's query and each document) a prefill-only request to the step
model, counted as prompt tokens and never as generation. Real vLLM's side of the same
requests is tests/conformance/test_pooling.py."""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given
from hypothesis import strategies as st

from tests.support.metrics import parse as parse_metrics
from weighbridge.emulator import text
from weighbridge.emulator.api import EMBEDDING_SIZE, ApiError
from weighbridge.emulator.engine import EngineConfig
from weighbridge.emulator.eos import EosModel
from weighbridge.emulator.intake import engine_sequences
from weighbridge.emulator.pooling import (
    EncodeRequest,
    ScoringRequest,
    _small_float,
    parse_pooling_request,
)
from weighbridge.emulator.profiles import get_profile
from weighbridge.emulator.server import Emulator, EmulatorSettings
from weighbridge.endpoints import EndpointKind

MODEL = "weighbridge-emulator"
POOLING, CLASSIFY, SCORE, RERANK = (EndpointKind.POOLING, EndpointKind.CLASSIFY,
                                    EndpointKind.SCORE, EndpointKind.RERANK)


def tokens(words: str) -> int:
    """A text's prompt tokens: the emulator's tokenizer, and BOS."""
    return text.count_tokens(words) + 1


def parse(kind: EndpointKind, body: Any) -> EncodeRequest | ScoringRequest:
    return parse_pooling_request(kind, body, served_model=MODEL, max_model_len=64,
                                 vocab_size=100, adapters=("sql",))


@pytest.mark.parametrize(("kind", "body", "counts"), [
    (POOLING, {"input": "hello world"}, [tokens("hello world")]),
    (POOLING, {"input": ["a", "b c"]}, [tokens("a"), tokens("b c")]),
    (POOLING, {"input": [7, 8, 9]}, [3]),
    (POOLING, {"input": [[7], [8, 9]], "model": MODEL}, [1, 2]),
    (POOLING, {"input": ""}, [1]),  # BOS alone, as vLLM
    (POOLING, {"input": "a b", "add_special_tokens": False}, [tokens("a b") - 1]),
    (CLASSIFY, {"input": "hello", "truncate_prompt_tokens": 1}, [1]),
    (CLASSIFY, {"input": [7, 8, 9, 10], "truncate_prompt_tokens": -1}, [4]),
    (CLASSIFY, {"input": "x", "padding": "max_length"}, [64]),
    (CLASSIFY, {"messages": [{"role": "user", "content": "hi"}]},
     [len(text.chat_ids([("user", "hi")])) - 1]),  # no generation prompt by default
    # A bi-encoder: the query once, then every document.
    (RERANK, {"query": "q", "documents": ["a", "b c", "d"]},
     [tokens("q"), tokens("a"), tokens("b c"), tokens("d")]),
    (RERANK, {"query": "q", "documents": "one"}, [tokens("q"), tokens("one")]),
    (SCORE, {"text_1": "q", "text_2": ["a", "b"]}, [tokens("q"), tokens("a"), tokens("b")]),
    (SCORE, {"queries": ["q", "r"], "documents": ["a", "b"]}, [2, 2, 2, 2]),
    (SCORE, {"queries": "q", "items": ["a"]}, [2, 2]),
    (SCORE, {"data_1": ["q"], "data_2": ["a", "b"]}, [2, 2, 2]),
    (RERANK, {"query": "q", "documents": ["aaaa bbbb cccc dddd"], "max_tokens_per_doc": 2},
     [2, 3]),
])
def test_each_input_is_a_prompt_of_its_own(kind: EndpointKind, body: dict[str, Any],
                                           counts: list[int]) -> None:
    request = parse(kind, body)
    assert [len(ids) for ids in request.input_ids] == counts
    seqs = engine_sequences(request, "r", 0.0, EosModel(128.0, 0), "fcfs")
    assert [s.prompt_tokens for s in seqs] == counts
    assert all(s.pooling and s.max_tokens == s.target_output_tokens == 1 for s in seqs)
    assert [s.request_id for s in seqs] == [f"r-{i}" for i in range(len(counts))]


def test_an_adapter_serves_and_names_the_answer() -> None:
    request = parse(RERANK, {"model": "sql", "query": "q", "documents": ["a"]})
    assert request.lora == request.model == "sql"
    seqs = engine_sequences(request, "r", 0.0, EosModel(128.0, 0), "priority")
    assert {s.lora for s in seqs} == {"sql"}


@pytest.mark.parametrize(("kind", "body", "status", "type_", "param"), [
    (RERANK, {"documents": ["a"]}, 400, "Bad Request", "body.query"),
    (RERANK, {"query": ["a"], "documents": ["a"]}, 400, "Bad Request", "body.query"),
    (RERANK, {"query": "q", "documents": []}, 400, "BadRequestError", None),
    (RERANK, {"query": "q", "documents": ["a"], "top_n": -1}, 400, "Bad Request",
     "body.top_n"),
    (RERANK, {"query": "q", "documents": [{"content": []}]}, 400, "BadRequestError", None),
    (RERANK, {"query": "q", "documents": ["a"], "model": "nope"}, 404, "NotFoundError",
     None),
    (RERANK, {"query": "q", "documents": ["a"], "max_tokens_per_doc": 64}, 400,
     "BadRequestError", None),
    (RERANK, {"query": "q", "documents": ["a"], "max_tokens_per_query": -1}, 400,
     "BadRequestError", None),
    (RERANK, {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 65}, 400,
     "BadRequestError", None),
    (RERANK, {"query": "q", "documents": ["a"], "priority": 2**63}, 400, "Bad Request",
     "body.priority"),
    (RERANK, {"query": "q", "documents": ["w " * 80]}, 400, "BadRequestError",
     "input_tokens"),
    (RERANK, [1], 400, "Bad Request", "body"),
    (SCORE, {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, 400, "BadRequestError", None),
    (SCORE, {"text_1": [], "text_2": ["c"]}, 400, "BadRequestError", None),
    (SCORE, {"text_1": "a"}, 400, "Bad Request", "body.queries"),
    (SCORE, "x", 400, "Bad Request", "body"),
    (POOLING, {"input": []}, 400, "BadRequestError", None),
    (POOLING, {"input": [[7], []]}, 400, "BadRequestError", None),
    (POOLING, {"input": [100]}, 400, "BadRequestError", None),
    (POOLING, {"input": [7] * 65}, 400, "BadRequestError", "input_tokens"),
    (POOLING, {"input": "a", "dimensions": 8}, 400, "BadRequestError", "dimensions"),
    (POOLING, {"input": "a", "task": "token_embed"}, 400, "BadRequestError", "task"),
    (POOLING, {"input": "a", "task": "classify"}, 400, "BadRequestError", "task"),
    (POOLING, {"input": "a", "task": "nope"}, 400, "Bad Request", "body.task"),
    (POOLING, {"input": "a", "normalize": True}, 400, "BadRequestError", "normalize"),
    (POOLING, {"data": {}}, 400, "BadRequestError", "task"),
    (POOLING, {"prompt": "a"}, 400, "Bad Request", "body.input"),
    (POOLING, {"input": "a", "encoding_format": "int8"}, 400, "Bad Request",
     "body.encoding_format"),
    (CLASSIFY, {"messages": []}, 400, "BadRequestError", None),
    (CLASSIFY, {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": True,
                "continue_final_message": True}, 400, "BadRequestError", None),
    (CLASSIFY, {"input": "a", "truncate_prompt_tokens": 0}, 400, "BadRequestError", None),
    (CLASSIFY, {"input": "a", "user": 5}, 400, "Bad Request", "body.user"),
])
def test_bad_requests_get_vllm_s_answers(kind: EndpointKind, body: Any, status: int,
                                         type_: str, param: str | None) -> None:
    with pytest.raises(ApiError) as e:
        parse(kind, body)
    assert (e.value.status, e.value.type, e.value.param) == (status, type_, param), \
        e.value.message


def test_a_validation_message_lists_pydantic_s_errors_as_vllm_prints_them() -> None:
    with pytest.raises(ApiError) as e:
        parse(SCORE, {"text_1": "a"})
    # One error per missing field of each of the four request forms, union branches unnamed.
    assert e.value.message.splitlines()[0] == "7 validation errors:"
    assert ("  {'type': 'missing', 'loc': 'body.queries', 'msg': 'Field required', "
            "'input': '<dict of 1 items>'}") in e.value.message.splitlines()
    with pytest.raises(ApiError) as e:
        parse(RERANK, {"query": "q", "documents": list(range(12))})
    lines = e.value.message.splitlines()
    assert lines[0] == "26 validation errors:" and lines[-1] == "  ...and 16 more errors"


@pytest.fixture
async def client() -> AsyncIterator[TestClient[Any, Any]]:
    settings = EmulatorSettings(engine=EngineConfig(max_model_len=256, num_kv_blocks=64))
    async with TestClient(TestServer(Emulator(settings, get_profile("cpu-tiny")).app)) as c:
        yield c


async def _post(client: TestClient[Any, Any], path: str, body: Any) -> dict[str, Any]:
    response = await client.post(path, json=body)
    assert response.status == 200, await response.text()
    answer: dict[str, Any] = await response.json()
    return answer


@pytest.mark.parametrize("path", EndpointKind.RERANK.paths)
async def test_rerank_ranks_documents_by_their_cosine_to_the_query(
        client: TestClient[Any, Any], path: str) -> None:
    docs = ["the cat", "a dog", "the cat", "sky"]
    body = await _post(client, path, {"query": "the cat", "documents": docs})
    assert body["id"].startswith("score-") and body["model"] == MODEL
    assert set(body) == {"id", "model", "usage", "results"}
    results = body["results"]
    assert sorted(r["index"] for r in results) == [0, 1, 2, 3]
    scores = [r["relevance_score"] for r in results]
    assert scores == sorted(scores, reverse=True)
    # The query's own text scores 1 (twice, in the documents' order), the rest below.
    assert [r["index"] for r in results[:2]] == [0, 2]
    assert scores[0] == pytest.approx(1.0) and scores[2] < 1.0
    assert all(r["document"] == {"text": docs[r["index"]], "multi_modal": None}
               for r in results)
    prompt = tokens("the cat") * 3 + tokens("a dog") + tokens("sky")
    assert body["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt}
    top = await _post(client, path, {"query": "the cat", "documents": docs, "top_n": 1})
    assert [r["index"] for r in top["results"]] == [0]


@pytest.mark.parametrize("path", EndpointKind.SCORE.paths)
async def test_score_answers_one_score_per_pair(client: TestClient[Any, Any],
                                                path: str) -> None:
    body = await _post(client, path, {"queries": ["x", "y"], "documents": ["x", "z"]})
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert [d["index"] for d in body["data"]] == [0, 1]
    assert all(d["object"] == "score" for d in body["data"])
    assert body["data"][0]["score"] == pytest.approx(1.0)
    assert -1.0 <= body["data"][1]["score"] < 1.0
    prompt = 2 * tokens("x") + tokens("y") + tokens("z")
    assert body["usage"] == {"prompt_tokens": prompt, "total_tokens": prompt,
                             "completion_tokens": 0, "prompt_tokens_details": None,
                             "completion_tokens_details": None}


async def test_pooling_answers_the_embedding_in_every_encoding(
        client: TestClient[Any, Any]) -> None:
    plain = await _post(client, "/pooling", {"input": [[7, 8], [9]]})
    assert plain["id"].startswith("pooling-")
    vectors = [d["data"] for d in plain["data"]]
    assert [d["object"] for d in plain["data"]] == ["pooling", "pooling"]
    assert all(len(v) == EMBEDDING_SIZE for v in vectors)
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0) for v in vectors)
    assert plain["usage"]["prompt_tokens"] == 3
    # The same ids embed alike on /v1/embeddings.
    embedded = await _post(client, "/v1/embeddings", {"input": [7, 8]})
    assert embedded["data"][0]["embedding"] == vectors[0]
    raw = await _post(client, "/pooling", {"input": [7, 8], "use_activation": False})
    assert not math.isclose(math.fsum(x * x for x in raw["data"][0]["data"]), 1.0)
    for dtype, fmt, tolerance in (("float32", "<f", 1e-6), ("float16", "<e", 1e-3)):
        encoded = await _post(client, "/pooling", {
            "input": [7, 8], "encoding_format": "base64", "embed_dtype": dtype,
            "endianness": "little"})
        data = base64.b64decode(encoded["data"][0]["data"])
        decoded = [v for (v,) in struct.iter_unpack(fmt, data)]
        assert decoded == pytest.approx(vectors[0], abs=tolerance)
    response = await client.post("/pooling", json={"input": [[7, 8], [9]],
                                                   "encoding_format": "bytes",
                                                   "endianness": "big"})
    assert response.status == 200 and response.content_type == "application/octet-stream"
    metadata = json.loads(response.headers["metadata"])
    payload = await response.read()
    assert metadata["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    for item, vector in zip(metadata["data"], vectors, strict=True):
        assert item["shape"] == [EMBEDDING_SIZE] and item["embed_dtype"] == "float32"
        values = struct.unpack(f">{EMBEDDING_SIZE}f", payload[item["start"]:item["end"]])
        assert values == pytest.approx(vector, abs=1e-6)
    bare = await client.post("/pooling", json={"input": [7], "encoding_format": "bytes_only"})
    assert "metadata" not in bare.headers and len(await bare.read()) == 4 * EMBEDDING_SIZE


async def test_classify_answers_two_labels_probabilities(client: TestClient[Any, Any]) -> None:
    body = await _post(client, "/classify", {"input": ["good", "bad"]})
    assert body["id"].startswith("classify-")
    for item in body["data"]:
        assert item["num_classes"] == 2 and math.isclose(math.fsum(item["probs"]), 1.0)
        assert item["label"] == ("LABEL_0" if item["probs"][0] >= item["probs"][1]
                                 else "LABEL_1")
    assert body["usage"]["prompt_tokens"] == tokens("good") + tokens("bad")


async def test_every_input_is_engine_prompt_work_and_never_generation(
        client: TestClient[Any, Any]) -> None:
    await _post(client, "/rerank", {"query": "q", "documents": ["a", "b", "c"]})
    await _post(client, "/pooling", {"input": [[7] * 10, [8] * 5]})
    samples = parse_metrics(await (await client.get("/metrics")).text())
    prompt = tokens("q") + 3 * tokens("a") + 15
    assert samples.total("vllm:prompt_tokens_total") == prompt
    assert samples.total("vllm:generation_tokens_total") == 0
    # Six engine requests (a query, three documents, two inputs), each finished by a stop.
    assert samples.total("vllm:request_success_total", finished_reason="stop") == 6
    assert samples.total("vllm:request_prompt_tokens_sum") == prompt
    assert samples.total("vllm:request_generation_tokens_sum") == 0
    assert samples.total("vllm:request_generation_tokens_count") == 6
    assert samples.total("vllm:request_time_per_output_token_seconds_count") == 6
    assert samples.total("vllm:time_to_first_token_seconds_count") == 6
    assert samples.total("vllm:request_queue_time_seconds_count") == 6
    assert samples.total("vllm:num_requests_running") == 0


async def test_a_pooling_prompt_may_fill_the_whole_context(client: TestClient[Any, Any]) -> None:
    # Its output is the pooled state, no token: 256 prompt tokens fit a 256-token model.
    body = await _post(client, "/classify", {"input": [7] * 256})
    assert body["usage"]["prompt_tokens"] == 256


@given(st.floats(allow_nan=False, width=32, min_value=-65504.0, max_value=65504.0))
def test_the_small_float_encoder_is_ieee_half_precision_on_float16(value: float) -> None:
    (expected,) = struct.unpack("<H", struct.pack("<e", value))
    assert _small_float(value, 5, 10, True) == expected
