"""vLLM's own scheduler against the emulator's step model, in step space (no model, no clock).

    .venv-vllm/bin/python benchmarks/_vllm_scheduler_replay.py [--policy fcfs|priority] [--json]

Runs in the real vLLM venv: it builds vLLM 0.32's v1 ``Scheduler`` (the class the engine core
runs) for the fidelity benchmark's flood shape, feeds it the flood regime's requests (the
same arrival times, lengths and output counts), and answers each step with one sampled token
per request that caught up — what the model runner would return, without running a model.
Each step lasts what the emulator's step-time profile says for that batch, so both sides
share one cost model and differ only in *what they schedule*. Then the emulator's
``StepModel`` runs the same requests, and the two are compared step by step: number of
steps, tokens per step, preemptions, and every request's first-token and finish step.

Why: a live comparison on a shared 2-core machine measures the machine as much as the
engine; this one is exact and takes seconds. The emulator is given one block less than
vLLM's ``num_gpu_blocks``: vLLM keeps one block as its null block (docs/emulator.md).
"""

from __future__ import annotations

import argparse
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


def run_vllm(policy: str, requests: list[tuple[float, str, int, int, int]]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.sampling_params import SamplingParams
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
                                 enable_prefix_caching=False))
    vllm_config.cache_config.num_gpu_blocks = blocks
    kv = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer"], FullAttentionSpec(block_size=bs, num_kv_heads=2,
                                                      head_size=64, dtype=torch.float32))])
    from vllm.v1.structured_output import StructuredOutputManager
    sched = Scheduler(vllm_config=vllm_config, kv_cache_config=kv,
                      structured_output_manager=StructuredOutputManager(vllm_config),
                      block_size=bs)
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
            r = Request(rid, [7] * prompt, SamplingParams(max_tokens=out, ignore_eos=True),
                        None, arrival_time=at, priority=prio if policy == "priority" else 0)
            sched.add_request(r)
            reqs[rid] = r
            k += 1
        if not sched.has_unfinished_requests():
            now = requests[k][0]
            continue
        so = sched.schedule()
        preemptions += len(so.preempted_req_ids or ())
        ids = list(so.num_scheduled_tokens)
        prefill = decode = kv_tokens = 0
        sampled: list[list[int]] = []
        for rid in ids:
            n, r = so.num_scheduled_tokens[rid], reqs[rid]
            kv_tokens += r.num_computed_tokens  # already advanced by this step
            if n == 1 and r.num_computed_tokens - 1 >= r.num_prompt_tokens:
                decode += 1
            else:
                prefill += n
            sampled.append([11] if r.num_computed_tokens >= r.num_tokens else [])
        now += prof.step_time(prefill, decode, kv_tokens) if ids else 0.0
        sched.update_from_output(so, ModelRunnerOutput(
            req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled))
        step_tokens.append(sum(so.num_scheduled_tokens.values()))
        for rid, tokens in zip(ids, sampled, strict=True):
            if tokens:
                first.setdefault(rid, step)
                if reqs[rid].is_finished():
                    finish[rid] = step
        step += 1
    return {"steps": step, "step_tokens": step_tokens, "preemptions": preemptions,
            "first_token_step": first, "finish_step": finish, "end_s": now}


def run_emulator(policy: str, requests: list[tuple[float, str, int, int, int]]
                 ) -> dict[str, Any]:
    config = EngineConfig(
        max_num_seqs=ENGINE["max_num_seqs"],
        max_num_batched_tokens=ENGINE["max_num_batched_tokens"],
        max_model_len=ENGINE["max_model_len"], block_size=ENGINE["block_size"],
        num_kv_blocks=ENGINE["num_kv_blocks"] - 1,  # vLLM's null block
        scheduling_policy=policy)  # type: ignore[arg-type]
    model = StepModel(config, get_profile(PROFILE))
    seqs = [Sequence(rid, prompt, out, out, at, priority=prio if policy == "priority" else 0)
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
    return {"steps": step, "step_tokens": step_tokens, "preemptions": model.num_preemptions,
            "first_token_step": first, "finish_step": finish, "end_s": end}


def compare(policy: str) -> dict[str, Any]:
    requests = workload()
    vllm, emu = run_vllm(policy, requests), run_emulator(policy, requests)
    same_steps = vllm["step_tokens"] == emu["step_tokens"]
    differing = sum(1 for rid in vllm["first_token_step"]
                    if vllm["first_token_step"][rid] != emu["first_token_step"].get(rid))
    return {"policy": policy, "vllm": {k: vllm[k] for k in ("steps", "preemptions", "end_s")},
            "emulator": {k: emu[k] for k in ("steps", "preemptions", "end_s")},
            "identical_step_tokens": same_steps,
            "requests_with_different_first_token_step": differing,
            "finish_steps_equal": vllm["finish_step"] == emu["finish_step"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policy", choices=["fcfs", "priority"], action="append")
    p.add_argument("--json", action="store_true", help="one JSON object per policy")
    a = p.parse_args(argv)
    for policy in a.policy or ["fcfs", "priority"]:
        result = compare(policy)
        print(json.dumps(result) if a.json else
              f"{policy}: vLLM {result['vllm']}, emulator {result['emulator']}, identical "
              f"tokens per step: {result['identical_step_tokens']}, requests whose first "
              f"token came at another step: {result['requests_with_different_first_token_step']}"
              f", same finish steps: {result['finish_steps_equal']}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
