"""Token fairness in virtual time: three backlogged tenants with weights 1:1:2, one sending
short requests (100 + 20 tokens), one long (2000 + 500), one a 50/50 mix, served by a simple
continuous-batching backend model. ``drr`` (token cost, learned estimates, settlement, with
or without live charging) gives each its weighted share of served tokens within 5%;
``rr`` (request round robin) does not."""

from __future__ import annotations

import heapq
import itertools
import random

import pytest

from weighbridge.sidecar.estimator import OutputEstimator
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.sidecar.scheduler import EndpointSpec, Scheduler, TenantSpec
from weighbridge.statistics import jain_index

SHORT = (100, 20)
LONG = (2000, 500)
WEIGHTS = {"short": 1.0, "long": 1.0, "mixed": 2.0}
SLOTS = 16  # concurrent sequences on the backend
PREFILL_TOKENS_PER_S = 4000.0
DECODE_TOKENS_PER_S = 25.0  # per sequence
CHUNK = 10  # output tokens per streamed chunk
ENDPOINT = "/v1/completions"


def shape(tenant: str, rng: random.Random) -> tuple[int, int]:
    if tenant == "short":
        return SHORT
    if tenant == "long":
        return LONG
    return SHORT if rng.random() < 0.5 else LONG


def simulate(policy: str, charge_streamed: bool, duration_s: float = 2400.0,
             warmup_s: float = 300.0) -> dict[str, float]:
    rng = random.Random(7)
    scheduler = Scheduler(
        {"t": 1},
        {name: TenantSpec("t", weight) for name, weight in WEIGHTS.items()},
        {ENDPOINT: EndpointSpec("tokens", 2048)},
        policy=policy,  # type: ignore[arg-type]
        charge_streamed_tokens=charge_streamed,
    )
    estimator = OutputEstimator({ENDPOINT: 256}, alpha=0.2)
    ids = itertools.count()
    served = dict.fromkeys(WEIGHTS, 0.0)
    events: list[tuple[float, int, str, QueuedRequest, int]] = []
    order = itertools.count()
    truth: dict[str, tuple[int, int]] = {}

    def top_up(tenant: str, now: float) -> None:
        # Keep every tenant continuously backlogged.
        while scheduler.tenant_queued(tenant)[0] < 24:
            prompt, output = shape(tenant, rng)
            rid = f"r{next(ids)}"
            truth[rid] = (prompt, output)
            scheduler.enqueue(
                QueuedRequest(
                    id=rid,
                    tenant=tenant,
                    tier="t",
                    endpoint=ENDPOINT,
                    prompt_tokens=prompt,
                    max_tokens=output,
                    estimated_output_tokens=estimator.estimate(tenant, ENDPOINT, output),
                    arrival_s=now,
                ),
                now,
            )

    def count(tenant: str, tokens: int, now: float) -> None:
        if warmup_s <= now <= duration_s:
            served[tenant] += tokens

    def fill(now: float) -> None:
        while scheduler.inflight_requests < SLOTS:
            request = scheduler.next(now)
            if request is None:
                return
            top_up(request.tenant, now)
            prompt, _ = truth[request.id]
            t = now + prompt / PREFILL_TOKENS_PER_S
            heapq.heappush(events, (t, next(order), "prefill", request, prompt))

    now = 0.0
    for tenant in WEIGHTS:
        top_up(tenant, now)
    fill(now)
    while events:
        now, _, kind, request, n = heapq.heappop(events)
        if now > duration_s:
            break
        prompt, output = truth[request.id]
        if kind == "prefill":
            count(request.tenant, prompt, now)
            left = output
        else:
            count(request.tenant, n, now)
            scheduler.on_tokens_streamed(request, n)
            left = output - request.streamed_output_tokens
        if left > 0:
            step = min(CHUNK, left)
            heapq.heappush(events, (now + step / DECODE_TOKENS_PER_S, next(order), "chunk",
                                    request, step))
        else:
            scheduler.on_finished(request, prompt, output)
            estimator.observe(request.tenant, ENDPOINT, output)
            fill(now)
    return served


def shares(served: dict[str, float]) -> dict[str, float]:
    total = sum(served.values())
    return {name: tokens / total for name, tokens in served.items()}


def jain(served: dict[str, float]) -> float | None:
    """Jain's index of the weight-normalised service."""
    return jain_index([served[name] / WEIGHTS[name] for name in WEIGHTS])


@pytest.mark.parametrize("charge_streamed", [False, True])
def test_drr_serves_weighted_token_shares_within_five_percent(charge_streamed: bool) -> None:
    served = simulate("drr", charge_streamed)
    weight_total = sum(WEIGHTS.values())
    for name, share in shares(served).items():
        expected = WEIGHTS[name] / weight_total
        assert share == pytest.approx(expected, rel=0.05), (name, shares(served))
    assert jain(served) >= 0.99


def test_rr_shows_the_divergence() -> None:
    served = simulate("rr", charge_streamed=False)
    got = shares(served)
    # equal request counts: the long tenant takes most tokens, the short one almost none
    assert got["short"] < 0.05
    assert got["long"] > 0.5
    assert (jain(served) or 0.0) < 0.8
