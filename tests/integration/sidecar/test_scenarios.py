"""Acceptance scenarios of issue 3, points 2-6, with real emulator and sidecar processes on
loopback: token fairness (drr against rr), tiers (interactive TTFT while batch traffic
saturates the backend), work conservation (drr against passthrough), the backend queue bound,
and routing (least_tokens against round_robin).

Every comparison measures both sides in the same test, on identical emulators. Where the
two sides run at the same time (fairness, work conservation, routing) each has its own
emulators, so the shared machine's CPU noise hits both alike. Engines use the
``h100-llama3-8b`` step profile, sized (tens of sequences, KV for about that many average
sequences) so queueing happens within seconds. Figures are printed (``pytest -s``).

Service is measured from the client's side, over a window in which every tenant is
backlogged: a request's prompt counts when its first token arrives (prefill done), its
output as it streams (``Outcome.tokens_served``), with the counts from ``usage``.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests.support import driver
from tests.support.metrics import Scrape
from tests.support.scenarios import (
    FAIR_CLIENTS,
    FAIR_END_S,
    FAIR_ENGINE,
    FAIR_WARMUP_S,
    FAIR_WEIGHTS,
    LONG,
    MODEL,
    SHORT,
    TIER_CHAT,
    TIER_CHAT_RATE,
    TIER_CHAT_START_S,
    TIER_ENGINE,
    TIER_FLOOD,
    TIER_FLOOD_CLIENTS,
    TIER_JOB_CLIENTS,
    TIER_JOBS,
    TIER_SLO_S,
    Sampler,
    drained,
    drr_share_tolerance,
    engine_tokens,
    fair_config,
    fmt_shares,
    key,
    started,
    tenant,
    tier_config,
)
from weighbridge.launch import ServerProcess, emulator_process, sidecar_process
from weighbridge.statistics import jain_index, percentile

pytestmark = pytest.mark.timeout(60)

H100 = "h100-llama3-8b"
COMPLETIONS = "/v1/completions"


# vLLM's --stream-interval for every live engine here: the first token still comes alone, the
# rest in chunks of 8. A token streamed one event at a time crosses three processes, which
# on a loaded 2-core machine made the processes the bottleneck, not the schedule: with 6
# busy loops beside the tiers test, interactive TTFT p50 was 0.63 s at 1 and 0.07 s at 8.
STREAM_INTERVAL = 8


def emulator(name: str, **shape: object) -> ServerProcess:
    return emulator_process(name=name, profile=H100, stream_interval=STREAM_INTERVAL, **shape)


def sidecar(name: str, backends: Sequence[ServerProcess], tenants: dict[str, Any],
            backend: dict[str, Any] | None = None, **config: Any) -> ServerProcess:
    """A sidecar in front of ``backends`` (``backend``: extra fields for each entry)."""
    return sidecar_process({"tenants": tenants,
                            "backends": [{"url": b.url, **(backend or {})} for b in backends],
                            **config}, name=name)


def window(scrapes: Sequence[Scrape], t0: float, start_s: float, end_s: float) -> list[Scrape]:
    return [s for s in scrapes if start_s <= s.at_s - t0 < end_s]


def served(outcomes: Sequence[driver.Outcome], start_s: float, end_s: float) -> float:
    return sum(o.tokens_served(start_s, end_s) for o in outcomes)


def failures(outcomes: Sequence[driver.Outcome]) -> list[str]:
    """Requests that neither completed nor were cut off by the end of their phase."""
    return [f"{o.status} {o.reject_reason or o.error}" for o in outcomes
            if not o.ok and o.error != "stopped"]


# ============================================================================ 2. fairness
#
# The scenario (tests/support/scenarios.py): three backlogged tenants of different request
# sizes, weights 1:1:2. Its exact acceptance (+-5% of the weighted share) is asserted in
# virtual time (tests/unit/simulation/test_scenarios_in_virtual_time.py); here the live
# processes must keep within DRR's own guarantee over the window.

def fair_shape(tenant_name: str, client: int, k: int) -> tuple[int, int]:
    if tenant_name == "short":
        return SHORT
    if tenant_name == "long":
        return LONG
    return SHORT if (client + k) % 2 == 0 else LONG


@dataclass
class FairRun:
    policy: str
    shares: dict[str, float]  # served share / weighted share (1.0 = exact)
    jain: float  # on weight-normalised service
    tokens_per_s: float
    counter_shares: dict[str, float]  # the same from the sidecar's token counters
    dispatched_shares: dict[str, float]  # the same for the tokens dispatched in the window
    min_queued: dict[str, float]  # fewest queued at the sidecar in any sample of the window
    forfeited: dict[str, float]  # quanta each tenant forfeited to admission in the window
    failures: list[str]


async def fairness_phase(session: aiohttp.ClientSession, policy: str, url: str,
                         t0: float) -> FairRun:
    bodies = {shape: driver.completion_body(*shape, MODEL, continuous_usage=True)
              for shape in (SHORT, LONG)}
    sizes: dict[int, int] = {}  # id(Outcome) -> prompt + max_tokens

    def sender(name: str) -> Callable[[int, float, driver.Outcome], Any]:
        count: dict[int, int] = {}

        async def send(client: int, scheduled_s: float, out: driver.Outcome) -> None:
            k = count[client] = count.get(client, 0) + 1
            shape = fair_shape(name, client, k)
            sizes[id(out)] = sum(shape)
            await driver.streamed_request(session, url + COMPLETIONS, key(name), name,
                                          bodies[shape], scheduled_s, t0, record_chunks=True,
                                          out=out)
        return send

    async with Sampler(session, [url], 0.5) as sampler:
        results = await asyncio.gather(*(
            driver.closed_loop(FAIR_CLIENTS, t0, FAIR_END_S, sender(name), tenant=name)
            for name in FAIR_WEIGHTS))
    outcomes = dict(zip(FAIR_WEIGHTS, results, strict=True))
    total_weight = sum(FAIR_WEIGHTS.values())

    def relative(service: dict[str, float]) -> dict[str, float]:
        total = sum(service.values())
        return {n: service[n] / total / (FAIR_WEIGHTS[n] / total_weight) for n in service}

    service = {n: served(outcomes[n], FAIR_WARMUP_S, FAIR_END_S) for n in FAIR_WEIGHTS}
    dispatched = {n: sum(sizes[id(o)] for o in outcomes[n] if o.queue_ms is not None
                         and FAIR_WARMUP_S <= o.scheduled_s + o.queue_ms / 1000 < FAIR_END_S)
                  for n in FAIR_WEIGHTS}
    scrapes = window(sampler.samples[url], t0, FAIR_WARMUP_S, FAIR_END_S)
    first, last = scrapes[0], scrapes[-1]
    counters = {n: last.total("weighbridge_tokens_served_total", tenant=n)
                - first.total("weighbridge_tokens_served_total", tenant=n) for n in FAIR_WEIGHTS}
    return FairRun(
        policy=policy,
        shares=relative(service),
        jain=jain_index([service[n] / FAIR_WEIGHTS[n] for n in FAIR_WEIGHTS]),
        tokens_per_s=sum(service.values()) / (FAIR_END_S - FAIR_WARMUP_S),
        counter_shares=relative(counters),
        dispatched_shares=relative(dispatched),
        min_queued={n: min(s.total("weighbridge_requests_queued", tenant=n) for s in scrapes)
                    for n in FAIR_WEIGHTS},
        forfeited={n: last.total("weighbridge_drr_quanta_forfeited_total", tenant=n)
                   - first.total("weighbridge_drr_quanta_forfeited_total", tenant=n)
                   for n in FAIR_WEIGHTS},
        failures=[f for n in FAIR_WEIGHTS for f in failures(outcomes[n])],
    )


async def test_token_fairness_drr_vs_rr() -> None:
    """Acceptance 2, live: under drr every tenant's weight-normalised service stays within
    DRR's guarantee of the others' and Jain's index on it is >= 0.99; rr, measured at the
    same time on an identical engine, diverges.

    The margin is derived: DRR bounds the difference between two backlogged flows' weight-
    normalised booked service by ``2Q + C_i/w_i + C_j/w_j`` tokens over any interval
    (sidecar/drr.py), i.e. 7-10% of this window's service per unit of weight; the +-5% the
    issue asks for is what DRR gives on average, and is asserted exactly where it can be, in
    virtual time. A CI run on 2026-12-01 measured short 0.933 dispatched (0.941 served)
    against 0.99 on a quiet machine: inside the guarantee, outside +-5%.

    The guarantee is for flows DRR may serve. On a loaded machine the emulator decodes below
    the sidecar's floor (min_decode_tokens_per_s) for moments, and then only tenants under
    their share of *slots* may start: "short", whose requests hold more slots per token, is
    passed over and forfeits those rounds (ci11 failed at 0.925; reproduced with four busy
    loops beside the test, 0.913, with short forfeiting turns to ``decode_slow`` and mixed to
    prefill pacing). The margin adds each tenant's forfeit, read from the sidecar's
    weighbridge_drr_quanta_forfeited_total over the window; the counter includes a pass-over
    still going on when the window closes (a run on 2026-12-07 at load average ~7 gave short
    0.79 with 0 forfeited, when the count only grew once the tenant was next served).
    """
    engines = [emulator(f"fair-{p}", **FAIR_ENGINE) for p in ("drr", "rr")]
    sidecars = [sidecar(f"fair-{p}", [engine], **fair_config(p))
                for p, engine in zip(("drr", "rr"), engines, strict=True)]
    async with started(*engines, *sidecars), driver.session() as session:
        t0 = time.monotonic() + 0.2
        runs = await asyncio.gather(*(fairness_phase(session, p, s.url, t0)
                                      for p, s in zip(("drr", "rr"), sidecars, strict=True)))
        for s, e in zip(sidecars, engines, strict=True):
            await drained(session, s.url, [e.url])
    for run in runs:
        print(f"\n[fairness] {run.policy}: window {FAIR_WARMUP_S:.0f}-{FAIR_END_S:.0f} s, "
              f"{run.tokens_per_s:,.0f} tok/s; served / weighted share "
              f"{fmt_shares(run.shares)}; Jain {run.jain:.4f}; from the sidecar's "
              f"completion counters {fmt_shares(run.counter_shares)}; dispatched in the window "
              f"{fmt_shares(run.dispatched_shares)}; fewest queued "
              f"{run.min_queued}; quanta forfeited to admission {fmt_shares(run.forfeited)}")
    drr, rr = runs
    for run in runs:
        assert not run.failures, (run.policy, run.failures[:5])
        # The premise: every tenant stayed backlogged at the sidecar through the window.
        assert min(run.min_queued.values()) > 0, (run.policy, run.min_queued)
    per_weight = drr.tokens_per_s * (FAIR_END_S - FAIR_WARMUP_S) / sum(FAIR_WEIGHTS.values())
    for name in FAIR_WEIGHTS:
        tolerance = drr_share_tolerance(name, per_weight, drr.forfeited)
        for measure in (drr.dispatched_shares, drr.shares):
            assert measure[name] == pytest.approx(1.0, abs=tolerance), (name, tolerance, measure)
    assert drr.jain >= 0.99
    # rr hands out requests, not tokens: the long tenant takes far more than its share.
    assert rr.jain < 0.8, rr
    assert rr.shares["long"] > 1.5 and rr.shares["short"] < 0.5, rr.shares


# ============================================================================ 3. tiers
#
# The scenario (tests/support/scenarios.py): a batch flood saturates the engine while an
# interactive tenant sends a Poisson stream of short requests. Its exact acceptance (p99
# TTFT under 500 ms) is asserted in virtual time (tests/unit/simulation/
# test_scenarios_in_virtual_time.py); here the live processes, with a derived margin.

@dataclass
class TierRun:
    policy: str
    chat: list[driver.Outcome]
    batch_tokens_per_s: float
    running_mean: float
    min_batch_queued: float


async def tier_phase(session: aiohttp.ClientSession, policy: str, url: str, engine_url: str,
                     duration_s: float) -> TierRun:
    t0 = time.monotonic() + 0.1
    flood = driver.completion_body(*TIER_FLOOD, MODEL)
    jobs = driver.completion_body(*TIER_JOBS, MODEL)
    chat = driver.completion_body(*TIER_CHAT, MODEL)

    async def bulk(_client: int, scheduled_s: float, out: driver.Outcome) -> None:
        await driver.streamed_request(session, url + COMPLETIONS, key("bulk"), "bulk", flood,
                                      scheduled_s, t0, record_chunks=True, out=out)

    async def app(_client: int, scheduled_s: float, out: driver.Outcome) -> None:
        await driver.streamed_request(session, url + COMPLETIONS, key("app"), "app", jobs,
                                      scheduled_s, t0, {"x-weighbridge-tier": "batch"},
                                      record_chunks=True, out=out)

    times = driver.poisson_times(TIER_CHAT_RATE, duration_s - TIER_CHAT_START_S - 1, seed=3,
                                 start_s=TIER_CHAT_START_S)
    async with Sampler(session, [url, engine_url], 0.2) as sampler:
        floods, apps, chats = await asyncio.gather(
            driver.closed_loop(TIER_FLOOD_CLIENTS, t0, duration_s, bulk, tenant="bulk"),
            driver.closed_loop(TIER_JOB_CLIENTS, t0, duration_s, app, tenant="app"),
            asyncio.gather(*(driver.streamed_request(session, url + COMPLETIONS, key("chat"),
                                                     "chat", chat, t, t0) for t in times)))
    await drained(session, url, [engine_url])
    start, end = TIER_CHAT_START_S, duration_s - 1
    engine = window(sampler.samples[engine_url], t0, start, end)
    side = window(sampler.samples[url], t0, start, end)
    return TierRun(
        policy=policy, chat=list(chats),
        batch_tokens_per_s=(served(floods, start, end) + served(apps, start, end)) / (end - start),
        running_mean=sum(s.total("vllm:num_requests_running") for s in engine) / len(engine),
        min_batch_queued=min(s.total("weighbridge_requests_queued", tier="batch") for s in side),
    )


async def test_interactive_ttft_while_batch_saturates() -> None:
    """Acceptance 3, live: interactive requests are served within their 500 ms TTFT target
    while batch traffic saturates the backend (the engine runs full and batch requests wait
    upstream all along). The same load through ``fcfs`` (no tiers) is shown for contrast:
    interactive requests queue behind the flood, and early rejection turns them away.

    What the live run adds to the model is not a fixed margin: three processes share two
    cores, every step is slower, so each interactive request stays longer, more of them are
    in flight than the 4 headroom slots, and the rest wait for the flood's slots to turn
    over, which the slower steps also slow. The tail amplifies the machine's slowdown: p99
    0.26-0.40 s on a quiet machine, 0.44 s with a CPU-bound process holding one core, 0.59 s
    and 1.16 s (p90 0.74 s, 80% within 500 ms) in two CI runs on 2026-12-01. So the live test
    asserts what holds through that: the median interactive request meets the target and
    most of them do, where through fcfs none does; the p99 within the target is asserted in
    virtual time, where it is the scheduler's doing alone
    (tests/unit/simulation/test_scenarios_in_virtual_time.py, p99 0.18 s).
    """
    engine = emulator("tiers", **TIER_ENGINE)
    fair, fifo = (sidecar(f"tiers-{p}", [engine], backend={"priority_scheduling": True},
                          **tier_config(p))
                  for p in ("drr", "fcfs"))
    async with started(engine, fair, fifo), driver.session() as session:
        drr = await tier_phase(session, "drr", fair.url, engine.url, 12.0)
        baseline = await tier_phase(session, "fcfs", fifo.url, engine.url, 6.0)
    for run in (drr, baseline):
        ttft = [o.ttft_s for o in run.chat if o.ok and o.ttft_s is not None]
        rejected = sorted({o.reject_reason or "" for o in run.chat if not o.ok})
        in_slo = sum(1 for t in ttft if t < TIER_SLO_S) / len(run.chat)
        p50, p99 = percentile(sorted(ttft), 0.5), percentile(sorted(ttft), 0.99)
        print(f"\n[tiers] {run.policy}: interactive {len(run.chat)} sent, {len(ttft)} served "
              f"(turned away: {len(run.chat) - len(ttft)} {rejected}); TTFT p50 {p50:.3f} s, "
              f"p99 {p99:.3f} s, max {max(ttft, default=float('nan')):.3f} s; within 500 ms "
              f"{in_slo:.1%}; batch {run.batch_tokens_per_s:,.0f} tok/s; engine running "
              f"{run.running_mean:.1f} of 32 on average; fewest batch requests queued "
              f"upstream {run.min_batch_queued:.0f}")
    # Saturation: the engine ran (nearly) full and batch work waited upstream throughout.
    assert drr.running_mean >= 0.8 * 32
    assert drr.min_batch_queued > 0
    ttft = sorted(o.ttft_s for o in drr.chat if o.ok and o.ttft_s is not None)
    assert len(ttft) == len(drr.chat), failures(drr.chat)[:5]
    assert percentile(ttft, 0.5) < TIER_SLO_S, ttft[-15:]
    assert sum(1 for t in ttft if t < TIER_SLO_S) > 0.5 * len(drr.chat), ttft[-15:]
    # Without tiers the interactive requests do not get that service.
    baseline_in_slo = [o for o in baseline.chat if o.ok and (o.ttft_s or 1.0) < TIER_SLO_S]
    assert len(baseline_in_slo) < 0.5 * len(baseline.chat)


# =================================================== 4. work conservation, 5. backend queue
#
# The same saturating load through drr and through passthrough at the same time, each with
# its own engine: 96 closed-loop clients over three tenants, prompts of 128-1536 and outputs
# of 16-128 tokens from a fixed list. Engine: 32 sequences, B = 2048, 3,328 KV blocks
# (53,248 tokens: every running sequence fits at its longest, so the engine's waiting queue
# holds only what was sent to it, never preempted sequences). drr dispatches at most 32 in
# flight and holds while the engine's waiting queue is above 2; passthrough sends everything.
#
# Outputs are kept short because every output token crosses three processes on a shared
# 2-core machine: with outputs of 16-256 the emulators ran up to 12% behind their step model
# (CPU), unequally, and the ratio drifted between 0.94 and 1.04 from run to run. Here both
# engines keep to their model (weighbridge_emulator_step_model_seconds ~ wall time), so the
# ratio measures the sidecar, not the machine.

SAT_ENGINE = {"max_num_seqs": 32, "max_num_batched_tokens": 2048, "num_kv_blocks": 3328,
              "block_size": 16, "max_model_len": 2048}
SAT_CLIENTS = 96
SAT_PROMPTS, SAT_OUTPUTS = (128, 512, 1024, 1536), (16, 32, 64, 128)
SAT_WARMUP_S, SAT_END_S = 2.0, 11.0
MAX_BACKEND_WAITING = 2
SAT_PROMPT_BACKLOG = 2048  # admission.max_backend_prefill_tokens
STARTUP_S = 1.5  # the flood's start (see test_backend_queue_stays_bounded)


@dataclass
class SatRun:
    policy: str
    tokens_per_s: float  # served to clients in the window
    engine_tokens_per_s: float  # processed by the engine (prefill recomputation included)
    model_s_per_s: float  # the step model's seconds per wall second (1: never idle, no lag)
    waiting: list[tuple[float, float, float]]  # (t, engine waiting, drr sidecar queued)


@pytest.fixture(scope="module")
def saturation() -> dict[str, SatRun]:
    """One run of the saturating load through drr and passthrough (for tests 4 and 5)."""
    return asyncio.run(saturation_run())


async def saturation_run() -> dict[str, SatRun]:
    rng = random.Random(5)
    bodies = [driver.completion_body(rng.choice(SAT_PROMPTS), rng.choice(SAT_OUTPUTS), MODEL,
                                     continuous_usage=True) for _ in range(64)]
    engines = [emulator(f"sat-{p}", **SAT_ENGINE) for p in ("drr", "passthrough")]
    tenants = {f"t{i}": tenant(f"t{i}", "standard") for i in range(3)}
    sidecars = [sidecar(f"sat-{p}", [e], tenants, scheduler={"policy": p},
                        admission={"max_running_per_backend": 32,
                                   "max_inflight_per_backend": 32,
                                   "max_backend_waiting": MAX_BACKEND_WAITING,
                                   # One step budget of prompts waiting to be prefilled
                                   # (half a budget cost ~9% of throughput here).
                                   "max_backend_prefill_tokens": SAT_PROMPT_BACKLOG},
                        # No deadline: a closed loop of 96 clients keeps waits near the
                        # standard tier's 10 s on a slow machine, and early rejection would
                        # change the offered load of one side only.
                        tiers={"standard": {"rank": 1}})
                for p, e in zip(("drr", "passthrough"), engines, strict=True)]
    async with started(*engines, *sidecars), driver.session() as session:
        t0 = time.monotonic() + 0.2

        def sender(url: str) -> Callable[[int, float, driver.Outcome], Any]:
            count: dict[int, int] = {}

            async def send(client: int, scheduled_s: float, out: driver.Outcome) -> None:
                k = count[client] = count.get(client, 0) + 1
                await driver.streamed_request(
                    session, url + COMPLETIONS, key(f"t{client % 3}"), f"t{client % 3}",
                    bodies[(client * 7 + k) % len(bodies)], scheduled_s, t0,
                    record_chunks=True, out=out)
            return send

        # Engines are sampled often (acceptance 5), both alike: a scrape costs the emulator
        # CPU time; the drr sidecar's queue less often.
        fast = Sampler(session, [e.url for e in engines], 0.05)
        slow = Sampler(session, [sidecars[0].url], 0.25)
        async with fast, slow:
            results = await asyncio.gather(*(driver.closed_loop(SAT_CLIENTS, t0, SAT_END_S,
                                                                sender(s.url))
                                             for s in sidecars))
        for s, e in zip(sidecars, engines, strict=True):
            await drained(session, s.url, [e.url])
    samples = {**fast.samples, **slow.samples}
    runs = {}
    for (policy, engine, outcomes) in zip(("drr", "passthrough"), engines, results,
                                          strict=True):
        assert not failures(outcomes), (policy, failures(outcomes)[:5])
        scrapes = window(samples[engine.url], t0, SAT_WARMUP_S, SAT_END_S)
        queued = [(s.at_s, s.total("weighbridge_requests_queued"))
                  for s in samples[sidecars[0].url]]
        waiting = []
        for s in samples[engine.url]:
            # drr: the sidecar's queue at the latest sample before this one.
            before = [q for at, q in queued if at <= s.at_s]
            waiting.append((s.at_s - t0, s.total("vllm:num_requests_waiting"),
                            before[-1] if before else 0.0))
        first, last = scrapes[0], scrapes[-1]
        model_s = "weighbridge_emulator_step_model_seconds_total"
        runs[policy] = SatRun(
            policy=policy,
            tokens_per_s=served(outcomes, SAT_WARMUP_S, SAT_END_S) / (SAT_END_S - SAT_WARMUP_S),
            engine_tokens_per_s=(engine_tokens(last) - engine_tokens(first))
            / (last.at_s - first.at_s),
            model_s_per_s=(last.total(model_s) - first.total(model_s)) / (last.at_s - first.at_s),
            waiting=waiting)
    return runs


def test_work_conservation_drr_vs_passthrough(saturation: dict[str, SatRun]) -> None:
    """Acceptance 4, live: under saturation, token throughput through drr is close to
    passthrough's.

    The policy's own bound (at least 95%) is asserted in virtual time, where only the gate
    and the step model decide: tests/unit/sidecar/test_saturation_sim.py. Here two emulators
    and two sidecars share 2 cores with everything else, so each side's throughput is first
    divided by the CPU its engine got (the step model's seconds per wall second: the engine
    is never idle for lack of work on either side, so it is the engine's CPU share). What is
    left is how full the sidecar kept the engine's batches, less the shell's refill time:
    each completion leaves a slot empty for one round trip r (stream end, dispatch, next
    step), a loss of about completions/s x r / slots = 14/s x 0.2 s / 32 = 9% on a loaded
    machine (r up to 200 ms). Hence 0.95 - 0.10 = 0.85 (measured: 0.95 with the machine at
    load 7, 0.97-1.0 quiet).
    """
    drr, passthrough = saturation["drr"], saturation["passthrough"]
    raw = drr.tokens_per_s / passthrough.tokens_per_s
    ratio = ((drr.tokens_per_s / drr.model_s_per_s)
             / (passthrough.tokens_per_s / passthrough.model_s_per_s))
    print(f"\n[work conservation] window {SAT_WARMUP_S:.0f}-{SAT_END_S:.0f} s: drr "
          f"{drr.tokens_per_s:,.0f} tok/s served (engine {drr.engine_tokens_per_s:,.0f}, "
          f"model s/s {drr.model_s_per_s:.2f}), passthrough {passthrough.tokens_per_s:,.0f} "
          f"(engine {passthrough.engine_tokens_per_s:,.0f}, model s/s "
          f"{passthrough.model_s_per_s:.2f}); drr / passthrough = {raw:.3f}, per model "
          f"second {ratio:.3f}")
    assert ratio >= 0.85


def test_backend_queue_stays_bounded(saturation: dict[str, SatRun]) -> None:
    """Acceptance 5, live: while requests wait upstream, the engine's queue stays small
    through drr (passthrough, for contrast, piles everything into it).

    ``admission.max_backend_prefill_tokens`` (one step budget here) holds the backend while
    that many prompt tokens are still being prefilled: the gate alone counts *slots* and on
    an idle engine would send one request per free slot at once (measured: ~28 waiting for
    the first second of the flood without it).

    The exact promise (no request of ours left waiting once a step has picked its batch) is
    asserted in virtual time (tests/unit/sidecar/test_saturation_sim.py). A scrape here is
    taken mid-step and can catch a burst of replacements for a burst of completions before
    the next step admits them, more often the slower the machine; so samples are asserted
    by their median, and their maximum by what the prefill backlog makes impossible to
    exceed: the engine's waiting requests are ours without a first token, the backlog
    closes at 2,048 prompt tokens of those and every prompt has at least 128, so at most
    2048 // 128 = 16 (15 under the backlog plus the one that crossed it).
    """
    drr, passthrough = saturation["drr"], saturation["passthrough"]
    bound = MAX_BACKEND_WAITING + 1
    held = [(t, w) for t, w, q in drr.waiting if q > 0]
    steady = [w for t, w in held if t >= STARTUP_S]
    over = [(round(t, 2), w) for t, w in held if w > bound]
    median = percentile(sorted(steady), 0.5) if steady else float("nan")
    print(f"\n[backend queue] drr: {len(held)} samples of the engine while requests waited "
          f"upstream, waiting max {max((w for _, w in held), default=0):.0f}, {len(over)} "
          f"above {bound}: {over[:10]}; after the first {STARTUP_S:.1f} s: {len(steady)} "
          f"samples, median {median:.0f}. passthrough: waiting max "
          f"{max(w for _, w, _ in passthrough.waiting):.0f}")
    # 9.5 s sampled every 50 ms gives ~190 on a quiet machine, 29 were seen at load 7: ten
    # are enough for a median.
    assert len(steady) >= 10
    assert median <= bound
    assert max(w for _, w in held) <= SAT_PROMPT_BACKLOG // min(SAT_PROMPTS)
    # 96 clients for 32 slots: ~64 wait in passthrough's engine.
    assert max(w for _, w, _ in passthrough.waiting) > 10 * bound


# ============================================================================ 6. routing
#
# Two engines of 8 sequences each (B = 2048, 2,048 KV blocks) behind one sidecar with the
# default admission (in-flight cap 64, hold while the engine queue is above 2), so the
# router's choice decides which engine a request waits in. Load: a Poisson stream of 16/s,
# 85% short (128 + 32 tokens), 15% long (1536 + 384), the same arrivals through a
# least_tokens and a round_robin sidecar at the same time, each with its own pair of engines.
#
# The margin depends on the arrival pattern: round_robin hurts when it sends requests to an
# engine whose slots are all taken while the other has room, which needs a burst of long
# requests. With this seed least_tokens won every run (p99 0.13-0.28 s against 0.45-1.3 s).
# Over 16 runs with 6 seeds it won 14, tied once (no contention) and lost once (0.23 against
# 0.13 s): least_tokens ranks engines by outstanding tokens only and can pick an engine with
# no free slot.

ROUTE_ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 2048, "num_kv_blocks": 2048,
                "block_size": 16, "max_model_len": 2048}
ROUTE_RATE, ROUTE_DURATION_S, ROUTE_LONG_FRACTION, ROUTE_SEED = 16.0, 10.0, 0.15, 2


async def test_routing_least_tokens_vs_round_robin() -> None:
    """Acceptance 6: with two backends and a bimodal load, least_tokens gives a lower p99
    TTFT than round_robin."""
    routings = ("least_tokens", "round_robin")
    engines = {r: [emulator(f"route-{r}-{i}", **ROUTE_ENGINE) for i in range(2)]
               for r in routings}
    tenants = {"t": tenant("t", "standard")}
    sidecars = {r: sidecar(f"route-{r}", engines[r], tenants, routing=r) for r in routings}
    rng = random.Random(ROUTE_SEED)
    times = driver.poisson_times(ROUTE_RATE, ROUTE_DURATION_S, seed=ROUTE_SEED)
    kinds = ["long" if rng.random() < ROUTE_LONG_FRACTION else "short" for _ in times]
    bodies = {"short": driver.completion_body(128, 32, MODEL),
              "long": driver.completion_body(1536, 384, MODEL)}
    async with started(*engines[routings[0]], *engines[routings[1]],
                       *sidecars.values()), driver.session() as session:
        t0 = time.monotonic() + 0.2
        results = await asyncio.gather(*(
            asyncio.gather(*(driver.streamed_request(session, sidecars[r].url + COMPLETIONS,
                                                     key("t"), kind, bodies[kind], t, t0)
                             for t, kind in zip(times, kinds, strict=True)))
            for r in routings))
    p99 = {}
    for r, outcomes in zip(routings, results, strict=True):
        assert not failures(outcomes), (r, failures(outcomes)[:5])
        ttft = [o.ttft_s for o in outcomes if o.ttft_s is not None]
        short = [o.ttft_s for o in outcomes if o.ttft_s is not None and o.tenant == "short"]
        per_backend = {b: sum(1 for o in outcomes if o.backend == b)
                       for b in sorted({o.backend or "" for o in outcomes})}
        p99[r] = percentile(sorted(ttft), 0.99)
        print(f"\n[routing] {r}: {len(ttft)} requests ({kinds.count('long')} long); TTFT p50 "
              f"{percentile(sorted(ttft), 0.5):.3f} s, p90 {percentile(sorted(ttft), 0.9):.3f} s,"
              f" p99 {p99[r]:.3f} s; short-only p99 {percentile(sorted(short), 0.99):.3f} s; "
              f"per backend {list(per_backend.values())}")
    assert p99["least_tokens"] < p99["round_robin"]
