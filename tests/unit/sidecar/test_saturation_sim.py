"""Work conservation and the backend queue bound in virtual time: the sidecar's own
``SchedulingCore`` in front of the engine's own ``StepModel``, driven by one virtual clock.

The live version (tests/integration/sidecar/test_scenarios.py, tests 4 and 5) runs the same
load through real processes; on a shared 2-core machine its throughput ratio and its sampled
engine queue measure the machine as much as the policy. Here nothing but the policy and the
step model decide: no sockets, no sleeps, the same result on every run.

Model of the shell: requests reach the engine the instant the core dispatches them (no
transport latency: what is measured is what the gate and the scheduler leave unused); every
sampled token streams to the client at the end of its step; the sidecar scrapes the engine
every ``metrics_poll_ms`` (the scrape answers with the engine's state at that instant, as
the emulator does mid-step) and runs ``dispatch_ready`` after every event, as the shell does.
"""

from __future__ import annotations

import heapq
import itertools
import random
import statistics
from dataclasses import dataclass

import pytest

from weighbridge.emulator.engine import EngineConfig, Sequence, StepModel, StepResult
from weighbridge.emulator.profiles import get_profile
from weighbridge.sidecar.config import parse_config
from weighbridge.sidecar.core import SchedulingCore
from weighbridge.sidecar.request import QueuedRequest
from weighbridge.vllm_metrics import BackendSample

# The shapes of tests/integration/sidecar/test_scenarios.py's saturation run.
ENGINE = EngineConfig(max_num_seqs=32, max_num_batched_tokens=2048, num_kv_blocks=3328,
                      block_size=16, max_model_len=2048)
PROFILE = "h100-llama3-8b"
CLIENTS = 96
PROMPTS, OUTPUTS = (128, 512, 1024, 1536), (16, 32, 64, 128)
MAX_BACKEND_WAITING = 2
MAX_BACKEND_PREFILL_TOKENS = 2048
POLL_S = 0.25  # the config's default metrics_poll_ms
WARMUP_S, END_S = 2.0, 20.0
COMPLETIONS = "/v1/completions"
LATENCY_S = 0.005


@dataclass
class SimRun:
    tokens_per_s: float  # prompt + output tokens the engine computed in the window
    scraped_waiting: list[float]  # the engine's waiting queue at each scrape in the window
    waiting_after_schedule: list[int]  # ... right after each step picked its batch
    max_awaiting_prefill: int  # most of ours in flight without a first token, at any time


