"""KV pressure when one tenant's outputs run far past their estimates (issue 41, point 4).

Seed 000 asks to admit at the mean output, reserve for longer outputs, and preempt the
longest-running sequence when the KV cache is under pressure. The sidecar admits each
request at prompt + its tenant's expected output (an EMA of what its answers were,
``sidecar.estimator``), capped by ``max_tokens``; a bimodal tenant that sends its long
requests without ``max_tokens`` is admitted at the mean of both modes, so its long answers
run far past what KV-aware admission counted for them, and the engine runs out of blocks.

The engine is issue 14's KV-tight one (``benchmarks/isolation.py``: 32 sequences, a step
budget of 1,024 tokens, blocks of 32, ``max_model_len`` 1,024, 572 blocks): the emulator's
cpu-tiny step model in virtual time, the emulator live, or real vLLM CPU with the tiny model.
Tenants, in one tier with one weight each, through a sidecar whose config names only them:
``runner``, 48 closed-loop users (backlogged at the sidecar) sending chat requests, 80% short
(96-160 prompt tokens, 8-24 output tokens, ``max_tokens`` set to it) and 20% long (64
prompt tokens, no ``max_tokens``: the answer runs to the context, 960 tokens, as vLLM runs
an unbounded answer with ``ignore_eos``); ``victim``, Poisson 4/s of 64 + 16 tokens.

Arms: ``unimodal`` is the runner with every answer at the mix's mean (``max_tokens`` set):
the same token volume with estimates that are right, the reference; ``bimodal`` is the
runner above through the defaults, which count each in-flight answer at its expected final
length given what it has generated (the reserve from the spread, decision 0018); the others
are ``bimodal`` with one change each (docs/decisions/0018-kv-pressure-lever.md): the
footprint before that decision, prompt + max(generated, mean) (``MeanOnly``); a larger
static KV reserve (configuration); priorities that aim vLLM's preemption at the over-share
tenant's longest-running request (``EvictLongest``) and an abort and requeue of requests not
yet started (``AbortRequeueSimulation``), these three measured by substitution in virtual
time (not in the product, so not live); and ``geometric``, answers ended by the engine's end
of sequence at the mix's mean, where the mean footprint never preempts, to show what the
reserve from the spread costs there.

Per arm, over the requests sent in the window: the victim's TTFT and end-to-end latency
(p50/p90/p99), the engine's preemptions (``vllm:num_preemptions_total``; in virtual time
also how many evicted the victim's sequences), the engine's output tokens/s over the
window, and the runner's requests completed in it (of which long).

``python -m benchmarks.kv_pressure [--engine sim emulator real] [--arms ...] [--record]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import aiohttp
import orjson

from benchmarks import _results, isolation
from benchmarks._core import BenchContext, Benchmark, BenchResult, Table
from benchmarks.isolation_sim import WindowEngine
from weighbridge.app.simulation.clients import ClientRequest, Clients, WorkloadClients
from weighbridge.app.simulation.loop import Simulation
from weighbridge.emulator.engine import StepResult
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.emulator.real_vllm import RealVllmServer
from weighbridge.launch import emulator_process, sidecar_process
from weighbridge.loadgen.arrivals import Closed, Poisson
from weighbridge.loadgen.bodies import prompt_text
from weighbridge.loadgen.lengths import Lengths
from weighbridge.loadgen.scenario import PhaseSpan, Workload
from weighbridge.loadgen.tenants import TenantSpec
from weighbridge.records import RequestRecord
from weighbridge.sidecar.config import Config, parse_config
from weighbridge.sidecar.core import Dispatch, SchedulingCore
from weighbridge.sidecar.estimator import OutputEstimator
from weighbridge.sidecar.prompt import BYTES_PER_TOKEN, CHAT_TOKENS_PER_MESSAGE
from weighbridge.statistics import percentile

ENGINE: dict[str, Any] = {"max_num_seqs": 32, "max_num_batched_tokens": 1024,
                          "block_size": 32, "max_model_len": 1024, "num_kv_blocks": 572}
PROFILE = "cpu-tiny"
RUNNER_USERS = 48
SHORT_SHARE = 0.8
SHORT_PROMPT = (96, 160)
SHORT_OUTPUT = (8, 24)
LONG_PROMPT = 64
LONG_OUTPUT = ENGINE["max_model_len"] - LONG_PROMPT  # to the context: vLLM's room
VICTIM_PROMPT, VICTIM_OUTPUT, VICTIM_RATE = 64, 16, 4.0
VICTIM_KEY, RUNNER_KEY = "sk-victim", "sk-runner"
WARMUP_S, WINDOW_S, TAIL_S = 20.0, 60.0, 20.0


def mean_output() -> int:
    """The bimodal runner's mean answer: what its EMA estimate settles near."""
    short = sum(SHORT_OUTPUT) / 2
    return round(SHORT_SHARE * short + (1 - SHORT_SHARE) * LONG_OUTPUT)


