"""/score, /rerank, /pooling and /classify: the emulator against real vLLM CPU, request by
request.

Real vLLM serves the tiny model on its pooling runner: ``--convert embed`` (shared with
test_embeddings.py) answers /pooling, and /score and /rerank as a bi-encoder (every query
and document an input of its own, scored by the cosine of their embeddings);
``--convert classify`` answers /classify. Its classifier has two labels (transformers'
default), so vLLM serves no /score or /rerank from it: a cross-encoder needs one label, and
the emulator models the bi-encoder only. The emulator serves every kind from one process,
with the tiny model's tokenizer (``--tokenizer``), so text counts alike on both.

What must agree exactly: usage (every input's prompt tokens, the query of a rerank once),
the answers' shapes and ids, the ranking's rules (best first, ``top_n``), and every refusal
(status, type, param and message). Scores and vectors are the models' own: the emulator's
are made up, so only their ranges and identities are compared (a text scores 1 against
itself). The engine's counters move alike: every input is a prompt, no token is generated,
each finishes with a stop.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.conformance.backends import (
    CLASSIFY_MODEL,
    MAX_MODEL_LEN,
    Backend,
    emulator_backend,
    real_vllm,
)
from tests.support import loopback, metrics
from weighbridge.emulator.api import EMBEDDING_SIZE
from weighbridge.emulator.real_vllm import tiny_model_dir
from weighbridge.endpoints import EndpointKind

pytestmark = pytest.mark.vllm

QUERY = "Where does the night train to Vienna leave from?"
DOCUMENTS = ["The night train leaves from platform nine at eleven.",
             "Vienna is the capital of Austria.",
             "Where does the night train to Vienna leave from?",
             "Bananas are rich in potassium."]


@pytest.fixture(scope="module")
def emulator() -> Iterator[Backend]:
    with emulator_backend(tokenizer=str(tiny_model_dir())) as backend:
        yield backend


@pytest.fixture(scope="module")
def vllm_classifier() -> Iterator[Backend]:
    with real_vllm(extra_args=list(CLASSIFY_MODEL)) as server:
        yield Backend("vllm", server.url, server.model_name)


def post(backend: Backend, path: str, body: Any) -> httpx.Response:
    if isinstance(body, dict):
        body = {"model": backend.model, **body}
    return loopback.post(backend.url + path, json=body, timeout=60)


def both(emulator: Backend, vllm: Backend, path: str, body: Any) -> tuple[Any, Any]:
    """The two answers, each a 200, alike in shape and usage."""
    answers = []
    for backend in (emulator, vllm):
        r = post(backend, path, body)
        assert r.status_code == 200, (backend.kind, r.text)
        answers.append(r.json())
    ours, theirs = answers
    assert shape(ours) == shape(theirs)
    assert ours["usage"] == theirs["usage"]
    return ours, theirs


def shape(answer: Any) -> Any:
    """An answer's keys and types, its values left out."""
    if isinstance(answer, dict):
        return {k: shape(v) for k, v in answer.items()}
    if isinstance(answer, list):
        return [shape(answer[0])] if answer else []
    return type(answer).__name__


@pytest.mark.parametrize("path", EndpointKind.RERANK.paths)
def test_rerank_ranks_every_document_with_vllm_s_usage(emulator: Backend,
                                                       vllm_pooling_backend: Backend,
                                                       path: str) -> None:
    answers = both(emulator, vllm_pooling_backend, path,
                   {"query": QUERY, "documents": DOCUMENTS})
    ours, theirs = answers  # the usage: the query once, and each document
    assert ours["id"].startswith("score-") and theirs["id"].startswith("score-")
    for answer in answers:
        results = answer["results"]
        assert sorted(r["index"] for r in results) == list(range(len(DOCUMENTS)))
        scores = [r["relevance_score"] for r in results]
        assert scores == sorted(scores, reverse=True)
        assert results[0]["index"] == 2 and scores[0] == pytest.approx(1.0, abs=1e-5)
        assert all(r["document"] == {"text": DOCUMENTS[r["index"]], "multi_modal": None}
                   for r in results)
    ours, theirs = both(emulator, vllm_pooling_backend, path,
                        {"query": QUERY, "documents": DOCUMENTS, "top_n": 2})
    assert len(ours["results"]) == len(theirs["results"]) == 2
    assert ours["results"][0]["index"] == theirs["results"][0]["index"] == 2


