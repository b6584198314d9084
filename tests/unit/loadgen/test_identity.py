"""How a request names its agent program, per harness (weighbridge.loadgen.identity), and the
one body builder (weighbridge.loadgen.bodies): the fields the simulator gives the sidecar
are the body the load generator sends, less its prompt."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter

from weighbridge.loadgen.bodies import BodyOptions, build_body, prompt_fields, request_fields
from weighbridge.loadgen.identity import agentic_context, identity_headers, request_headers
from weighbridge.loadgen.plan import ProgramRef, RequestPlan, plan_request
from weighbridge.loadgen.tenants import HARNESSES, TenantSpec, parse_tenants

ROOT = ProgramRef("coder-p3", "coder-p3", None, 6)
CHILD = ProgramRef("coder-p3-c1.0", "coder-p3", "coder-p3", 2)
GRANDCHILD = ProgramRef("coder-p3-c1.0-c0.1", "coder-p3", "coder-p3-c1.0", 2)

# vLLM 0.32's type of vllm_xargs (vllm/entrypoints/openai/{completion,chat_completion}/
# protocol.py): what it refuses, it answers 400, and the sidecar would forward.
VLLM_XARGS: TypeAdapter[Any] = TypeAdapter(
    dict[str, str | int | float | list[str | int | float]] | None)


def _plan(program: ProgramRef | None, turn: int | None = 2, endpoint: str = "/v1/completions",
          **fields: Any) -> RequestPlan:
    return RequestPlan(request_id="r", tenant="coder", tier="standard", phase="p", user=None,
                       endpoint=endpoint, stream=True, prompt_tokens=10, max_tokens=5,
                       scheduled_s=0.0, content_seed=1, session_id=None if program is None
                       else program.program_id, turn=turn, program=program, **fields)


def _tenant(**fields: Any) -> TenantSpec:
    spec = {"name": "coder", "endpoint": "completions", "lengths": {"prompt": 10, "output": 5},
            "arrival": {"kind": "poisson", "rate": 1}, **fields}
    return parse_tenants({"tenants": [spec]}, base_dir=Path("."), source="t").tenants[0]


def test_claude_code_names_the_session_and_its_subagents_by_agent_ids() -> None:
    assert identity_headers(ROOT, ("claude_code",)) == {"x-claude-code-session-id": "coder-p3"}
    assert identity_headers(CHILD, ("claude_code",)) == {
        "x-claude-code-session-id": "coder-p3", "x-claude-code-agent-id": "coder-p3-c1.0"}
    assert identity_headers(GRANDCHILD, ("claude_code",)) == {
        "x-claude-code-session-id": "coder-p3",
        "x-claude-code-agent-id": "coder-p3-c1.0-c0.1",
        "x-claude-code-parent-agent-id": "coder-p3-c1.0"}


def test_opencode_gives_each_subagent_a_session_and_codex_a_thread() -> None:
    assert identity_headers(CHILD, ("opencode",)) == {
        "x-session-id": "coder-p3-c1.0", "x-session-affinity": "coder-p3-c1.0"}
    assert identity_headers(CHILD, ("codex",)) == {"session-id": "coder-p3",
                                                   "thread-id": "coder-p3-c1.0"}
    assert identity_headers(CHILD, ()) == {}
    assert identity_headers(CHILD, ("agentic_context",)) == {}  # it speaks in the body


def test_the_agentic_context_is_a_json_string_vllm_takes() -> None:
    """vllm-router reads the object or its JSON string; vLLM 0.32 refuses the object (its
    vllm_xargs holds scalars and lists), so the string is the form both take."""
    plan = _plan(GRANDCHILD)
    tenant = _tenant(identity=["agentic_context"])
    body = orjson.loads(build_body(plan, tenant))
    context = body["vllm_xargs"]["agentic_context"]
    assert isinstance(context, str)
    VLLM_XARGS.validate_python(body["vllm_xargs"])
    assert orjson.loads(context) == {
        "program_id": "coder-p3-c1.0-c0.1", "root_program_id": "coder-p3",
        "parent_program_id": "coder-p3-c1.0", "blocks_parent": True, "step_id": 2}
    assert orjson.loads(agentic_context(_plan(ROOT, turn=0)) or "") == {
        "program_id": "coder-p3", "root_program_id": "coder-p3", "step_id": 0}
    assert agentic_context(_plan(None)) is None
    assert "vllm_xargs" not in orjson.loads(build_body(plan, _tenant()))
    assert "vllm_xargs" not in orjson.loads(build_body(_plan(None), tenant))


def test_request_headers_add_the_program_to_the_tenant_s_own() -> None:
    tenant = _tenant(identity=["claude_code", "opencode"], headers={"x-team": "a"},
                     ask_tier=True)
    assert request_headers(_plan(CHILD), tenant) == {
        "x-team": "a", "x-weighbridge-tier": "standard",
        "x-claude-code-session-id": "coder-p3", "x-claude-code-agent-id": "coder-p3-c1.0",
        "x-session-id": "coder-p3-c1.0", "x-session-affinity": "coder-p3-c1.0"}
    assert request_headers(_plan(None), tenant) == {"x-team": "a",
                                                   "x-weighbridge-tier": "standard"}
    assert set(HARNESSES) == {"claude_code", "opencode", "codex", "agentic_context"}


_TENANTS = st.builds(
    lambda endpoint, stream, ignore_eos, usage, priority, identity, system: _tenant(
        endpoint=endpoint, stream=stream and endpoint != "embeddings", ignore_eos=ignore_eos,
        continuous_usage=usage, priority=priority, identity=identity,
        **({"system_prompt": {"length": 12}} if system and endpoint != "embeddings" else {})),
    st.sampled_from(["completions", "chat", "embeddings"]), st.booleans(), st.booleans(),
    st.booleans(), st.none() | st.integers(-5, 5),
    st.lists(st.sampled_from(HARNESSES), unique=True), st.booleans())


@settings(max_examples=60, deadline=None)
@given(tenant=_TENANTS, seed=st.integers(0, 2**16), model=st.none() | st.just("m"),
       program=st.none() | st.sampled_from([ROOT, CHILD]), chat_words=st.none() | st.just(7))
def test_one_body_builder_the_fields_and_the_prompt(tenant: TenantSpec, seed: int,
                                                    model: str | None,
                                                    program: ProgramRef | None,
                                                    chat_words: int | None) -> None:
    """The body is exactly its fields (what the simulator hands the sidecar) and its prompt."""
    plan = plan_request(tenant, "r-1", "p", 1.0, seed)
    if program is not None and tenant.endpoint != "embeddings":
        plan = dataclasses.replace(plan, program=program, session_id=program.program_id,
                                   turn=1)
    body = orjson.loads(build_body(plan, tenant, model, chat_words))
    fields = request_fields(plan, BodyOptions.of(tenant), model)
    prompt = prompt_fields(plan, chat_words)
    assert body == {**fields, **prompt}
    assert not set(fields) & set(prompt)
    assert set(prompt) == {{"/v1/completions": "prompt", "/v1/chat/completions": "messages",
                            "/v1/embeddings": "input"}[plan.endpoint]}


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_a_replayed_row_s_endpoint_shapes_its_body(endpoint: str) -> None:
    """A row naming its own endpoint gets that endpoint's prompt, whatever its tenant's."""
    body = orjson.loads(build_body(_plan(None, endpoint=endpoint), _tenant(endpoint="chat")))
    assert ("messages" in body) == (endpoint == "/v1/chat/completions")