def run(policy: str, latency_s: float = LATENCY_S) -> SimRun:
    config = parse_config({
        "tenants": {f"t{i}": {"tier": "standard", "api_keys": [f"plain:k{i}"],
                              "limits": {"max_queued": 5000}} for i in range(3)},
        "backends": [{"url": "http://127.0.0.1:1", "name": "e"}],
        "scheduler": {"policy": policy},
        "admission": {"max_running_per_backend": 32, "max_inflight_per_backend": 32,
                      "max_backend_waiting": MAX_BACKEND_WAITING,
                      "max_backend_prefill_tokens": MAX_BACKEND_PREFILL_TOKENS},
        "tiers": {"standard": {"rank": 1}},
    })
    core = SchedulingCore(config)
    engine = StepModel(ENGINE, get_profile(PROFILE))
    rng = random.Random(5)
    shapes = [(rng.choice(PROMPTS), rng.choice(OUTPUTS)) for _ in range(64)]
    ids = itertools.count()
    sent: dict[int, int] = {}  # client -> requests sent
    client_of: dict[str, int] = {}
    requests: dict[str, QueuedRequest] = {}

    def arrive(client: int, now: float) -> None:
        k = sent[client] = sent.get(client, 0) + 1
        prompt, output = shapes[(client * 7 + k) % len(shapes)]
        rid = f"r{next(ids)}"
        result = core.arrive(request_id=rid, tenant=f"t{client % 3}", tier="standard",
                             endpoint=COMPLETIONS, prompt_tokens=prompt, max_tokens=output,
                             now=now)
        assert isinstance(result, QueuedRequest), result
        requests[rid] = result
        client_of[rid] = client

    most_awaiting = 0
    # Events: (time, order, kind, payload). "step": the engine's step ends; "scrape": the
    # sidecar's poll; "reach": dispatched requests reach the engine; "stream": a step's
    # tokens reach the sidecar.
    events: list[tuple[float, int, str, object]] = []
    order = itertools.count()

    def push(at: float, kind: str, payload: object = None) -> None:
        heapq.heappush(events, (at, next(order), kind, payload))

    def dispatch(now: float) -> None:
        seqs = [Sequence(request_id=d.request.id, prompt_tokens=d.request.prompt_tokens,
                         target_output_tokens=d.request.max_tokens or 1,
                         max_tokens=d.request.max_tokens or 1, arrival_s=now + latency_s)
                for d in core.dispatch_ready(now)]
        if seqs:
            push(now + latency_s, "reach", seqs)

    batch = None
    computed = 0
    scraped: list[float] = []
    after_schedule: list[int] = []
    generated = 0.0

    def start_step(now: float) -> None:
        nonlocal batch
        if batch is None:
            batch = engine.schedule(now)
            if batch is not None:
                if now >= WARMUP_S:
                    after_schedule.append(engine.num_waiting)
                push(now + batch.duration_s, "step")

    now = 0.0
    for client in range(CLIENTS):
        arrive(client, now)
    dispatch(now)
    push(0.0, "scrape")
    while events:
        now, _, kind, payload = heapq.heappop(events)
        if now >= END_S:
            break
        if kind == "scrape":
            if now >= WARMUP_S:
                scraped.append(engine.num_waiting)
            core.on_backend_metrics("e", BackendSample(
                at_s=now, waiting=engine.num_waiting, running=engine.num_running,
                kv_cache_usage=engine.kv_cache_usage, generation_tokens_total=generated))
            push(now + POLL_S, "scrape")
        elif kind == "reach":
            assert isinstance(payload, list)
            for seq in payload:
                engine.add(seq)
        elif kind == "step":
            assert batch is not None
            if now - batch.duration_s >= WARMUP_S:
                computed += batch.num_tokens
            result = engine.complete(batch, now)
            batch = None
            generated += len(result.emitted)
            push(now + latency_s, "stream", result)
        else:  # "stream": the sidecar sees the step's tokens and ends
            assert isinstance(payload, StepResult)
            result = payload
            for seq in result.emitted:
                request = requests[seq.request_id]
                if request.streamed_output_tokens == 0:
                    core.on_first_token(request, now)
                core.on_tokens_streamed(request, 1, now)
            for seq in result.finished:
                request = requests.pop(seq.request_id)
                core.on_completed(request, seq.prompt_tokens, seq.output_tokens, now)
                arrive(client_of.pop(seq.request_id), now)  # closed loop, no think time
        dispatch(now)
        if kind == "stream" or kind == "scrape":  # the only events that dispatch
            most_awaiting = max(most_awaiting, sum(
                1 for r in requests.values()
                if r.backend is not None and r.streamed_output_tokens == 0))
        start_step(now)
    return SimRun(tokens_per_s=computed / (END_S - WARMUP_S), scraped_waiting=scraped,
                  waiting_after_schedule=after_schedule, max_awaiting_prefill=most_awaiting)


@pytest.fixture(scope="module", params=[0.0, 0.005, 0.02], ids=lambda s: f"{s * 1000:g}ms")
def runs(request: pytest.FixtureRequest) -> dict[str, SimRun]:
    """Both policies at one transport latency (each way): none, about loopback plus the
    sidecar's proxying (benchmarks/RESULTS.md: +2 ms p50), and a loaded machine's."""
    return {policy: run(policy, request.param) for policy in ("drr", "passthrough")}


def test_drr_is_work_conserving(runs: dict[str, SimRun]) -> None:
    """Issue 3, acceptance 4 in virtual time: under saturation the engine computes at least
    95% of the tokens through drr (gate, prefill backlog, caps) that it computes when every
    request is sent straight to it (measured: 99.7%, 99.4%, 97.7% at 0, 5, 20 ms)."""
    drr, passthrough = runs["drr"], runs["passthrough"]
    assert drr.tokens_per_s >= 0.95 * passthrough.tokens_per_s, (drr.tokens_per_s,
                                                                 passthrough.tokens_per_s)


def test_backend_queue_stays_bounded(runs: dict[str, SimRun]) -> None:
    """Issue 3, acceptance 5 in virtual time. What the gate promises: no request of ours is
    left waiting in the engine once a step has picked its batch (drr: none after any step;
    passthrough piles the backlog there, 96 clients for 32 slots).

    A scrape can still catch requests that reached the engine during the step under way
    (a burst of completions, each replaced at once): they are admitted at the step's end.
    So the scraped queue is asserted by its median, not by its maximum (measured: the
    maximum was 4 against the bound of 3 at 5 ms, as live runs also saw)."""
    drr, passthrough = runs["drr"], runs["passthrough"]
    bound = MAX_BACKEND_WAITING + 1
    assert max(drr.waiting_after_schedule) == 0
    assert statistics.median(drr.scraped_waiting) <= bound
    assert min(passthrough.waiting_after_schedule) > 10 * bound
    assert statistics.median(passthrough.scraped_waiting) > 10 * bound
    # Ours without a first token at any moment: a handful, against passthrough's 96.
    assert drr.max_awaiting_prefill <= ENGINE.max_num_batched_tokens // min(PROMPTS)
