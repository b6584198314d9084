from __future__ import annotations

import math
from pathlib import Path

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.emulator.text import count_chat_tokens, count_tokens
from weighbridge.loadgen.bodies import ChatFraming, build_body, prompt_text, prompt_token_ids
from weighbridge.loadgen.lag import LagSummary, lag_warning
from weighbridge.loadgen.plan import plan_request
from weighbridge.loadgen.tenants import TenantsError, parse_tenants


@given(st.integers(1, 20_000), st.integers(0, 2**32))
def test_token_id_prompts_have_the_exact_length(n: int, seed: int) -> None:
    ids = prompt_token_ids(n, seed)
    assert len(ids) == n
    assert all(6 <= i < 506 for i in ids)  # clear of the special ids, inside any vocabulary


def test_prompts_do_not_share_a_prefix() -> None:
    assert prompt_token_ids(100, 1)[:8] != prompt_token_ids(100, 2)[:8]


@given(st.integers(1, 3000), st.integers(0, 2**32))
def test_chat_words_are_one_token_each_under_the_emulator(words: int, seed: int) -> None:
    assert count_tokens(prompt_text(words, seed)) == words


def test_chat_framing_makes_the_prompt_exact() -> None:
    framing = ChatFraming()
    words = framing.words_for(100)
    framing.observe(words, count_chat_tokens([prompt_text(words, 0)]))
    words = framing.words_for(100)
    assert count_chat_tokens([prompt_text(words, 5)]) == 100


def test_body_fields() -> None:
    tenant = parse_tenants({"tenants": [{
        "name": "t", "endpoint": "chat", "users": 3, "priority": 4, "continuous_usage": True,
        "lengths": {"prompt": 50, "output": 7}}]}, base_dir=Path("."), source="t").tenants[0]
    plan = plan_request(tenant, "t-0", "p", 0.0, 0)
    body = orjson.loads(build_body(plan, tenant, "m", chat_words=40))
    assert body["model"] == "m" and body["max_tokens"] == 7 and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert count_tokens(body["messages"][0]["content"]) == 40
    assert body["user"] == plan.user and body["priority"] == 4


def test_an_embeddings_tenant_sends_its_prompt_as_input_and_never_streams() -> None:
    tenant = parse_tenants({"tenants": [{
        "name": "e", "endpoint": "embeddings", "users": 2,
        "lengths": {"prompt": 50, "output": 7}}]}, base_dir=Path("."), source="t").tenants[0]
    assert tenant.path == "/v1/embeddings" and tenant.stream is False
    plan = plan_request(tenant, "e-0", "p", 0.0, 0)
    assert plan.max_tokens == 0 and plan.prompt_tokens == 50
    body = orjson.loads(build_body(plan, tenant, "m"))
    assert body == {"input": prompt_token_ids(50, plan.content_seed), "model": "m",
                    "user": plan.user}
    with pytest.raises(TenantsError, match="never streamed"):
        parse_tenants({"tenants": [{"name": "e", "endpoint": "embeddings", "stream": True,
                                    "lengths": {"prompt": 5, "output": 1}}]},
                      base_dir=Path("."), source="t")


def test_lag_summary_and_warning() -> None:
    calm = LagSummary.of([0.001] * 99 + [0.004])
    assert calm.count == 100 and calm.max_s == 0.004
    assert lag_warning(calm) is None
    late = LagSummary.of([0.001] * 90 + [0.05] * 10)
    assert late.p99_s == 0.05
    assert "exceeds 10 ms" in lag_warning(late)
    empty = LagSummary.of([])
    assert empty.count == 0 and math.isnan(empty.p99_s)
    assert empty.to_dict()["p99_s"] is None
    assert lag_warning(empty) is None


def test_each_request_names_its_tenants_model_else_the_runs() -> None:
    own, default = parse_tenants({"tenants": [
        {"name": "a", "model": "model-b", "lengths": {"prompt": 5, "output": 2}},
        {"name": "b", "lengths": {"prompt": 5, "output": 2}}]},
        base_dir=Path("."), source="t").tenants
    # The driver passes the run's model (--model or the server's first) to every plan.
    a = plan_request(own, "a-0", "p", 0.0, 0, "run-model")
    b = plan_request(default, "b-0", "p", 0.0, 0, "run-model")
    assert (a.model, b.model) == ("model-b", "run-model")
    assert orjson.loads(build_body(a, own))["model"] == "model-b"
    assert orjson.loads(build_body(b, default))["model"] == "run-model"
    # The model does not change what else is drawn for the request.
    assert a.prompt_tokens == plan_request(own, "a-0", "p", 0.0, 0).prompt_tokens
    bare = plan_request(default, "b-0", "p", 0.0, 0)
    assert bare.model is None and "model" not in orjson.loads(build_body(bare, default))
