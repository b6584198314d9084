"""A request's prompt, read by its kind (``weighbridge.endpoints.EndpointKind``): a score's
or a rerank's every query and document, a pooling request's every input (or its chat), the
forms vLLM takes, refused with ``PromptError`` (the sidecar's 400) where vLLM would refuse
the body, before it takes any budget."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.endpoints import EndpointKind
from weighbridge.sidecar.prefix import PromptPrefix
from weighbridge.sidecar.prompt import BYTES_PER_TOKEN, PromptError, prompt_tokens

POOLING, CLASSIFY, SCORE, RERANK, EMBEDDINGS = (
    EndpointKind.POOLING, EndpointKind.CLASSIFY, EndpointKind.SCORE, EndpointKind.RERANK,
    EndpointKind.EMBEDDINGS)


def estimate(text: str) -> int:
    return max(1, -(-len(text.encode()) // BYTES_PER_TOKEN))


texts = st.text(min_size=0, max_size=40)


@given(query=texts, documents=st.lists(texts, min_size=1, max_size=8))
def test_a_rerank_costs_its_query_once_and_every_document(query: str,
                                                          documents: list[str]) -> None:
    body = {"query": query, "documents": documents}
    assert prompt_tokens(RERANK, body) == estimate(query) + sum(map(estimate, documents))
    assert PromptPrefix.of(RERANK, body) is None  # one engine request per text


@given(queries=st.lists(texts, min_size=1, max_size=4), extra=st.integers(0, 3),
       fields=st.sampled_from([("queries", "documents"), ("queries", "items"),
                               ("data_1", "data_2"), ("text_1", "text_2")]))
def test_a_score_costs_every_query_and_document(queries: list[str], extra: int,
                                                fields: tuple[str, str]) -> None:
    documents = [f"doc {i}" for i in range(len(queries) if len(queries) > 1 else 1 + extra)]
    body = {fields[0]: queries, fields[1]: documents}
    assert prompt_tokens(SCORE, body) == sum(map(estimate, queries + documents))


@pytest.mark.parametrize(("kind", "body", "tokens"), [
    (RERANK, {"query": "abcd", "documents": "efgh"}, 2),
    (RERANK, {"query": {"content": [{"type": "text", "text": "abcdefgh"}]},
              "documents": [{"content": [{"type": "image_url", "image_url": {}}]}]}, 3),
    (SCORE, {"text_1": "abcd", "text_2": ["a", "b"]}, 3),
    # vLLM tries the forms in this order and takes the first it has both fields of.
    (SCORE, {"queries": "a", "text_1": "abcdefgh", "text_2": "b"}, 3),
    (POOLING, {"input": [7, 8, 9]}, 3),
    (POOLING, {"input": [[7], [8, 9]]}, 3),
    (CLASSIFY, {"input": ["abcd", "efgh"]}, 2),
    (CLASSIFY, {"messages": [{"role": "user", "content": "abcd"}]}, 6),
    (EMBEDDINGS, {"messages": [{"role": "user", "content": "abcd"}]}, 6),
    # A chat, as vLLM reads a body with both.
    (POOLING, {"input": "abcd", "messages": [{"role": "user", "content": "x" * 400}]}, 105),
])
def test_the_forms_vllm_takes(kind: EndpointKind, body: dict[str, Any], tokens: int) -> None:
    assert prompt_tokens(kind, body) == tokens


@pytest.mark.parametrize(("kind", "body"), [
    (RERANK, {"documents": ["a"]}),
    (RERANK, {"query": "q"}),
    (RERANK, {"query": ["q"], "documents": ["a"]}),  # one query, not a list
    (RERANK, {"query": "q", "documents": []}),
    (RERANK, {"query": "q", "documents": [1, 2]}),
    (RERANK, {"query": "q", "documents": [{"text": "no content"}]}),
    (RERANK, {"query": 5, "documents": ["a"]}),
    (SCORE, {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}),  # neither 1:N nor N:N
    (SCORE, {"text_1": [], "text_2": ["c"]}),
    (SCORE, {"text_1": "a"}),
    (SCORE, {"queries": "a", "items": None}),
    (SCORE, {}),
    (POOLING, {"input": []}),
    (POOLING, {"input": [[7], []]}),
    (POOLING, {"input": [-1]}),
    (CLASSIFY, {"messages": []}),
    (CLASSIFY, {}),
])
def test_what_vllm_refuses_is_the_sidecar_s_400(kind: EndpointKind,
                                                body: dict[str, Any]) -> None:
    with pytest.raises(PromptError):
        prompt_tokens(kind, body)