Outputs = Literal["bimodal", "unimodal", "geometric"]


def runner_lengths(outputs: Outputs) -> Lengths:
    """The runner's sizes: the bimodal mix; every answer at its mean (``unimodal``); or
    prompts as the unimodal and answers left to the engine's end of sequence, a geometric
    draw of the mix's mean capped by the context (``geometric``: the plan's output is that
    cap)."""
    if outputs != "bimodal":
        return Lengths.model_validate({
            "prompt": {"kind": "uniform", "low": LONG_PROMPT, "high": SHORT_PROMPT[1]},
            "output": mean_output() if outputs == "unimodal" else LONG_OUTPUT})
    return Lengths.model_validate({"classes": [
        {"name": "short", "weight": SHORT_SHARE,
         "prompt": {"kind": "uniform", "low": SHORT_PROMPT[0], "high": SHORT_PROMPT[1]},
         "output": {"kind": "uniform", "low": SHORT_OUTPUT[0], "high": SHORT_OUTPUT[1]}},
        {"name": "long", "weight": 1 - SHORT_SHARE, "prompt": LONG_PROMPT,
         "output": LONG_OUTPUT}]})


def chat_body(prompt_tokens: int, content_seed: int, model: str | None = None) -> bytes:
    """A streamed chat request of ``prompt_tokens`` as the sidecar counts text
    (``sidecar.prompt``: four bytes a token, a few for the message's framing) and no
    ``max_tokens``: its answer is bounded by the context alone."""
    size = BYTES_PER_TOKEN * max(1, prompt_tokens - 1 - CHAT_TOKENS_PER_MESSAGE)
    text = prompt_text(size, content_seed)[:size]
    return orjson.dumps({"messages": [{"role": "user", "content": text}], "stream": True,
                         "stream_options": {"include_usage": True},
                         **({"model": model} if model else {})})


def long_request(client: ClientRequest) -> bool:
    return client.plan.max_tokens >= LONG_OUTPUT


class Unhinted(Clients):
    """The workload's clients, the requests ``which`` picks sent without ``max_tokens``
    (chat, each plan's prompt and model; the engine still runs each to the plan's output,
    as vLLM runs an unbounded answer to its end). Default: the runner's long requests."""

    def __init__(self, inner: WorkloadClients,
                 which: Callable[[ClientRequest], bool] = long_request) -> None:
        self.inner = inner
        self.which = which

    def _unhinted(self, client: ClientRequest) -> ClientRequest:
        if self.which(client):
            plan = client.plan
            client.body = chat_body(plan.prompt_tokens, plan.content_seed, plan.model)
        return client

    def initial(self) -> Iterator[ClientRequest]:
        return (self._unhinted(c) for c in self.inner.initial())

    def after(self, request: ClientRequest, end_s: float,
              answer: Any = None) -> list[ClientRequest]:
        return [self._unhinted(c) for c in self.inner.after(request, end_s, answer)]


