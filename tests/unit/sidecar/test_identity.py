"""Where a request's tenant is read (``weighbridge.sidecar.identity``): the sources parse
and print back, only the named ones are read, in their order, and the first present
decides."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
from google.protobuf import struct_pb2
from hypothesis import given
from hypothesis import strategies as st

from weighbridge.sidecar.identity import KEY, IdentitySource, TrustedSources

JWT = "metadata:envoy.filters.http.jwt_authn/jwt_payload/tenant"


def metadata(namespaces: Mapping[str, Mapping[str, Any]]) -> Any:
    """A request's dynamic metadata as the picker reads it: protobuf Structs by namespace."""
    structs = {}
    for name, values in namespaces.items():
        struct = struct_pb2.Struct()
        struct.update(dict(values))
        structs[name] = struct
    return structs.get


NONE = metadata({})
JWT_AUTHN = "envoy.filters.http.jwt_authn"


@pytest.mark.parametrize("text", ["key", "header:x-gateway-tenant", JWT,
                                  "metadata:ext_authz/tenant"])
def test_a_source_prints_as_it_parses(text: str) -> None:
    assert str(IdentitySource.parse(text)) == text


@pytest.mark.parametrize("text", ["", "keys", "key:x", "header:", "header:x y",
                                  "header::path", "header:authorization", "header:Host",
                                  "metadata:ns", "metadata:ns/", "metadata:/tenant",
                                  "metadata:ns//tenant", "cookie:tenant"])
def test_a_malformed_source_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text).strip("'")[:8] or "source"):
        IdentitySource.parse(text)


def test_a_header_name_is_read_in_lower_case() -> None:
    assert IdentitySource.parse("header:X-Gateway-Tenant").name == "x-gateway-tenant"


def test_the_key_alone_by_default() -> None:
    sources = TrustedSources()
    assert sources.claimed({"authorization": "Bearer sk"}, NONE) == (IdentitySource(KEY), None)
    # A header or metadata naming a tenant is not a source unless named: never read.
    forged = {"x-gateway-tenant": "victim"}
    assert sources.claimed(forged, metadata({"ext_authz": {"tenant": "victim"}})) is None
    assert sources.headers == ()


def test_the_first_present_decides() -> None:
    sources = TrustedSources([IdentitySource.parse(JWT),
                              IdentitySource.parse("header:x-gateway-tenant"),
                              IdentitySource(KEY)])
    jwt = metadata({JWT_AUTHN: {"jwt_payload": {"tenant": "a"}}})
    everything = {"x-gateway-tenant": "b", "authorization": "Bearer sk"}
    assert sources.claimed(everything, jwt)[1] == "a"  # type: ignore[index]
    assert sources.claimed(everything, NONE)[1] == "b"  # type: ignore[index]
    assert sources.claimed({"authorization": "Bearer sk"}, NONE) == (IdentitySource(KEY),
                                                                     None)
    assert sources.claimed({}, NONE) is None
    assert sources.headers == ("x-gateway-tenant",)


@pytest.mark.parametrize("payload", [{"tenant": 3}, {"tenant": ["a"]}, {"tenant": {"a": 1}},
                                     {"sub": "a"}, {}])
def test_metadata_names_a_tenant_only_as_a_string(payload: dict[str, Any]) -> None:
    sources = TrustedSources([IdentitySource.parse(JWT)])
    jwt = metadata({JWT_AUTHN: {"jwt_payload": payload}})
    assert sources.claimed({}, jwt) is None


def test_a_present_but_empty_value_still_decides() -> None:
    """An empty header is the gateway's word that it knows no tenant: the picker's 401, not
    the next source."""
    sources = TrustedSources([IdentitySource.parse("header:x-gateway-tenant"),
                              IdentitySource(KEY)])
    claim = sources.claimed({"x-gateway-tenant": " ", "authorization": "Bearer sk"}, NONE)
    assert claim == (IdentitySource.parse("header:x-gateway-tenant"), "")


def test_a_source_named_twice_or_none_is_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        TrustedSources([IdentitySource(KEY), IdentitySource(KEY)])
    with pytest.raises(ValueError, match="at least one"):
        TrustedSources([])


names = st.text(st.sampled_from("abcxyz-_."), min_size=1, max_size=8)


@given(st.lists(st.one_of(st.just("key"), names.map(lambda n: f"header:x-{n}"),
                          st.tuples(names, st.lists(names, min_size=1, max_size=3)).map(
                              lambda t: f"metadata:{t[0]}/{'/'.join(t[1])}")),
                min_size=1, max_size=4, unique=True),
       st.dictionaries(names.map(lambda n: f"x-{n}"), names, max_size=4))
def test_only_a_named_header_is_ever_read(texts: list[str], headers: dict[str, str]) -> None:
    """Whatever headers a client sends, the tenant comes from a header the sources name, or
    from none."""
    sources = TrustedSources([IdentitySource.parse(t) for t in texts])
    claim = sources.claimed(headers, NONE)
    if claim is not None and claim[0].kind == "header":
        assert claim[0].name in sources.headers and claim[1] == headers[claim[0].name].strip()
    elif claim is not None:
        assert claim[0].kind == KEY or claim[0].kind == "metadata"