@pytest.mark.parametrize("body", [
    {"queries": QUERY, "documents": DOCUMENTS},
    {"queries": DOCUMENTS[:2], "items": DOCUMENTS[2:]},
    {"data_1": [QUERY], "data_2": DOCUMENTS[:3]},
    {"text_1": QUERY, "text_2": QUERY},
    {"text_1": [QUERY, "a"], "text_2": [QUERY, "b"], "max_tokens_per_doc": 3,
     "truncate_prompt_tokens": 8},
], ids=["queries-documents", "queries-items", "data", "text", "limits"])
@pytest.mark.parametrize("path", EndpointKind.SCORE.paths)
def test_score_scores_each_pair_with_vllm_s_usage(emulator: Backend,
                                                  vllm_pooling_backend: Backend, path: str,
                                                  body: dict[str, Any]) -> None:
    ours, theirs = both(emulator, vllm_pooling_backend, path, body)
    assert [d["index"] for d in ours["data"]] == [d["index"] for d in theirs["data"]]
    assert all(-1.0 - 1e-6 <= d["score"] <= 1.0 + 1e-6 for d in ours["data"] + theirs["data"])


@pytest.mark.parametrize("body", [
    {"input": QUERY},
    {"input": [QUERY, "", "short"]},
    {"input": [[6, 7, 8], [9] * 40]},
    {"messages": [{"role": "user", "content": QUERY}]},
    {"messages": [{"role": "user", "content": QUERY}], "add_generation_prompt": True},
    {"input": "x", "messages": [{"role": "user", "content": QUERY}]},
    {"input": QUERY, "add_special_tokens": False},
    {"input": QUERY, "truncate_prompt_tokens": 4, "truncation_side": "left"},
    {"input": QUERY, "padding": "max_length"},
], ids=["text", "texts", "ids", "chat", "chat-generation-prompt", "both", "no-special",
        "truncated", "padded"])
def test_pooling_embeds_each_input_with_vllm_s_usage(emulator: Backend,
                                                     vllm_pooling_backend: Backend,
                                                     body: dict[str, Any]) -> None:
    for answer in both(emulator, vllm_pooling_backend, "/pooling", body):
        assert answer["id"].startswith("pooling-")
        for item in answer["data"]:
            assert len(item["data"]) == EMBEDDING_SIZE
            assert math.isclose(math.fsum(x * x for x in item["data"]), 1.0, rel_tol=1e-3)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"])
def test_pooling_encodes_its_vectors_as_vllm_lays_them_out(emulator: Backend,
                                                          vllm_pooling_backend: Backend,
                                                          dtype: str) -> None:
    body = {"input": ["ab", "cd"], "embed_dtype": dtype, "endianness": "little"}
    ours, theirs = both(emulator, vllm_pooling_backend, "/pooling",
                        {**body, "encoding_format": "base64"})
    width = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 1)
    for answer in (ours, theirs):
        assert [len(base64.b64decode(d["data"])) for d in answer["data"]] == \
            [width * EMBEDDING_SIZE] * 2
    raw = [post(b, "/pooling", {**body, "encoding_format": "bytes"})
           for b in (emulator, vllm_pooling_backend)]
    for r in raw:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "application/octet-stream")
        assert len(r.content) == 2 * width * EMBEDDING_SIZE
    layouts = [json.loads(r.headers["metadata"]) for r in raw]
    assert [{k: v for k, v in m.items() if k not in ("id", "created")} for m in layouts[:1]] \
        == [{k: v for k, v in m.items() if k not in ("id", "created")} for m in layouts[1:]]
    bare = [post(b, "/pooling", {**body, "encoding_format": "bytes_only"})
            for b in (emulator, vllm_pooling_backend)]
    assert all("metadata" not in r.headers and len(r.content) == 2 * width * EMBEDDING_SIZE
               for r in bare)