class PreemptionEngine(WindowEngine):
    """A WindowEngine that names the request of every sequence it preempts in the window."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.preempted: list[str] = []

    def advance(self, end_s: float) -> tuple[StepResult, float | None]:
        batch = self.batch
        if batch is not None and batch.preempted and \
                self.window[0] <= end_s < self.window[1]:
            self.preempted.extend(s.request_id for s in batch.preempted)
        return super().advance(end_s)


class MeanOnly(OutputEstimator):
    """The footprint before decision 0018, measured by substitution: no expected final
    length, so KV-aware admission and routing count an in-flight answer at prompt +
    max(generated, its tenant's mean output) as they did."""

    def final(self, tenant: str, endpoint: str, generated: int, max_tokens: int | None,
              model: str | None = None) -> int | None:
        del tenant, endpoint, generated, max_tokens, model
        return None


def mean_only(config: Config) -> MeanOnly:
    """A ``MeanOnly`` estimator seeded as the core's own is."""
    return MeanOnly({path: e.initial_output_estimate for path, e in config.endpoints.items()},
                    config.scheduler.output_estimate_alpha)


class EvictLongest:
    """Candidate lever 2, measured by substitution: over-share dispatches to a priority
    engine get priorities that fall with each dispatch (``BASE`` above the demoted value,
    less the dispatch's number), so vLLM's preemption victim, the running request of the
    largest (priority, arrival), is the over-share tenant's *earliest* running request,
    not its latest."""

    BASE = 1_000_000

    def __init__(self, core: SchedulingCore) -> None:
        self._ready = core.dispatch_ready
        self._n = 0

    def __call__(self, now: float) -> Iterator[Dispatch]:
        for d in self._ready(now):
            if d.over_share and d.vllm_priority is not None:
                self._n += 1
                d = replace(d, vllm_priority=d.vllm_priority + self.BASE - self._n)
            yield d


class AbortRequeueSimulation(Simulation):
    """Candidate lever 3, measured by substitution: at each scrape, while an engine's KV
    cache is above ``KV_PRESSURE`` of its blocks, every over-share request that waits in the
    engine and has never been scheduled there is aborted and requeued at the sidecar
    (``RequestSession.unreachable``: back to its place, its charges refunded), so that the
    sidecar's order, not the engine's, decides what starts next."""

    KV_PRESSURE = 0.9

    def _poll(self, now: float, replica: int) -> None:
        scheduler = self.core.scheduler
        for engine in self.engines:
            model = engine.model
            if model.kv_cache_usage < self.KV_PRESSURE or not model.num_waiting:
                continue
            slots = model.config.max_num_seqs
            for flight in [f for f in self._dispatched.values() if f.engine is engine]:
                seqs = [model.get(s.request_id) for s in flight.seqs]
                if not all(s is not None and s.first_scheduled_s is None for s in seqs) \
                        or not scheduler.over_share(flight.request.tenant, slots):
                    continue
                for seq in flight.seqs:
                    model.abort(seq.request_id, now)
                del self._dispatched[flight.client.plan.request_id]
                flight.engine, flight.seqs, flight.parsed = None, [], None
                flight.session.unreachable(now)
        super()._poll(now, replica)


@dataclass(frozen=True)
class ArmSpec:
    """One arm: what differs from the defaults."""

    name: str
    outputs: Outputs = "bimodal"
    priority: bool = False  # the engine schedules by priority, the backend says so
    admission: Mapping[str, object] = field(default_factory=dict)
    lever: str | None = None  # measured by substitution: mean (before 0018), evict, abort
    why: str = ""


ARMS: dict[str, ArmSpec] = {a.name: a for a in (
    ArmSpec("unimodal", outputs="unimodal",
            why="every runner answer at the mix's mean, max_tokens set: estimates right"),
    ArmSpec("bimodal", why="the defaults: each answer counted at its expected final length"),
    ArmSpec("bimodal, priority engine", priority=True,
            why="vLLM --scheduling-policy priority, the backend's priority_scheduling on"),
    ArmSpec("bimodal, reserve x2", admission={"kv_reserve_blocks": 144}),
    ArmSpec("bimodal, reserve x4", admission={"kv_reserve_blocks": 286}),
    ArmSpec("bimodal, priority, reserve x4", priority=True, admission={"kv_reserve_blocks": 286}),
    ArmSpec("bimodal, mean footprint", lever="mean",
            why="before decision 0018: each answer counted at max(generated, mean)"),
    ArmSpec("bimodal, priority, mean footprint", priority=True, lever="mean"),
    ArmSpec("bimodal, priority, evict longest", priority=True, lever="evict"),
    ArmSpec("bimodal, abort and requeue", lever="abort"),
    ArmSpec("bimodal, priority, abort and requeue", priority=True, lever="abort"),
    ArmSpec("geometric", outputs="geometric",
            why="answers end at the engine's EOS, a geometric draw of the mix's mean; no "
                "max_tokens"),
    ArmSpec("geometric, mean footprint", outputs="geometric", lever="mean"),
)}


def config(arm: ArmSpec, url: str = "http://127.0.0.1:9") -> dict[str, object]:
    return {
        "tiers": {"shared": {"rank": 1}},
        "tenants": {"victim": {"tier": "shared", "api_keys": [f"plain:{VICTIM_KEY}"]},
                    "runner": {"tier": "shared", "api_keys": [f"plain:{RUNNER_KEY}"]}},
        "backends": [{"name": "engine-0", "url": url,
                      "priority_scheduling": arm.priority}],
        **({"admission": dict(arm.admission)} if arm.admission else {}),
    }


def workload(arm: ArmSpec, until_s: float) -> Workload:
    tenants = (
        TenantSpec(name="runner", api_key=RUNNER_KEY, tier="shared", endpoint="chat",
                   lengths=runner_lengths(arm.outputs), arrival=Closed(users=RUNNER_USERS),
                   ignore_eos=arm.outputs != "geometric"),
        TenantSpec(name="victim", api_key=VICTIM_KEY, tier="shared",
                   lengths=Lengths.model_validate({"prompt": VICTIM_PROMPT,
                                                   "output": VICTIM_OUTPUT}),
                   arrival=Poisson(rate=VICTIM_RATE)),
    )
    return Workload(scenario="kv-pressure", phases=(PhaseSpan("load", 0, until_s),),
                    tenants=tenants, victim="victim")


@dataclass(frozen=True)
class ArmFigures:
    arm: str
    victim_ttft_s: tuple[float, float, float]  # p50, p90, p99
    victim_e2e_s: tuple[float, float, float]
    victim_requests: int
    victim_unanswered: int
    preemptions: int
    preempted_victim: int
    output_tokens_per_s: float
    runner_done: int  # runner requests completed in the window
    runner_long_done: int
    wall_s: float = 0.0
    holds: dict[str, int] = field(default_factory=dict)
    victim_queue_s: float | None = None  # its mean wait in the sidecar's queue (live)


def _percentiles(values: Sequence[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    if not ordered:
        return (math.nan, math.nan, math.nan)
    return (percentile(ordered, 0.5), percentile(ordered, 0.9), percentile(ordered, 0.99))


def figures(arm: str, records: Sequence[RequestRecord], preempted: Sequence[str],
            output_tokens: int, warmup_s: float, window_s: float, wall_s: float = 0.0,
            holds: Mapping[str, int] | None = None) -> ArmFigures:
    end = warmup_s + window_s
    mine = [r for r in records if warmup_s <= r.scheduled_s < end]
    victim = [r for r in mine if r.tenant == "victim"]
    ttft = [math.inf if r.ttft_s is None else r.ttft_s for r in victim]
    e2e = [r.end_s - r.scheduled_s if r.status == "ok" else math.inf for r in victim]
    runner_ok = [r for r in records if r.tenant == "runner" and r.status == "ok"
                 and warmup_s <= r.end_s < end]
    victims = {r.request_id for r in records if r.tenant == "victim"}
    return ArmFigures(
        arm=arm, victim_ttft_s=_percentiles(ttft), victim_e2e_s=_percentiles(e2e),
        victim_requests=len(victim),
        victim_unanswered=sum(1 for r in victim if r.ttft_s is None),
        preemptions=len(preempted),
        preempted_victim=sum(1 for rid in preempted if rid in victims),
        output_tokens_per_s=output_tokens / window_s,
        runner_done=len(runner_ok),
        runner_long_done=sum(1 for r in runner_ok if (r.output_tokens or 0) >= LONG_OUTPUT),
        wall_s=wall_s, holds=dict(holds or {}))


def engine_options() -> EmulatorOptions:
    return EmulatorOptions(profile=PROFILE, **ENGINE)


def run_sim_arm(arm: ArmSpec, seed: int = 1, warmup_s: float = WARMUP_S,
                window_s: float = WINDOW_S, tail_s: float = TAIL_S) -> ArmFigures:
    until = warmup_s + window_s + tail_s
    options = engine_options().model_copy(
        update={"scheduling_policy": "priority" if arm.priority else "fcfs",
                "mean_output_tokens": mean_output()})
    engine = PreemptionEngine("engine-0", options, warmup_s, warmup_s + window_s)
    which = (lambda c: c.plan.tenant == "runner") if arm.outputs == "geometric" \
        else long_request
    clients = Unhinted(WorkloadClients(workload(arm, until), seed=seed, until_s=until), which)
    kind = AbortRequeueSimulation if arm.lever == "abort" else Simulation
    sim = kind(parse_config(config(arm)), [engine], clients, run_id="kv-pressure",
               scenario="kv-pressure", until_s=until)
    core = sim.core
    if arm.lever == "mean":
        core.estimator = mean_only(core.config)
    elif arm.lever == "evict":
        core.dispatch_ready = EvictLongest(core)  # type: ignore[method-assign]
    result = sim.run()
    return figures(arm.name, result.records, engine.preempted, engine.window_tokens,
                   warmup_s, window_s, result.wall_s, result.holds)


# ---------------------------------------------------------------------------- live engines

MODEL = "tiny"
EngineKind = Literal["emulator", "real"]


@contextlib.contextmanager
def live_engine(kind: EngineKind, priority: bool, log_dir: Path) -> Iterator[str]:
    """The engine's URL: real vLLM CPU (the tiny model) or the emulator, issue 14's shape."""
    policy: Literal["fcfs", "priority"] = "priority" if priority else "fcfs"
    if kind == "real":
        with RealVllmServer(model_name=MODEL, scheduling_policy=policy,
                            log_path=log_dir / f"vllm-{policy}.log", **ENGINE) as server:
            yield server.url
    else:
        with emulator_process(profile=PROFILE, model_name=MODEL, scheduling_policy=policy,
                              **ENGINE) as process:
            yield process.url


async def stream_times(session: aiohttp.ClientSession, url: str, payload: Mapping[str, Any],
                       headers: Mapping[str, str], start: float
                       ) -> tuple[float | None, float | None, int]:
    """One streaming request: (TTFT, end-to-end, output tokens from its usage), times from
    ``start``; (None, None, 0) when it failed."""
    first: float | None = None
    output = 0
    async with session.post(url, json=payload, headers=headers) as response:
        if response.status != 200:
            await response.read()
            return None, None, 0
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            choices = chunk.get("choices") or []
            if first is None and any((c.get("text") or (c.get("delta") or {}).get("content"))
                                     for c in choices):
                first = time.monotonic()
            if chunk.get("usage"):
                output = chunk["usage"].get("completion_tokens") or 0
    if first is None:
        return None, None, output
    return first - start, time.monotonic() - start, output


async def victim(url: str, rate: float, seconds: float, seed: int, start_at: float
                 ) -> list[tuple[float | None, float | None]]:
    """Poisson arrivals from wall-clock ``start_at`` for ``seconds``: (TTFT, e2e) each."""
    rng = random.Random(seed)
    offsets, t = [], 0.0
    while (t := t + rng.expovariate(rate)) < seconds:
        offsets.append(t)
    headers = {"authorization": f"Bearer {VICTIM_KEY}"}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        base = time.monotonic() + max(0.0, start_at - time.time())

        async def one(offset: float) -> tuple[float | None, float | None]:
            await asyncio.sleep(max(0.0, base + offset - time.monotonic()))
            payload = isolation.body(VICTIM_PROMPT, VICTIM_OUTPUT, rng)
            try:
                ttft, e2e, _ = await stream_times(session, url + "/v1/completions", payload,
                                                  headers, base + offset)
            except (aiohttp.ClientError, TimeoutError):
                return None, None
            return ttft, e2e

        return list(await asyncio.gather(*(one(o) for o in offsets)))


def victim_main(argv: list[str]) -> int:
    url, rate, seconds, seed, start_at, out = argv
    times = asyncio.run(victim(url, float(rate), float(seconds), int(seed), float(start_at)))
    Path(out).write_text(json.dumps(times))
    return 0


def runner_body(arm: ArmSpec, rng: random.Random) -> dict[str, Any]:
    """A runner request as its client sends it: the long ones without ``max_tokens``."""
    prompt, output = runner_lengths(arm.outputs).draw(rng)
    payload: dict[str, Any] = orjson.loads(chat_body(prompt, rng.getrandbits(32)))
    payload.update(model=MODEL, ignore_eos=True)
    if output < LONG_OUTPUT:
        payload["max_tokens"] = output
    return payload


async def live_arm(arm: ArmSpec, engine_url: str, sidecar_url: str, seed: int,
                   workdir: Path, warmup_s: float, window_s: float) -> ArmFigures:
    """The runner's closed loop through the sidecar from the start; the victim's client (a
    process of its own) over the window; the engine's counters at both ends of it."""
    headers = {"authorization": f"Bearer {RUNNER_KEY}"}
    done: list[tuple[float, int]] = []  # runner requests ended ok: (end, output tokens)
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def user(u: int) -> None:
            rng = random.Random(f"{seed}/runner/{u}")
            while not stop.is_set():
                with contextlib.suppress(aiohttp.ClientError):
                    _, e2e, tokens = await stream_times(
                        session, sidecar_url + "/v1/chat/completions", runner_body(arm, rng),
                        headers, time.monotonic())
                    if e2e is not None:
                        done.append((time.monotonic(), tokens))

        users = [asyncio.create_task(user(u)) for u in range(RUNNER_USERS)]
        out = workdir / f"victim-{seed}.json"
        window_at = time.time() + warmup_s
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.kv_pressure", "victim", sidecar_url,
            str(VICTIM_RATE), str(window_s), str(seed), str(window_at), str(out))
        await asyncio.sleep(max(0.0, window_at - time.time()))
        first = await isolation.engine_sample(session, engine_url)
        t0 = time.monotonic()
        await asyncio.sleep(window_s)
        last = await isolation.engine_sample(session, engine_url)
        elapsed = time.monotonic() - t0
        if await proc.wait() != 0:
            raise RuntimeError("the victim's client failed")
        stop.set()
        for task in users:
            task.cancel()
        await asyncio.gather(*users, return_exceptions=True)
        times = json.loads(out.read_text())
        diagnostics = isolation.ArmResult(arm.name, 0)
        await isolation.sidecar_diagnostics(session, sidecar_url, diagnostics)
        await isolation.drain(session, engine_url)
    ttft = [math.inf if t is None else t for t, _ in times]
    e2e = [math.inf if e is None else e for _, e in times]
    in_window = [tokens for end, tokens in done if t0 <= end < t0 + elapsed]
    return ArmFigures(
        arm=arm.name, victim_ttft_s=_percentiles(ttft), victim_e2e_s=_percentiles(e2e),
        victim_requests=len(times), victim_unanswered=sum(1 for t, _ in times if t is None),
        preemptions=round((last.preemptions_total or 0.0) - (first.preemptions_total or 0.0)),
        preempted_victim=-1,  # vLLM does not say whose
        output_tokens_per_s=((last.generation_tokens_total or 0.0)
                             - (first.generation_tokens_total or 0.0)) / elapsed,
        runner_done=len(in_window),
        runner_long_done=sum(1 for tokens in in_window if tokens > LONG_OUTPUT // 2),
        holds={k: round(v) for k, v in diagnostics.holds.items()},
        victim_queue_s=diagnostics.victim_queue_wait_s)


def run_live(kind: EngineKind, arms: Sequence[ArmSpec], warmup_s: float, window_s: float,
             log: Callable[[str], None], seed: int = 1) -> list[ArmFigures]:
    """Each arm on a fresh sidecar; one engine per scheduling policy, drained between
    arms. Only the arms the product can run (no lever substitution) run live."""
    workdir = Path(tempfile.mkdtemp(prefix="weighbridge-kv-pressure-"))
    results: list[ArmFigures] = []
    for priority in (False, True):
        # No lever substitution live, nor EOS-ended answers (the tiny model's EOS is noise).
        mine = [a for a in arms if a.priority == priority and a.lever is None
                and a.outputs != "geometric"]
        if not mine:
            continue
        with live_engine(kind, priority, workdir) as engine_url:
            for i, arm in enumerate(mine):
                with sidecar_process(config(arm, engine_url), config_dir=workdir,
                                     name=f"sidecar-{i}") as sidecar:
                    started = time.perf_counter()
                    f = asyncio.run(live_arm(arm, engine_url, sidecar.url, seed + i, workdir,
                                             warmup_s, window_s))
                log(f"{kind} {arm.name}: {time.perf_counter() - started:.0f} s; {f}")
                results.append(f)
    return results


def _ms(values: tuple[float, float, float]) -> str:
    return " / ".join("inf" if math.isinf(v) else f"{v * 1000:,.0f}" for v in values)


def table(results: Sequence[ArmFigures], caption: str = "") -> Table:
    rows: list[tuple[str, ...]] = [(f.arm, _ms(f.victim_ttft_s), _ms(f.victim_e2e_s),
             f"{f.victim_requests} / {f.victim_unanswered}",
             f"{f.preemptions} ({f.preempted_victim})", f"{f.output_tokens_per_s:,.0f}",
             f"{f.runner_done} ({f.runner_long_done})") for f in results]
    return Table(("arm", "victim TTFT ms p50 / p90 / p99", "victim e2e ms p50 / p90 / p99",
                  "victim sent / unanswered", "preemptions (of the victim's)",
                  "engine output tok/s", "runner done (long)"), rows, caption=caption)


def summary(engine: str, results: Sequence[ArmFigures]) -> list[str]:
    by = {f.arm: f for f in results}
    lines = []
    for name in ("unimodal", "bimodal", "bimodal, priority engine",
                 "bimodal, mean footprint", "bimodal, priority, mean footprint"):
        if (f := by.get(name)) is not None:
            lines.append(f"{engine}, {name}: {f.preemptions} preemptions, victim TTFT p99 "
                         f"{_ms(f.victim_ttft_s).split(' / ')[2]} ms, e2e p99 "
                         f"{_ms(f.victim_e2e_s).split(' / ')[2]} ms, engine "
                         f"{f.output_tokens_per_s:,.0f} tok/s")
    return lines


NOTES = [
    " ".join(__doc__.split("\n\n")[i].split()) for i in (2, 3, 4)
] + [
    f"Virtual time: warm-up {WARMUP_S:g} s, window {WINDOW_S:g} s, tail {TAIL_S:g} s, seed 1. "
    "Live: each arm on a fresh sidecar, one engine per scheduling policy, drained between "
    "arms; the victim's client is a process of its own.",
    "Live figures share 2 cores with the engine, the sidecar, both clients and whatever "
    "else runs (the load average is in the machine line): compare rows of one engine.",
]


def run_engines(engines: Sequence[str], arms: Sequence[ArmSpec], warmup_s: float,
                window_s: float, log: Callable[[str], None]) -> BenchResult:
    tables, lines = [], []
    for engine in engines:
        if engine == "sim":
            results = []
            for arm in arms:
                started = time.perf_counter()
                results.append(run_sim_arm(arm, warmup_s=warmup_s, window_s=window_s))
                log(f"sim {arm.name}: {time.perf_counter() - started:.0f} s")
        else:
            results = run_live(engine, arms, warmup_s, window_s, log)  # type: ignore[arg-type]
        label = {"sim": "virtual time", "emulator": "emulator, live",
                 "real": "real vLLM CPU, live"}[engine]
        tables.append(table(results, f"**{label}**"))
        lines += summary(label, results)
    return BenchResult(summary=lines, tables=tables, notes=NOTES)


def run(ctx: BenchContext) -> BenchResult:
    return run_engines(["sim", "emulator", "real"], list(ARMS.values()), WARMUP_S,
                       20.0 if ctx.quick else WINDOW_S, ctx.log)


BENCHMARK = Benchmark("kv_pressure", "KV pressure from answers past their estimates: "
                      "virtual time, the emulator and real vLLM CPU", run, needs_vllm=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "victim":
        return victim_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_pressure",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--engine", nargs="+", choices=["sim", "emulator", "real"],
                        default=["sim", "emulator", "real"])
    parser.add_argument("--arms", nargs="+", choices=sorted(ARMS), default=list(ARMS))
    parser.add_argument("--warmup", type=float, default=WARMUP_S)
    parser.add_argument("--window", type=float, default=WINDOW_S)
    parser.add_argument("--record", action="store_true",
                        help="write the result into benchmarks/RESULTS.md")
    args = parser.parse_args(argv)
    standalone = _results.StandaloneRun(["python", "-m", "benchmarks.kv_pressure", *argv])
    result = run_engines(args.engine, [ARMS[name] for name in args.arms], args.warmup,
                         args.window, lambda line: print(line, file=sys.stderr, flush=True))
    standalone.finish(BENCHMARK, result, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
