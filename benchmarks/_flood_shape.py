"""The fidelity benchmark's flood regime, as data (issue 14's shape): shared by the live
comparison (benchmarks/_fidelity_flood.py) and the step-space replay against vLLM's own
scheduler (benchmarks/_vllm_scheduler_replay.py, which runs in the vLLM venv and so cannot
import the live one's aiohttp)."""

from __future__ import annotations

ENGINE = {"max_num_seqs": 32, "max_num_batched_tokens": 1024, "max_model_len": 1024,
          "block_size": 32, "num_kv_blocks": 576}
FLOOD_REQUESTS = 500
FLOOD = (512, 192)  # prompt, output tokens
VICTIM = (64, 16)
VICTIM_RATE = 4.0  # requests/s, Poisson
VICTIM_WINDOW_S = 20.0