def test_pooling_without_activation_is_not_normalised(emulator: Backend,
                                                     vllm_pooling_backend: Backend) -> None:
    ours, theirs = both(emulator, vllm_pooling_backend, "/pooling",
                        {"input": QUERY, "use_activation": False})
    for answer in (ours, theirs):
        vector = answer["data"][0]["data"]
        assert not math.isclose(math.fsum(x * x for x in vector), 1.0, rel_tol=1e-2)
    # float32 little-endian, as the float answer.
    encoded = post(emulator, "/pooling", {"input": QUERY, "encoding_format": "base64",
                                          "endianness": "little"}).json()
    plain = post(emulator, "/pooling", {"input": QUERY}).json()
    decoded = struct.unpack(f"<{EMBEDDING_SIZE}f", base64.b64decode(encoded["data"][0]["data"]))
    assert decoded == pytest.approx(plain["data"][0]["data"], abs=1e-6)


@pytest.mark.parametrize("body", [
    {"input": QUERY},
    {"input": [QUERY, "b"], "use_activation": False},
    {"messages": [{"role": "user", "content": QUERY}]},
    {"input": [[6] * 30]},
], ids=["text", "raw", "chat", "ids"])
def test_classify_answers_two_labels_with_vllm_s_usage(emulator: Backend,
                                                       vllm_classifier: Backend,
                                                       body: dict[str, Any]) -> None:
    for answer in both(emulator, vllm_classifier, "/classify", body):
        assert answer["id"].startswith("classify-")
        for item in answer["data"]:
            assert item["num_classes"] == len(item["probs"]) == 2
            assert item["label"] in ("LABEL_0", "LABEL_1")
            if body.get("use_activation") is not False:
                assert math.isclose(math.fsum(item["probs"]), 1.0, rel_tol=1e-5)


# Refusals: the same status, type, param and message from both, before any engine work.
EMBED_MODEL_REFUSALS: list[tuple[str, Any]] = [
    ("/rerank", {"documents": ["a"]}),
    ("/rerank", {"query": ["q1", "q2"], "documents": ["a", "b"]}),
    ("/rerank", {"query": "q", "documents": []}),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}),
    ("/rerank", {"query": "q", "documents": [1, 2, 3]}),
    ("/rerank", {"query": "q", "documents": [{"content": [{"type": "text", "text": "hi"}]}]}),
    ("/rerank", {"query": "q", "documents": ["a"], "model": "no-such-model"}),
    ("/rerank", {"query": "q", "documents": ["a"], "priority": 2**63}),
    ("/rerank", {"query": "q", "documents": ["a"], "user": 5}),
    ("/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_doc": MAX_MODEL_LEN}),
    ("/rerank", {"query": "q", "documents": ["a"], "max_tokens_per_query": -1}),
    ("/rerank", {"query": "q", "documents": ["a"], "truncate_prompt_tokens": 5000}),
    ("/rerank", {"query": "q", "documents": ["word " * 1500]}),
    ("/rerank", [1]),
    ("/v2/rerank", "text"),
    ("/score", {"data_1": ["a", "b", "c"], "data_2": ["c", "d"]}),
    ("/score", {"text_1": [], "text_2": ["a"]}),
    ("/score", {"text_1": "a"}),
    ("/score", {}),
    ("/v1/score", [1]),
    ("/pooling", {"input": "hi", "task": "classify"}),
    ("/pooling", {"input": "hi", "task": "token_embed"}),
    ("/pooling", {"input": "hi", "task": "no-such-task"}),
    ("/pooling", {"input": "hi", "dimensions": 4}),
    ("/pooling", {"input": []}),
    ("/pooling", {"input": [[6, 7], []]}),
    ("/pooling", {"input": [5000]}),
    ("/pooling", {"input": [7] * (MAX_MODEL_LEN + 1)}),
    ("/pooling", {"input": [7] * (MAX_MODEL_LEN + 50)}),
    ("/pooling", {"input": "hi", "normalize": True}),
    ("/pooling", {"input": "hi", "truncate_prompt_tokens": 0}),
    ("/pooling", {"input": "hi", "encoding_format": "int8"}),
    ("/pooling", {"prompt": "hi"}),
    ("/pooling", {"messages": []}),
    ("/pooling", {"messages": [{"role": "user", "content": "x"}],
                  "add_generation_prompt": True, "continue_final_message": True}),
    ("/pooling", {"data": {"x": 1}}),
]
CLASSIFIER_REFUSALS: list[tuple[str, Any]] = [
    ("/classify", {"input": []}),
    ("/classify", {"input": "x", "model": "no-such-model"}),
    ("/classify", {"input": "x", "truncate_prompt_tokens": 2000}),
    ("/classify", {"prompt": "x"}),
    ("/classify", [1]),
]


