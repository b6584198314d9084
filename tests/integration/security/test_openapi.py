"""sidecar/openapi.yaml describes the sidecar's HTTP API as the application serves it: the
same routes and methods, every reference resolving, the error codes of docs/sidecar.md's
table, and — against a live sidecar — every answer's status documented for its operation and
its JSON body valid against the documented schema.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support import loopback
from tests.support.stack import ADMIN_KEY, auth, completion, start_emulator, start_sidecar, tenant
from tests.support.stub_backend import StubBackend
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import parse_config

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[3]
SPEC: dict[str, Any] = yaml.safe_load((REPO / "sidecar/openapi.yaml").read_text())
KEY = "sk-openapi"
METHODS = {"get", "post", "put", "delete", "patch"}


def resolve(node: Any) -> Any:
    while isinstance(node, dict) and "$ref" in node:
        ref = node["$ref"]
        assert ref.startswith("#/"), ref
        target: Any = SPEC
        for part in ref[2:].split("/"):
            target = target[part]
        node = target
    return node


def refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        if "$ref" in node:
            yield node["$ref"]
        for value in node.values():
            yield from refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from refs(value)


_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def violations(value: Any, schema: Any, where: str = "$") -> list[str]:
    """JSON Schema checking for the keywords the description uses."""
    schema = resolve(schema)
    found: list[str] = []
    if "allOf" in schema:
        for part in schema["allOf"]:
            found += violations(value, part, where)
    if "anyOf" in schema and all(violations(value, part, where) for part in schema["anyOf"]):
        found.append(f"{where}: matches none of anyOf")
    if "oneOf" in schema:
        matches = sum(not violations(value, part, where) for part in schema["oneOf"])
        if matches != 1:
            found.append(f"{where}: matches {matches} of oneOf")
    if "const" in schema and value != schema["const"]:
        found.append(f"{where}: {value!r} != {schema['const']!r}")
    if "enum" in schema and value not in schema["enum"]:
        found.append(f"{where}: {value!r} not in the enum")
    if "type" in schema:
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        ok = any(
            (t == "integer" and isinstance(value, int) and not isinstance(value, bool))
            or (t == "number" and isinstance(value, int | float) and not isinstance(value, bool)
                and math.isfinite(value))
            or (t in _TYPES and isinstance(value, _TYPES[t])
                and not (t != "boolean" and isinstance(value, bool)))
            for t in types)
        if not ok:
            return [*found, f"{where}: {value!r} is not {types}"]
    if isinstance(value, str) and len(value) < schema.get("minLength", 0):
        found.append(f"{where}: shorter than {schema['minLength']}")
    if isinstance(value, int | float) and not isinstance(value, bool) \
            and value < schema.get("minimum", -math.inf):
        found.append(f"{where}: below {schema['minimum']}")
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            found.append(f"{where}: fewer than {schema['minItems']} items")
        if "items" in schema:
            for i, item in enumerate(value):
                found += violations(item, schema["items"], f"{where}[{i}]")
    if isinstance(value, dict):
        for name in schema.get("required", ()):
            if name not in value:
                found.append(f"{where}: {name} missing")
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                found += violations(value[name], sub, f"{where}.{name}")
    return found


def test_the_description_is_openapi_3_1_and_every_reference_resolves() -> None:
    assert str(SPEC["openapi"]).startswith("3.1")
    assert SPEC["info"]["title"] and SPEC["paths"]
    for ref in set(refs(SPEC)):
        assert resolve({"$ref": ref}) is not None, ref
    for path, item in SPEC["paths"].items():
        for method, operation in item.items():
            assert operation["responses"], (method, path)
            for status in operation["responses"]:
                assert status == "default" or re.fullmatch(r"[1-5][0-9][0-9]", status)


def test_the_description_lists_exactly_the_apps_routes() -> None:
    config = parse_config({"backends": [{"url": "http://127.0.0.1:1"}]})
    served = {(route.method.lower(), route.resource.canonical)
              for route in Sidecar(config).app.router.routes()
              if route.method != "HEAD" and route.resource is not None}
    described = {(method, path) for path, item in SPEC["paths"].items()
                 for method in item if method in METHODS}
    assert described == served


def test_the_error_codes_are_the_documented_reasons() -> None:
    """The ErrorCode enum and the status table of docs/sidecar.md list the same reasons."""
    doc = (REPO / "docs/sidecar.md").read_text()
    table = doc[doc.index("### Status codes and reasons"):]
    table = table[:table.index("\n\n", table.index("| status"))]
    documented: set[str] = set()
    rows = [line for line in table.splitlines() if line.startswith("|")]
    for line in rows[2:]:  # after the header and its rule
        cells = [c.strip() for c in line.strip("|").split("|")]
        documented |= set(re.findall(r"`([a-z_]+)`", cells[1]))
    enum = set(SPEC["components"]["schemas"]["ErrorCode"]["enum"])
    assert enum == documented


@dataclass(frozen=True)
class Stack:
    url: str
    down: str  # a sidecar whose only backend is stopped


@pytest.fixture(scope="module")
def stack(processes) -> Stack:
    emulator = start_emulator(processes)
    config = {"tenants": {"t": tenant("standard", KEY, limits={"max_queued": 1})},
              "max_tokens_limit": 64, "max_body_bytes": 8192,
              "admin_api_keys": [f"plain:{ADMIN_KEY}"]}
    url = start_sidecar(processes, {**config, "backends": [{"url": emulator.url}]}).url
    stub = StubBackend()
    with stub:
        down = start_sidecar(processes, {**config, "backends": [{"url": stub.url}],
                                         "health_probe": {"interval_ms": 100}})
    return Stack(url, down.url)


CASES: list[tuple[str, str, str, dict[str, str], Any]] = [
    # (sidecar, method, path, headers, json body or raw bytes)
    ("up", "post", "/v1/completions", auth(KEY), completion()),
    ("up", "post", "/v1/completions", auth(KEY), completion(stream=True)),
    ("up", "post", "/v1/chat/completions", auth(KEY),
     {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("up", "post", "/v1/completions", auth(KEY), b"{"),
    ("up", "post", "/v1/completions", auth(KEY), completion(65)),
    ("up", "post", "/v1/chat/completions", auth(KEY), {"messages": []}),
    ("up", "post", "/v1/completions", {}, completion()),
    ("up", "post", "/v1/completions", {**auth(KEY), "x-weighbridge-tier": "interactive"},
     completion()),
    ("up", "post", "/v1/completions", {**auth(KEY), "x-weighbridge-tier": "gold"},
     completion()),
    ("up", "post", "/v1/completions", {**auth(KEY), "x-weighbridge-deadline-ms": "-1"},
     completion()),
    ("up", "post", "/v1/completions", auth(KEY), {"prompt": "x" * 9000}),
    ("up", "post", "/v1/completions", auth(KEY), {"prompt": [10 ** 9], "max_tokens": 2}),
    ("up", "post", "/v1/completions", auth(KEY), completion(model="no-such-model")),
    ("up", "get", "/v1/models", auth(KEY), None),
    ("up", "get", "/v1/models", {}, None),
    ("up", "get", "/healthz", {}, None),
    ("up", "get", "/readyz", {}, None),
    ("up", "get", "/metrics", {}, None),
    ("up", "get", "/admin/state", auth(ADMIN_KEY), None),
    ("up", "get", "/admin/state", auth(KEY), None),
    ("up", "get", "/admin/state", {}, None),
    ("down", "get", "/readyz", {}, None),
    ("down", "get", "/v1/models", auth(KEY), None),
]


@pytest.mark.parametrize(("which", "method", "path", "headers", "body"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_live_answers_match_the_description(stack: Stack, which: str, method: str, path: str,
                                            headers: dict[str, str], body: Any) -> None:
    url = stack.url if which == "up" else stack.down
    if which == "down":
        # Its stub backend is gone: wait for the probe to notice.
        for _ in range(100):
            if loopback.get(url + "/readyz", timeout=10).status_code == 503:
                break
            time.sleep(0.05)
    kwargs: dict[str, Any] = {"headers": headers, "timeout": 30}
    if isinstance(body, bytes):
        kwargs["content"] = body
    elif body is not None:
        kwargs["json"] = body
    response = loopback.request(method.upper(), url + path, **kwargs)
    responses = SPEC["paths"][path][method]["responses"]
    status = str(response.status_code)
    assert status in responses or "default" in responses, (status, response.text[:300])
    documented = resolve(responses.get(status, responses.get("default")))
    content_type = response.headers["content-type"].split(";")[0]
    assert content_type in documented["content"], (content_type, list(documented["content"]))
    if content_type == "application/json":
        schema = documented["content"][content_type]["schema"]
        problems = violations(response.json(), schema)
        assert not problems, (problems, response.text[:300])
    reason = response.headers.get("x-weighbridge-reject-reason")
    if reason is not None:
        # The sidecar's own error: the header is documented and the body is its Error, or
        # vLLM's own for a model no backend serves.
        assert "x-weighbridge-reject-reason" in documented.get("headers", {})
        error = response.json()
        if reason == "model_not_found":
            assert not violations(error, {"$ref": "#/components/schemas/NotFoundBody"})
        else:
            assert not violations(error, {"$ref": "#/components/schemas/Error"})
            assert error["error"]["code"] == reason
