"""A vLLM-compatible engine emulator: a pure step model of continuous batching, chunked
prefill, a finite KV cache and preemption, and an HTTP face with vLLM's API and metrics."""

from weighbridge.emulator.engine import (
    Batch,
    EngineConfig,
    Sequence,
    SequenceStatus,
    StepModel,
    StepResult,
    simulate,
)
from weighbridge.emulator.profiles import PROFILES, StepTimeProfile, get_profile

__all__ = [
    "PROFILES",
    "Batch",
    "EngineConfig",
    "Sequence",
    "SequenceStatus",
    "StepModel",
    "StepResult",
    "StepTimeProfile",
    "get_profile",
    "simulate",
]
