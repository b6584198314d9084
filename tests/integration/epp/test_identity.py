"""The tenant as a gateway's own authentication names it (``weighbridge epp --tenant-from``;
sidecar/identity.py), and never as a client does.

Behind a real Envoy whose ``jwt_authn`` filter checks the client's JWT (signed here with an
RSA key whose public half Envoy holds as its JWKS), writes the payload into the request's
dynamic metadata and its ``tenant`` claim into ``x-gateway-tenant``, after taking any
``x-gateway-tenant`` the client sent off the request: one picker trusts the metadata, one
the header. A client that forges the header, or holds a weighbridge key, gets the tenant its
JWT names or a 401. Then, against a picker directly: a header or metadata is read only when
named, and a named source present with an unknown tenant is a 401, not the next source."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_proc_grpc
from jwt.algorithms import RSAAlgorithm

from tests.integration.epp.data_plane import bind, channel
from tests.support.answers import assert_rejected, assert_served
from tests.support.ledger import ledger, settled
from tests.support.stack import auth, completion, start_emulator, tenant
from weighbridge.launch import GatewayAuth, envoy_config, envoy_process, epp_process, free_port

pytestmark = pytest.mark.timeout(120)

JWT_AUTHN = "envoy.filters.http.jwt_authn"
CLAIM_HEADER = "x-gateway-tenant"
ISSUER = "https://auth.gateway.test"
BY_METADATA = f"metadata:{JWT_AUTHN}/jwt_payload/tenant"
BY_HEADER = f"header:{CLAIM_HEADER}"
TENANTS = {"light": tenant("standard", "sk-light"), "heavy": tenant("standard", "sk-heavy")}


@dataclass(frozen=True)
class Issuer:
    """The gateway's identity provider: it signs the JWTs Envoy checks."""

    key: rsa.RSAPrivateKey

    def token(self, **claims: object) -> str:
        return jwt.encode({"iss": ISSUER, "sub": "someone", **claims}, self.key,
                          algorithm="RS256", headers={"kid": "gateway"})

    def jwks(self) -> str:
        public = json.loads(RSAAlgorithm.to_jwk(self.key.public_key()))
        return json.dumps({"keys": [{**public, "kid": "gateway", "alg": "RS256",
                                     "use": "sig"}]})


def gateway_auth(issuer: Issuer) -> GatewayAuth:
    """Envoy's jwt_authn on every path: the JWT required, removed once checked (it is the
    gateway's credential, not the engine's), its payload in metadata and its tenant claim
    in a header that no client's copy survives."""
    jwt_authn = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.jwt_authn.v3."
                 "JwtAuthentication",
        "providers": {"gateway": {
            "issuer": ISSUER,
            "local_jwks": {"inline_string": issuer.jwks()},
            "forward": False,
            "payload_in_metadata": "jwt_payload",
            "claim_to_headers": [{"header_name": CLAIM_HEADER, "claim_name": "tenant"}],
        }},
        "rules": [{"match": {"prefix": "/"}, "requires": {"provider_name": "gateway"}}],
    }
    return GatewayAuth(filters=({"name": JWT_AUTHN, "typed_config": jwt_authn},),
                       forwarded_namespaces=(JWT_AUTHN,), removed_headers=(CLAIM_HEADER,))


@dataclass(frozen=True)
class Gateway:
    url: str
    picker: str  # its HTTP port (/metrics)


@pytest.fixture(scope="module")
def issuer() -> Issuer:
    return Issuer(rsa.generate_private_key(public_exponent=65537, key_size=2048))


@pytest.fixture(scope="module")
def gateways(processes: contextlib.ExitStack, issuer: Issuer) -> dict[str, Gateway]:
    """One Envoy and picker for each source the picker trusts, in front of one engine."""
    engine = start_emulator(processes)
    found = {}
    for source in (BY_METADATA, BY_HEADER):
        picker, grpc_port = epp_process({"tenants": TENANTS, "backends": [{"url": engine.url}]},
                                        args=("--tenant-from", source))
        processes.enter_context(picker)
        port, admin = free_port(), free_port()
        envoy = processes.enter_context(envoy_process(
            envoy_config(port, admin, [("127.0.0.1", grpc_port)], auth=gateway_auth(issuer)),
            port, admin))
        found[source] = Gateway(envoy.url, picker.url)
    return found


@pytest.fixture(params=[BY_METADATA, BY_HEADER], ids=["metadata", "header"])
def gateway(request: pytest.FixtureRequest, gateways: dict[str, Gateway]) -> Iterator[Gateway]:
    yield gateways[request.param]
    settled(gateways[request.param].picker)


