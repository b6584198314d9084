"""Property-based fuzzing of a live sidecar: arbitrary bodies (JSON of any shape, OpenAI-like
objects with fields of the wrong types, raw bytes), headers and paths. Whatever arrives:
never a 5xx, every error an OpenAI error body, and the process stays healthy with its
ledger balanced.

The 56 hand-picked bad inputs (and their exact reasons) are in
tests/integration/sidecar/test_bad_input.py; this searches the space around them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support import loopback
from tests.support.ledger import ledger, settled
from tests.support.stack import ADMIN_KEY, start_emulator, start_sidecar, tenant

pytestmark = pytest.mark.timeout(180)

KEY = "sk-fuzz"
FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@dataclass(frozen=True)
class Stack:
    sidecar: str
    client: httpx.Client


@pytest.fixture(scope="module")
def stack(processes) -> Iterator[Stack]:
    emulator = start_emulator(processes)
    sidecar = start_sidecar(processes, {
        "tenants": {"t": tenant("batch", KEY), "gold": tenant("interactive", "sk-fuzz-gold")},
        "backends": [{"url": emulator.url}],
        # Small answers: a fuzzed request that is valid must not occupy the engine for long.
        "max_tokens_limit": 8,
        "max_body_bytes": 64 * 1024,
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    })
    with httpx.Client(base_url=sidecar.url, timeout=30) as client:
        yield Stack(sidecar.url, client)
    # The process survived it all, and every request ended exactly once.
    assert loopback.get(sidecar.url + "/healthz", timeout=10).status_code == 200
    settled(sidecar.url)


def check_answer(response: httpx.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"]
        assert isinstance(error["type"], str)
        reason = response.headers.get("x-weighbridge-reject-reason")
        if reason == "model_not_found":  # the sidecar's own answer, in vLLM's body
            assert (response.status_code, error["type"], error["code"]) == (
                404, "NotFoundError", 404)
        elif reason is not None:  # the sidecar's own answer
            assert error["code"] == reason


def encode(value: object) -> bytes:
    """JSON as a lax client writes it: integers beyond 64 bits, NaN and Infinity included."""
    return json.dumps(value).encode()


json_scalars = (st.none() | st.booleans() | st.integers() | st.floats()
                | st.text(max_size=40))
json_values = st.recursive(json_scalars,
                           lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                           max_leaves=20)
token_ids = st.lists(st.integers(min_value=-2, max_value=40_000), min_size=0, max_size=8)
message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "x"]),
                                 "content": json_scalars | st.lists(json_values, max_size=2)})
field_values = {
    "prompt": st.text(max_size=30) | token_ids | json_values,
    "messages": st.lists(message, max_size=3) | json_values,
    "max_tokens": st.integers(min_value=-5, max_value=2**70) | json_values,
    "max_completion_tokens": st.integers(min_value=-5, max_value=20) | json_values,
    "stream": st.booleans() | json_values,
    "stream_options": st.fixed_dictionaries({"include_usage": json_values}) | json_values,
    "priority": st.integers(min_value=-2**40, max_value=2**40) | json_values,
    "user": st.text(max_size=20) | json_values,
    "model": st.text(max_size=300) | json_values,
    "ignore_eos": st.booleans() | json_values,
}
openai_like = st.fixed_dictionaries(
    {}, optional={name: values for name, values in field_values.items()})


@FUZZ
@given(body=openai_like, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_openai_bodies(stack: Stack, body: dict, path: str) -> None:
    response = stack.client.post(path, content=encode(body), headers={
        "authorization": f"Bearer {KEY}", "content-type": "application/json"})
    check_answer(response)


@FUZZ
@given(body=st.binary(max_size=300) | json_values.map(encode),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
def test_fuzzed_raw_bodies(stack: Stack, body: bytes, path: str) -> None:
    response = stack.client.post(path, content=body, headers={
        "authorization": f"Bearer {KEY}", "content-type": "application/json"})
    check_answer(response)
    assert response.status_code == 400 or response.status_code == 200


header_text = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF,
                                    exclude_characters="\x7f"), max_size=40
                      ).map(lambda v: v.strip(" \t"))  # edge whitespace is not on the wire
header_names = st.sampled_from([
    "authorization", "x-weighbridge-tier", "x-weighbridge-deadline-ms",
    "x-weighbridge-tenant", "content-type", "content-encoding", "traceparent",
    "tracestate", "x-forwarded-for", "openai-organization", "accept-encoding",
]) | st.from_regex(r"\Ax-[a-z0-9-]{1,20}\Z")


@FUZZ
@given(headers=st.dictionaries(header_names,
                               header_text | header_text.map(lambda v: f"Bearer {v}".strip()),
                               max_size=5),
       keyed=st.sampled_from([None, KEY, "sk-fuzz-gold", ADMIN_KEY]))
def test_fuzzed_headers(stack: Stack, headers: dict[str, str], keyed: str | None) -> None:
    if keyed is not None:
        headers = {**headers, "authorization": f"Bearer {keyed}"}
    # Bytes, so Latin-1 values go out as they are (not re-encoded as UTF-8).
    encoded = {k: v.encode("latin-1") for k, v in headers.items()}
    response = stack.client.post("/v1/completions", headers=encoded, content=orjson.dumps(
        {"prompt": [1, 2], "max_tokens": 2}))
    check_answer(response)
    if response.status_code == 200:
        # Served only with a tenant key, and as the key's tenant, whatever the headers say.
        assert keyed in (KEY, "sk-fuzz-gold")
        assert response.headers["x-weighbridge-tenant"] == ("t" if keyed == KEY else "gold")


@FUZZ
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]),
       path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models",
                             "/metrics", "/healthz", "/readyz", "/admin/state", "/"])
       | st.from_regex(r"\A/[A-Za-z0-9._~%/-]{0,60}\Z"),
       keyed=st.sampled_from([None, KEY, ADMIN_KEY]))
def test_fuzzed_paths_and_methods(stack: Stack, method: str, path: str,
                                  keyed: str | None) -> None:
    headers = {"authorization": f"Bearer {keyed}"} if keyed else {}
    response = stack.client.request(method, stack.sidecar + path, headers=headers)
    assert response.status_code < 500, (method, path, response.status_code, response.text)
    if response.status_code >= 400 and method != "HEAD":
        check_answer(response)


def test_ledger_balances_after_fuzzing(stack: Stack) -> None:
    ledger(stack.sidecar)  # asserts arrivals = every end + in flight
