"""vLLM 0.32's own v1 scheduler and the emulator's step model schedule the fidelity
benchmark's flood (KV-constrained, preempting) identically, step for step, under fcfs and
priority, with the prefix cache off and on (benchmarks/_vllm_scheduler_replay.py: no model
and no clock, so the machine's load cannot blur the comparison). With the cache on, every
request's cached tokens and the prefix-cache counters are equal too."""

from __future__ import annotations

import json
import subprocess

import pytest

from weighbridge.emulator.real_vllm import REPO_ROOT, check_environment, vllm_python

REPLAY = REPO_ROOT / "benchmarks" / "_vllm_scheduler_replay.py"


@pytest.mark.vllm
def test_vllm_scheduler_and_step_model_schedule_the_flood_identically() -> None:
    check_environment()
    done = subprocess.run([str(vllm_python()), str(REPLAY), "--json"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=1200, check=True)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["prefix_caching"], r["policy"]) for r in results] == [
        (False, "fcfs"), (False, "priority"), (True, "fcfs"), (True, "priority")]
    for r in results:
        assert r["vllm"]["preemptions"] > 0  # the regime does exercise preemption
        if r["prefix_caching"]:
            assert r["vllm"]["hits"] > 0  # and the cache
            assert (r["vllm"]["queries"], r["vllm"]["hits"]) == (
                r["emulator"]["queries"], r["emulator"]["hits"])
            assert r["requests_with_different_cached_tokens"] == 0
        assert r["vllm"]["steps"] == r["emulator"]["steps"]
        assert r["vllm"]["preemptions"] == r["emulator"]["preemptions"]
        assert r["identical_step_tokens"]
        assert r["requests_with_different_first_token_step"] == 0
        assert r["finish_steps_equal"]
