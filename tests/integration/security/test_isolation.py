"""Tenant isolation: the tenant comes only from the key, and nothing a client sends besides
the key — headers naming a tenant, tier or priority, body fields naming a tenant, user or a
vLLM priority — can move its request to another tenant or raise it above its tier, in the
sidecar's accounting or at the backend (the vLLM ``priority`` a priority-scheduling backend
receives is the tier's, never the client's).

Covered in tests/integration/sidecar/test_auth.py: 401 for missing/unknown keys and the
admin key on the API, 403 for a tenant key on /admin/state, ``x-weighbridge-tenant`` ignored,
a higher ``x-weighbridge-tier`` refused (403), keys and prompts absent from the log,
/metrics and /admin/state.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.answers import assert_rejected
from tests.support.ledger import Ledger, ledger, ledger_of, settled
from tests.support.metrics import scrape
from tests.support.stack import ADMIN_KEY, auth, start_sidecar, tenant
from tests.support.stub_backend import StubBackend

pytestmark = pytest.mark.timeout(120)

# vLLM priorities of the default tiers (lower runs first).
PRIORITY = {"interactive": 0, "standard": 5, "batch": 10}
TENANTS = {"gold": ("interactive", "sk-iso-gold"), "silver": ("standard", "sk-iso-silver"),
           "bronze": ("batch", "sk-iso-bronze")}


@dataclass(frozen=True)
class Stack:
    sidecar: str
    backend: StubBackend
    client: httpx.Client


@pytest.fixture(scope="module")
def stack(processes) -> Iterator[Stack]:
    backend = processes.enter_context(StubBackend())
    backend.release()  # answer at once
    sidecar = start_sidecar(processes, {
        "tenants": {name: tenant(tier, key) for name, (tier, key) in TENANTS.items()},
        "backends": [{"url": backend.url, "name": "stub", "priority_scheduling": True}],
        "admin_api_keys": [f"plain:{ADMIN_KEY}"],
    })
    with httpx.Client(base_url=sidecar.url, timeout=30) as client:
        yield Stack(sidecar.url, backend, client)


SPOOF_HEADERS = ["x-weighbridge-tenant", "x-weighbridge-tier", "x-weighbridge-priority",
                 "x-tenant", "x-tenant-id", "x-api-key", "openai-organization",
                 "openai-project", "x-forwarded-user", "x-weighbridge-backend",
                 "x-weighbridge-queue-ms"]
SPOOF_VALUES = st.sampled_from([*TENANTS, "interactive", "standard", "batch", "admin", "0",
                                "-100", ADMIN_KEY, "sk-iso-gold"])
SPOOF_FIELDS = st.fixed_dictionaries({"priority": st.integers(-1000, 1000)}, optional={
    "user": SPOOF_VALUES, "tenant": SPOOF_VALUES,
    "tier": SPOOF_VALUES, "metadata": st.dictionaries(st.sampled_from(["tenant", "tier"]),
                                                      SPOOF_VALUES, max_size=2),
})


def ledgers(url: str) -> dict[str, Ledger]:
    """Every tenant's ledger, from one scrape: the examples below read them before and after
    each request, and one scrape for all three is one moment for all three."""
    s = scrape(url)
    return {n: ledger_of(s, tenant=n) for n in TENANTS}


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["silver", "bronze"]),
       headers=st.dictionaries(st.sampled_from(SPOOF_HEADERS), SPOOF_VALUES, max_size=4),
       fields=SPOOF_FIELDS)
def test_spoofed_headers_and_fields_cannot_move_or_raise_a_request(
        stack: Stack, name: str, headers: dict[str, str], fields: dict) -> None:
    own_tier, key = TENANTS[name]
    before = ledgers(stack.sidecar)
    seen = len(stack.backend.bodies)
    response = stack.client.post("/v1/completions", headers={**headers, **auth(key)},
                                 json={"prompt": [1, 2, 3], "max_tokens": 2, **fields})
    asked = headers.get("x-weighbridge-tier")
    if asked is not None and asked not in PRIORITY:
        assert_rejected(response, 400, "unknown_tier")
    elif asked is not None and PRIORITY[asked] < PRIORITY[own_tier]:
        assert_rejected(response, 403, "tier_not_allowed")
    else:
        assert response.status_code == 200, response.text
        assert response.headers["x-weighbridge-tenant"] == name
        (body,) = stack.backend.bodies[seen:]
        # The backend's priority is the tier's (maybe demoted), never higher than the
        # tenant's own tier, whatever the client put in the body.
        tier = asked or own_tier
        assert body["priority"] >= PRIORITY[tier] >= PRIORITY[own_tier]
    settled(stack.sidecar)
    # Counted under its own tenant only, in its own tier or one it may step down to.
    after = scrape(stack.sidecar)
    for other in TENANTS:
        delta = ledger_of(after, tenant=other) - before[other]
        assert delta.arrived == (1 if other == name else 0), (other, delta)
    for tier, rank in PRIORITY.items():
        if rank < PRIORITY[own_tier]:
            assert ledger_of(after, tenant=name, tier=tier).arrived == 0


@pytest.mark.parametrize("key", ["sk-iso-gold", "sk-iso-silver", "sk-iso-bronze",
                                 f" {ADMIN_KEY}", ADMIN_KEY.upper(), ADMIN_KEY + " x",
                                 "sk-admin", ADMIN_KEY[:-1]])
def test_no_tenant_key_or_near_miss_reads_the_admin_state(stack: Stack, key: str) -> None:
    response = stack.client.get("/admin/state", headers={"authorization": f"Bearer {key}"})
    if key.strip() in {k for _, k in TENANTS.values()}:
        assert_rejected(response, 403, "forbidden")
    elif key.strip() == ADMIN_KEY:  # surrounding blanks are not part of a key
        assert response.status_code == 200
    else:
        assert_rejected(response, 401, "unauthorized")


def test_the_admin_key_is_not_a_tenant_key(stack: Stack) -> None:
    before = ledger(stack.sidecar)
    response = stack.client.post("/v1/completions", headers=auth(ADMIN_KEY),
                                 json={"prompt": [1], "max_tokens": 1})
    assert_rejected(response, 401, "unauthorized")
    delta = settled(stack.sidecar) - before
    assert delta.rejected == {"unauthorized": 1}
    assert ledger(stack.sidecar, tenant="unauthenticated").rejected["unauthorized"] >= 1


def test_a_second_authorization_header_does_not_change_the_tenant(stack: Stack) -> None:
    """The first Authorization header decides; a second one smuggled after it (another
    tenant's key, or the admin key) is not looked at."""
    seen = len(stack.backend.bodies)
    response = stack.client.post(
        "/v1/completions", json={"prompt": [1], "max_tokens": 1},
        headers=[("authorization", "Bearer sk-iso-bronze"),
                 ("authorization", "Bearer sk-iso-gold")])
    assert response.status_code == 200
    assert response.headers["x-weighbridge-tenant"] == "bronze"
    assert stack.backend.bodies[seen]["priority"] >= PRIORITY["batch"]
    response = stack.client.post(
        "/v1/completions", json={"prompt": [1], "max_tokens": 1},
        headers=[("authorization", "Bearer sk-nobody"), ("authorization", "Bearer sk-iso-gold")])
    assert_rejected(response, 401, "unauthorized")
    settled(stack.sidecar)
