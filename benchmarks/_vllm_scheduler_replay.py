"""vLLM's own scheduler against the emulator's step model, in step space (no model, no clock).

    .venv-vllm/bin/python benchmarks/_vllm_scheduler_replay.py [--policy fcfs|priority]
        [--prefix-caching on|off] [--json]

Runs in the real vLLM venv: it builds vLLM 0.32's v1 ``Scheduler`` (the class the engine core
runs) for the fidelity benchmark's flood shape, feeds it the flood regime's requests (the
same arrival times, lengths and output counts), and answers each step with one sampled token
per request that caught up — what the model runner would return, without running a model.
Each step lasts what the emulator's step-time profile says for that batch, so both sides
share one cost model and differ only in *what they schedule*. Then the emulator's
``StepModel`` runs the same requests, and the two are compared step by step: number of
steps, tokens per step, preemptions, and every request's first-token and finish step.

With the prefix cache on, the requests carry token ids with prefix structure (every flood
prompt opens with one shared block run, pairs of flood requests are the same prompt, the
victims share a short prefix of their own; every request samples a token of its own), and
the comparison adds every request's cached tokens at its first admission and the
prefix-cache counters (queries and hits). The blocks a preempted request finds again, and
the ones evicted, shape the steps that follow, so equal steps check those too.

Why: a live comparison on a shared 2-core machine measures the machine as much as the
engine; this one is exact and takes seconds. The emulator is given one block less than
vLLM's ``num_gpu_blocks``: vLLM keeps one block as its null block (docs/emulator.md).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import random
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script from the vLLM venv: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._flood_shape import (
    ENGINE,
    FLOOD,
    FLOOD_REQUESTS,
    VICTIM,
    VICTIM_RATE,
    VICTIM_WINDOW_S,
)
from weighbridge.emulator.engine import EngineConfig, Sequence, StepModel, simulate
from weighbridge.emulator.profiles import get_profile

PROFILE = "cpu-tiny"
SHARED_PREFIX = 64  # tokens every flood prompt opens with
VICTIM_PREFIX = 32  # tokens every victim prompt opens with


def prompt_ids(rid: str, prompt: int) -> list[int]:
    """The prompt's token ids when the prefix cache is on: a prefix shared by its kind, then
    tokens of its own (one flood request in eight repeats the one before it)."""
    kind, index = rid.rsplit("-", 1)
    if kind == "flood":
        i = int(index)
        shared, own = [7] * SHARED_PREFIX, 10_000 + (i - 1 if i % 8 == 1 else i)
    else:
        shared, own = [8] * VICTIM_PREFIX, 20_000 + int(index)
    return (shared + [own] * prompt)[:prompt]


def sampled_token(rid: str) -> int:
    """The token a request samples at every step: its own, so decode blocks are never shared."""
    kind, index = rid.rsplit("-", 1)
    return (30_000 if kind == "flood" else 40_000) + int(index)


def workload(repeat: int = 0) -> list[tuple[float, str, int, int, int]]:
    """(arrival at the engine, id, prompt, output, priority), in arrival order: the flood
    admitted one by one by the API server's serial part, the victim's Poisson arrivals."""
    prof = get_profile(PROFILE)
    out = [(prof.t_api_serial * (i + 1) + prof.t_api_latency, f"flood-{i}", *FLOOD, 1)
           for i in range(FLOOD_REQUESTS)]
    rng = random.Random(f"fidelity-flood/victim/{repeat}")
    t, k = 0.0, 0
    while True:
        t += rng.expovariate(VICTIM_RATE)
        if t >= VICTIM_WINDOW_S:
            break
        out.append((t + prof.t_api_latency, f"victim-{k}", *VICTIM, 0))
        k += 1
    return sorted(out)


def run_vllm(policy: str, requests: list[tuple[float, str, int, int, int]],
             prefix_caching: bool = False) -> dict[str, Any]:
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import ModelRunnerOutput
    from vllm.v1.request import Request

    from weighbridge.emulator.real_vllm import tiny_model_dir

    model = str(tiny_model_dir())
    bs, blocks = ENGINE["block_size"], ENGINE["num_kv_blocks"]
    vllm_config = VllmConfig(
        model_config=ModelConfig(model=model, tokenizer=model, dtype="float32",
                                 max_model_len=ENGINE["max_model_len"], seed=0,
                                 skip_tokenizer_init=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=ENGINE["max_num_seqs"],
            max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
            max_model_len=ENGINE["max_model_len"], enable_chunked_prefill=True,
            policy=policy, is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=bs, cache_dtype="auto",
                                 enable_prefix_caching=prefix_caching))
    vllm_config.cache_config.num_gpu_blocks = blocks
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=2,
                                                      head_size=64, dtype=torch.float32))])
    from vllm.v1.structured_output import StructuredOutputManager
    sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv,
                      structured_output_manager=StructuredOutputManager(vllm_config),
                      block_size=bs, log_stats=True)
    hasher = None
    if prefix_caching:  # as vLLM's engine core builds it
        hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        hasher = get_request_block_hasher(bs, hash_fn)
    cached: dict[str, int] = {}
    queries = hits = 0
    prof = get_profile(PROFILE)
    reqs: dict[str, Any] = {}
    first: dict[str, int] = {}
    finish: dict[str, int] = {}
    step_tokens: list[int] = []
    preemptions = 0
    now, k, step = 0.0, 0, 0
    while k < len(requests) or sched.has_unfinished_requests():
        while k < len(requests) and requests[k][0] <= now:
            at, rid, prompt, out, prio = requests[k]
            ids = prompt_ids(rid, prompt) if prefix_caching else [7] * prompt
            r = Request(rid, ids, SamplingParams(max_tokens=out, ignore_eos=True),
                        None, arrival_time=at, priority=prio if policy == "priority" else 0,
                        block_hasher=hasher)
            sched.add_request(r)
            reqs[rid] = r
            k += 1
        if not sched.has_unfinished_requests():
            now = requests[k][0]
            continue
        so = sched.schedule()
        preemptions += len(so.preempted_req_ids or ())
        ids = list(so.num_scheduled_tokens)
        prefill = decode = kv_tokens = context = 0
        sampled: list[list[int]] = []
        for rid in ids:
            n, r = so.num_scheduled_tokens[rid], reqs[rid]
            kv_tokens += r.num_computed_tokens  # already advanced by this step
            if n == 1 and r.num_computed_tokens - 1 >= r.num_prompt_tokens:
                decode += 1
            else:
                prefill += n
                context += n * (r.num_computed_tokens - n)  # the chunk's new x cached before
            token = sampled_token(rid) if prefix_caching else 11
            sampled.append([token] if r.num_computed_tokens >= r.num_tokens else [])
        now += prof.step_time(prefill, decode, kv_tokens, context) if ids else 0.0
        outputs = sched.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled))
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                if output.prefill_stats is not None:
                    cached[output.request_id] = output.prefill_stats.num_cached_tokens
            stats = engine_outputs.scheduler_stats  # the step's, as the engine core logs it
            if stats is not None and stats.prefix_cache_stats is not None:
                queries += stats.prefix_cache_stats.queries
                hits += stats.prefix_cache_stats.hits
        step_tokens.append(sum(so.num_scheduled_tokens.values()))
        for rid, tokens in zip(ids, sampled, strict=True):
            if tokens:
                first.setdefault(rid, step)
                if reqs[rid].is_finished():
                    finish[rid] = step
        step += 1
    return {"steps": step, "step_tokens": step_tokens, "preemptions": preemptions,
            "first_token_step": first, "finish_step": finish, "end_s": now,
            "cached_tokens": cached, "queries": queries, "hits": hits}


def _same(token: int, _index: int) -> int:
    return token


def run_emulator(policy: str, requests: list[tuple[float, str, int, int, int]],
                 prefix_caching: bool = False) -> dict[str, Any]:
    config = EngineConfig(
        max_num_seqs=ENGINE["max_num_seqs"],
        max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
        max_model_len=ENGINE["max_model_len"], block_size=ENGINE["block_size"],
        num_kv_blocks=ENGINE["num_kv_blocks"] - 1,  # vLLM's null block
        scheduling_policy=policy,  # type: ignore[arg-type]
        enable_prefix_caching=prefix_caching)
    model = StepModel(config, get_profile(PROFILE))
    seqs = [Sequence(rid, prompt, out, out, at, priority=prio if policy == "priority" else 0,
                     prompt_ids=tuple(prompt_ids(rid, prompt)),
                     output_ids=functools.partial(_same, sampled_token(rid)))
            for at, rid, prompt, out, prio in requests]
    first: dict[str, int] = {}
    finish: dict[str, int] = {}
    step_tokens: list[int] = []
    step, end = 0, 0.0
    for result in simulate(model, seqs):
        step_tokens.append(result.batch.num_tokens)
        for s in result.emitted:
            first.setdefault(s.request_id, step)
        for s in result.finished:
            finish[s.request_id] = step
        step, end = step + 1, result.end_s
    counters = model.counters
    return {"steps": step, "step_tokens": step_tokens, "preemptions": counters.preemptions,
            "first_token_step": first, "finish_step": finish, "end_s": end,
            "cached_tokens": {s.request_id: s.num_cached_tokens for s in seqs},
            "queries": counters.prefix_cache_queries, "hits": counters.prefix_cache_hits}


def compare(policy: str, prefix_caching: bool = False) -> dict[str, Any]:
    requests = workload()
    vllm = run_vllm(policy, requests, prefix_caching)
    emu = run_emulator(policy, requests, prefix_caching)
    same_steps = vllm["step_tokens"] == emu["step_tokens"]
    differing = sum(1 for rid in vllm["first_token_step"]
                    if vllm["first_token_step"][rid] != emu["first_token_step"].get(rid))
    keys = ("steps", "preemptions", "end_s", "queries", "hits")
    return {"policy": policy, "prefix_caching": prefix_caching,
            "vllm": {k: vllm[k] for k in keys}, "emulator": {k: emu[k] for k in keys},
            "identical_step_tokens": same_steps,
            "requests_with_different_cached_tokens": sum(
                1 for rid, n in vllm["cached_tokens"].items()
                if emu["cached_tokens"].get(rid) != n),
            "requests_with_different_first_token_step": differing,
            "finish_steps_equal": vllm["finish_step"] == emu["finish_step"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=["fcfs", "priority"], action="append")
    p.add_argument("--prefix-caching", choices=["off", "on"], action="append",
                   help="vLLM's prefix cache on both sides (default: off, then on)")
    p.add_argument("--json", action="store_true", help="one JSON object per policy")
    a = p.parse_args(argv)
    for caching, policy in itertools.product(a.prefix_caching or ["off", "on"],
                                             a.policy or ["fcfs", "priority"]):
        result = compare(policy, caching == "on")
        print(json.dumps(result) if a.json else
              f"{policy}, prefix caching {caching}: vLLM {result['vllm']}, emulator "
              f"{result['emulator']}, identical "
              f"tokens per step: {result['identical_step_tokens']}, requests whose first "
              f"token came at another step: {result['requests_with_different_first_token_step']}"
              f", same finish steps: {result['finish_steps_equal']}, requests with other "
              f"cached tokens: {result['requests_with_different_cached_tokens']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