def assert_same_refusal(emulator: Backend, vllm: Backend, path: str, body: Any) -> None:
    ours, theirs = post(emulator, path, body), post(vllm, path, body)
    assert ours.status_code == theirs.status_code and 400 <= ours.status_code < 500, \
        (ours.text, theirs.text)
    assert _task_lists_sorted(ours.json()) == _task_lists_sorted(theirs.json())


def _task_lists_sorted(answer: dict[str, Any]) -> dict[str, Any]:
    """vLLM lists a model's supported tasks from a set, in an order that changes from one
    start to the next: the list is compared sorted."""
    message = answer["error"]["message"]
    start, end = message.find("Supported tasks: ["), message.find("]")
    if start >= 0 < end:
        listed = sorted(message[start + len("Supported tasks: ["):end].split(", "))
        message = message[:start] + f"Supported tasks: [{', '.join(listed)}" + message[end:]
    return {"error": {**answer["error"], "message": message}}


@pytest.mark.parametrize(("path", "body"), EMBED_MODEL_REFUSALS,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(EMBED_MODEL_REFUSALS)])
def test_a_refusal_is_vllm_s_to_the_byte(emulator: Backend, vllm_pooling_backend: Backend,
                                         path: str, body: Any) -> None:
    assert_same_refusal(emulator, vllm_pooling_backend, path, body)


@pytest.mark.parametrize(("path", "body"), CLASSIFIER_REFUSALS,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(CLASSIFIER_REFUSALS)])
def test_a_classifier_s_refusal_is_vllm_s_to_the_byte(emulator: Backend,
                                                      vllm_classifier: Backend, path: str,
                                                      body: Any) -> None:
    assert_same_refusal(emulator, vllm_classifier, path, body)


COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total",
            "vllm:request_prompt_tokens_sum", "vllm:request_prompt_tokens_count",
            "vllm:request_generation_tokens_sum", "vllm:request_generation_tokens_count",
            "vllm:request_time_per_output_token_seconds_count",
            "vllm:request_queue_time_seconds_count", "vllm:time_to_first_token_seconds_count",
            "vllm:e2e_request_latency_seconds_count")


def _counted(backend: Backend, path: str, body: dict[str, Any]) -> dict[str, float]:
    before = metrics.scrape(backend.url)
    assert post(backend, path, body).status_code == 200
    after = metrics.scrape(backend.url)
    deltas = {name: after.total(name) - before.total(name) for name in COUNTERS}
    deltas["stop"] = (after.total("vllm:request_success_total", finished_reason="stop")
                      - before.total("vllm:request_success_total", finished_reason="stop"))
    deltas["length"] = (
        after.total("vllm:request_success_total", finished_reason="length")
        - before.total("vllm:request_success_total", finished_reason="length"))
    return deltas


@pytest.mark.parametrize(("path", "body"), [
    ("/rerank", {"query": QUERY, "documents": DOCUMENTS}),
    ("/pooling", {"input": [[11] * 20, [12] * 33]}),
], ids=["rerank", "pooling"])
def test_the_engine_counts_every_input_as_a_prompt_and_nothing_generated(
        emulator: Backend, vllm_pooling_backend: Backend, path: str,
        body: dict[str, Any]) -> None:
    ours, theirs = (_counted(b, path, body) for b in (emulator, vllm_pooling_backend))
    assert ours == theirs
    assert ours["vllm:generation_tokens_total"] == ours["vllm:request_generation_tokens_sum"] \
        == ours["length"] == 0
    assert ours["stop"] == ours["vllm:request_prompt_tokens_count"] > 1
