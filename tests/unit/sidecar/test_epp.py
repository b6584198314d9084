"""The endpoint picker's pure pieces (sidecar/epp.py): endpoints as the data plane reads
them, Envoy's header map as the session reads headers, the subset hint, refusals as
ImmediateResponses. The protocol end to end is tests/integration/epp."""

from __future__ import annotations

import orjson
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from google.protobuf import struct_pb2

from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.epp import (
    MAX_HEADER_BYTES,
    RESOLVE_TTL_S,
    Endpoints,
    bound,
    endpoint_of,
    header_map,
    immediate,
    subset_hint,
)
from weighbridge.sidecar.session import ApiError


def test_endpoint_of_a_url() -> None:
    assert endpoint_of("http://10.0.0.7:8000") == "10.0.0.7:8000"
    assert endpoint_of("http://10.0.0.7") == "10.0.0.7:80"
    assert endpoint_of("https://10.0.0.7/v1") == "10.0.0.7:443"
    assert endpoint_of("http://[fd00::7]:8000/") == "[fd00::7]:8000"
    assert endpoint_of("http://vllm-0.vllm:8000", resolve=lambda host: "10.1.2.3") == \
        "10.1.2.3:8000"


def test_a_host_name_is_resolved_again_after_its_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    config = parse_config({"tenants": {"t": {"tier": "standard", "api_keys": ["plain:k"]}},
                           "backends": [{"url": "http://vllm-0.vllm:8000", "name": "b"},
                                        {"url": "http://10.0.0.9:8000", "name": "ip"}]})
    answers = iter(["10.0.0.1", "10.0.0.2"])
    monkeypatch.setattr("weighbridge.sidecar.epp._resolve", lambda host: next(answers))
    now = [0.0]
    endpoints = Endpoints(lambda: config, clock=lambda: now[0])
    assert endpoints.of("b") == "10.0.0.1:8000"
    now[0] = RESOLVE_TTL_S / 2
    assert endpoints.of("b") == "10.0.0.1:8000"  # cached
    now[0] = RESOLVE_TTL_S + 1
    assert endpoints.of("b") == "10.0.0.2:8000"  # the pod came back elsewhere
    assert endpoints.of("ip") == "10.0.0.9:8000"
    assert endpoints.backends_at(["10.0.0.9:8000", "10.9.9.9:1"]) == {"ip"}


def _map(*pairs: tuple[str, bytes]) -> base_pb2.HeaderMap:
    return base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v)
                                       for k, v in pairs])


def test_header_map_lower_cases_joins_and_bounds() -> None:
    headers = header_map(_map(("Authorization", b"Bearer k"), ("x-a", b"1"), ("x-a", b"2"),
                              ("x-bin", b"\xff\xfe")))
    assert headers["authorization"] == "Bearer k"
    assert headers["x-a"] == "1,2"
    assert headers["x-bin"].encode("utf-8", "surrogateescape") == b"\xff\xfe"
    huge = header_map(_map(*[(f"x-{i}", b"v" * 1024) for i in range(200)]))
    assert sum(len(k) + len(v) for k, v in huge.items()) <= MAX_HEADER_BYTES


def _with_hint(value: object) -> ext_proc.ProcessingRequest:
    request = ext_proc.ProcessingRequest()
    hint = struct_pb2.Struct()
    hint.update({"x-gateway-destination-endpoint-subset": value})
    request.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return request


def test_subset_hint_as_a_list_as_text_and_absent() -> None:
    assert subset_hint(ext_proc.ProcessingRequest()) is None
    assert subset_hint(_with_hint(["10.0.0.1:8000", "10.0.0.2:8000"])) == \
        ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert subset_hint(_with_hint("10.0.0.1:8000, 10.0.0.2:8000")) == \
        ["10.0.0.1:8000", "10.0.0.2:8000"]
    assert subset_hint(_with_hint([])) == []
    assert subset_hint(_with_hint(7)) == []  # not endpoints: none eligible


def test_immediate_carries_the_openai_body_and_headers() -> None:
    error = ApiError(429, "rate_limited", "rate limited", "rate_limit_error",
                     {"Retry-After": "3"})
    answer = immediate(error).immediate_response
    assert answer.status.code == 429
    assert orjson.loads(answer.body)["error"]["code"] == "rate_limited"
    headers = {h.header.key: h.header.raw_value for h in answer.headers.set_headers}
    assert headers == {"content-type": b"application/json",
                       "x-weighbridge-reject-reason": b"rate_limited", "retry-after": b"3"}


@pytest.mark.parametrize("full_duplex", [True, False])
def test_binding_sets_header_and_metadata_alike(full_duplex: bool) -> None:
    answers = bound("10.0.0.1:8000", b"{}", full_duplex)
    first = answers[0]
    common = (first.request_headers.response if full_duplex
              else first.request_body.response)
    set_headers = {h.header.key: h.header.raw_value.decode()
                   for h in common.header_mutation.set_headers}
    assert set_headers == {"x-gateway-destination-endpoint": "10.0.0.1:8000"}
    # The client's key stays at the gateway; the body sent is not the client's length.
    assert set(common.header_mutation.remove_headers) == {"authorization", "content-length"}
    lb = first.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert lb["x-gateway-destination-endpoint"].string_value == "10.0.0.1:8000"
    assert common.clear_route_cache
