"""One set of ingress and end rules (``weighbridge.sidecar.session``), two fronts: the same
malformed and edge-case requests, sent through the live app (in process, in front of the
emulator's own server, in process too) and through the simulator (its engine the emulator's
step model, in virtual time), get the same answer (status and reject reason) and leave the
same ledger.

The rows are tests/integration/sidecar/test_bad_input.py's (``tests/support/bad_input``),
plus the headers, the keys, the limits and a few requests that are served."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from tests.support.bad_input import (
    BAD_BODIES,
    BAD_CHAT_BODIES,
    BAD_DEADLINES,
    BAD_EMBEDDING_BODIES,
    BAD_POOLING_BODIES,
    KEY,
    MAX_BODY_BYTES,
    MAX_TOKENS_LIMIT,
)
from tests.support.stack import auth, completion, tenant
from weighbridge import headers
from weighbridge.app.simulation.clients import ClientRequest, TraceClients
from weighbridge.app.simulation.engines import SimEngine
from weighbridge.app.simulation.loop import Simulation
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.emulator.server import Emulator, EmulatorSettings
from weighbridge.loadgen.plan import RequestPlan
from weighbridge.sidecar.app import Sidecar
from weighbridge.sidecar.config import Config, parse_config

COMPLETIONS, CHAT, EMBEDDINGS = "/v1/completions", "/v1/chat/completions", "/v1/embeddings"
SMALL_KEY = "sk-small"  # a tenant whose token bucket holds less than one request
MODEL = "weighbridge-emulator"
ENGINE = EmulatorOptions(profile="cpu-tiny", max_model_len=256)


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: bytes
    headers: dict[str, str] = field(default_factory=lambda: auth(KEY))
    # What the simulator's engine is told the request is (its sizes), for a served one.
    prompt_tokens: int = 1
    max_tokens: int = 1


def served(name: str, body: dict[str, Any], path: str = COMPLETIONS,
           extra: dict[str, str] | None = None) -> Case:
    """A request the sidecar admits: its sizes as the body gives them (the limit when it
    names no budget)."""
    prompt = body.get("prompt")
    budget = body.get("max_completion_tokens") or body.get("max_tokens") or MAX_TOKENS_LIMIT
    return Case(name, path, orjson.dumps(body), {**auth(KEY), **(extra or {})},
                len(prompt) if isinstance(prompt, list) else 8, int(budget))


def with_headers(name: str, extra: dict[str, str]) -> Case:
    return Case(name, COMPLETIONS, orjson.dumps(completion()), {**auth(KEY), **extra}, 4, 4)


MESSAGES = [{"role": "user", "content": "hi"}]
CASES: list[Case] = [
    *(Case(f"completions-{name}", COMPLETIONS, body) for name, body, _ in BAD_BODIES),
    *(Case(f"chat-{name}", CHAT, body) for name, body, _ in BAD_CHAT_BODIES),
    *(Case(f"embeddings-{name}", EMBEDDINGS, body) for name, body, _ in BAD_EMBEDDING_BODIES),
    *(Case(f"pooling-{name}", path, body) for name, path, body, _ in BAD_POOLING_BODIES),
    *(with_headers(f"deadline-{value or 'empty'}", {headers.DEADLINE_MS: value})
      for value in BAD_DEADLINES),
    Case("body-over-the-limit", COMPLETIONS,
         orjson.dumps({"prompt": "x" * (MAX_BODY_BYTES + 10), "max_tokens": 4})),
    Case("key-missing", COMPLETIONS, orjson.dumps(completion()), {}),
    Case("key-unknown", COMPLETIONS, orjson.dumps(completion()), auth("sk-nobody")),
    Case("key-not-bearer", COMPLETIONS, orjson.dumps(completion()),
         {"authorization": f"Basic {KEY}"}),
    Case("key-empty", COMPLETIONS, orjson.dumps(completion()), {"authorization": "Bearer "}),
    with_headers("tier-unknown", {headers.TIER: "gold"}),
    with_headers("tier-blank", {headers.TIER: " \t"}),
    with_headers("tier-above-its-own", {headers.TIER: "interactive"}),
    # Only HTTP's optional whitespace is stripped: a no-break space is part of the name.
    with_headers("tier-with-a-no-break-space", {headers.TIER: "batch\xa0"}),
    with_headers("tier-below-its-own", {headers.TIER: " batch\t"}),
    with_headers("deadline-good", {headers.DEADLINE_MS: "30000.5"}),
    with_headers("deadline-spaced", {headers.DEADLINE_MS: " 20000 "}),
    Case("model-unknown", COMPLETIONS, orjson.dumps(completion(model="no-such-model"))),
    Case("rate-limited", COMPLETIONS, orjson.dumps(completion(16)), auth(SMALL_KEY)),
    # A prompt past the engine's context: the engine's own 400, relayed; the request failed.
    Case("prompt-too-long", COMPLETIONS,
         orjson.dumps(completion(4, prompt_tokens=ENGINE.max_model_len + 1)),
         prompt_tokens=ENGINE.max_model_len + 1, max_tokens=4),
    served("max_tokens-at-the-limit", completion(MAX_TOKENS_LIMIT)),
    served("stream", completion(4, stream=True)),
    served("no-budget-gets-the-limit", {"messages": MESSAGES, "ignore_eos": True}, CHAT),
    served("max_tokens-16.0", {**completion(), "max_tokens": 16.0}),
]


@dataclass(frozen=True)
class Outcome:
    status: int | None
    reject_reason: str | None  # the sidecar's x-weighbridge-reject-reason
    ledger: dict[str, Any]


def sidecar_config(url: str) -> Config:
    return parse_config({
        "tenants": {"t": tenant("standard", KEY),
                    "small": tenant("standard", SMALL_KEY,
                                    limits={"tokens_per_minute": 10})},
        "backends": [{"name": "engine-0", "url": url, "models": [MODEL]}],
        "max_body_bytes": MAX_BODY_BYTES,
        "max_tokens_limit": MAX_TOKENS_LIMIT,
    })


async def live(case: Case) -> Outcome:
    emulator = Emulator(EmulatorSettings(engine=ENGINE.engine(), model_name=MODEL),
                        ENGINE.step_profile())
    async with TestServer(emulator.app) as backend:
        sidecar = Sidecar(sidecar_config(f"http://{backend.host}:{backend.port}"))
        async with TestClient(TestServer(sidecar.app)) as client:
            response = await client.post(case.path, data=case.body, headers=case.headers)
            await response.read()
            return Outcome(response.status, response.headers.get(headers.REJECT_REASON),
                           sidecar.core.ledger.snapshot())


def simulated(case: Case) -> Outcome:
    plan = RequestPlan(request_id="r-0", tenant="", tier="", phase="p", user=None,
                       endpoint=case.path, stream=False, prompt_tokens=case.prompt_tokens,
                       max_tokens=case.max_tokens, scheduled_s=0.0, content_seed=0)
    client = ClientRequest(plan=plan, tenant=None, api_key=None, timeout_s=60.0,
                           headers=case.headers, body=case.body)
    result = Simulation(sidecar_config("http://127.0.0.1:9"), [SimEngine("engine-0", ENGINE)],
                        TraceClients([client]), run_id="session", scenario="session",
                        until_s=60.0, drain=True).run()
    (record,) = result.records
    return Outcome(record.http_status, record.reason if record.status == "rejected" else None,
                   result.ledger)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
async def test_the_live_app_and_the_simulator_answer_alike(case: Case) -> None:
    assert await live(case) == simulated(case)


def test_the_rows_cover_refusals_failures_and_service() -> None:
    """What the comparison above covers: every reason of the bad-input rows, the keys and
    headers, the core's own refusals, a backend's error and requests served."""
    outcomes = [simulated(case) for case in CASES]
    reasons = {o.reject_reason for o in outcomes}
    expected = {r for rows in (BAD_BODIES, BAD_CHAT_BODIES, BAD_EMBEDDING_BODIES)
                for _, _, r in rows} | {r for _, _, _, r in BAD_POOLING_BODIES}
    assert expected | {"invalid_deadline", "body_too_large", "unauthorized", "unknown_tier",
                       "tier_not_allowed", "model_not_found", "rate_limited"} <= reasons
    assert [o.status for o in outcomes if o.ledger["total"]["failed"]] == [400]
    assert sum(o.ledger["total"]["completed"] for o in outcomes) == 7
