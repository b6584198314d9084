"""/v1/embeddings, one suite for the emulator and real vLLM CPU serving the tiny model as a
pooling model (``--runner pooling --convert embed``: last-token pooling, normalised).

A vLLM instance serves either generation or pooling, so real vLLM gets a server of its own
(``vllm_pooling_backend``, which test_pooling.py shares); the emulator serves both from the
suite's one instance.
"""

from __future__ import annotations

import base64
import math
import struct

import httpx
import pytest

from tests.conformance.backends import MAX_MODEL_LEN, Backend, assert_error_body
from tests.support import loopback, metrics
from weighbridge.emulator.api import EMBEDDING_SIZE


@pytest.fixture(params=["emulator", pytest.param("vllm_pooling", marks=pytest.mark.vllm)])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")


def ids(n: int, salt: int = 0) -> list[int]:
    return [(i * 13 + salt) % 90 + 6 for i in range(n)]


def embed(backend: Backend, **body: object) -> httpx.Response:
    return loopback.post(backend.url + "/v1/embeddings", json={"model": backend.model, **body},
                      timeout=60)


def test_one_unit_vector_per_input_with_its_prompt_tokens(backend: Backend) -> None:
    r = embed(backend, input=[ids(5), ids(40, 1), ids(5)])
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == backend.model
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert all(d["object"] == "embedding" for d in body["data"])
    vectors = [d["embedding"] for d in body["data"]]
    assert {len(v) for v in vectors} == {EMBEDDING_SIZE}  # the tiny model's hidden size
    assert all(math.isclose(math.fsum(x * x for x in v), 1.0, rel_tol=1e-3) for v in vectors)
    assert vectors[0] == pytest.approx(vectors[2], abs=1e-5)  # same input, same embedding
    assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 50


def test_a_single_token_id_list_and_base64(backend: Backend) -> None:
    plain = embed(backend, input=ids(12))
    encoded = embed(backend, input=ids(12), encoding_format="base64")
    assert plain.status_code == encoded.status_code == 200, (plain.text, encoded.text)
    vector = plain.json()["data"][0]["embedding"]
    raw = base64.b64decode(encoded.json()["data"][0]["embedding"])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == pytest.approx(vector, abs=1e-5)
    assert plain.json()["usage"]["prompt_tokens"] == 12


def test_inputs_count_as_prompt_tokens_never_as_generation(backend: Backend) -> None:
    before = metrics.scrape(backend.url)
    assert embed(backend, input=[ids(30), ids(20, 2)]).status_code == 200
    after = metrics.scrape(backend.url)
    grown = (after.total("vllm:prompt_tokens_total")
             - before.total("vllm:prompt_tokens_total"))
    assert grown == 50
    assert after.total("vllm:generation_tokens_total") == before.total(
        "vllm:generation_tokens_total")


@pytest.mark.parametrize("body", [
    {"input": ids(MAX_MODEL_LEN + 1)},
    {"input": ids(4), "dimensions": 8},
    {"input": ids(4), "encoding_format": "int4"},
], ids=["too-long", "dimensions", "encoding"])
def test_bad_requests_are_400(backend: Backend, body: dict[str, object]) -> None:
    assert_error_body(embed(backend, **body), 400)


def test_unknown_model_is_404(backend: Backend) -> None:
    assert_error_body(loopback.post(backend.url + "/v1/embeddings",
                                 json={"model": "no-such-model", "input": ids(3)}, timeout=10),
                      404)