def post(gateway: Gateway, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(gateway.url + "/v1/completions", json=completion(2), headers=headers,
                      timeout=30)


def test_the_jwt_names_the_tenant(gateway: Gateway, issuer: Issuer) -> None:
    for name in TENANTS:
        assert_served(post(gateway, auth(issuer.token(tenant=name))), name)


def test_a_forged_header_does_not_choose_the_tenant(gateway: Gateway, issuer: Issuer) -> None:
    """The client names another tenant in the very header the gateway writes: the gateway
    took the client's copy off before its auth ran (Envoy's jwt_authn also replaces a
    client's copy of a claim header itself: measured without the early removal too)."""
    response = post(gateway, {**auth(issuer.token(tenant="light")), CLAIM_HEADER: "heavy"})
    assert_served(response, "light")


def test_a_jwt_without_the_claim_is_refused(gateway: Gateway, issuer: Issuer) -> None:
    """Authenticated, but the gateway names no tenant: the forged header is gone, and the
    picker's only source is absent, so a 401 (counted, before a slot)."""
    before = ledger(gateway.picker)
    response = post(gateway, {**auth(issuer.token()), CLAIM_HEADER: "heavy"})
    assert_rejected(response, 401, "unauthorized")
    delta = settled(gateway.picker) - before
    assert delta.rejected == {"unauthorized": 1} and delta.dispatched == 0


def test_a_jwt_naming_an_unknown_tenant_is_refused(gateway: Gateway, issuer: Issuer) -> None:
    assert_rejected(post(gateway, auth(issuer.token(tenant="nobody"))), 401, "unauthorized")


def test_a_weighbridge_key_is_no_identity_here(gateway: Gateway) -> None:
    """The picker trusts the gateway alone: a tenant's own key is not a JWT, so the gateway
    refuses it (its own 401) and the picker never sees the request."""
    before = ledger(gateway.picker)
    response = post(gateway, {**auth("sk-heavy"), CLAIM_HEADER: "heavy"})
    assert response.status_code == 401
    assert "x-weighbridge-tenant" not in response.headers
    assert ledger(gateway.picker).arrived == before.arrived


# -- against a picker directly --------------------------------------------------------------


@pytest.fixture(scope="module")
def pickers(processes: contextlib.ExitStack) -> dict[str, str]:
    """A picker of each trust, by its gRPC address: the key alone (the default), the
    metadata then the key, and the header alone."""
    engine = start_emulator(processes)
    found = {}
    for name, args in (("key", ()),
                       ("metadata-then-key", ("--tenant-from", BY_METADATA,
                                              "--tenant-from", "key")),
                       ("header", ("--tenant-from", BY_HEADER))):
        process, port = epp_process({"tenants": TENANTS, "backends": [{"url": engine.url}]},
                                    args=args)
        processes.enter_context(process)
        found[name] = f"127.0.0.1:{port}"
    return found


async def served_as(stub: ext_proc_grpc.ExternalProcessorStub, key: str | None,
                    **headers: Any) -> str:
    """The tenant a request was served as (the picker's x-weighbridge-tenant), or its
    refusal's status."""
    stream, answer = await bind(stub, key, **headers)
    if answer.HasField("immediate_response"):
        return str(answer.immediate_response.status.code)
    await stream.read()
    return (await stream.finish())["x-weighbridge-tenant"]


async def test_headers_and_metadata_are_not_read_unless_named(pickers: dict[str, str]) -> None:
    """The default picker reads the key alone: the metadata and the header a gateway might
    set name another tenant, and are ignored; without a key, they are no identity."""
    forged: dict[str, Any] = {"headers": {CLAIM_HEADER: "heavy"},
                              "metadata": {JWT_AUTHN: {"jwt_payload": {"tenant": "heavy"}}}}
    async with channel(pickers["key"]) as stub:
        assert await served_as(stub, "sk-light", **forged) == "light"
        assert await served_as(stub, None, **forged) == "401"


async def test_the_first_named_source_present_decides(pickers: dict[str, str]) -> None:
    """Metadata, then the key: the metadata's tenant wins over the key's; absent, the key
    decides; present with an unknown tenant, a 401 although the key is valid."""
    def claim(name: str) -> dict[str, Any]:
        return {"metadata": {JWT_AUTHN: {"jwt_payload": {"tenant": name}}}}

    async with channel(pickers["metadata-then-key"]) as stub:
        assert await served_as(stub, "sk-light", **claim("heavy")) == "heavy"
        assert await served_as(stub, "sk-light") == "light"
        assert await served_as(stub, "sk-light", **claim("nobody")) == "401"
        assert await served_as(stub, None, **claim("light")) == "light"


async def test_the_identity_header_never_reaches_the_engine(pickers: dict[str, str]) -> None:
    """A header the picker reads identity from is taken off the forwarded request, as the
    client's key is."""
    async with channel(pickers["header"]) as stub:
        stream, answer = await bind(stub, None, headers={CLAIM_HEADER: "light"})
        removed = set(answer.request_headers.response.header_mutation.remove_headers)
        assert {"authorization", CLAIM_HEADER} <= removed
        await stream.read()
        assert (await stream.finish())["x-weighbridge-tenant"] == "light"
