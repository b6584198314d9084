"""Program identity (sidecar.programs): the harnesses' headers and vllm-router's agentic
context name a program and its fork-join family, never a tenant; what vLLM would refuse is
never forwarded; every map is bounded."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.sidecar.test_core import make_config
from weighbridge.loadgen.identity import agentic_context, identity_headers
from weighbridge.loadgen.plan import ProgramRef, RequestPlan
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.programs import (
    DEFAULT_AGENT_HEADERS,
    DEFAULT_SOURCES,
    MAX_ID_CHARS,
    ProgramError,
    ProgramId,
    ProgramIdentity,
    ProgramSource,
    check_xargs,
)
from weighbridge.sidecar.session import ApiError, Ingress, RelayOutcome, Usage

CHAT = "/v1/chat/completions"


def default() -> ProgramIdentity:
    return ProgramIdentity.of(DEFAULT_SOURCES, DEFAULT_AGENT_HEADERS)


def context_body(**context: Any) -> dict[str, Any]:
    return {"vllm_xargs": {"agentic_context": orjson.dumps(context).decode()}}


ROOT = ProgramRef("task-1", "task-1", None, 5)
CHILD = ProgramRef("task-1.a", "task-1", "task-1", 3)
GRANDCHILD = ProgramRef("task-1.a.b", "task-1", "task-1.a", 2)


@pytest.mark.parametrize("harness", ["claude_code", "codex"])
def test_a_harness_that_keeps_the_session_in_subagents_makes_one_family(harness: str) -> None:
    ids = default()
    found = [ids.read("t", identity_headers(p, (harness,)), {})
             for p in (ROOT, CHILD, GRANDCHILD)]
    assert {f.family for f in found if f} == {"task-1"}
    # Each subagent keeps its own context on one backend: its program is its own.
    assert len({f.program for f in found if f}) == 3


def test_opencode_subagents_are_programs_of_their_own() -> None:
    found = default().read("t", identity_headers(CHILD, ("opencode",)), {})
    assert found == ProgramId("task-1.a", "task-1.a")


def plan_of(program: ProgramRef, turn: int = 0) -> RequestPlan:
    return RequestPlan(request_id="r", tenant="t", tier="standard", phase="p", user=None,
                       endpoint=CHAT, stream=False, prompt_tokens=1, max_tokens=1,
                       scheduled_s=0.0, content_seed=0, program=program, turn=turn)


@pytest.mark.parametrize("as_object", [False, True])
def test_the_agentic_context_names_the_family_through_parents(as_object: bool) -> None:
    ids = ProgramIdentity.of(["agentic_context"], [])
    for program in (ROOT, CHILD, GRANDCHILD):
        context = orjson.loads(str(agentic_context(plan_of(program))))
        context.pop("root_program_id")  # the family from the parent links alone
        body: dict[str, Any] = {"vllm_xargs": {"agentic_context": context}} if as_object \
            else context_body(**context)
        check_xargs(body)
        found = ids.read("t", {}, body)
        assert found == ProgramId(program.program_id, "task-1")
        assert isinstance(body["vllm_xargs"]["agentic_context"], str)  # as vLLM takes it


def test_task_and_agent_ids_name_a_program_in_the_tasks_family() -> None:
    found = default().read("t", {}, context_body(task_id="T", agent_id="planner"))
    assert found == ProgramId("T/planner", "T")
    assert default().read("t", {}, context_body(session_id="S")) == ProgramId("S", "S")


def test_sources_are_read_in_order_and_a_body_field_is_one() -> None:
    ids = ProgramIdentity.of(["body:conversation", "header:x-session-id"], [])
    assert ids.read("t", {"x-session-id": "h"}, {"conversation": "b"}) == ProgramId("b", "b")
    assert ids.read("t", {"x-session-id": "h"}, {}) == ProgramId("h", "h")
    assert ProgramIdentity.of([], []).read("t", {"x-session-id": "h"}, {}) is None


def test_parent_links_are_per_tenant() -> None:
    ids = ProgramIdentity.of(["agentic_context"], [])
    ids.read("a", {}, context_body(program_id="child", root_program_id="root-a"))
    # Tenant b's program of the same name has no family of a's.
    found = ids.read("b", {}, context_body(program_id="grandchild", parent_program_id="child"))
    assert found == ProgramId("grandchild", "child")


def test_the_parent_links_are_bounded() -> None:
    ids = ProgramIdentity(tuple(ProgramSource.parse(s) for s in DEFAULT_SOURCES), (),
                          max_programs=100)
    for k in range(1000):
        ids.read("t", {}, context_body(program_id=f"p{k}", parent_program_id=f"q{k}"))
    assert len(ids) == 100


@pytest.mark.parametrize(("body", "reason"), [
    ({"vllm_xargs": "x"}, "invalid_vllm_xargs"),
    ({"vllm_xargs": {"k": {"a": 1}}}, "invalid_vllm_xargs"),
    ({"vllm_xargs": {"k": [1, [2]]}}, "invalid_vllm_xargs"),
    ({"vllm_xargs": {"agentic_context": "[1]"}}, "invalid_agentic_context"),
    ({"vllm_xargs": {"agentic_context": 5}}, "invalid_agentic_context"),
])
def test_what_vllm_refuses_is_an_error(body: dict[str, Any], reason: str) -> None:
    with pytest.raises(ProgramError) as caught:
        check_xargs(body)
    assert caught.value.reason == reason


def test_what_vllm_takes_passes_unchanged() -> None:
    body = {"vllm_xargs": {"a": "s", "b": 1, "c": 1.5, "d": [1, "x", 2.0], "e": True}}
    check_xargs(body)
    assert body == {"vllm_xargs": {"a": "s", "b": 1, "c": 1.5, "d": [1, "x", 2.0], "e": True}}


def test_an_overlong_header_id_is_an_error() -> None:
    with pytest.raises(ProgramError):
        default().read("t", {"x-session-id": "x" * (MAX_ID_CHARS + 1)}, {})


@pytest.mark.parametrize("text", ["header:authorization", "header:bad name", "key", "body:",
                                  "metadata:a/b"])
def test_a_source_that_names_no_program_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        ProgramSource.parse(text)


# -- through the ingress ------------------------------------------------------------------


def ingress() -> Ingress:
    config = make_config()
    return Ingress(config, SchedulingCore(config))


def send(ing: Ingress, headers: dict[str, str], body: dict[str, Any], key: str = "ka"):
    headers = {"authorization": f"Bearer {key}", **headers}
    caller = ing.authenticate(headers)
    arrival = ing.read(caller, CHAT, headers, orjson.dumps(body))
    return ing.arrive(arrival, f"r{id(body)}", 0.0)


def test_the_program_reaches_the_queued_request_and_never_the_tenant() -> None:
    ing = ingress()
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            **context_body(program_id="p1", root_program_id="root")}
    session = send(ing, {"x-weighbridge-tenant": "b", "x-session-id": "other"}, body)
    request = session.request
    assert (request.tenant, request.session, request.program) == ("a", "p1", "root")
    assert request.tier == "standard"
    forwarded = session.arrival.body["vllm_xargs"]["agentic_context"]
    assert isinstance(forwarded, str)


def test_a_bad_shape_is_a_400_before_a_slot() -> None:
    ing = ingress()
    body = {"messages": [{"role": "user", "content": "hi"}], "vllm_xargs": {"k": {"a": 1}}}
    with pytest.raises(ApiError) as caught:
        send(ing, {}, body)
    assert caught.value.status == 400 and caught.value.reason == "invalid_vllm_xargs"
    assert orjson.loads(caught.value.body())["error"]["type"] == "invalid_request_error"
    assert ing.core.next_dispatch(0.0) is None  # nothing took a slot


@settings(max_examples=200, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=8))
def test_whatever_passes_is_what_vllm_types_vllm_xargs_as(xargs: Any) -> None:
    body = {"vllm_xargs": xargs}
    try:
        check_xargs(body)
    except ProgramError:
        return
    value = body["vllm_xargs"]
    assert value is None or all(
        isinstance(v, str | int | float)
        or (isinstance(v, list) and all(isinstance(x, str | int | float) for x in v))
        for v in value.values())


def test_a_programs_calls_stay_on_one_backend_through_the_core() -> None:
    """The x-session-id header reaches session_affinity: program y's first call goes to the
    idle backend while x's runs on the other; with both idle again, y's next call goes back
    to y's backend, where load alone (a tie) would choose the first."""
    config = make_config(routing={"picker": "bounded_load",
                                  "scorers": {"least_tokens": 1.0, "session_affinity": 1.0}})
    ing = Ingress(config, SchedulingCore(config))
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def call(program: str, now: float) -> tuple[Any, str]:
        session = send(ing, {"x-session-id": program}, dict(body))
        dispatch = ing.core.next_dispatch(now)
        assert dispatch is not None and dispatch.request is session.request
        return session, dispatch.backend

    x, x_backend = call("x", 0.0)
    y, y_backend = call("y", 0.1)
    assert x_backend != y_backend
    for session in (x, y):
        session.relayed(RelayOutcome(200, Usage(10, 4)), 1.0)
    assert call("y", 2.0)[1] == y_backend
    assert x_backend == config.backends[0].name  # what load alone would choose
